"""The values of small emulated tensors, kept on the CPU beside them.

The emulated device holds no data, yet scripts and libraries branch on small values: an attention
mask that is all ones lets Hugging Face skip building a causal mask, labels and position ids are
read back, `nonzero` sizes its output by them. So every op whose device inputs all have known
values and whose outputs are small also runs on the CPU copies: masks, ids, counters and their
arithmetic keep their real values, while activations (large, or made from weights, which have no
values) stay shapes only. An op that writes into a tensor with a value it cannot compute drops that
value, and those of every tensor sharing its storage (a write to `x[:n]` writes `x`), but for the
checks for infs and NaNs (GradScaler's), which find none.

Ops that draw random numbers (`randint`, `randperm`, `rand`, `random_`, `bernoulli`, `multinomial`)
follow the same rule: a small output whose device inputs have known values is drawn on the CPU, from
the emulated device's own generator (patches.Generator, seeded by `torch.cuda.manual_seed` and
`torch.manual_seed`, its state what `torch.cuda.get_rng_state` saves), or from the one the script
passes. Never from torch's CPU generator: the script's own CPU draws stay those of a GPU run. So
random labels, ids, permutations and masks hold numbers of the distribution, dtype and bounds asked
for (`torch.all(labels >= 0)` is true, as on every GPU), the same on every run of the same script,
though not the numbers a GPU's generator gives. Weights the script initialises on the device are
parameters, which have no values (a parameter is not the tensor it was made from), so their draws are
not made; nor are large ones (dropout's masks), whose host memory would be the device's.

What a read-back gives where there is no value to read is one policy (docs/emulate.md, "Values read
back"): a single float (0-dim, float32 or float64: a loss, a mean, a norm) that an op makes without
values takes, when made, the next number of one sequence that falls through the run (`unknown_float`,
`Values.made`), as its value: a loss made later is lower (it improves, as a short real run's does, so a
save gated on it runs, and so does a comparison of two such losses on the device), and two reads of
it agree. A rate or a count of a comparison without values (a mean or a sum of `predicted == targets`,
cast, copied or viewed first: an accuracy) takes a rising fraction instead (`unknown_rate`,
`Values.rate`), the count that fraction of the elements it could count (a mask's true count where the
comparison was masked first by a mask with values: `((preds == labels) & mask).sum()`, MASKED_BY): an
accuracy made later is higher.
What computes from such numbers and would give an inf or a NaN has no value instead. A
Python number read from any other float without values (`.item()`, `float(t)`, a format) is the
stand-in of `Values.read_back_scalar`, the sequence's next number at each read, a host copy
(`.cpu()`, `.numpy()`, `.tolist()`) holds one such number in every element, uninitialised memory
(`torch.empty`) holds zeros, and the checks for an inf or a NaN (`isfinite`, `isnan`, ...) answer as
for finite numbers: emulated tensors hold none. An op with an input without values still has one
where its known operands decide it alone (DECIDED): `x | True`, `x & False`, a comparison with a
sentinel such as -1e9, `where` of a known condition all true or all false.

A router's choices (`topk` of a tensor without values: choices.py) and what is computed from them
are `routed`: their values are kept at any size, past MAX_ELEMENTS, as the sizes that follow from
them (the tokens each expert takes) must not change with the batch. A routed op computes from the
number a constant factory (`torch.zeros`, `ones`, `full`, their `_like` and `new_` forms, and a cast
or copy of one) filled its output with, at any size too (JetMoE scatters its choices into a `zeros` of
tokens x experts, Megatron-core into `zeros_like(logits).int()`); other ops see a constant's values
only where it is small, as any output's. A `_like` or `new_` factory reads only its template's shape
and dtype, so its output has values though the template (logits made from weights) has none.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from memdiff.recording.emulate import choices

# Outputs up to this many elements get values: a batch's ids, masks and labels, not its activations.
MAX_ELEMENTS = 1 << 16
# Factories of one number (None: a `full`'s, given among its arguments). The number is remembered at
# any size, for routed ops (module docstring) to compute with.
CONSTANTS = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1,
             "full": None, "full_like": None, "new_full": None}
# Checks that set a flag only when they find an inf or a NaN (GradScaler's): emulated tensors hold
# no such value, so the flag keeps the value it had (no overflow), and the scale grows as on a GPU.
FINITE_CHECKS = {"_amp_foreach_non_finite_check_and_unscale_", "_amp_non_finite_check_and_unscale_"}
# Factories of uninitialised memory: run on the CPU they would give whatever the host's allocator
# left there, a value that changes from run to run (a compiled loss read back as -1.9e+32). They
# hold zeros, as values the emulator does not have read back, so what fills them later
# (`fill_`, `copy_` of known values) still computes, and the same script gives the same snapshot.
UNINITIALISED = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"}
# Factories whose first tensor is a template: only its shape, dtype and device are read, never its
# values, so their output has values though it has none (Megatron-core's router scatters its choices
# into `zeros_like(logits)`, and logits are made from weights).
TEMPLATED = {name for name in (*CONSTANTS, *UNINITIALISED) if name.endswith("_like") or name.startswith("new_")}
# Casts and copies of a constant factory's output hold the same number (`zeros_like(x).int()`).
CASTS = {"_to_copy", "clone"}
CPU = torch.device("cpu")
# What an unknown float reads back as (unknown_float): the n-th number of a run (from 0) is
# 0.5 x PACE / (PACE + n), 0.5 first, each later one lower by 1 / (PACE + n + 1) of the one before: by
# 1.2e-4 of it at first, more than ReduceLROnPlateau's default threshold (1e-4 of the best), so one
# number between two of its steps is an improvement for the first 1,808 numbers, 5 for the first 41,777
# (halving every 65,536 numbers, the fall before, took 10 numbers). A number in (0, 1) is a valid
# loss, probability, accuracy or mean squared error: `log` of it, of `1 - x`, and `1 / x` run; `exp` of
# it is finite. It stays above 0.01 for the first 401,408 numbers, so a run's `if loss < 0.01: break`
# does not stop a short run at its first step (as the smallest normal number, the stand-in before,
# did), and above 1e-3 for 4,087,809; it falls in float32 at every number for the first 11,856,147
# and never reaches zero.
FIRST_READ = 0.5
PACE = 8192
# The dtypes of the single numbers an op makes without values that take their number of the same
# sequence when made (Values.made): a loss, a mean, a norm. Made, not read: two reads of one loss
# agree, and a comparison on the device (`val_loss < best`, both device tensors: Lightning's
# EarlyStopping and ModelCheckpoint) has the answer a falling loss gives. Not bfloat16 or float16,
# whose steps (2^-8, 2^-11 of the number) are coarser than 32 and 4 of the sequence's at its start, more
# later: two losses made one after the other would be one number there, and read back tied where reads
# differ.
MADE = (torch.float32, torch.float64)
# Rates and counts (Values.rated): a comparison without values (`predicted == targets`, `err < 1`) has
# elements that are each true or false; a cast, copy or view of it too (`.float()`, `.reshape(-1)`). A
# mean of one is a rate (an accuracy), a sum or count_nonzero a count of true elements (`correct +=
# predicted.eq(targets).sum().item()`). They take, when made, a rising fraction of their own sequence
# (unknown_rate: 0.5, then up towards 1 as 1 - 0.5 h / (h + c) for the c-th rate or count made), the
# count that fraction of the elements it reduced, rounded: an accuracy made later is higher, as a short
# real run's is, where it fell with the losses (a rate) or read 0 (a count, so `if acc > best_acc` never
# saved). Hyperbolic, not halving, and each count's rounding carried to the next (Values.counted): a
# count of N elements can rise only N / 2 times, and a test loop of 4 batches of 32
# (`tests/scenarios/best_accuracy.py`) and kuangliu's CIFAR-10 (391 training counts of 128 and 100 test
# counts of 100 an epoch) both see a higher test total at each of their first 11 and 21 epochs.
RATE_PACE = 64
RATED_FROM = {"_to_copy", "clone", "_unsafe_view", "alias", "detach", "lift_fresh", "contiguous"}
# Ops that keep a marked tensor's elements true or false while a mask zeroes some of them (token
# accuracy of a padded batch: trl's `((preds == labels) & mask).sum()`, `torch.where(mask, preds ==
# labels, False)`, `* mask`) or selects some (`(preds == labels)[mask]`, `masked_select`): their output is
# marked, with which of its elements may be true (Values.rates: the mask's, where it has values), so a
# count's N is the elements it could count, not every element it reduced.
MASKED_BY = {"bitwise_and", "logical_and", "where", "mul", "index", "masked_select"}
RATES = {"mean"}
COUNTS = {"sum", "count_nonzero"}
# The checks for an inf or a NaN, and what each answers for a tensor of finite numbers: emulated
# tensors hold none (the rule FINITE_CHECKS follows), so a script's `torch.isfinite(loss).all()`
# guard passes as on a GPU whose loss is finite. Given for an output of any size, as a constant
# broadcast to its shape (no memory per element), so that `.all()` of a large one has its value too.
FINITENESS = {"isfinite": True, "isnan": False, "isinf": False, "isposinf": False, "isneginf": False}
# Boolean ops whose result one operand decides alone: `x | True` is true and `x & False` false (and
# `n & 0` zero) whatever x is. Hugging Face's generate() stops on
# `unfinished & ~(max_length_done | eos_found)`: the length criterion is known, the end-of-sequence one
# reads sampled tokens, which have no values; without this the loop's stop flag never had a value and
# generate() never stopped.
ABSORBING = {"bitwise_or": True, "logical_or": True, "bitwise_or_": True, "logical_or_": True,
             "bitwise_and": False, "logical_and": False, "bitwise_and_": False, "logical_and_": False}
# Comparisons that a known sentinel decides. Code marks "nothing here" with a number no model computes
# (-1e9, a dtype's lowest, -inf) and compares with it: Hugging Face's beam search asks whether a running
# beam's score (a sum of log-probabilities, which has no values here) beats its worst finished one,
# -1e9 while none has finished. Emulated tensors hold finite numbers (FINITENESS), and of a model's
# size: against a known operand of magnitude SENTINEL or more, every element compares as zero would.
# Without this the answer read as False, and beam search stopped after its first token.
COMPARISONS = {"gt", "ge", "lt", "le", "eq", "ne"}
SENTINEL = 1e9
# Ops that can have a value though one input has none: what a known operand decides alone.
DECIDED = {*ABSORBING, *COMPARISONS, "where"}


class Values:
    """Known values of meta tensors (a CPU tensor of the same shape per meta tensor)."""

    def __init__(self, generator: Optional[torch.Generator] = None) -> None:
        """`generator`: the emulated device's default generator, which random ops draw from (None:
        they get no values)."""
        self.known = WeakTensorKeyDictionary()
        # tensors whose values come from a router's balanced choices (choices.py): kept at any size
        self.routed = WeakTensorKeyDictionary()
        # the number each constant factory's output holds until written (CONSTANTS)
        self.constants = WeakTensorKeyDictionary()
        self.generator = generator
        # how many numbers of unknown_float's sequence the run has taken: at each read back of a float
        # the emulator does not know, and at each single float an op made without values (made)
        self.reads = 0
        # tensors without values whose elements are each a comparison's true or false (RATES), and
        # how many rates and counts (sums of their elements) the run has made (unknown_rate)
        self.rates = WeakTensorKeyDictionary()
        self.rated = 0
        self.counted = 0.0  # what rounding left of the counts given so far (in (-0.5, 0.5])
        # tensors whose values were computed from such a made number: where one of their results
        # would be an inf or a NaN, it is not kept (a number of the sequence, not one a GPU computes)
        self.invented = WeakTensorKeyDictionary()

    def read_back_scalar(self, dtype: torch.dtype) -> Any:
        """The Python number a device value of `dtype` the emulator does not know reads back as
        (`.item()`): False for a bool, 0 for an integer (an index and a class any tensor has: argmax, a
        label), and for a float (or a complex's real part) the next of unknown_float's numbers, each
        read lower than the one before (the same float32 number whatever the float dtype: finer than
        bfloat16's or float16's, so that successive reads still differ). A read gives the tensor no
        value: two reads of one bfloat16 loss, or of an element of a larger tensor, are two numbers, the
        second lower (a float32 or float64 loss has its number from when it was made: Values.made)."""
        if dtype == torch.bool:
            return False
        if not (dtype.is_floating_point or dtype.is_complex):
            return 0
        number = unknown_float(self.reads)
        self.reads += 1
        return complex(number, 0.0) if dtype.is_complex else number

    def read_back_host(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host copy (`.cpu()`, `.numpy()`, `.tolist()`, a print) of a device tensor whose values the
        emulator does not know: one read_back_scalar number (one read) in every element, so that host
        arithmetic on it runs where the GPU's would (`torch.multinomial(logits.exp().cpu(), 1)`
        samples, where zeros would be no distribution at all)."""
        return torch.full(shape, self.read_back_scalar(dtype), dtype=dtype)

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """`torch.equal(a, b)` of two device tensors, a Python bool read back (aten::equal has no meta
        kernel): False for two shapes, as torch answers without reading; the CPU's answer where both
        have values; True where both view the same elements of one storage (a weight tied to another,
        as llama2.c's export asks of its embedding and head: emulated tensors hold no NaN); else False,
        as `bool()` of any comparison without values reads."""
        if a.shape != b.shape:
            return False
        known_a, known_b = self.of(a), self.of(b)
        if known_a is not None and known_b is not None:
            return bool(torch.equal(known_a, known_b))
        storage = _storage(a)
        return storage is not None and storage == _storage(b) and a.dtype == b.dtype \
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()

    def handed(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """What is kept of `old` (its values, a router's choices, its constant) is `new`'s from now on:
        the tensor under `old` was swapped into `new` (moved.py's `.data =` across devices)."""
        for table in (self.known, self.routed, self.constants, self.invented, self.rates):
            if old in table:
                table[new] = table.pop(old)

    def of(self, t: Any) -> Optional[torch.Tensor]:
        """The CPU value of meta tensor `t`, or None when it is unknown."""
        return self.known.get(t) if isinstance(t, torch.Tensor) and t.is_meta else None

    def follow(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        """After op `func` ran on meta tensors: give its outputs values when they can be computed."""
        base = func._schema.name.split("::", 1)[-1]
        if base in FINITE_CHECKS:
            return
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_meta]
        first = args[0] if args else kwargs.get("self")
        if base == "topk" and len(outputs) == 2 and isinstance(first, torch.Tensor) and first.is_meta \
                and self.of(first) is None:
            self.chose(first, args, kwargs, outputs)
            return
        if base in FINITENESS and len(outputs) == 1:
            self.checked(args[0] if args else None, outputs[0], base)
            if self.of(outputs[0]) is not None:
                return
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.Tensor)]
        routed = self._routed((args, kwargs))
        computed = self._compute(func, args, kwargs, outputs, routed) if outputs else None
        for t in outputs + written:
            self.routed.pop(t, None)
            self.constants.pop(t, None)
            if self.rates:
                self.rates.pop(t, None)
        if base in CONSTANTS and len(outputs) == 1:
            self.constants[outputs[0]] = _number(base, args, kwargs)
        elif base in CASTS and len(outputs) == 1 and isinstance(first, torch.Tensor) and first in self.constants:
            number = torch.tensor(self.constants[first]).to(outputs[0].dtype).item()
            self.constants[outputs[0]] = number
        invented = computed is not None and self._invented((args, kwargs))
        if invented and computed is not None and any(
                v.is_floating_point() and not bool(torch.isfinite(v).all()) for v in computed):
            computed = None  # finite numbers gave an inf or a NaN: emulated tensors hold none
        if computed is None:
            self._drop(outputs + written)
            if not self.rate(func, base, args, kwargs, outputs, written):
                self.made(func, outputs)
            return
        if base in UNINITIALISED:
            computed = [torch.zeros_like(value) for value in computed]
        for t, value in zip(outputs, computed):
            self.known[t] = value
            if routed:
                self.routed[t] = True
            if invented:
                self.invented[t] = True
            else:
                self.invented.pop(t, None)

    def made(self, func: Any, outputs: list) -> None:
        """Op `func` made `outputs` without values: each single float of them (0-dim, a MADE dtype) that it
        allocated (not a view, nor a write into an input, nor one of a foreach op's list of per-tensor
        results) takes the sequence's next number now, as its value (docs/emulate.md, "Values read
        back"). A loss made later holds a lower number than one made earlier, so comparing the two on
        the device, or reading either back any number of times, answers as in a short real run."""
        singles = [t for t in outputs if t.dim() == 0 and t.dtype in MADE]
        if not singles:  # most ops: asked first, as the schema is built anew at each look
            return
        returns = func._schema.returns
        if any(r.alias_info is not None or isinstance(r.type, torch.ListType) for r in returns):
            return
        for t in singles:
            self.known[t] = torch.tensor(unknown_float(self.reads), dtype=t.dtype)
            self.reads += 1
            self.invented[t] = True

    def rate(self, func: Any, base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], outputs: list,
             written: list) -> bool:
        """Op `func` (`base`) made `outputs` from `args` without values: whether they are rates or counts
        (RATES, COUNTS, module docstring). A comparison's output, and a cast, copy or view of one, is
        marked as a tensor of true and false elements, as is one masked (MASKED_BY); a mean of one takes
        the next rising fraction (unknown_rate) of the elements that may be true in each element, a sum
        or count_nonzero that fraction of the elements each output element could count, rounded
        (0 <= count <= N), as values (invented, as made numbers are)."""
        if len(outputs) != 1 or written:
            return False
        out = outputs[0]
        if base in COMPARISONS:
            self.rates[out] = True
            return True
        if not self.rates:
            return False
        first = args[0] if args else kwargs.get("self")
        if base in MASKED_BY:
            possible = self.masked(func, base, args, kwargs, out)
            if possible is None:
                return False
            self.rates[out] = possible
            return True
        if not isinstance(first, torch.Tensor) or first not in self.rates:
            return False
        if base in RATED_FROM or _is_view(func):
            self.rates[out] = self._possible(func, args, kwargs, out)
            return True
        if (base not in RATES and base not in COUNTS) or out.numel() > MAX_ELEMENTS \
                or (base in RATES and not out.is_floating_point()):
            return False
        fraction = unknown_rate(self.rated)
        self.rated += 1
        # a mask's marks: what each output element could count (a sum), or the share of its elements that
        # may be true (a mean); None where every element reduced may be
        could = None if self.rates[first] is True else self._possible(func, args, kwargs, out, reduced=True)
        if isinstance(could, torch.Tensor) and could.shape == out.shape:
            if base in RATES:
                self.known[out] = (fraction * could.double()).to(out.dtype)
            elif could.numel() == 1:
                count = self._count(fraction, int(could.item()))
                self.known[out] = torch.tensor(count).to(out.dtype).reshape(out.shape)
            else:  # one count per row of the mask: each rounded alone
                counts = (fraction * could.double() + 0.5).floor().clamp(min=0).minimum(could.double())
                self.known[out] = counts.to(out.dtype)
            self.invented[out] = True
            return True
        number: Any = fraction
        if base in COUNTS:
            count = self._count(fraction, first.numel() // max(out.numel(), 1))
            number = float(count) if out.is_floating_point() else count
        self.known[out] = torch.full(tuple(out.shape), number, dtype=out.dtype)
        self.invented[out] = True
        return True

    def _count(self, fraction: float, reduced: int) -> int:
        """`fraction` of `reduced` elements as a count in `[0, reduced]`, rounded with the rest carried to
        the next count, so that counts in a row sum to their fractions' sum (+-1): a test set's total
        rises while a batch's count alone would not."""
        exact = fraction * reduced + self.counted
        count = min(max(int(exact + 0.5), 0), reduced)
        self.counted = exact - count
        return count

    def masked(self, func: Any, base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               out: torch.Tensor) -> Any:
        """Op `base` (MASKED_BY) made `out` without values: which of its elements may be true where it
        keeps a marked input's true and false elements (True: every one; a CPU bool tensor: those), or
        None where it does not (no input marked; a product with numbers other than 0 and 1; a `where`
        whose other branch is not zero)."""
        tensors = [a for a in (*args[:3], *(args[1] if base == "index" and len(args) > 1 else ()))
                   if isinstance(a, torch.Tensor)]
        if not any(a.is_meta and a in self.rates for a in tensors):
            return None
        if base in ("index", "masked_select") and not (isinstance(args[0], torch.Tensor) and args[0] in self.rates):
            return None  # indexing something else by a marked mask selects its elements, not true and false
        if base == "where":
            if len(args) != 3:
                return None
            zero = [i for i in (1, 2) if not (isinstance(args[i], torch.Tensor) and args[i] in self.rates)]
            if len(zero) != 1 or not self._all_in(args[zero[0]], (0,)):
                return None
        if base == "mul":
            others = [a for a in args[:2] if not (isinstance(a, torch.Tensor) and a in self.rates)]
            if any(not self._all_in(a, (0, 1)) for a in others):
                return None
        return self._possible(func, args, kwargs, out)

    def _all_in(self, x: Any, numbers: Tuple[int, ...]) -> bool:
        """Whether every element of `x` (a number, a tensor on the host or one with known values) is one
        of `numbers`."""
        value = self.of(x) if isinstance(x, torch.Tensor) and x.is_meta else x
        if value is None:
            return False
        if not isinstance(value, torch.Tensor):
            return isinstance(value, (bool, int, float)) and value in numbers
        return value.numel() > 0 and bool(torch.isin(value.double(), torch.tensor(numbers, dtype=torch.double)).all())

    def _possible(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: torch.Tensor,
                  reduced: bool = False) -> Any:
        """Which elements of `out` may be true, `func` run on the CPU with each marked input's (Values.rates)
        in its place: True for every one (where every marked input's are, for an op that moves elements
        and masks none, and where it cannot be worked out: a large tensor, an index without values);
        else a bool tensor. With `reduced`, `func` (a sum or a mean) of them: each output element's N."""
        masking = func._schema.name.split("::", 1)[-1] in MASKED_BY
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_meta]
        if not reduced and not masking and all(self.rates.get(a) is True for a in tensors):
            return True
        unknown = []

        def value(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                mark = self.rates.get(x)
                if mark is not None:
                    if mark is True:
                        if x.numel() > MAX_ELEMENTS:
                            unknown.append(x)
                            return None
                        return torch.ones(x.shape, dtype=x.dtype)
                    return mark.to(x.dtype)
                known = self.known.get(x)
                if known is None and x.dtype == torch.bool and x.numel() <= MAX_ELEMENTS:
                    return torch.ones(x.shape, dtype=x.dtype)  # a mask without values: any element may be kept
                if known is None:
                    unknown.append(x)
                return known
            if isinstance(x, torch.device) and x.type == "meta":
                return CPU
            return x
        cpu_args, cpu_kwargs = tree_map(value, args), tree_map(value, kwargs)
        if unknown:
            return True
        try:
            result = func(*cpu_args, **cpu_kwargs)
        except Exception:  # an op the CPU runs otherwise: every element may be true
            return True
        if not isinstance(result, torch.Tensor) or result.shape != out.shape:
            return True
        if reduced:
            return result
        possible = result != 0
        return True if bool(possible.all()) else possible

    def _invented(self, inputs: Any) -> bool:
        """Whether any device tensor among `inputs` holds values computed from a made number."""
        if not self.invented:
            return False
        return any(isinstance(t, torch.Tensor) and t.is_meta and t in self.invented for t in tree_leaves(inputs))

    def chose(self, x: torch.Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any], outputs: list) -> None:
        """`topk` of `x`, which has no values, gave `outputs` (values, indices): the indices are a balanced
        router's choices (choices.py), routed; the values stay without values (made from weights)."""
        picked, indices = outputs
        self.known.pop(picked, None)
        self.routed.pop(picked, None)
        dim = choices.topk_dim(x, args, kwargs)
        n = int(x.shape[dim]) if x.dim() else 1
        self.known[indices] = choices.balanced(tuple(indices.shape), dim if x.dim() else 0, n)
        self.routed[indices] = True

    def join(self, out: torch.Tensor, value: torch.Tensor, inputs: Any) -> None:
        """`out`, made by an op the emulator sizes itself (nonzero, unique, bincount), has `value`,
        computed from `inputs`' values: routed where any of them is."""
        self.known[out] = value
        if self._routed(inputs):
            self.routed[out] = True
        else:
            self.routed.pop(out, None)

    def _routed(self, inputs: Any) -> bool:
        """Whether any device tensor among `inputs` holds values from a router's choices."""
        if not self.routed:  # no router ran (most models): nothing to look for, op after op
            return False
        return any(isinstance(t, torch.Tensor) and t.is_meta and t in self.routed for t in tree_leaves(inputs))

    def checked(self, x: Any, out: Any, check: str = "isfinite") -> None:
        """`out` is `check` (FINITENESS) of `x`: where `x` has no values, the answer for finite numbers."""
        if isinstance(out, torch.Tensor) and out.is_meta and isinstance(x, torch.Tensor) and self.of(x) is None:
            self.known[out] = torch.tensor(FINITENESS[check]).expand(out.shape)

    def forget(self, written: Any) -> None:
        """Tensors written by code the emulator does not run (a compiled graph's Triton kernels):
        their values are no longer known."""
        self._drop([t for t in tree_leaves(written) if isinstance(t, torch.Tensor)])

    def _drop(self, tensors: List[torch.Tensor]) -> None:
        """No value for `tensors` any more, nor for any tensor that shares its device storage with one
        of them: a write through a view (`x[:n].add_(y)`, a kernel given `x[:n]`) writes its base and
        every other view of it, on the GPU as here."""
        storages = {_storage(t) for t in tensors if self.known.pop(t, None) is not None} - {None}
        if storages:
            for t in [t for t in self.known.keys() if _storage(t) in storages]:
                self.known.pop(t, None)

    def _compute(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], outputs: list,
                 routed: bool) -> Optional[list]:
        if torch.Tag.nondeterministic_seeded in func.tags:
            drawn = self._drawing(func, kwargs, outputs)
            if drawn is None:
                return None
            func, kwargs = drawn
        # A large output gets values only where that makes no more data than its inputs' known values
        # hold: a view of them, a copy, a concatenation (an object collective's pickled bytes, the
        # only large values there are); never a mask expanded to every head and position. What comes
        # from a router's choices is kept at any size (module docstring).
        big = not routed and not _is_view(func) and any(t.numel() > MAX_ELEMENTS for t in outputs)
        missing, found = [], []
        base = func._schema.name.split("::", 1)[-1]
        template = id(args[0]) if base in TEMPLATED and args else None
        if not routed and base not in DECIDED and any(
                isinstance(x, torch.Tensor) and x.is_meta and id(x) != template and x not in self.known
                for x in _arguments(args, kwargs)):
            return None  # an input without values (most ops of a model): below would find it missing, slower

        def value(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                v = self.known.get(x)
                if v is None and id(x) == template:  # its shape and dtype, in one element: no values are read
                    return torch.empty((), dtype=x.dtype).expand(x.shape)
                if v is None and routed and x in self.constants:  # a large constant, for a router's op
                    v = torch.full(x.shape, self.constants[x], dtype=x.dtype)
                if v is None:
                    missing.append(x)
                else:  # the elements it holds: an expanded mask holds its own, not every position's
                    found.append(min(v.numel(), v.untyped_storage().nbytes() // max(v.element_size(), 1)))
                return v
            if isinstance(x, torch.device) and x.type == "meta":
                return CPU
            return x
        cpu_args, cpu_kwargs = tree_map(value, args), tree_map(value, kwargs)
        if big and (missing or sum(t.numel() for t in outputs) > sum(found)):
            return None
        if missing:
            return _decided(base, args, cpu_args, outputs)
        try:
            result = func(*cpu_args, **cpu_kwargs)
        except Exception:  # an op the CPU does not run as the device would (dtype support): no value
            return None
        values = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if len(values) != len(outputs) or any(v.shape != t.shape for v, t in zip(values, outputs)):
            return None
        return values

    def _drawing(self, func: Any, kwargs: Dict[str, Any], outputs: list) -> Optional[Tuple[Any, Dict[str, Any]]]:
        """Random op `func` as it draws on the CPU from the device's generator: its overload taking a
        generator, and its arguments with one; None where it gets no values (a large output, an op
        with no such overload, such as `native_dropout`)."""
        if any(t.numel() > MAX_ELEMENTS for t in outputs):
            return None  # checked before any draw: a dropout mask's host copy would be activation-sized
        drawing = _with_generator(func)
        # The generator a script passes arrives as a new wrapper of the same generator: it is the
        # stand-in of a `cuda` one (patches.Generator), as a GPU refuses a CPU generator for its ops.
        generator = kwargs.get("generator") or self.generator
        if drawing is None or generator is None:
            return None
        return drawing, {**kwargs, "generator": generator}


def _absorbed(base: str, cpu_args: Tuple[Any, ...], outputs: list) -> Optional[list]:
    """The value of an `or`/`and` that one known operand decides (ABSORBING), else None: an `or` with
    an operand all true is all true; an `and` with an operand all false or zero is all zero, in the
    output's dtype (`unfinished & ~done` is a long tensor)."""
    absorbing = ABSORBING[base]
    if len(outputs) != 1 or outputs[0].is_floating_point() or outputs[0].is_complex():
        return None
    out = outputs[0]
    if absorbing and out.dtype != torch.bool:
        return None  # an integer `or` is decided only by all bits set, which no mask or count holds
    for known in cpu_args[:2]:
        if isinstance(known, (bool, int)) and not isinstance(known, torch.Tensor):
            decides = known is True if absorbing else known == 0
        elif isinstance(known, torch.Tensor) and not known.is_floating_point() and known.numel():
            decides = bool(known.all()) if absorbing else not bool(known.any())
        else:
            continue
        if decides:
            return [torch.full(out.shape, absorbing, dtype=out.dtype)]
    return None


def _decided(base: str, args: Tuple[Any, ...], cpu_args: Tuple[Any, ...], outputs: list) -> Optional[list]:
    """The value of op `base` (DECIDED), some of whose device inputs have no values (None among
    `cpu_args`), where its known operands decide it alone; else None."""
    if base in ABSORBING:
        return _absorbed(base, cpu_args, outputs)
    if base in COMPARISONS:
        return _against_sentinel(base, args, cpu_args, outputs)
    if base == "where":
        return _selected(cpu_args, outputs)
    return None


def _against_sentinel(base: str, args: Tuple[Any, ...], cpu_args: Tuple[Any, ...], outputs: list) -> Optional[list]:
    """Comparison `base` of a float without values with a known sentinel (COMPARISONS): every element
    of the unknown side compares as zero does, broadcast to the output's shape; else None."""
    if len(outputs) != 1 or len(cpu_args) < 2:
        return None
    sides = list(cpu_args[:2])
    unknown = [i for i, v in enumerate(sides) if v is None]
    if len(unknown) != 1:
        return None
    i = unknown[0]
    template, known = args[i], sides[1 - i]
    if not isinstance(template, torch.Tensor) or not template.is_floating_point():
        return None
    known_values = known if isinstance(known, torch.Tensor) else torch.tensor(known)
    if isinstance(known, bool) or known_values.is_complex() or known_values.numel() == 0 \
            or not bool((known_values.double().abs() >= SENTINEL).all()):
        return None
    sides[i] = torch.zeros((), dtype=template.dtype)
    answer = getattr(torch, base)(*sides)
    return [answer.to(outputs[0].dtype).expand(outputs[0].shape).clone()]  # small (MAX_ELEMENTS): writable


def _selected(cpu_args: Tuple[Any, ...], outputs: list) -> Optional[list]:
    """`where(condition, a, b)` with a known condition all true (all false) and a (b) known: that
    operand, broadcast to the output's shape, whatever the other holds; else None."""
    if len(outputs) != 1 or len(cpu_args) != 3 or not isinstance(cpu_args[0], torch.Tensor):
        return None
    condition, a, b = cpu_args
    if condition.numel() == 0:
        return None
    chosen = a if bool(condition.all()) else b if not bool(condition.any()) else None
    if chosen is None:
        return None
    out = outputs[0]
    return [torch.as_tensor(chosen).to(out.dtype).expand(out.shape).clone()]


@functools.lru_cache(maxsize=None)
def _with_generator(func: Any) -> Any:
    """The overload of random op `func` that takes a generator: itself (`uniform_`, `bernoulli`), its
    twin (`randint.low` -> `randint.low_generator`, `randperm` -> `randperm.generator`), or None."""
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for overload in packet.overloads():
        twin = getattr(packet, overload)
        taken = [a.name for a in twin._schema.arguments]
        if "generator" in taken and [n for n in taken if n != "generator"] == names:
            return twin
    return None


def _number(base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The number constant factory `base` (CONSTANTS) fills its output with."""
    number = CONSTANTS[base]
    if number is None:  # full(size, fill_value), full_like(self, fill_value), new_full(self, size, fill_value)
        at = 2 if base == "new_full" else 1
        number = args[at] if len(args) > at else kwargs["fill_value"]
    return number


def _arguments(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[Any]:
    """An aten op's arguments, lists opened (its lists hold tensors or numbers, never lists), lazily:
    the first input without a value ends the search, where flattening every argument first cost a
    foreach op over a model's parameters its whole list."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, (list, tuple)):
            yield from x
        else:
            yield x


def _is_view(func: Any) -> bool:
    """Whether op `func` returns views of its input (slice, view, select), whose values cost no memory."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _storage(t: torch.Tensor) -> Optional[int]:
    """Which storage `t` views (the same for a tensor and its views); None for a layout without one
    (sparse)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def forget_written(written: Any) -> None:
    """Tensors written by code the emulator does not run (a compiled graph's Triton kernels, a Triton
    kernel launched directly) have no value known any more, in every dispatch mode that keeps values:
    without this a compiled loss kept the (uninitialised) value of the buffer Inductor made for it,
    and `loss.item()` read it."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(getattr(mode, "values", None), Values):
            mode.values.forget(written)


def unknown_rate(c: int) -> float:
    """The fraction the `c`-th rate or count (from 0) made without values takes (RATE_PACE,
    docs/emulate.md "Values read back"): 1 - 0.5 h / (h + c), h = RATE_PACE, in float64: 0.5 first,
    rising towards 1 and never reaching it; strictly rising in float32 for some 23,000 of them."""
    return 1.0 - 0.5 * RATE_PACE / (RATE_PACE + c)


def unknown_float(n: int) -> float:
    """The number the `n`-th read (from 0) of the run of a device float the emulator does not know
    gives (docs/emulate.md, "Values read back"): FIRST_READ x PACE / (PACE + n), a float32 number.
    For its first 11,856,147 numbers each is strictly lower than every one before it in float32 too
    (2,048 float32 steps below the last at first, 26 at 0.01), so any mean or sum of later reads is lower
    than the same of as many earlier ones: a loss averaged over an evaluation improves from one
    evaluation to the next, as a short real run's does, and a save gated on it runs. Hyperbolic, as
    a real run's loss falls fast and then slower: each number is 1 / (PACE + n + 1) below the last,
    more than a 1e-4 relative threshold's improvement for the first 1,808 numbers."""
    return float(torch.tensor(FIRST_READ * PACE / (PACE + n), dtype=torch.float32))
