"""counterfactual: `memdiff whatif`, from one recorded run, the peak after a change nobody has made yet.

A what-if is the forecast's replay (forecasting.replay_course) with each allocation of the run
changed by a rule instead of by a fitted size: a rule drops an allocation, scales it, moves its
birth, or adds allocations the change makes. Which allocations a rule touches is read from what
the earlier stages say of each: its category (classify), the phase run and step it was born and
freed in (lifetimes), its site, and the profiler's module instances on its stack
(`nn.Module: GPT2Block_3`) for the repeated blocks, or without them (CUDA stacks) the call the
forward repeats with the same allocations (a loop over the layers). Every change names what it assumed, and a
change the run cannot show (no optimizer state, no repeated blocks) is one line, not a guess.

The changes (`--change`, several joined by `+` apply together):

- `checkpoint`, `checkpoint=F`: non-reentrant activation checkpointing of the repeated blocks
  (all, or the fraction F: 0.5 is every other one). A block's activations saved for the backward
  are dropped but its output (the next block's input); before the block's backward they come back
  (the recomputation) together with the block's forward transient peak.
- `weights=bf16|fp16`: parameters, gradients, optimizer state and activations in 2 bytes; the
  loss (upcast to fp32 by the libraries), inputs, BLAS workspaces and one-element tensors keep
  their size.
- `autocast=bf16|fp16`: activations and their gradients made in the forward and backward halve
  (the loss excepted); a half-precision copy of the weights is made in each forward and lives
  to the end of its backward (autocast's weight casts, saved for the backward). Where the stacks
  name the ATen ops (CUDA), what autocast runs in fp32 and what its line computes after it stay
  fp32 (_fp32_regions).
- `optimizer=NAME`: the run's optimizer state scaled to NAME's tensors per parameter, its step
  temporaries replaced by NAME's, in the run's form (single-tensor: a few of the largest
  parameter's size; foreach: a few of every parameter's).
- `zero-grad=none|zeros`: gradients freed after each step, or kept (zeroed) from the first.
- `accumulate=K`: K micro-batches of 1/K the batch: what the forward and backward make scales by
  1/K; from the second micro-batch on, the gradients of the earlier ones are held throughout.

Named so that importing it cannot hide the API's `memdiff.whatif` (as forecasting.py, differ.py).
Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from importlib import resources
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from memdiff import __version__
from memdiff.classify import Rule
from memdiff.errors import InputError
from memdiff.findings import finding
from memdiff.forecasting import DeviceCourse, Replayed, read_course, replay_course, structure
from memdiff.inert import scrubbed
from memdiff.lifetimes import BACKWARD, FORWARD, OPTIMIZER
from memdiff.model import Finding, PhaseSpan, Step
from memdiff.units import format_bytes
from memdiff.window import Window

SCHEMA_VERSION = 1
NAMES = ("checkpoint", "weights", "autocast", "optimizer", "zero-grad", "accumulate")
PRECISIONS = ("bf16", "fp16")
# Per optimizer: (state tensors per parameter, step temporaries per parameter in the update).
# From each optimizer's update in torch.optim: Adam's denominator is sqrt(v) then a division
# (two tensors of the parameter's size at once); AMSGrad's max is taken in place; Adagrad's
# and RMSprop's std is sqrt(state) + eps in place (one); SGD updates in place (none);
# Adafactor's state is a row and a column per matrix (counted as none; a vector's full variance
# is small) and its update's one full-size tensor is the variance estimate row_var @ col_var.
OPTIMIZERS: Dict[str, Tuple[int, int]] = {
    "sgd": (0, 0), "sgd-momentum": (1, 0), "adam": (2, 2), "adamw": (2, 2), "adamw-amsgrad": (3, 2),
    "adagrad": (1, 1), "rmsprop": (1, 1), "adafactor": (0, 1)}
ZERO_GRAD = ("none", "zeros")
MAX_ACCUMULATE = 1024
# Loss computations that libraries run in fp32 whatever the model's precision (Hugging Face
# upcasts the logits in its loss; log_softmax and nll_loss then stay fp32, and so do their grads).
LOSS_SITE = re.compile(r"cross_entropy|nll_loss|log_softmax|LogSoftmaxBackward|NllLossBackward|loss_utils|"
                       r"binary_cross_entropy|mse_loss", re.IGNORECASE)
# Ops that return int64 indices beside their values: an allocation of theirs twice the size of
# the one just before it (same site) is the indices (8 bytes an element against fp32's 4), whose
# size no precision changes.
INDEX_SITE = re.compile(r"max_pool\dd|adaptive_max_pool|fractional_max_pool|topk|\bsort\b|\bmax\b|kthvalue|\bmode\b")
# Their backward (`max_pool2d_with_indices_backward`, the node `MaxPool2DWithIndicesBackward0`)
# only reads the indices: what it makes is the input's gradient, in the values' dtype.
GRADIENT_SITE = re.compile(r"_backward|Backward\d*\b")
MODULE_FRAME = re.compile(r"^nn\.Module: (\w+?)_(\d+)$")
# Module classes too small to be "the repeated block" when a larger repeated one exists.
GENERIC = frozenset(("Linear", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "RMSNorm",
                     "GroupNorm", "BatchNorm1d", "BatchNorm2d", "Dropout", "GELU", "ReLU", "SiLU", "Tanh",
                     "Softmax", "Identity", "NewGELUActivation", "GELUActivation", "Sequential", "ModuleList"))
# The share of a repeated module's bytes that a class nested in it, with more instances, must
# hold to be the block instead (T5's blocks hold about 90% of what its two stacks make).
NESTED_SHARE = 0.75
# CUDA autocast's op lists (rules/autocast.json, shared with the emulator), by ATen op name.
_AUTOCAST = json.loads((resources.files("memdiff") / "rules" / "autocast.json").read_text(encoding="utf-8"))["cuda"]
AUTOCAST_LOWER = frozenset(_AUTOCAST["lower"])
AUTOCAST_FP32 = frozenset(_AUTOCAST["fp32"])
AUTOCAST_SAVES_INPUT = frozenset(_AUTOCAST["saves_input"])
# An ATen op's frame on the caching allocator's C++ stacks: `at::_ops::` names the op and its
# overload joined by "_" (`sum_dim_IntList`, `pow_Tensor_Scalar`, `max_dim`).
ATEN_OP = re.compile(r"^at::_ops::(\w+)::call$")
# Ops whose result is bool or an integer whatever the floating type of their inputs (a mask from
# `eq`, `argmax`'s indices): neither half-precision weights nor autocast change their size.
NOT_FLOAT_OPS = frozenset(("eq", "ne", "lt", "gt", "le", "ge", "logical_and", "logical_or", "logical_not",
                           "logical_xor", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "argmax", "argmin",
                           "nonzero", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor"))
# The op names an overload's suffix is taken off to find (`sum_dim_IntList`: sum).
_KNOWN_OPS = AUTOCAST_LOWER | AUTOCAST_FP32 | frozenset(_AUTOCAST["promote"]) | NOT_FLOAT_OPS
# The matrix products of autocast's lower list that take one activation and a weight (a layer's
# projections); attention, which casts q, k and v together, is not one.
MATRIX_PRODUCTS = AUTOCAST_LOWER - {"scaled_dot_product_attention"}
# Normalisations whose output is fp32 under autocast: on CUDA's fp32 list, and on the CPU fed the
# fp32 residual stream (CPU autocast runs them in their input's dtype).
NORM_OPS = frozenset(("layer_norm", "group_norm", "rms_norm"))
# The profiler's frame for a built-in the Python code called: its name.
BUILTIN_CALL = re.compile(r"^<built-in (?:method|function) (\w+)")
# CPU attention on the profiler route: the call's frame, and what CPU flash attention allocates in it.
SDPA_CALL = "<built-in function scaled_dot_product_attention>"
FLASH_CPU_ALLOCATIONS = 2
SCALAR_BYTES = 8  # a one-element tensor (an optimizer's step count): its dtype does not follow the model's
# torch.optim's optimizers, by their class names lowercased (`torch.optim.RMSprop`: rmsprop), which
# are also the names of the files their update code lives in (Adafactor's: `_adafactor.py`).
TORCH_OPTIMIZERS = frozenset(("adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "asgd", "lbfgs",
                              "nadam", "radam", "rmsprop", "rprop", "sgd", "sparseadam", "sparse_adam"))
# The scope torch.optim opens around every step (`Optimizer.step#AdamW.step`): the class's name.
STEP_SCOPE = re.compile(r"^Optimizer\.step#(\w{1,64})\.step$")
# A frame of torch.optim's code (the file in CUDA frames, in the name of the profiler's:
# `torch/optim/adam.py(345): _single_tensor_adam`).
OPTIM_FILE = re.compile(r"(?:^|/)torch/optim/(\w{1,64})\.py\b")
# torch's multi-tensor update: its functions and the foreach ops they call (not a user's `my_foreach_`).
FOREACH_FRAME = re.compile(r"\b_multi_tensor_\w|\b_foreach_\w")


@dataclass(frozen=True)
class Change:
    """One `--change` as given: its parts (name, value or None), applied together."""

    text: str
    parts: Tuple[Tuple[str, Optional[str]], ...]


@dataclass
class ChangePrediction:
    """The run's device replayed with one change: the peak, where, what it saves, how far to trust it."""

    change: str
    applies: bool
    reason: Optional[str]  # why it cannot apply (then no prediction)
    predicted_peak_bytes: Optional[int]
    predicted_peak_phase: Optional[str]
    predicted_peak_step: Optional[int]
    delta_bytes: Optional[int]
    delta_pct: Optional[float]
    fits_budget: Optional[bool]
    phase_peaks: Dict[str, int]
    categories: Dict[str, int]
    assumptions: List[str]
    line: str  # the change in one sentence


