"""The values of small emulated tensors, kept on the CPU beside them.

The emulated device holds no data, yet scripts and libraries branch on small values: an attention
mask that is all ones lets Hugging Face skip building a causal mask, labels and position ids are
read back, `nonzero` sizes its output by them. So every op whose device inputs all have known
values and whose outputs are small also runs on the CPU copies: masks, ids, counters and their
arithmetic keep their real values, while activations (large, or made from weights, which have no
values) stay shapes only. Ops that draw random numbers are not copied (they would advance the
CPU's generator, which the GPU's run leaves alone), and an op that writes into a tensor with a
value it cannot compute drops that value, but for the checks for infs and NaNs (GradScaler's),
which find none.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

# Outputs up to this many elements get values: a batch's ids, masks and labels, not its activations.
MAX_ELEMENTS = 1 << 16
# Checks that set a flag only when they find an inf or a NaN (GradScaler's): emulated tensors hold
# no such value, so the flag keeps the value it had (no overflow), and the scale grows as on a GPU.
FINITE_CHECKS = {"_amp_foreach_non_finite_check_and_unscale_", "_amp_non_finite_check_and_unscale_"}
# Factories of uninitialised memory: run on the CPU they would give whatever the host's allocator
# left there, a value that changes from run to run (a compiled loss read back as -1.9e+32). They
# hold zeros, as values the emulator does not have read back, so what fills them later
# (`fill_`, `copy_` of known values) still computes, and the same script gives the same snapshot.
UNINITIALISED = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"}
CPU = torch.device("cpu")
# Boolean ops whose result one operand decides alone: `x | True` is true and `x & False` false (and
# `n & 0` zero) whatever x is. Hugging Face's generate() stops on
# `unfinished & ~(max_length_done | eos_found)`: the length criterion is known, the end-of-sequence one
# reads sampled tokens, which have no values; without this the loop's stop flag never had a value and
# generate() never stopped.
ABSORBING = {"bitwise_or": True, "logical_or": True, "bitwise_or_": True, "logical_or_": True,
             "bitwise_and": False, "logical_and": False, "bitwise_and_": False, "logical_and_": False}


class Values:
    """Known values of meta tensors (a CPU tensor of the same shape per meta tensor)."""

    def __init__(self) -> None:
        self.known = WeakTensorKeyDictionary()

    def of(self, t: Any) -> Optional[torch.Tensor]:
        """The CPU value of meta tensor `t`, or None when it is unknown."""
        return self.known.get(t) if isinstance(t, torch.Tensor) and t.is_meta else None

    def follow(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        """After op `func` ran on meta tensors: give its outputs values when they can be computed."""
        if func._schema.name.split("::", 1)[-1] in FINITE_CHECKS:
            return
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_meta]
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.Tensor)]
        computed = self._compute(func, args, kwargs, outputs) if outputs else None
        if computed is None:
            for t in outputs + written:
                self.known.pop(t, None)
            return
        if func._schema.name.split("::", 1)[-1] in UNINITIALISED:
            computed = [torch.zeros_like(value) for value in computed]
        for t, value in zip(outputs, computed):
            self.known[t] = value

    def forget(self, written: Any) -> None:
        """Tensors written by code the emulator does not run (a compiled graph's Triton kernels):
        their values are no longer known."""
        for t in tree_leaves(written):
            if isinstance(t, torch.Tensor):
                self.known.pop(t, None)

    def _compute(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], outputs: list) -> Optional[list]:
        if torch.Tag.nondeterministic_seeded in func.tags or any(t.numel() > MAX_ELEMENTS for t in outputs):
            return None
        missing = []

        def value(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                v = self.known.get(x)
                if v is None:
                    missing.append(x)
                return v
            if isinstance(x, torch.device) and x.type == "meta":
                return CPU
            return x
        cpu_args, cpu_kwargs = tree_map(value, args), tree_map(value, kwargs)
        if missing:
            return self._absorbed(func, cpu_args, outputs)
        try:
            result = func(*cpu_args, **cpu_kwargs)
        except Exception:  # an op the CPU does not run as the device would (dtype support): no value
            return None
        values = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if len(values) != len(outputs) or any(v.shape != t.shape for v, t in zip(values, outputs)):
            return None
        return values

    @staticmethod
    def _absorbed(func: Any, cpu_args: Tuple[Any, ...], outputs: list) -> Optional[list]:
        """The value of an `or`/`and` that one known operand decides (ABSORBING), else None: an `or` with
        an operand all true is all true; an `and` with an operand all false or zero is all zero, in the
        output's dtype (`unfinished & ~done` is a long tensor)."""
        absorbing = ABSORBING.get(func._schema.name.split("::", 1)[-1])
        if absorbing is None or len(outputs) != 1 or outputs[0].is_floating_point() or outputs[0].is_complex():
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
