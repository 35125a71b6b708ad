"""What a recorded run shows, per allocation, that the what-if rules read: its category, the phase
run it was born and freed in, whether the loss made it, the ATen op or call on its stack.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, List, Optional, Sequence

import numpy as np

from memdiff.analyse.guesses import inference
from memdiff.analyse.lifetimes import FORWARD
from memdiff.model import PhaseSpan, Step
from memdiff.predict.forecast.course import DeviceCourse
from memdiff.predict.forecast.replay import Replayed, replay_course
from memdiff.read.frames import NODE_NATIVE, PROFILER_NODE, SHARED_LIBRARY
from memdiff.read.host import CpuHost

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


# The op names an overload's suffix is taken off to find (`sum_dim_IntList`: sum), with the
# reduction of an RMS norm's variance (`mean_dim`: mean), which precision.variance_upcasts reads.
_KNOWN_OPS = AUTOCAST_LOWER | AUTOCAST_FP32 | frozenset(_AUTOCAST["promote"]) | NOT_FLOAT_OPS | {"mean"}


# The matrix products of autocast's lower list that take one activation and a weight (a layer's
# projections); attention, which casts q, k and v together, is not one.
MATRIX_PRODUCTS = AUTOCAST_LOWER - {"scaled_dot_product_attention"}


# The profiler's frame for a built-in the Python code called: its name.
BUILTIN_CALL = re.compile(r"^<built-in (?:method|function) (\w+)")


SCALAR_BYTES = 8  # a one-element tensor (an optimizer's step count): its dtype does not follow the model's


@dataclass
class Run:
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
    call: np.ndarray  # the op or built-in each allocation's stack shows (called), "" for neither
    line: np.ndarray  # each allocation's innermost line of Python (a 1-tuple of its frame; () for none)
    forward: np.ndarray  # the forward allocations made in the trace, by forward run, then in order
    base: Replayed
    # The repeated blocks' instances the stacks show, in order, and each allocation's block (-1:
    # none), as blocks.blocks_of reads them: set by the engine before any rule runs.
    blocks: List[str] = field(default_factory=list)
    block: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # What a CPU capture says of its host (memdiff.read.host): None for other runs.
    host: Optional[CpuHost] = None
    # How memdiff inferred each allocation's category where no stack of its own says it (memory live before the
    # trace: analyse.guesses, C001), "" where its stack does: a rule that reads such a category reads a guess.
    inferred: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))

    def of(self, *names: str) -> np.ndarray:
        """Allocations of these categories."""
        return np.isin(self.category, list(names))


def read_run(course: DeviceCourse, spans: List[PhaseSpan], steps: List[Step]) -> Run:
    """The facts every rule reads, per allocation of one device's course (blocks excepted: blocks.py)."""
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
        ops = [aten_op(frames) for frames in course.origins]
        op = np.array(ops, dtype=object)[course.origin]
        call = np.array([o or called(frames) for o, frames in zip(ops, course.origins)], dtype=object)[course.origin]
        lines = np.empty(len(course.origins), dtype=object)
        lines[:] = [tuple(f for f in frames if python_frame(f))[:1] for frames in course.origins]
        line = lines[course.origin]
    else:
        op = np.full(len(course.size), "", dtype=object)
        call = op.copy()
        line = np.empty(len(course.size), dtype=object)
        line[:] = [()] * len(course.size)
    made = np.flatnonzero((phase == FORWARD) & ~course.before)
    forward = made[np.lexsort((course.start[made], born_run[made]))]
    return Run(course, spans, steps, category, born_run, end_run, phase, loss, _indices(course), op, call, line,
               forward, base, inferred=_inferred(course))


def _inferred(course: DeviceCourse) -> np.ndarray:
    """Per allocation, how memdiff inferred its category (analyse.guesses.inference), "" where it read it from
    the allocation's own stack; worked out once per distinct site and category."""
    out = np.full(len(course.size), "", dtype=object)
    if not len(course.size):
        return out
    sites = [site for _, site in course.stacks]
    n = max(len(course.categories), 1)
    unique, inverse = np.unique(course.stack.astype(np.int64) * n + course.category, return_inverse=True)
    how = np.array([inference(sites[int(u) // n], course.categories[int(u) % n]) or "" for u in unique],
                   dtype=object)
    return how[inverse.reshape(-1)]


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


def forward_in_order(run: Run, also: Optional[np.ndarray] = None) -> np.ndarray:
    """The run's forward allocations made in the trace (and in `also`), by forward run, then in order."""
    return run.forward if also is None else run.forward[also[run.forward]]


def step_index(run: Run, events: np.ndarray) -> np.ndarray:
    starts = np.array([s.start_event for s in run.steps], dtype=np.int64)
    if not len(starts):
        return np.zeros(len(events), dtype=np.int64)
    return np.maximum(np.searchsorted(starts, events, side="right") - 1, 0)


def peak_of_set(c: DeviceCourse, members: np.ndarray, size: Optional[np.ndarray] = None) -> int:
    """The most bytes the allocations `members` hold at once (with `size`, at those sizes)."""
    if not len(members):
        return 0
    size = c.size if size is None else size
    events = np.concatenate([c.start[members], np.minimum(c.end[members], c.events)])
    sizes = np.concatenate([size[members], -size[members]])
    order = np.lexsort((sizes, events))  # frees before allocations at the same event
    return int(max(0, np.cumsum(sizes[order]).max()))


def python_frame(frame: Any) -> bool:
    """Whether a display frame is one of Python code: a native frame has no file where memdiff's
    own recordings write it, and names its shared library (`libtorch_cpu.so`, line 0) where torch's
    symbolizer does, as in a real GPU's snapshot."""
    return bool(frame.file) and not SHARED_LIBRARY.search(frame.file)


def called(frames: Sequence[Any]) -> str:
    """The op a stack shows: the ATen op on CUDA's C++ frames, else the built-in the profiler's
    innermost frame names (`<built-in method pow of Tensor object at 0x..>`: pow); "" for neither."""
    op = aten_op(frames)
    if op or not frames:
        return op
    m = BUILTIN_CALL.match(frames[0].name)
    return m.group(1) if m else ""


def aten_op(frames: Sequence[Any]) -> str:
    """The ATen op the innermost Python frame called (`at::_ops::pow_Tensor_Scalar::call`: pow), from
    the C++ frames of the caching allocator's stacks; "" when the stack shows none."""
    op = ""
    for f in frames:
        if python_frame(f):
            break
        m = ATEN_OP.match(f.name)
        if m:
            op = _op_name(m.group(1))  # the outermost op frame below the Python code wins: what it called
    return op


def autograd_node(frames: Sequence[Any]) -> str:
    """The autograd node a backward allocation was made in (`MmBackward0`), as both routes' stacks
    name it (CUDA's C++ frames; the CPU route's `evaluate_function` frames), where the CPU route names
    no ATen op as aten_op reads them; "" outside a node."""
    for f in frames:
        m = PROFILER_NODE.match(f.name) or NODE_NATIVE.match(f.name)
        if m:
            return m.group(1)
    return ""


def _op_name(joined: str) -> str:
    """The op of an `at::_ops::` name: the longest known op it starts with (`sum_dim_IntList`: sum;
    `layer_norm`: layer_norm), else the name up to a capitalised overload (`mul_Tensor`: mul)."""
    parts = joined.split("_")
    for k in range(len(parts), 0, -1):
        name = "_".join(parts[:k])
        if name in _KNOWN_OPS:
            return name
    return re.sub(r"_[A-Z]\w*$", "", joined)