@dataclass
class DeviceWhatIf:
    """Every change asked of one device of the run."""

    device: int
    base_peak_bytes: int
    base_peak_phase: Optional[str]
    base_peak_step: Optional[int]
    blocks: List[str]  # the repeated blocks' instances the stacks show, in order
    optimizer: Optional[str]  # the run's optimizer, as torch.optim's scope or code names it (run_optimizer)
    changes: List[ChangePrediction]
    headline: str  # the run's peak and the change that saves most, in one line
    findings: List[Finding] = field(default_factory=list)  # each change that does not apply (W014)


@dataclass
class WhatIf:
    """The whole what-if, every number and sentence any output shows."""

    file: str
    budget_bytes: Optional[int]
    asked: List[str]  # the changes given (empty: every applicable one)
    devices: List[DeviceWhatIf]
    notes: List[Finding] = field(default_factory=list)  # the catalogue's (findings.py)
    tool: str = f"memdiff {__version__}"

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (schemas/whatif.schema.json)."""
        return {"schema_version": SCHEMA_VERSION, "tool": self.tool, "file": self.file,
                "budget_bytes": self.budget_bytes, "asked": self.asked, "notes": [n.text for n in self.notes],
                "findings": [n.to_dict() for n in self.notes],
                "devices": [{**asdict(d), "findings": [f.to_dict() for f in d.findings]} for d in self.devices]}


# ---------------------------------------------------------------- parsing


def _closest(word: str, choices: Sequence[str]) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.4)
    return f" (did you mean {near[0]}?)" if near else f" (one of: {', '.join(choices)})"


def parse_change(text: str) -> Change:
    """The Change in `checkpoint=0.5+weights=bf16`; InputError naming the closest known name or value."""
    if not text or len(text) > 200:
        raise InputError("--change", "give a change such as checkpoint, weights=bf16 or optimizer=sgd")
    parts: List[Tuple[str, Optional[str]]] = []
    for piece in text.split("+"):
        name, sep, value = piece.strip().partition("=")
        name = name.strip().lower()
        if name not in NAMES:
            raise InputError("--change", f"unknown change {name!r}{_closest(name, NAMES)}")
        if any(n == name for n, _ in parts):
            raise InputError("--change", f"{name} is given twice in {text!r}")
        v: Optional[str] = value.strip().lower() if sep else None
        _check_value(name, v)
        parts.append((name, v))
    return Change(text, tuple(parts))


def _check_value(name: str, value: Optional[str]) -> None:
    if name == "checkpoint":
        if value is None:
            return
        try:
            f = float(value)
        except ValueError:
            raise InputError("--change", f"checkpoint={value}: give a fraction of the blocks in (0, 1]") from None
        if not 0 < f <= 1:
            raise InputError("--change", f"checkpoint={value}: give a fraction of the blocks in (0, 1]")
        return
    choices = {"weights": PRECISIONS, "autocast": PRECISIONS, "optimizer": tuple(OPTIMIZERS),
               "zero-grad": ZERO_GRAD}.get(name)
    if choices is not None:
        if value is None:
            raise InputError("--change", f"{name} needs a value: {name}={choices[0]} (one of: {', '.join(choices)})")
        if value not in choices:
            raise InputError("--change", f"{name}={value}: unknown value{_closest(value, choices)}")
        return
    # accumulate
    if value is None or not value.isdigit() or not 2 <= int(value) <= MAX_ACCUMULATE:
        raise InputError("--change", f"accumulate={value or ''}: give the micro-batches per step, "
                                     f"a whole number from 2 to {MAX_ACCUMULATE}")


# ---------------------------------------------------------------- what the run shows


class CannotApply(Exception):
    """A change the run cannot show: its message is the one line said instead of a guess."""


@dataclass
class _Run:
    """One device of the run, with the facts every rule reads per allocation."""

    course: DeviceCourse
    spans: List[PhaseSpan]
    steps: List[Step]
    category: np.ndarray  # names, per allocation
    born_run: np.ndarray  # index into spans of the phase run each allocation opened in
    end_run: np.ndarray  # and was freed in (len(spans): never freed)
    phase: np.ndarray  # the phase each allocation opened in
    loss: np.ndarray  # made by the loss (kept in fp32 by the libraries)
    indices: np.ndarray  # int64 indices an op returns beside its values
    op: np.ndarray  # the ATen op that made each allocation, "" where the stacks name none (CUDA's name them)
    call: np.ndarray  # the op or built-in each allocation's stack shows (_called), "" for neither
    line: np.ndarray  # each allocation's innermost line of Python (a 1-tuple of its frame; () for none)
    forward: np.ndarray  # the forward allocations made in the trace, by forward run, then in order
    base: Replayed

    def of(self, *names: str) -> np.ndarray:
        """Allocations of these categories."""
        return np.isin(self.category, list(names))


def _facts(course: DeviceCourse, spans: List[PhaseSpan], steps: List[Step]) -> _Run:
    starts = np.array([s.start_event for s in spans], dtype=np.int64)
    n_events = course.events
    if len(starts):
        born_run = np.maximum(np.searchsorted(starts, course.start, side="right") - 1, 0)
        end_run = np.where(course.end >= n_events, len(spans),
                           np.maximum(np.searchsorted(starts, np.minimum(course.end, max(n_events - 1, 0)),
                                                      side="right") - 1, 0))
        phase = np.array([s.phase for s in spans], dtype=object)[born_run]
    else:
        born_run = np.zeros(len(course.size), dtype=np.int64)
        end_run = np.zeros(len(course.size), dtype=np.int64)
        phase = np.full(len(course.size), "other", dtype=object)
    names = np.array(course.categories, dtype=object)
    category = names[course.category] if len(course.category) else np.zeros(0, dtype=object)
    # The site is per signature, the frames per origin: a loss frame in either counts.
    loss_stack = np.array([bool(LOSS_SITE.search(site)) for _, site in course.stacks], dtype=bool)
    loss = loss_stack[course.stack] if len(course.stack) else np.zeros(0, dtype=bool)
    if course.origins and len(course.origin):
        loss_origin = np.array([any(LOSS_SITE.search(f.name) for f in frames) for frames in course.origins], dtype=bool)
        loss = loss | loss_origin[course.origin]
    base = replay_course(course, course.size, spans, steps)
    if course.origins and len(course.origin):
        ops = [_aten_op(frames) for frames in course.origins]
        op = np.array(ops, dtype=object)[course.origin]
        call = np.array([o or _called(frames) for o, frames in zip(ops, course.origins)], dtype=object)[course.origin]
        lines = np.empty(len(course.origins), dtype=object)
        lines[:] = [tuple(f for f in frames if f.file)[:1] for frames in course.origins]
        line = lines[course.origin]
    else:
        op = np.full(len(course.size), "", dtype=object)
        call = op.copy()
        line = np.empty(len(course.size), dtype=object)
        line[:] = [()] * len(course.size)
    made = np.flatnonzero((phase == FORWARD) & ~course.before)
    forward = made[np.lexsort((course.start[made], born_run[made]))]
    return _Run(course, spans, steps, category, born_run, end_run, phase, loss, _indices(course), op, call, line,
                forward, base)


def _indices(course: DeviceCourse) -> np.ndarray:
    """The allocations that are int64 indices (INDEX_SITE, not their backward: GRADIENT_SITE): twice
    the size of the allocation just before them with the same stack."""
    out = np.zeros(len(course.size), dtype=bool)
    sites = np.array([bool(INDEX_SITE.search(site)) and not GRADIENT_SITE.search(site) for _, site in course.stacks],
                     dtype=bool)
    if not len(course.stack) or not sites.any():
        return out
    members = np.flatnonzero(sites[course.stack])
    members = members[np.argsort(course.start[members], kind="stable")]
    for a, b in zip(members[:-1].tolist(), members[1:].tolist()):
        if course.stack[a] == course.stack[b] and course.size[b] == 2 * course.size[a]:
            out[b] = True
    return out


def repeated_blocks(course: DeviceCourse) -> Tuple[List[str], np.ndarray]:
    """(the repeated blocks' instance names in order, each allocation's index into them or -1).

    The repeated block is the module class with at least two instances under one parent on the
    stacks (the profiler's `nn.Module: GPT2Block_0` frames) whose instances made the most bytes;
    a generic one (Linear, Embedding) only when no other repeats. When a class nested inside it
    has more instances holding most of those bytes (an encoder-decoder's layers inside its two
    stacks), that class is the block."""
    if not course.origins or not len(course.origin):
        return [], np.full(len(course.size), -1, dtype=np.int64)
    paths: List[List[Tuple[str, int]]] = []
    for frames in course.origins:
        mods = [(m.group(1), int(m.group(2))) for m in (MODULE_FRAME.match(f.name) for f in frames) if m]
        paths.append(mods[::-1])  # outermost first
    by_origin = np.bincount(course.origin, weights=course.size.astype(np.float64), minlength=len(paths))
    instances: Dict[Tuple[Tuple[str, ...], str], Dict[int, float]] = {}
    for o, path in enumerate(paths):
        for depth, (cls, number) in enumerate(path):
            parent = tuple(c for c, _ in path[:depth])
            slot = instances.setdefault((parent, cls), {})
            slot[number] = slot.get(number, 0.0) + float(by_origin[o])
    candidates = [(cls not in GENERIC, sum(v.values()), len(parent), cls, parent)
                  for (parent, cls), v in instances.items() if len(v) >= 2]
    if not candidates:
        return [], np.full(len(course.size), -1, dtype=np.int64)
    _, held, _, cls, parent = max(candidates)
    # An encoder-decoder repeats its stacks (T5Stack_0, T5Stack_1), which are not alike (only the
    # decoder's layers attend to the encoder), and, inside them, its layers: the layers are the
    # blocks (what gradient checkpointing wraps) when they are more and hold most of what the stacks
    # made. Alike instances (a Mixtral layer's experts inside its decoder layers) keep the outer one.
    while not _alike(paths, parent, cls):
        count = len(instances[(parent, cls)])
        inner = [(b, p, c) for specific, b, _, c, p in candidates
                 if specific and p[:len(parent) + 1] == (*parent, cls) and len(instances[(p, c)]) > count
                 and b >= NESTED_SHARE * held]
        if not inner:
            break
        held, parent, cls = max(inner)
    numbers = sorted(instances[(parent, cls)])
    index = {n: k for k, n in enumerate(numbers)}
    of_origin = np.full(len(paths), -1, dtype=np.int64)
    for o, path in enumerate(paths):
        inside = len(path) > len(parent) and tuple(c for c, _ in path[:len(parent)]) == parent
        if inside and path[len(parent)][0] == cls:
            of_origin[o] = index[path[len(parent)][1]]
    return [f"{cls}_{n}" for n in numbers], of_origin[course.origin]


def _alike(paths: List[List[Tuple[str, int]]], parent: Tuple[str, ...], cls: str) -> bool:
    """Whether every instance of `cls` under `parent` runs the same module classes inside it."""
    inside: Dict[int, Set[str]] = {}
    depth = len(parent)
    for path in paths:
        if len(path) > depth and path[depth][0] == cls and tuple(c for c, _ in path[:depth]) == parent:
            inside.setdefault(path[depth][1], set()).update(c for c, _ in path[depth + 1:])
    return len({frozenset(s) for s in inside.values()}) <= 1


# Calls tried as the repeated block, those holding the most forward bytes first.
MAX_CALLS = 64


def repeated_calls(run: _Run) -> Tuple[List[str], np.ndarray]:
    """repeated_blocks for stacks without module frames (the caching allocator's, on CUDA): the
    block is the call, one Python call path, under which every forward makes one sequence of
    allocations k >= 2 times over (the same stacks, in the same order: the loop over a model's
    layers), workspaces apart, each time more than one. Of such calls, the one whose allocations
    hold the most bytes; on a tie, the innermost (the tightest call around the block). Each
    allocation's block is its repeat's place in its forward."""
    c = run.course
    none = np.full(len(c.size), -1, dtype=np.int64)
    # A workspace (cuBLAS's, made by the first matrix product) is made once, not per block.
    fwd = _forward_in_order(run, ~run.of("workspace"))
    if not c.origins or not len(c.origin) or not len(fwd):
        return [], none
    # Origins are kinds, told apart by their lifetimes too: a block's allocations are the same by their frames.
    numbered: Dict[Tuple[Any, ...], int] = {}
    same_frames = np.array([numbered.setdefault(tuple(frames), len(numbered)) for frames in c.origins], dtype=np.int64)
    # Each origin's call paths: its stack from the outermost frame down to each Python frame, each
    # path a node numbered from its parent's, so a deep stack costs its depth, not its depth squared.
    # Nested calls around the same allocations are one candidate: the innermost stands for them.
    node_of: Dict[Tuple[Any, int], int] = {}
    members: Dict[int, List[int]] = {}
    place: Dict[int, Tuple[int, int]] = {}  # node -> (an origin, the index of the path's innermost frame)
    for o, frames in enumerate(c.origins):
        parent = -1
        for i in range(len(frames) - 1, -1, -1):
            parent = node_of.setdefault((frames[i], parent), len(node_of))
            if frames[i].file:
                members.setdefault(parent, []).append(o)
                place[parent] = (o, i)
    candidates: Dict[Tuple[int, ...], Tuple[int, int]] = {}  # origins -> (depth, node)
    for node, origins in members.items():
        key = tuple(origins)
        o, i = place[node]
        depth = len(c.origins[o]) - i
        if depth > candidates.get(key, (0, -1))[0]:
            candidates[key] = (depth, node)
    origin = c.origin[fwd]
    # The bytes under a call are those of its origins' forward allocations: the most first (on a tie,
    # the innermost), and the first that repeats is the block. Only the first MAX_CALLS are tried,
    # so that a file of thousands of distinct deep stacks costs a bounded number of passes.
    held_by = np.bincount(origin, weights=c.size[fwd].astype(np.float64), minlength=len(c.origins))
    ranked = sorted(((float(held_by[list(key)].sum()), depth, key, node) for key, (depth, node) in candidates.items()),
                    key=lambda r: (r[0], r[1]), reverse=True)
    cuts = np.flatnonzero(np.diff(run.born_run[fwd])) + 1
    best: Optional[Tuple[Tuple[Any, ...], np.ndarray, int]] = None  # (path, under, period)
    for _, _, key, node in ranked[:MAX_CALLS]:
        mask = np.zeros(len(c.origins), dtype=bool)
        mask[list(key)] = True
        under = mask[origin]
        period = 0
        for part in np.split(np.arange(len(fwd)), cuts):
            mine = part[under[part]]
            if not len(mine):
                continue
            p = _period(same_frames[origin[mine]])
            # A call that makes one allocation each time (a dropout) is no block to checkpoint.
            if p == len(mine) or p < 2 or (period and p != period):
                period = 0
                break
            period = p
        if period:
            o, i = place[node]
            best = (c.origins[o][i:], under, period)
            break
    if best is None:
        return [], none
    path, under, period = best
    block = none.copy()
    count = 0
    for part in np.split(np.arange(len(fwd)), cuts):
        mine = part[under[part]]
        block[fwd[mine]] = np.arange(len(mine)) // period
        count = max(count, len(mine) // period)
    where = f"{path[0].file.rpartition('/')[2]}:{path[0].line}"  # the innermost line the block runs under
    return [f"call {k + 1} at {where}" for k in range(count)], block


def _forward_in_order(run: _Run, also: Optional[np.ndarray] = None) -> np.ndarray:
    """The run's forward allocations made in the trace (and in `also`), by forward run, then in order."""
    return run.forward if also is None else run.forward[also[run.forward]]


def _period(seq: np.ndarray) -> int:
    """The shortest p that repeats to make `seq` whole (len(seq) when none shorter does)."""
    n = len(seq)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and np.array_equal(seq, np.tile(seq[:p], n // p)):
            return p
    return n


def blocks_of(run: _Run) -> Tuple[List[str], np.ndarray]:
    """The repeated blocks: by the profiler's module frames, else by the calls that repeat."""
    blocks, block = repeated_blocks(run.course)
    return (blocks, block) if blocks else repeated_calls(run)


def run_optimizer(run: _Run) -> Tuple[Optional[str], int, int, str]:
    """(the run's optimizer name or None, state tensors per parameter, trainable parameter bytes,
    the update's form: "single" or "foreach").

    The name comes from torch.optim's own record: the class its step scope names
    (`Optimizer.step#AdamW.step`), else the file of torch.optim whose code made the most bytes
    (`torch/optim/rmsprop.py`); the state's bytes per parameter tell SGD from SGD with momentum,
    AdamW from AMSGrad, and name an optimizer torch.optim does not (one state tensor a weight:
    SGD with momentum's memory). The user's files, functions and scopes are never read for it."""
    c = run.course
    state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
    stepped = any(s.phase == OPTIMIZER for s in run.spans)
    grads = _grad_bytes(run)
    if grads <= 0:
        return None, 0, 0, _update_form(run)
    per = int(round(_per_step_state(run, state) / grads))
    base = next((m.group(1).lower() for m in map(STEP_SCOPE.match, c.scopes) if m
                 and m.group(1).lower() in TORCH_OPTIMIZERS), None) or _optimizer_code(run)
    name: Optional[str]
    if base in ("adam", "adamw"):
        name = "adamw-amsgrad" if per == 3 else base
    elif base == "sgd":
        name = "sgd-momentum" if per >= 1 else "sgd"
    elif base is not None:
        name = base
    elif per == 1:
        name = "sgd-momentum"
    elif per == 0 and stepped:
        name = "sgd"
    else:
        name = None
    return name, per, grads, _update_form(run)


def _optimizer_code(run: _Run) -> Optional[str]:
    """The torch.optim optimizer whose update code (its file in torch/optim) made the most bytes."""
    c = run.course
    if not c.origins or not len(c.origin):
        return None
    made = np.bincount(c.origin, weights=c.size.astype(np.float64), minlength=len(c.origins))
    held: Dict[str, float] = {}
    for o, frames in enumerate(c.origins):
        # The innermost frame in an optimizer's own file (not optimizer.py's wrappers around it).
        stems = (m.group(1).lstrip("_") for f in frames for m in [OPTIM_FILE.search(f"{f.file}:{f.name}")] if m)
        found = next((stem for stem in stems if stem in TORCH_OPTIMIZERS), None)
        if found is not None:
            held[found] = held.get(found, 0.0) + float(made[o])
    return max(held, key=lambda k: (held[k], k)) if held else None


def _update_form(run: _Run) -> str:
    """"foreach" when the optimizer step ran torch's multi-tensor update (`_multi_tensor_adam`,
    `_foreach_sqrt` ops), else "single"."""
    c = run.course
    if not c.origins or not len(c.origin):
        return "single"
    mine = np.unique(c.origin[run.phase == OPTIMIZER]).tolist()
    return "foreach" if any(FOREACH_FRAME.search(f.name) for o in mine for f in c.origins[o]) else "single"


def _grad_bytes(run: _Run) -> int:
    """Trainable parameter bytes: the most gradient bytes live at once (without gradients in the
    run, the parameters' when it holds optimizer state, else 0)."""
    c = run.course
    grads = np.flatnonzero(run.of("gradient"))
    if not len(grads):
        state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
        return 0 if not state.any() else _peak_of_set(c, np.flatnonzero(run.of("parameter")))
    return _peak_of_set(c, grads)


def _per_step_state(run: _Run, state: np.ndarray) -> int:
    """Optimizer state bytes (one-element tensors aside) live at once: an in-place update makes
    a new version of each state tensor every step, so its allocations are not summed."""
    return _peak_of_set(run.course, np.flatnonzero(state))


def _step_index(run: _Run, events: np.ndarray) -> np.ndarray:
    starts = np.array([s.start_event for s in run.steps], dtype=np.int64)
    if not len(starts):
        return np.zeros(len(events), dtype=np.int64)
    return np.maximum(np.searchsorted(starts, events, side="right") - 1, 0)


# ---------------------------------------------------------------- the edit every rule makes


@dataclass
class _Edit:
    """Sizes and lifetimes of the run's allocations as a change leaves them, and what it adds."""

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    added_start: List[int] = field(default_factory=list)
    added_end: List[int] = field(default_factory=list)
    added_size: List[int] = field(default_factory=list)
    added_category: List[str] = field(default_factory=list)
    assumptions: List[str] = field(default_factory=list)

    def add(self, start: int, end: int, size: int, category: str) -> None:
        """An allocation the change makes, live after events start .. end - 1."""
        if size > 0 and end > start:
            self.added_start.append(start)
            self.added_end.append(end)
            self.added_size.append(size)
            self.added_category.append(category)


def _changed_course(run: _Run, edit: _Edit) -> Tuple[DeviceCourse, np.ndarray]:
    """The run's course as the edit leaves it (added allocations appended), and its sizes."""
    c = run.course
    names = list(c.categories)
    for name in edit.added_category:
        if name not in names:
            names.append(name)
    codes = [names.index(n) for n in edit.added_category]
    k = len(edit.added_size)
    course = DeviceCourse(
        device=c.device, events=c.events,
        start=np.concatenate([edit.start, np.array(edit.added_start, dtype=np.int64)]),
        end=np.concatenate([edit.end, np.array(edit.added_end, dtype=np.int64)]),
        size=np.concatenate([edit.size, np.array(edit.added_size, dtype=np.int64)]),
        stack=np.concatenate([c.stack, np.zeros(k, dtype=np.int64)]),
        category=np.concatenate([c.category, np.array(codes, dtype=np.int64)]),
        stacks=c.stacks, categories=names,
        before=np.concatenate([c.before & (edit.start == c.start), np.zeros(k, dtype=bool)]))
    return course, course.size


# ---------------------------------------------------------------- the rules


def _checkpoint(run: _Run, edit: _Edit, value: Optional[str], blocks: List[str], block: np.ndarray) -> None:
    if not blocks:
        raise CannotApply("no repeated blocks on the stacks (no nn.Module frames, and no call that each "
                          "forward makes again with the same allocations)")
    if blocks[0].rpartition("_")[0] in GENERIC:
        block = _by_position(run, block, len(blocks))
    fraction = Fraction(value) if value is not None else Fraction(1)
    chosen = [k for k in range(len(blocks)) if int((k + 1) * fraction) > int(k * fraction)]
    c = run.course
    spans = run.spans
    fwd = (run.phase == FORWARD) & run.of("activation", "autograd", "other") & ~c.before
    outlives = run.end_run != run.born_run  # kept past the forward run it was made in: saved for the backward
    transient = fwd & ~outlives
    saved = fwd & outlives
    step_of = _step_index(run, c.start)
    dropped = 0
    picked = np.zeros(len(blocks) + 1, dtype=bool)
    picked[chosen] = True
    in_chosen = picked[block]  # block -1 reads the last entry, False
    saved_groups = _groups(np.flatnonzero(in_chosen & saved), block, step_of)
    transient_groups = _groups(np.flatnonzero(in_chosen & transient), block, step_of)
    for key, members in saved_groups.items():
        if len(members) < 2:
            continue
        # Its output is the last tensor it makes that outlives its forward: the next block's
        # input, which checkpointing keeps.
        output = members[np.argmax(c.start[members])]
        rest = members[members != output]
        in_backward = rest[c.end[rest] < c.events]
        # The recomputation runs when the backward first needs what the block saved: just
        # before the first of those tensors is freed.
        again = int(c.end[in_backward].min()) - 1 if len(in_backward) else None
        for k in rest.tolist():
            dropped += int(c.size[k])
            freed_in_backward = run.end_run[k] < len(spans) and spans[run.end_run[k]].phase == BACKWARD
            if again is not None and c.end[k] > again and freed_in_backward:
                edit.start[k] = max(int(c.start[k]), again)
            else:
                edit.size[k] = 0
        if again is not None:
            temps = transient_groups.get(key, np.zeros(0, dtype=np.int64))
            edit.add(again, again + 1, _peak_of_set(c, temps, edit.size), "autograd")
    edit.assumptions.append(
        f"checkpointing {len(chosen)} of the {len(blocks)} repeated blocks ({', '.join(blocks[k] for k in chosen)}): "
        "each keeps its output (the next block's input); what else it saved for the backward is remade just "
        "before the backward first needs it, with the block's forward transient peak"
        + ("; a generic module repeats, so each block is what the forward makes from one instance to the next"
           if blocks[0].rpartition("_")[0] in GENERIC else ""))
    if not dropped:
        edit.assumptions.append("the chosen blocks save nothing for the backward in this run")


def _groups(members: np.ndarray, block: np.ndarray, step_of: np.ndarray) -> Dict[Tuple[int, int], np.ndarray]:
    """`members` grouped by (block, step), in one sort rather than a scan per block and step."""
    if not len(members):
        return {}
    keys = np.stack([block[members], step_of[members]], axis=1)
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    members, keys = members[order], keys[order]
    cuts = np.flatnonzero(np.any(np.diff(keys, axis=0) != 0, axis=1)) + 1
    return {(int(keys[i, 0]), int(keys[i, 1])): part
            for i, part in zip(np.concatenate([[0], cuts]).tolist(), np.split(members, cuts))}


def _by_position(run: _Run, block: np.ndarray, count: int) -> np.ndarray:
    """Block membership by position in each forward: a generic repeated module (a Linear, a
    Conv2d) is usually checkpointed with what follows it outside any module (its activation
    function, pooling, dropout), so everything the forward makes from one instance's first
    allocation to the next's belongs to the first; the last instance spans as many events as the
    others do (their median)."""
    c = run.course
    out = block.copy()
    fwd = np.flatnonzero(run.phase == FORWARD)
    step_of = _step_index(run, c.start)
    firsts: Dict[int, List[Tuple[int, int]]] = {}  # step -> (first event, block), in event order
    for (b, step), members in _groups(fwd[block[fwd] >= 0], block, step_of).items():
        firsts.setdefault(step, []).append((int(c.start[members].min()), b))
    by_step = fwd[np.argsort(step_of[fwd], kind="stable")]
    cuts = np.flatnonzero(np.diff(step_of[by_step])) + 1
    for part in np.split(by_step, cuts) if len(by_step) else []:
        known = sorted(firsts.get(int(step_of[part[0]]), []))
        if len(known) < 2:
            continue
        starts = np.array([f for f, _ in known], dtype=np.int64)
        length = int(np.median(np.diff(starts)))
        ends = np.append(starts[1:], starts[-1] + length)
        slot = np.searchsorted(starts, c.start[part], side="right") - 1
        inside = (slot >= 0) & (c.start[part] < ends[np.maximum(slot, 0)])
        owners = np.array([b for _, b in known], dtype=np.int64)
        out[part[inside]] = owners[slot[inside]]
    return out


def _peak_of_set(c: DeviceCourse, members: np.ndarray, size: Optional[np.ndarray] = None) -> int:
    """The most bytes the allocations `members` hold at once (with `size`, at those sizes)."""
    if not len(members):
        return 0
    size = c.size if size is None else size
    events = np.concatenate([c.start[members], np.minimum(c.end[members], c.events)])
    sizes = np.concatenate([size[members], -size[members]])
    order = np.lexsort((sizes, events))  # frees before allocations at the same event
    return int(max(0, np.cumsum(sizes[order]).max()))


def _cpu_math_attention(run: _Run) -> np.ndarray:
    """The forward allocations of CPU `scaled_dot_product_attention` calls that ran PyTorch's math
    backend: it computes half-precision inputs in fp32 ("keep query, key, value in high precision",
    unless `allow_fp16_bf16_reduction_math_sdp(True)`), so they keep their size in half precision.
    The profiler route names the call (`<built-in function scaled_dot_product_attention>`); the math
    backend makes the scores, softmax, dropout mask and products inside it (GPT-2 with attention
    dropout: 22 allocations a call), where CPU flash attention makes its output and logsumexp (2)."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not c.origins or not len(c.origin):
        return out
    inside = np.array([bool(frames) and frames[0].name.startswith(SDPA_CALL) for frames in c.origins], dtype=bool)
    if not inside.any():
        return out
    fwd = _forward_in_order(run)
    call: List[int] = []
    for k in [*fwd.tolist(), -1]:
        if k >= 0 and inside[c.origin[k]]:
            call.append(k)
            continue
        if len(call) > FLASH_CPU_ALLOCATIONS:
            out[call] = True
        call = []
    return out


def _math_note(math: np.ndarray) -> str:
    """The assumption said when CPU math attention keeps its size (_cpu_math_attention)."""
    if not math.any():
        return ""
    return (f"; CPU attention's math backend computes in fp32: the {int(math.sum())} allocations of its calls in "
            "the forward keep their size")


def _not_float(run: _Run) -> np.ndarray:
    """The allocations an op of NOT_FLOAT_OPS made (a mask, indices): their size is not the model's dtype's."""
    return np.isin(run.op, list(NOT_FLOAT_OPS))


def _not_float_note(kept: np.ndarray) -> str:
    """The assumption said when bool or integer results keep their size (_not_float)."""
    return (f"; the {int(kept.sum())} bool or integer results of comparisons and arg-reductions (a mask from eq) "
            "keep their size" if kept.any() else "")


def _called(frames: Sequence[Any]) -> str:
    """The op a stack shows: the ATen op on CUDA's C++ frames, else the built-in the profiler's
    innermost frame names (`<built-in method pow of Tensor object at 0x..>`: pow); "" for neither."""
    op = _aten_op(frames)
    if op or not frames:
        return op
    m = BUILTIN_CALL.match(frames[0].name)
    return m.group(1) if m else ""


@dataclass
class _Upcasts:
    """The fp32 copies half-precision RMS norms keep (_variance_upcasts), and the inputs they replace."""

    copies: List[Tuple[int, int, int]]  # (start, end, size)
    released: List[Tuple[int, int]]  # (allocation, end): a norm's input, kept in the fp32 run by its pow


def _variance_upcasts(run: _Run) -> _Upcasts:
    """The fp32 copies a half-precision model's RMS norms make and keep: the RMS-norm idiom of
    Llama, T5 and most Hugging Face models computes the variance in fp32
    (`hidden_states.to(torch.float32).pow(2).mean(-1)`), and `pow` keeps that fp32 copy of its
    input for the backward. The fp32 run shows the line as a `pow` then a `mean`; the copy has the
    pow's fp32 size and is kept as long as the normalised product after it (the next allocation of
    that size), which the backward frees with it. The norm's input (the last allocation of that size
    before it: the residual stream), which pow kept in the fp32 run, is then kept by nothing: it
    goes once the next norm starts (Llama's residual add after the attention has read it)."""
    c = run.course
    out = _Upcasts([], [])
    if not (run.call == "pow").any():
        return out
    fwd = _forward_in_order(run).tolist()
    pows = [i for i in range(len(fwd) - 1) if run.call[fwd[i]] == "pow" and run.call[fwd[i + 1]] == "mean"
            and run.line[fwd[i]] == run.line[fwd[i + 1]]]
    for n, i in enumerate(pows):
        k = fwd[i]
        kept = next((j for j in fwd[i + 2:] if c.size[j] == c.size[k]), None)
        if kept is None:
            continue
        out.copies.append((int(c.start[k]), int(c.end[kept]), int(c.size[k])))
        source = next((j for j in reversed(fwd[:i]) if c.size[j] == c.size[k] and run.line[j] != run.line[k]
                       and run.born_run[j] == run.born_run[k]), None)
        if source is not None:
            following = fwd[pows[n + 1]] if n + 1 < len(pows) else None
            same_run = following is not None and run.born_run[following] == run.born_run[k]
            out.released.append((source, int(c.start[following]) if same_run else int(c.end[kept])))
    return out


def _loss_upcasts(run: _Run) -> List[Tuple[int, int, int]]:
    """(start, end, size) of the fp32 copy of the logits each forward's loss reads in half
    precision: Hugging Face's loss functions upcast them (`logits = logits.float()`) and autocast
    casts the input of `cross_entropy`, on its fp32 list. The fp32 run shows neither (the copy of an
    fp32 tensor is the tensor). The logits are the last matrix product before the loss's first
    allocation; the copy lives until the forward computes something else (the loss function
    returned: log_softmax keeps its output, not its input)."""
    c = run.course
    if not run.loss.any():
        return []
    fwd = _forward_in_order(run).tolist()
    out = []
    i = 0
    while i < len(fwd):
        if not run.loss[fwd[i]]:
            i += 1
            continue
        first = fwd[i]
        j = i
        while j < len(fwd) and run.loss[fwd[j]] and run.born_run[fwd[j]] == run.born_run[first]:
            j += 1
        logits = next((fwd[h] for h in range(i - 1, max(i - 8, -1), -1)
                       if run.call[fwd[h]] in MATRIX_PRODUCTS
                       and run.born_run[fwd[h]] == run.born_run[first]), None)
        if logits is not None:
            end = int(c.start[fwd[j]]) if j < len(fwd) and run.born_run[fwd[j]] == run.born_run[first] \
                else int(max(c.end[fwd[h]] for h in range(i, j)))
            out.append((int(c.start[first]), end, int(c.size[logits])))
        i = j
    return out


def _loss_note(upcasts: List[Tuple[int, int, int]]) -> str:
    """The assumption said when the loss reads an fp32 copy of half-precision logits (_loss_upcasts)."""
    return ("; the loss reads an fp32 copy of the half-precision logits (`logits.float()`, or autocast's cast "
            f"for cross_entropy), kept while it is computed ({len(upcasts)} made)" if upcasts else "")


def _weights(run: _Run, edit: _Edit, value: str) -> None:
    c = run.course
    # A BLAS workspace is sized by the library per handle (CUBLAS_WORKSPACE_CONFIG), whatever the dtype.
    halved = run.of("parameter", "gradient", "optimizer_state", "optimizer_temporary", "activation",
                    "recomputed_activation", "autograd", "other") & ~run.loss & ~run.indices & (c.size > SCALAR_BYTES)
    kept = halved & _not_float(run)
    halved &= ~kept
    math = _cpu_math_attention(run)
    halved &= ~math
    edit.size[halved] = edit.size[halved] // 2
    upcasts = _variance_upcasts(run)
    for start, end, size in upcasts.copies:
        edit.add(start, end, size, "activation")
    logits = _loss_upcasts(run)
    for start, end, size in logits:
        edit.add(start, end, size, "activation")
    for k, end in upcasts.released:
        edit.end[k] = min(int(edit.end[k]), end)
    edit.assumptions.append(f"{value} weights: parameters, gradients, optimizer state and activations in 2 bytes; "
                            "the loss (computed in fp32 by the libraries), inputs, int64 indices (max pooling's), "
                            "BLAS workspaces and one-element tensors keep their size; every float tensor is assumed "
                            "fp32 in the run" + _not_float_note(kept) + _math_note(math)
                            + (f"; each of the {len(upcasts.copies)} RMS norms that computes its variance as pow then "
                               "mean keeps an fp32 copy of its input in its place (the variance is computed in fp32)"
                               if upcasts.copies else "") + _loss_note(logits))


def _aten_op(frames: Sequence[Any]) -> str:
    """The ATen op the innermost Python frame called (`at::_ops::pow_Tensor_Scalar::call`: pow), from
    the C++ frames of the caching allocator's stacks; "" when the stack shows none."""
    op = ""
    for f in frames:
        if f.file:
            break
        m = ATEN_OP.match(f.name)
        if m:
            op = _op_name(m.group(1))  # the outermost op frame below the Python code wins: what it called
    return op


def _op_name(joined: str) -> str:
    """The op of an `at::_ops::` name: the longest known op it starts with (`sum_dim_IntList`: sum;
    `layer_norm`: layer_norm), else the name up to a capitalised overload (`mul_Tensor`: mul)."""
    parts = joined.split("_")
    for k in range(len(parts), 0, -1):
        name = "_".join(parts[:k])
        if name in _KNOWN_OPS:
            return name
    return re.sub(r"_[A-Z]\w*$", "", joined)


@dataclass
class _Fp32Regions:
    """What CUDA autocast leaves in fp32 in a run's forward (_fp32_regions)."""

    full: np.ndarray  # the forward allocations that keep their fp32 size
    casts: List[Tuple[int, int, int]]  # (start, end, size): fp32 copies of half-precision inputs, kept
    released: List[Tuple[int, int]]  # (allocation, end): half-precision inputs only such a copy kept


def _fp32_regions(run: _Run) -> _Fp32Regions:
    """What CUDA autocast leaves in fp32 in the forward, from the ATen ops on the stacks.

    An op of autocast's fp32 list (`pow`, `layer_norm`) makes an fp32 result, and what the same
    line of Python computes after it from that result promotes to fp32 too (Hugging Face GPT-2's
    GELU: `0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))`: the pow, and the add, tanh and
    products after it). The line's result (its last allocation of the largest size: a layer norm's
    output, not its mean and rstd) goes on to a matrix product, which saves a half-precision copy
    of it in its place: it halves. An fp32 op that keeps its input for the
    backward (`pow`) keeps an fp32 copy of a half-precision one: the input is half precision when
    a product made it or the line computed it before the op. A product's output the op kept in the
    fp32 run is then kept by nothing: it is freed when the line ends (GPT-2's `c_fc` output)."""
    c = run.course
    out = _Fp32Regions(np.zeros(len(c.size), dtype=bool), [], [])
    full, casts = out.full, out.casts
    if not c.origins or not len(c.origin) or not (run.op != "").any():
        return out
    numbered: Dict[Tuple[Any, ...], int] = {}
    lines = [numbered.setdefault(tuple(f for f in frames if f.file), len(numbered)) for frames in c.origins]
    fwd = _forward_in_order(run)
    region: List[int] = []  # the current line's allocations from its fp32 op on
    pending: List[Tuple[int, int]] = []  # (start, size) of its input copies, kept as long as the line's results
    inputs: List[int] = []  # products' outputs whose fp32 copy the line keeps
    prev = -1
    before_line = -1  # the allocation made before the current line's first

    def close(next_op: str, next_start: int) -> None:
        if region:
            end = int(c.end[region].max())
            casts.extend((start, end, size) for start, size in pending)
            out.released.extend((k, next_start) for k in inputs)
            if next_op in AUTOCAST_LOWER:
                # The line's result: its last allocation of the largest size (a layer norm's output,
                # not the mean and rstd it makes after it).
                largest = int(c.size[region].max())
                full[[k for k in region if c.size[k] == largest][-1]] = False
        region.clear()
        pending.clear()
        inputs.clear()

    for k in fwd.tolist():
        o = int(c.origin[k])
        op, line = run.op[k], lines[o]
        if region and (line != lines[int(c.origin[region[0]])] or run.born_run[k] != run.born_run[region[0]]):
            close(op, int(c.start[k]))
        if prev < 0 or lines[int(c.origin[prev])] != line:
            before_line = prev
        if op in AUTOCAST_FP32 or region:
            if op in AUTOCAST_SAVES_INPUT and prev >= 0 and not full[prev]:
                p_origin = int(c.origin[prev])
                if run.op[prev] in AUTOCAST_LOWER or lines[p_origin] == line:
                    pending.append((int(c.start[k]), int(c.size[k])))
                    # The product's output the line reads (GPT-2's c_fc output, whose fp32 copy pow keeps).
                    if before_line >= 0 and run.op[before_line] in AUTOCAST_LOWER and before_line not in inputs:
                        inputs.append(before_line)
            full[k] = True
            region.append(k)
        prev = k
    close("", c.events)
    return out


def _residual_adds(run: _Run, block: np.ndarray) -> np.ndarray:
    """The forward's adds of the residual stream: allocations of the size the repeated blocks end
    with (each block's last forward allocation: `x = x + h`, or the layer norm after it) made by
    `add` where the stacks name the ATen ops, or on the profiler route, which names the built-ins
    a line calls but not its operators, by an operator of a line of Python (`residual + h`).
    Autocast keeps the residual stream in fp32: the embedding and the layer norms give fp32, and an
    add promotes to the wider of its inputs (GPT-2, a Llama and the cs336 transformer each keep
    their residual adds at fp32 size on the GPU; GPT-2 and Llama on the CPU)."""
    c = run.course
    out = np.zeros(len(c.size), dtype=bool)
    if not (block >= 0).any() or not c.origins or not len(c.origin):
        return out
    if (run.op != "").any():
        made = run.op == "add"
    else:
        operator = np.array([bool(frames) and bool(frames[0].file) for frames in c.origins], dtype=bool)
        made = operator[c.origin]
    fwd = _forward_in_order(run, block >= 0)
    # Each block run's last line, and the largest allocation on it (a layer norm's output, not the
    # mean and rstd it makes after it).
    ends: Dict[Tuple[int, int], Tuple[Any, int]] = {}
    for k in fwd.tolist():
        key, here = (int(block[k]), int(run.born_run[k])), run.line[k]
        was = ends.get(key)
        ends[key] = (here, max(int(c.size[k]), was[1]) if was is not None and was[0] == here else int(c.size[k]))
    if not ends:
        return out
    sizes, counts = np.unique([size for _, size in ends.values()], return_counts=True)
    width = int(sizes[counts.argmax()])
    return (run.phase == FORWARD) & made & (c.size == width) & ~c.before


def _shared_reads(run: _Run, fp32: np.ndarray) -> List[Tuple[int, List[int]]]:
    """(an fp32 forward allocation, the products that read it) where two or more matrix products
    come straight after the line that made it: the query, key and value projections of a layer
    norm's output (the line's last allocation of its largest size: not the mean and rstd, nor an
    RMS norm's pow). Under autocast each
    product casts its fp32 input to half precision itself and keeps its own copy for the backward,
    where the fp32 run's products keep the one tensor (ViT, BERT and Llama on the CPU, the cs336
    transformer on the GPU)."""
    c = run.course
    if not fp32.any():
        return []
    fwd = _forward_in_order(run).tolist()
    out = []
    i = 0
    while i < len(fwd):
        j = i + 1  # the line's allocations: fwd[i:j]
        while j < len(fwd) and run.line[fwd[j]] == run.line[fwd[i]] and run.born_run[fwd[j]] == run.born_run[fwd[i]]:
            j += 1
        made = fwd[i:j]
        largest = max(int(c.size[a]) for a in made)
        k = [a for a in made if c.size[a] == largest][-1]  # a norm's output, after its pow; before its mean
        products = []
        while j < len(fwd) and run.call[fwd[j]] in MATRIX_PRODUCTS and run.born_run[fwd[j]] == run.born_run[k]:
            products.append(fwd[j])
            j += 1
        if fp32[k] and len(products) >= 2:
            out.append((k, products))
        i = j if products else i + len(made)
    return out


def _autocast(run: _Run, edit: _Edit, value: str, block: np.ndarray) -> None:
    c = run.course
    work = run.of("activation", "recomputed_activation", "autograd") & np.isin(run.phase, [FORWARD, BACKWARD]) \
        & ~run.loss & ~run.indices & (c.size > SCALAR_BYTES)
    kept = work & _not_float(run)
    residual = _residual_adds(run, block)
    work &= ~kept
    work &= ~residual
    regions = _fp32_regions(run)
    full, casts = regions.full, regions.casts
    math = _cpu_math_attention(run)
    work &= ~full & ~math
    edit.size[work] = edit.size[work] // 2
    for start, end, size in casts:
        edit.add(start, end, size, "activation")
    for k, end in regions.released:
        edit.end[k] = min(int(edit.end[k]), end)
    logits = _loss_upcasts(run)
    for start, end, size in logits:
        edit.add(start, end, size, "activation")
    shared = _shared_reads(run, (residual | np.isin(run.call, list(NORM_OPS))) & (run.phase == FORWARD))
    for k, products in shared:
        # The fp32 tensor itself is then kept by nothing: each product's half-size copy is.
        edit.size[k] = c.size[k] // 2
        for _ in products[1:]:
            edit.add(int(c.start[products[0]]), int(c.end[k]), int(c.size[k]) // 2, "activation")
    # The most parameter bytes live at once: an update in place makes a new version of each every step.
    params = _peak_of_set(c, np.flatnonzero(run.of("parameter")))
    grads = np.flatnonzero(run.of("gradient") & (run.phase == BACKWARD))
    alone = 0  # forwards no backward follows
    for step in run.steps:
        # One forward per backward (a micro-batch): the forward runs before each backward run.
        first: Optional[int] = None
        last_forward_end = 0
        for p in [*step.phases, None]:
            if p is not None and p.phase == FORWARD:
                first = p.start_event if first is None else first
                last_forward_end = p.end_event
            elif p is not None and p.phase == BACKWARD and first is not None:
                # Each weight's cast is saved for its backward: freed when its gradient is made
                # (where the run made it); without gradients in the run, when the backward starts.
                mine = grads[(c.start[grads] >= p.start_event) & (c.start[grads] <= p.end_event)]
                for g in mine.tolist():
                    edit.add(first, int(c.start[g]) + 1, int(edit.size[g]) // 2, "autocast_weights")
                if not len(mine):
                    edit.add(first, p.start_event, params // 2, "autocast_weights")
                first = None
            elif first is not None:
                # No backward follows (an evaluation, a forward measured alone): autocast still
                # caches the cast of every weight that requires grad, until the context exits,
                # which the trace shows no sooner than the forward's end.
                edit.add(first, last_forward_end + 1, params // 2, "autocast_weights")
                alone += 1
                first = None
    edit.assumptions.append(f"{value} autocast: activations of the forward and their gradients in the backward "
                            "halve (the loss stays fp32); weights, gradients and optimizer state stay fp32; each "
                            "forward casts every weight to 2 bytes, each cast kept until its weight's gradient "
                            "is made in the backward"
                            + (f" (in the {alone} forward{'s' if alone > 1 else ''} no backward follows, "
                               "to the forward's end: autocast caches the casts until it exits)" if alone else "")
                            + (f"; the residual stream's {int(residual.sum())} adds stay fp32 (an add promotes "
                               "to its wider input)" if residual.any() else "")
                            + (f"; each of the {sum(len(p) for _, p in shared)} products that read one of "
                               f"{len(shared)} fp32 tensors (a norm's output) keeps its own half-size copy of it"
                               if shared else "")
                            + ("; where the stacks name the ATen ops (CUDA), what autocast runs in fp32 (pow, "
                               "layer_norm, ...) and what the same line computes after it stay fp32"
                               + (f", with an fp32 copy of a half-precision input the op keeps ({len(casts)} made)"
                                  if casts else "")
                               if full.any() else "") + _not_float_note(kept) + _loss_note(logits) + _math_note(math))


def _optimizer(run: _Run, edit: _Edit, value: str) -> None:
    c = run.course
    name, per, grads, form = run_optimizer(run)
    if not any(s.phase == OPTIMIZER for s in run.spans) or grads <= 0:
        raise CannotApply("the run shows no optimizer step (no optimizer state, no update's temporaries): "
                          "nothing to replace")
    if name == value or {name, value} == {"adam", "adamw"}:
        raise CannotApply(f"the run already uses {name}" + (" (Adam and AdamW keep the same memory)"
                                                             if name in ("adam", "adamw") else ""))
    want_state, want_temps = OPTIMIZERS[value]
    # What an earlier rule (half-precision weights) did to the parameters, the new state and
    # temporaries follow.
    params_before = int(c.size[run.of("parameter")].sum())
    scale = int(edit.size[run.of("parameter")].sum()) / params_before if params_before else 1.0
    state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
    if per > 0 and state.any():
        edit.size[state] = (edit.size[state] * want_state) // per
    elif want_state:
        opt_runs = [s for s in run.spans if s.phase == OPTIMIZER]
        first = opt_runs[0]
        at = _peak_event(run, first)
        edit.add(at, c.events, int(grads * scale) * want_state, "optimizer_state")
        edit.assumptions.append("the state is made in the first optimizer step, as torch.optim does, and never freed")
    # The update's temporaries: made and freed inside an optimizer phase run.
    temps = run.of("optimizer_temporary", "autograd", "other", "activation") & (run.phase == OPTIMIZER) \
        & (run.end_run == run.born_run)
    edit.size[temps] = 0
    params = run.of("parameter")
    largest = int(edit.size[params].max()) if params.any() else 0
    unit = int(grads * scale) if form == "foreach" else largest
    for span in run.spans:
        if span.phase == OPTIMIZER:
            edit.add(_peak_event(run, span), _peak_event(run, span) + 1, want_temps * unit, "optimizer_temporary")
    edit.assumptions.append(
        f"{value} keeps {want_state} state tensor{'s' if want_state != 1 else ''} per parameter "
        f"(the run's {_shown_optimizer(name)} keeps {per}); its update makes {want_temps} temporar"
        f"{'ies' if want_temps != 1 else 'y'} of the size of "
        + ("every parameter at once (foreach, as the run)" if form == "foreach"
           else "the largest parameter (single-tensor, as the run)")
        + f", at the moment the run's update peaked; trainable weights {format_bytes(grads)}")


def _shown_optimizer(name: Optional[str]) -> str:
    # torch's AdamW runs Adam's update code: the stacks name adam.py for both
    return {None: "optimizer", "adam": "Adam or AdamW"}.get(name, name or "optimizer")


def _peak_event(run: _Run, span: PhaseSpan) -> int:
    totals = run.base.totals
    window = totals[span.start_event: span.end_event + 1]
    return span.start_event + (int(window.argmax()) if len(window) else 0)


def _zero_grad(run: _Run, edit: _Edit, value: str) -> None:
    c = run.course
    grads = np.flatnonzero(run.of("gradient"))
    if not len(grads):
        raise CannotApply("the run shows no gradients (category gradient)")
    freed = c.end[grads] < c.events
    step_of = _step_index(run, c.start)
    if value == "zeros":
        if not freed.any():
            if len(run.steps) <= 1:
                raise CannotApply("the run records one step and its gradients outlive it: whether zero_grad "
                                  "frees them shows only in the next step, which the trace does not hold")
            raise CannotApply("the run already keeps its gradients (zero_grad(set_to_none=False))")
        first = int(step_of[grads].min())
        for k in grads.tolist():
            if step_of[k] == first:
                edit.end[k] = c.events
            else:
                edit.size[k] = 0
        edit.assumptions.append("the first step's gradients are kept and zeroed in place from then on")
        return
    if freed.all():
        raise CannotApply("the run already frees its gradients (zero_grad(set_to_none=True))")
    if len(run.steps) <= 1:
        raise CannotApply("the run records one step and its gradients outlive it: whether zero_grad "
                          "frees them shows only in the next step, which the trace does not hold")
    # Zeroed in place, a gradient lives on between steps: as new versions made by zero_() in the
    # optimizer step (the profiler's record), or as one allocation outliving its step (CUDA's).
    # Set to None, neither exists: a gradient lives from its backward to its step's zero_grad.
    zeroed = grads[run.phase[grads] == OPTIMIZER]
    edit.size[zeroed] = 0
    windows = []  # per step: (first gradient made in its backward, end of its last optimizer run)
    made = grads[run.phase[grads] == BACKWARD]
    for s in run.steps:
        back = [p for p in s.phases if p.phase == BACKWARD]
        opt = [p for p in s.phases if p.phase == OPTIMIZER]
        if not back or not opt:
            continue
        mine = made[(c.start[made] >= back[0].start_event) & (c.start[made] <= back[-1].end_event)]
        first = int(c.start[mine].min()) if len(mine) else back[0].start_event
        windows.append((first, opt[-1].end_event + 1))
    for k in made.tolist():
        start, end = int(c.start[k]), int(c.end[k])
        pieces = [(max(start, w0), min(end, w1)) for w0, w1 in windows if min(end, w1) > max(start, w0)]
        if len(pieces) == 1 and pieces[0] == (start, end):
            continue
        size = int(edit.size[k])
        edit.size[k] = 0
        for p0, p1 in pieces:
            edit.add(p0, p1, size, "gradient")
    edit.assumptions.append("gradients live from the backward that makes them to their step's zero_grad; a "
                            "gradient kept across steps is made again from the first gradient of each backward")


def _accumulate(run: _Run, edit: _Edit, value: str) -> None:
    k = int(value)
    c = run.course
    batch = run.of("activation", "recomputed_activation", "autograd", "input") \
        & np.isin(run.phase, [FORWARD, BACKWARD]) & ~c.before
    edit.size[batch] = edit.size[batch] // k
    grads = np.flatnonzero(run.of("gradient") & (run.phase == BACKWARD))
    if not len(grads):
        raise CannotApply("the run shows no gradients made in the backward (category gradient) to accumulate")
    first_forward = {i: next((p.start_event for p in s.phases if p.phase == FORWARD), None)
                     for i, s in enumerate(run.steps)}
    step_of = _step_index(run, c.start)
    for g in grads.tolist():
        f = first_forward.get(int(step_of[g]))
        if f is not None and c.start[g] > f:
            # The earlier micro-batches' gradient of this weight, held from the forward until the
            # backward adds the new one to it (both live at that moment).
            edit.add(f, int(c.start[g]) + 1, int(edit.size[g]), "gradient")
    edit.assumptions.append(
        f"{k} micro-batches of 1/{k} the batch: what the forward and backward make scales with the batch "
        f"(1/{k}; weight-sized temporaries of the backward do not, and are undercounted); the last micro-batch "
        "is replayed, the gradients of the earlier ones held from its forward on")


# ---------------------------------------------------------------- the what-if


def _predict(run: _Run, change: Change, blocks: List[str], block: np.ndarray,
             budget: Optional[int]) -> ChangePrediction:
    c = run.course
    edit = _Edit(start=c.start.copy(), end=c.end.copy(), size=c.size.copy())
    # Precision first, so that rules adding memory (casts, state) add it at the changed sizes' scale.
    order = sorted(change.parts, key=lambda p: NAMES.index(p[0]) if p[0] != "weights" else -1)
    try:
        for name, value in order:
            if name == "checkpoint":
                _checkpoint(run, edit, value, blocks, block)
            elif name == "weights":
                _weights(run, edit, str(value))
            elif name == "autocast":
                if any(n == "weights" for n, _ in change.parts):
                    raise CannotApply("autocast and half-precision weights together: the weights are already "
                                      "in 2 bytes")
                _autocast(run, edit, str(value), block)
            elif name == "optimizer":
                _optimizer(run, edit, str(value))
            elif name == "zero-grad":
                _zero_grad(run, edit, str(value))
            else:
                _accumulate(run, edit, str(value))
    except CannotApply as why:
        return ChangePrediction(change=change.text, applies=False, reason=str(why), predicted_peak_bytes=None,
                                predicted_peak_phase=None, predicted_peak_step=None, delta_bytes=None,
                                delta_pct=None, fits_budget=None, phase_peaks={}, categories={}, assumptions=[],
                                line=finding("W014", change=change.text, why=str(why)).message)
    course, sizes = _changed_course(run, edit)
    r = replay_course(course, sizes, run.spans, run.steps)
    base = run.base.peak_bytes
    delta = r.peak_bytes - base
    pct = round(100.0 * delta / base, 2) if base else 0.0
    fits = None if budget is None else r.peak_bytes <= budget
    where = f"in the {r.phase}" if r.phase else "before the trace's first event"
    moved = "" if r.phase == run.base.phase else f" (it was in the {run.base.phase})"
    line = (f"{change.text}: peak {format_bytes(r.peak_bytes)} ({format_bytes(delta, signed=True)}, {pct:+.1f}%), "
            f"{where}{moved}" + ("" if fits is None else "; fits the budget" if fits else "; over the budget"))
    return ChangePrediction(change=change.text, applies=True, reason=None, predicted_peak_bytes=r.peak_bytes,
                            predicted_peak_phase=r.phase, predicted_peak_step=r.step, delta_bytes=delta,
                            delta_pct=pct, fits_budget=fits, phase_peaks=r.phase_peaks, categories=r.categories,
                            assumptions=edit.assumptions, line=line)


def every_change(run: _Run, optimizer: Optional[str]) -> List[Change]:
    """Every change worth trying on this run (without --change)."""
    texts = ["checkpoint", "checkpoint=0.5", "weights=bf16", "autocast=bf16"]
    same = ("adam", "adamw") if optimizer in ("adam", "adamw") else (optimizer,)
    texts += [f"optimizer={name}" for name in OPTIMIZERS if name not in same and name != "adam"]
    texts += ["zero-grad=none", "zero-grad=zeros", "accumulate=2", "accumulate=4"]
    return [parse_change(t) for t in texts]


def _headline(device: int, run: _Run, blocks: List[str], optimizer: Optional[str],
              predictions: Sequence[ChangePrediction]) -> str:
    where = f"in the {run.base.phase}" if run.base.phase else "before the trace's first event"
    step = "" if run.base.step is None else f" of step {run.base.step}"
    line = f"device {device}: peak {format_bytes(run.base.peak_bytes)} {where}{step}"
    line += f"; repeated blocks {blocks[0]} .. {blocks[-1]} ({len(blocks)})" if blocks else ""
    line += f"; optimizer {optimizer}" if optimizer else ""
    applied = [p for p in predictions if p.applies and p.delta_bytes is not None]
    if not applied:
        return line + "; no change asked applies to this run"
    best = min(applied, key=lambda p: (p.delta_bytes or 0, p.change))
    if (best.delta_bytes or 0) >= 0:
        return line + "; no change asked lowers the peak"
    moved = f", the peak moves to the {best.predicted_peak_phase}" if best.predicted_peak_phase != run.base.phase \
        else ""
    return line + (f"; most saved by {best.change}: {format_bytes(best.delta_bytes or 0, signed=True)} "
                   f"({best.delta_pct or 0:+.1f}%){moved}")


def whatif_course(path: str, courses: Dict[int, DeviceCourse],
                  spans_steps: Dict[int, Tuple[List[PhaseSpan], List[Step]]], changes: Sequence[Change],
                  budget: Optional[int]) -> WhatIf:
    """The WhatIf of a read run: each device replayed with each change."""
    if not courses:
        raise InputError(path, "no device records any allocation: nothing to replay")
    devices = []
    for device in sorted(courses):
        course = courses[device]
        spans, steps = spans_steps[device]
        run = _facts(course, spans, steps)
        blocks, block = blocks_of(run)
        optimizer = run_optimizer(run)[0]
        asked = list(changes) or every_change(run, optimizer)
        predictions = [_predict(run, ch, blocks, block, budget) for ch in asked]
        if not changes:
            applied = sorted((p for p in predictions if p.applies), key=lambda p: (p.delta_bytes or 0, p.change))
            predictions = applied + [p for p in predictions if not p.applies]
        devices.append(DeviceWhatIf(device=device, base_peak_bytes=run.base.peak_bytes, base_peak_phase=run.base.phase,
                                    base_peak_step=run.base.step, blocks=blocks, optimizer=optimizer,
                                    changes=predictions, headline=_headline(device, run, blocks, optimizer,
                                                                            predictions),
                                    findings=[finding("W014", device, change=p.change, why=p.reason or "")
                                              for p in predictions if not p.applies]))
    notes = [finding("W006")]
    # Names from the snapshot (module instances, the file) are made one line each here, once for every output.
    return scrubbed(WhatIf(file=path, budget_bytes=budget, asked=[c.text for c in changes], devices=devices,
                           notes=notes))


def whatif(path: str, changes: Sequence[str], rules: Sequence[Rule], budget: Optional[int] = None) -> WhatIf:
    """The WhatIf of a snapshot file with the changes given as text (none: every applicable one)."""
    parsed = [parse_change(t) for t in changes]
    course = read_course(path, 1, rules)
    structures = {d: structure(course.summary, d) for d in course.devices}
    return whatif_course(path, course.devices, structures, parsed, budget)


# ---------------------------------------------------------------- a regression bought back


@dataclass
class BuyBackTarget:
    """One device of a regressed head run: the peak to get back to, and the peak the rule passes."""

    device: int
    base_peak_bytes: int  # the base's (baseline's) peak on this device
    allowed_peak_bytes: int  # the highest head peak the peak rule passes (at least base_peak_bytes)
    base_name: str  # what names the base in words (`base`, `the baseline`)


@dataclass
class BuyBack:
    """One change that brings a regressed head's peak back to the base's (or within the rule),
    or, when none does, the one that saves most (enough False)."""

    device: int
    change: str
    predicted_peak_bytes: int
    predicted_peak_phase: Optional[str]
    delta_bytes: int  # against the head's own replayed peak
    target_bytes: int  # the base's peak
    enough: bool
    text: str


@dataclass
class BuyBackPart:
    """What a regression's report says of the changes that buy it back (`--whatif`)."""

    items: List[BuyBack]
    notes: List[Finding]  # why a device has none, or why the what-if could not run (the catalogue's W codes)


def _buy_back_text(p: ChangePrediction, t: BuyBackTarget, head_phase: Optional[str], prefix: str) -> str:
    peak = int(p.predicted_peak_bytes or 0)
    where = f" in the {p.predicted_peak_phase}" if p.predicted_peak_phase else ""
    moved = (f", the peak moves to the {p.predicted_peak_phase}"
             if p.predicted_peak_phase and head_phase and p.predicted_peak_phase != head_phase else "")
    if peak <= t.base_peak_bytes:
        within = f"within {t.base_name}'s {format_bytes(t.base_peak_bytes)}"
    elif peak <= t.allowed_peak_bytes:
        within = (f"{format_bytes(peak - t.base_peak_bytes)} over {t.base_name}'s "
                  f"{format_bytes(t.base_peak_bytes)}, within the rule")
    else:
        within = (f"not enough: {format_bytes(peak - t.base_peak_bytes)} over {t.base_name}'s "
                  f"{format_bytes(t.base_peak_bytes)}")
    return (f"{prefix}{p.change}: {format_bytes(p.delta_bytes or 0, signed=True)}, peak {format_bytes(peak)}{where}"
            f"{moved} ({within})")


def buy_back(path: str, rules: Sequence[Rule], targets: Sequence[BuyBackTarget],
             window: Optional[Window] = None) -> BuyBackPart:
    """The changes that bring the regressed run at `path` back to its base's peak on each target
    device, from `memdiff whatif`'s replay of every applicable change: those whose predicted peak
    the peak rule passes, the smallest saving first; when none does, the one that saves most, said
    to be not enough. With `window`, that window of the run (as the diff read it). A run the
    what-if cannot read as a course (a summary, a damaged trace) is a note, never an error: the
    regression's verdict stands as judged."""
    if not targets:
        return BuyBackPart([], [finding("W002", why="the peak did not grow on any device")])
    try:
        course = read_course(path, 1, rules, window)
    except InputError as why:
        return BuyBackPart([], [finding("W001", why=str(why))])
    items: List[BuyBack] = []
    notes: List[Finding] = []
    prefix_each = len(targets) > 1
    for t in targets:
        c = course.devices.get(t.device)
        prefix = f"device {t.device}: " if prefix_each else ""
        if c is None:
            notes.append(finding("W001", t.device,
                                 why=f"the head's snapshot records no allocation on device {t.device}"))
            continue
        run = _facts(c, *structure(course.summary, t.device))
        blocks, block = blocks_of(run)
        predictions = [p for p in (_predict(run, ch, blocks, block, None)
                                   for ch in every_change(run, run_optimizer(run)[0]))
                       if p.applies and p.predicted_peak_bytes is not None]
        enough = sorted((p for p in predictions if int(p.predicted_peak_bytes or 0) <= t.allowed_peak_bytes),
                        key=lambda p: (-(p.delta_bytes or 0), p.change))
        if enough:
            chosen = enough
        else:
            saving = [p for p in predictions if (p.delta_bytes or 0) < 0]
            if not saving:
                notes.append(finding("W003", t.device))
                continue
            chosen = [min(saving, key=lambda p: (p.delta_bytes or 0, p.change))]
            notes.append(finding("W004", t.device, base_name=t.base_name, base_peak=format_bytes(t.base_peak_bytes),
                                 base_peak_bytes=t.base_peak_bytes))
        for p in chosen:
            items.append(BuyBack(device=t.device, change=p.change,
                                 predicted_peak_bytes=int(p.predicted_peak_bytes or 0),
                                 predicted_peak_phase=p.predicted_peak_phase, delta_bytes=int(p.delta_bytes or 0),
                                 target_bytes=t.base_peak_bytes, enough=bool(enough),
                                 text=_buy_back_text(p, t, run.base.phase, prefix)))
    notes.append(finding("W005"))
    return scrubbed(BuyBackPart(items, notes))
