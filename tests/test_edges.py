"""Issue 26 on hand-built traces: state older than the trace, a leak between backward and step,
zero_grad between forward and backward, scalars kept from the last step, growth from nothing."""

from __future__ import annotations

from typing import Any, Dict, List

from conftest import alloc, free
from test_lifetimes import BATCH, BWD, FWD, LOOP, LOSS, Trace, prof

from memdiff.analyse.classify import PERSISTENT, load_rules
from memdiff.analyse.lifetimes import _inferred_step_starts
from memdiff.read.frames import NO_STACK_STATE_GUESSED
from memdiff.read.inputs import read_summary
from memdiff.units import pct_cell

ADAGRAD = prof("<built-in method sqrt of Tensor object at 0x7f>", "torch/optim/adagrad.py(364): _single_tensor_adagrad",
               "torch/optim/adagrad.py(200): step", "torch/optim/optimizer.py(60): _use_grad",
               "torch/optim/optimizer.py(509): wrapper", LOOP)
CLONE = prof("<built-in method clone of Tensor object at 0x7f>", "train.py(31): <listcomp>", LOOP)
STATE_AT, WEIGHT_AT, SIZE = 0x2000, 0x1000, 4096


def reversion(t: Trace, addr: int, size: int) -> None:
    """The profiler route's in-place update: the old version freed, a frameless new one at once."""
    t.events += [free(addr, size, [], completed=False), free(addr, size, []), alloc(addr, size, [])]


def adagrad_run(steps: int = 2, copies: bool = False) -> Dict[str, Any]:
    """Adagrad on one weight, its sum made in the constructor (before recording): each step's
    update writes a new version of the step counter, the sum, then the weight."""
    t = Trace()
    t.params = [(WEIGHT_AT, SIZE), (STATE_AT, SIZE), (0x3000, 4)]
    kept: List[int] = []
    for _ in range(steps):
        batch = t.new(1000, BATCH)
        act = t.new(100_000, FWD)
        loss = t.new(4, LOSS)
        grad = t.new(SIZE, BWD)
        t.drop(act, 100_000, FWD)
        if copies:
            kept.append(t.new(SIZE, CLONE))  # snapshots.append(p.detach().clone()) before step()
        reversion(t, 0x3000, 4)  # step counter
        reversion(t, STATE_AT, SIZE)  # state_sum.addcmul_(grad, grad)
        std = t.new(SIZE, ADAGRAD)  # std = state_sum.sqrt().add_(eps)
        reversion(t, WEIGHT_AT, SIZE)  # param.addcdiv_(grad, std)
        t.drop(std, SIZE, ADAGRAD)
        t.drop(grad, SIZE, BWD)  # zero_grad()
        t.drop(loss, 4, LOSS)
        t.drop(batch, 1000, BATCH)
    return t.snapshot()


def summary_of(write_snapshot, snap: Dict[str, Any]):
    return read_summary(write_snapshot(snap), load_rules()).devices[0]


def test_state_older_than_the_trace_is_told_from_the_weight_by_its_updates(write_snapshot):
    d = summary_of(write_snapshot, adagrad_run())
    by_category: Dict[str, int] = {}
    for g in d.groups:
        if g.lifetime and g.lifetime["born"] == "before_trace":
            by_category[g.category] = by_category.get(g.category, 0) + g.bytes
    assert by_category == {"parameter": SIZE, "optimizer_state": SIZE + 4}
    state = [g for g in d.groups if g.category == "optimizer_state"]
    assert {g.site for g in state} == {"updated in place at adagrad.py:_single_tensor_adagrad"}


def test_a_copy_made_between_backward_and_step_is_no_gradient(write_snapshot):
    d = summary_of(write_snapshot, adagrad_run(steps=3, copies=True))
    copies = [g for g in d.groups if g.site.startswith("train.py:<listcomp>")]
    assert copies and all(g.category not in PERSISTENT for g in copies)
    # Kept memory: the copies of the steps before the peak's.
    assert sum(g.bytes_from_earlier_steps for g in copies) == 2 * SIZE


def test_zero_grad_between_forward_and_backward_opens_no_step():
    runs = ["forward", "optimizer", "backward", "optimizer"] * 3
    runs[1] = "other"  # the first zero_grad finds no gradients: nothing to zero, no allocation
    assert _inferred_step_starts(runs) == [0, 4, 8]
    # A step that starts with its backward (a trace starting mid-step) still starts one.
    assert _inferred_step_starts(["backward", "optimizer", "forward", "backward", "optimizer"]) == [0, 2]


def test_a_scalar_kept_from_the_last_step_is_no_leak(write_snapshot):
    t = Trace()
    previous = None
    for _ in range(3):
        batch = t.new(1000, BATCH)
        acts = [t.new(100_000, FWD) for _ in range(3)]
        loss = t.new(4, LOSS)
        grad = t.new(4096, BWD)  # the peak: last step's loss is still held
        t.drop(t.new(64, BWD), 64, BWD)  # a backward temporary (one stack alone is no phase)
        for a in acts:
            t.drop(a, 100_000, FWD)
        if previous is not None:
            t.drop(previous, 4, LOSS)  # the loop replaces last step's loss only now
        t.drop(grad, 4096, BWD)
        t.drop(batch, 1000, BATCH)
        previous = loss
    d = summary_of(write_snapshot, t.snapshot())
    assert d.step_at_peak == 1
    assert [g.site for g in d.groups if g.bytes_from_earlier_steps and g.category not in PERSISTENT] == []


def test_growth_from_next_to_nothing_reads_new():
    assert pct_cell(4, 53_594_116) == "new"
    assert pct_cell(0, 10) == "new"
    assert pct_cell(19_530, 3_822_000) == "x195.7"


LAYER = 1 << 20  # bytes of one weight: twelve same-shaped layers
STEP_STATE = prof("<built-in method zeros_like of type object at 0x7f>", "torch/optim/adam.py(139): _init_group",
                  "torch/optim/adam.py(214): step", LOOP)
STEP_MATH = prof("<built-in method sqrt of Tensor object at 0x7f>", "torch/optim/adam.py(347): _single_tensor_adam",
                 "torch/optim/adam.py(214): step", LOOP)


def frozen_layers(trainable: int, state_in_trace: bool, native: bool = False) -> Dict[str, Any]:
    """Twelve same-shaped weights allocated before recording, all but `trainable` frozen, as a
    CUDA capture holds them (dump blocks without frames); AdamW makes its two moments per
    trainable weight in the first recorded step, or made them before recording (a warm-up).
    With `native`, the forward's and the backward's stacks carry the C++ frame of their matrix
    product, as CUDA's stacks="all" writes them."""
    events: List[Dict[str, Any]] = []
    addr = [0x10_000_000]
    mm = [{"name": "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "filename": "??", "line": 0}]
    fwd, bwd = (mm + FWD, mm + BWD) if native else (FWD, BWD)

    def new(size: int, frames: List[Dict[str, Any]]) -> int:
        addr[0] += 0x1_000_000
        events.append(alloc(addr[0], size, frames))
        return addr[0]

    def drop(at: int, size: int, frames: List[Dict[str, Any]]) -> None:
        events.extend([free(at, size, frames, completed=False), free(at, size, frames)])

    older = 12 + (0 if state_in_trace else 2 * trainable)
    for step in range(3):
        batch = new(1000, BATCH)
        acts = [new(100_000, fwd) for _ in range(3)]
        loss = new(4, LOSS)
        grads = [new(LAYER, bwd) for _ in range(trainable)]
        for a in acts:
            drop(a, 100_000, fwd)
        if step == 0 and state_in_trace:
            for _ in range(2 * trainable):
                new(LAYER, STEP_STATE)
        tmp = new(LAYER, STEP_MATH)
        drop(tmp, LAYER, STEP_MATH)
        for g in grads:  # zero_grad(set_to_none=True)
            drop(g, LAYER, prof("torch/optim/optimizer.py(990): zero_grad", LOOP))
        drop(loss, 4, LOSS)
        drop(batch, 1000, BATCH)
    blocks = [{"address": 0x1000 + k * LAYER, "size": LAYER, "requested_size": LAYER, "state": "active_allocated",
               "frames": []} for k in range(older)]
    return {"device_traces": [events], "segments": [{"device": 0, "address": 0x1000, "total_size": older * LAYER,
                                                      "allocated_size": older * LAYER, "stream": 0, "blocks": blocks}]}


def test_frozen_weights_of_the_trainable_ones_sizes_are_no_state(write_snapshot):
    """Optimizer state older than the trace is guessed by its sizes only where the trace shows no
    state made: 4 of 12 same-shaped layers trainable, AdamW recorded from its first step, reads
    12 weights and 8 moments (it read 4 weights and 16 moments: 8 frozen layers taken for state)."""
    d = read_summary(write_snapshot(frozen_layers(4, state_in_trace=True)), load_rules()).devices[0]
    assert (d.categories["parameter"], d.categories["optimizer_state"]) == (12 * LAYER, 8 * LAYER)
    # Recorded after a warm-up, the moments are older than the trace: told by their sizes, as a guess.
    d = read_summary(write_snapshot(frozen_layers(12, state_in_trace=False)), load_rules()).devices[0]
    assert (d.categories["parameter"], d.categories["optimizer_state"]) == (12 * LAYER, 24 * LAYER)
    assert [g.bytes for g in d.groups if g.site == NO_STACK_STATE_GUESSED] == [24 * LAYER]


def test_weights_of_a_cublaslt_workspaces_size_keep_their_state(write_snapshot):
    """Issue 60: the weights are 1 MiB each, a cuBLASLt workspace's size, and the stacks show
    products in the forward and the backward without one being made: a model without biases makes
    none (cuBLASLt runs `addmm` with its bias). The workspace guess took one of the moments first,
    the size no longer held three blocks per weight, and AdamW's two moments read as one (12 MiB of
    state, 23 MiB of parameter, a 1 MiB workspace). What the weights and their state leave over is
    the workspace: here nothing."""
    d = read_summary(write_snapshot(frozen_layers(12, state_in_trace=False, native=True)), load_rules()).devices[0]
    assert (d.categories["parameter"], d.categories["optimizer_state"]) == (12 * LAYER, 24 * LAYER)
    assert "workspace" not in d.categories
