"""Steps, phases and lifetimes on hand-built traces whose answer can be worked out by hand."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import pytest
from conftest import alloc, free

from memdiff.analyse.classify import PERSISTENT, load_rules
from memdiff.analyse.lifetimes import Lifetime
from memdiff.cli import main
from memdiff.read.inputs import read_summary

SP = "/venv/lib/python3.12/site-packages/"


def prof(*names: str) -> List[Dict[str, Any]]:
    """Profiler-route frames (CPU captures): the file and line live in the name."""
    return [{"filename": "none", "line": 0, "name": n} for n in names]


LOOP = "train.py(20): <module>"
FWD = prof("<built-in function linear>", "torch/nn/modules/linear.py(130): forward", "model.py(12): forward", LOOP)
LOSS = prof("<built-in method mean of Tensor object at 0x7f>", LOOP)
BWD = prof("<built-in method run_backward of torch._C._EngineBase object at 0x7f>",
           "torch/autograd/graph.py(966): _engine_run_backward", "torch/autograd/__init__.py(255): backward", LOOP)
STATE = prof("<built-in method zeros_like of type object at 0x7f>", "torch/optim/adam.py(139): _init_group",
             "torch/optim/adam.py(214): step", LOOP)
UPDATE = prof("<built-in method sqrt of Tensor object at 0x7f>", "torch/optim/adam.py(347): _single_tensor_adam",
              "torch/optim/adam.py(214): step", LOOP)
BATCH = prof("<built-in method randint of type object at 0x7f>", LOOP)
EMA = prof("<built-in method clone of Tensor object at 0x7f>", "train.py(31): <genexpr>", LOOP)


class Trace:
    """A profiler-route trace written step by step, with the parameter already on the device."""

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []
        self.addr = 0x10000
        self.params = [(0x1000, 4096)]  # (address, bytes) of tensors built before recording

    def new(self, size: int, frames: List[Dict[str, Any]], **kw: Any) -> int:
        self.addr += 0x10000
        self.events.append(alloc(self.addr, size, frames, **kw))
        return self.addr

    def drop(self, addr: int, size: int, frames: List[Dict[str, Any]], **kw: Any) -> None:
        self.events.append(free(addr, size, frames, completed=False, **kw))
        self.events.append(free(addr, size, frames, **kw))

    def step(self, first: bool, keep: Optional[List[int]], ema: bool = False) -> None:
        """One training step; a leaky loop passes `keep`, which holds on to the activations; with
        `ema`, the first step ends with an EMA copy of the weights, made after the update."""
        batch = self.new(1000, BATCH)
        acts = [self.new(100_000, FWD) for _ in range(3)]
        loss = self.new(4, LOSS)
        backward_tmp = self.new(50_000, BWD)
        if first:
            self.new(4096, BWD)  # the parameter's .grad: kept after the backward
        self.drop(backward_tmp, 50_000, BWD)
        for a in acts:
            if keep is None:
                self.drop(a, 100_000, FWD)  # saved tensors are released by the backward
            else:
                keep.append(a)
        if first:
            self.new(4096, STATE), self.new(4096, STATE)  # AdamW's two moments
        update_tmp = self.new(4096, UPDATE)
        self.drop(update_tmp, 4096, UPDATE)
        for addr, size in self.params:  # the in-place update: a new version of the parameter
            self.events.append(free(addr, size, [], completed=False))
            self.events.append(free(addr, size, []))
            self.events.append(alloc(addr, size, []))
        if ema and first:
            self.new(4096, EMA)
        self.drop(loss, 4, LOSS)
        self.drop(batch, 1000, BATCH)

    def snapshot(self) -> Dict[str, Any]:
        blocks_at_end = [{"size": s, "requested_size": s, "state": "active_allocated", "frames": []}
                         for _, s in self.params]
        return {"device_traces": [self.events],
                "segments": [{"device": 0, "address": 0x1000, "total_size": 4096, "allocated_size": 4096,
                              "stream": 0, "blocks": blocks_at_end}]}


def training(steps: int = 2, leak: bool = False, ema: bool = False) -> Dict[str, Any]:
    t = Trace()
    kept: Optional[List[int]] = [] if leak else None
    for k in range(steps):
        t.step(first=k == 0, keep=kept, ema=ema)
    return t.snapshot()


def summary_of(write_snapshot, snap: Dict[str, Any]):
    return read_summary(write_snapshot(snap), load_rules()).devices[0]


def test_steps_and_phases_from_stacks(write_snapshot):
    d = summary_of(write_snapshot, training(steps=3))
    assert [s.step for s in d.steps] == [0, 1, 2]
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 3
    # The batch is made before the forward: it opens the step, not the previous update.
    batches = [i for i, e in enumerate(training(steps=3)["device_traces"][0])
               if e["action"] == "alloc" and e["frames"] == BATCH]
    assert [s.start_event for s in d.steps] == batches
    # Steps cover the trace without gaps, and each phase's peak lies inside it.
    assert d.steps[0].start_event == 0 and d.steps[-1].end_event == d.trace_events - 1
    for before, after in zip(d.steps, d.steps[1:]):
        assert after.start_event == before.end_event + 1
    for p in (p for s in d.steps for p in s.phases):
        assert p.start_event <= p.peak_event_index <= p.end_event
    assert max(p.peak_bytes for s in d.steps for p in s.phases) == d.peak_bytes


# Lightning's automatic optimization (and LBFGS): the stepping batch's forward, loss and backward
# run in a closure that `optimizer.step(closure)` calls.
IN_STEP = prof("lightning/pytorch/loops/optimization/automatic.py(146): __call__",
               "lightning/pytorch/plugins/precision/precision.py(108): _wrap_closure",
               "torch/optim/adam.py(223): step", "torch/optim/optimizer.py(485): _use_grad",
               "torch/optim/optimizer.py(509): wrapper", "lightning/pytorch/core/optimizer.py(154): step")


def in_step(frames: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return frames[:-1] + IN_STEP + frames[-1:]


def accumulating(steps: int, closure: bool) -> Dict[str, Any]:
    """Two micro-batches per optimizer step; with `closure`, the second runs inside the step."""
    t = Trace()
    for k in range(steps):
        for micro in range(2):
            wrap = in_step if closure and micro == 1 else (lambda f: f)
            acts = [t.new(100_000, wrap(FWD)) for _ in range(3)]
            loss = t.new(4, wrap(LOSS))
            tmps = [t.new(50_000, wrap(BWD)) for _ in range(2)]
            if k == 0 and micro == 0:
                t.new(4096, BWD)  # the gradient, accumulated into by the second micro-batch
            for tmp in tmps:
                t.drop(tmp, 50_000, wrap(BWD))
            for a in acts:
                t.drop(a, 100_000, wrap(FWD))
            t.drop(loss, 4, wrap(LOSS))
        if k == 0:
            t.new(4096, STATE), t.new(4096, STATE)
        t.drop(t.new(4096, UPDATE), 4096, UPDATE)
    return t.snapshot()


@pytest.mark.parametrize("closure", [False, True], ids=["step-after", "step-with-closure"])
def test_a_forward_the_optimizer_step_calls_back_is_a_forward(write_snapshot, closure):
    """Two optimizer steps of two micro-batches read as two steps, each with its two forwards and
    backwards, whether the last micro-batch runs before `step()` or inside it."""
    d = summary_of(write_snapshot, accumulating(2, closure))
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward"] * 2 + ["optimizer"]] * 2


# The same loop as a CUDA snapshot records it (Python frames with their files; the backward on the
# autograd engine's thread, C++ frames only), inside the step's own `record_function` scope.
def py(*frames: str) -> List[Dict[str, Any]]:
    """CUDA-route frames from "file:name", innermost first."""
    return [{"filename": f, "line": 1, "name": n} for f, n in (frame.rsplit(":", 1) for frame in frames)]


def cpp(*names: str) -> List[Dict[str, Any]]:
    return [{"filename": "", "line": 0, "name": n} for n in names]


ENGINE = cpp("at::_ops::mm::call", "torch::autograd::generated::MmBackward0::apply",
             "torch::autograd::Engine::evaluate_function")
GRAD = cpp("at::_ops::zeros_like::call", "torch::autograd::AccumulateGrad::apply",
           "torch::autograd::Engine::evaluate_function")
TORCH = SP + "torch/optim/"
LIGHTNING = SP + "lightning/pytorch/"
CLOSURE = py(f"{LIGHTNING}demos/model.py:training_step", f"{LIGHTNING}loops/optimization/automatic.py:closure",
             f"{LIGHTNING}loops/optimization/automatic.py:__call__",
             f"{LIGHTNING}plugins/precision/precision.py:_wrap_closure")
WRAPPERS = py(f"{TORCH}optimizer.py:_use_grad", f"{TORCH}optimizer.py:wrapper", f"{LIGHTNING}core/optimizer.py:step",
              "/work/train.py:<module>")


def lightning(optimizer: str, steps: int = 2) -> Dict[str, Any]:
    """Lightning's automatic optimization on a GPU: each step `optimizer.step(closure)` inside its
    `Optimizer.step#...` scope, the closure running the forward, the loss, zero_grad (its own scope)
    and the backward, then the update: Adam's (state made in the first step, a temporary each
    step), plain SGD's (in place, nothing allocated) or a custom optimizer's `step`, code outside
    torch inside torch.optim's wrappers (its state and temporaries by its own file)."""
    step = py(f"{TORCH}adam.py:step") if optimizer != "custom" else py("/work/muon.py:step")
    forward = py("torch/nn/modules/linear.py:forward", "/work/model.py:forward") + CLOSURE + step + WRAPPERS
    loss = py("torch/nn/functional.py:cross_entropy") + CLOSURE + step + WRAPPERS
    state = (py(f"{TORCH}adam.py:_init_group") if optimizer == "Adam" else py("/work/muon.py:zeros")) + step + WRAPPERS
    update = (py(f"{TORCH}adam.py:_multi_tensor_adam", f"{TORCH}adam.py:adam") if optimizer == "Adam"
              else py("/work/muon.py:newton_schulz")) + step + WRAPPERS
    to_device = cpp("at::_ops::_to_copy::call") + py("/work/train.py:<module>")
    t = Trace()
    annotations: List[Dict[str, Any]] = []

    def scope(name: str, stage: str) -> None:
        annotations.append({"name": f"Optimizer.{name}#{optimizer}.{name}", "stage": stage, "device": 0,
                            "time_us": 10 * len(t.events) - 5})  # before the next event

    for k in range(steps):
        batch = t.new(1000, to_device)
        scope("step", "START")
        acts = [t.new(100_000, forward) for _ in range(3)]
        scores = t.new(400, loss)
        scope("zero_grad", "START")
        scope("zero_grad", "END")
        tmp = t.new(50_000, ENGINE)
        if k == 0:
            t.new(4096, GRAD)
        t.drop(tmp, 50_000, ENGINE)
        for a in acts:
            t.drop(a, 100_000, ENGINE)
        t.drop(scores, 400, ENGINE)
        if k == 0 and optimizer != "SGD":
            t.new(4096, state), t.new(4096, state)
        if optimizer != "SGD":
            t.drop(t.new(4096, update), 4096, update)
        scope("step", "END")
        t.drop(batch, 1000, to_device)
    for k, e in enumerate(t.events):
        e["time_us"] = 10 * k
    return {**t.snapshot(), "external_annotations": annotations}


@pytest.mark.parametrize("optimizer", ["Adam", "SGD", "custom"])
def test_lightnings_closure_is_the_forward_and_backward_inside_the_steps_scope(write_snapshot, optimizer):
    """Lightning's forward and backward run inside `Optimizer.step#...`'s scope; they read as the
    forward and the backward all the same, their memory as activations and gradients, and the
    update after them as the optimizer step (plain SGD's, which allocates nothing, included)."""
    d = summary_of(write_snapshot, lightning(optimizer))
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 2
    # The second step's forward: its activations and loss, the batch, the gradient and state kept.
    state = {} if optimizer == "SGD" else {"optimizer_state": 2 * 4096}
    kept = {"input": 1000, "gradient": 4096, **state}
    assert d.at("forward").categories == {"activation": 3 * 100_000 + 400, **kept}
    update = {} if optimizer == "SGD" else {"optimizer_temporary": 4096}
    assert d.at("optimizer").categories == {**kept, **update}


def test_a_custom_optimizers_own_step_is_the_optimizer_step(write_snapshot):
    """Without scopes (stacks alone), a custom optimizer's `step` (outside torch, called through
    torch.optim's wrappers) is the optimizer step, not a call back: its state is born there."""
    snap = lightning("custom")
    del snap["external_annotations"]
    d = summary_of(write_snapshot, snap)
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 2
    assert {g.lifetime["born"] for g in d.groups if g.category == "optimizer_state"} == {"optimizer"}


def test_a_copy_the_loop_keeps_after_the_update_is_no_activation(write_snapshot):
    """An EMA copy of the weights made after `step()`, which the next forward's phase takes in: it
    outlives every step and no model made it, so it is `other`, not an activation."""
    d = summary_of(write_snapshot, training(steps=3, ema=True))
    (group,) = [g for g in d.groups if "clone" in g.site]
    assert (group.category, group.lifetime["born"], group.bytes) == ("other", "forward", 4096)
    assert [s.step for s in d.steps] == [0, 1, 2]


def test_the_peak_in_the_backward_of_the_second_step(write_snapshot):
    d = summary_of(write_snapshot, training(steps=2))
    # Three 100 kB activations, the batch, the loss, the parameter, its gradient and both moments.
    assert d.peak_bytes == 4096 + 1000 + 300_000 + 4 + 50_000 + 4096 * 3
    assert (d.phase_at_peak, d.step_at_peak) == ("backward", 1)


def test_categories_from_lifetimes_on_cpu_stacks(write_snapshot):
    d = summary_of(write_snapshot, training(steps=2))
    by = {(g.site, g.category): g for g in d.groups}
    # Both are allocated under run_backward: only the lifetime tells the gradient from the temporary.
    grad = by[("graph.py:_engine_run_backward <- run_backward", "gradient")]
    assert grad.bytes == 4096 and grad.lifetime == {"born": "backward", "freed": "never", "outlives": "trace"}
    assert by[("graph.py:_engine_run_backward <- run_backward", "autograd")].bytes == 50_000
    assert by[("adam.py:_init_group <- zeros_like", "optimizer_state")].bytes == 8192
    # The parameter was updated in place before the peak: the re-version continues it.
    param = by[("<no stack: live before the trace>", "parameter")]
    assert param.bytes == 4096 and param.count == 1
    assert not any(g.site == "<no stack>" for g in d.groups)
    assert d.unmatched_free_count == 0 and d.unmatched_free_bytes == 0
    assert sum(d.categories.values()) == d.peak_bytes


def test_re_versions_change_who_owns_bytes_not_the_totals(write_snapshot):
    snap = training(steps=2)
    merged = summary_of(write_snapshot, snap)
    # The same events written by a CUDA recording are not the profiler route: no re-versions.
    cuda = {**snap, "device_traces": [[{**e, "frames": [{"filename": "train.py", "line": 20, "name": "<module>"}]
                                         if e["frames"] else [], "time_us": 1000 + i}
                                        for i, e in enumerate(snap["device_traces"][0])]]}
    plain = summary_of(write_snapshot, cuda)
    assert (merged.peak_bytes, merged.static_bytes) == (plain.peak_bytes, plain.static_bytes)
    assert (merged.unmatched_free_count, plain.unmatched_free_count) == (0, 1)


def test_phases_from_annotations_when_stacks_say_nothing(write_snapshot):
    events, annotations, t = [], [], 1000

    def scope(name: str, stage: str) -> None:
        annotations.append({"name": name, "stage": stage, "device": 0, "time_us": t})

    addr = 0x100000
    for step in range(2):
        scope(f"ProfilerStep#{step + 5}", "START")
        for phase, sizes in (("## forward ##", [300, 300]), ("## backward ##", [200]),
                             ("Optimizer.step#AdamW.step", [10])):
            scope(phase, "START")
            for size in sizes:
                t += 10
                addr += 0x1000
                events.append(alloc(addr, size, time_us=t))
                t += 10
                events.append(free(addr, size, time_us=t))
            t += 10
            scope(phase, "END")
        scope(f"ProfilerStep#{step + 5}", "END")
    d = summary_of(write_snapshot, {"device_traces": [events], "segments": [], "external_annotations": annotations})
    assert [s.step for s in d.steps] == [5, 6]
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 2
    assert (d.phase_at_peak, d.step_at_peak) == ("forward", 5)


def test_a_stray_stack_inside_a_phase_is_not_a_phase(write_snapshot):
    t = Trace()
    for frames in [FWD] * 5 + [BWD] + [FWD] * 5 + [BWD] * 5 + [STATE]:
        t.new(10, frames)
    d = summary_of(write_snapshot, t.snapshot())
    assert [p.phase for p in d.steps[0].phases] == ["forward", "backward", "optimizer"]


def test_a_leak_keeps_activations_from_earlier_steps(write_snapshot, capsys):
    leaky = summary_of(write_snapshot, training(steps=3, leak=True))
    kept = [g for g in leaky.groups if g.bytes_from_earlier_steps and g.category not in PERSISTENT]
    assert {g.category for g in kept} == {"activation"}
    assert sum(g.bytes_from_earlier_steps for g in kept) == 6 * 100_000  # steps 0 and 1
    clean = summary_of(write_snapshot, training(steps=3))
    assert not any(g.bytes_from_earlier_steps for g in clean.groups if g.category not in PERSISTENT)

    assert main(["peak", write_snapshot(training(steps=3, leak=True), "leaky.pickle")]) == 0
    out = capsys.readouterr().out
    assert ("kept from earlier steps (not parameters, gradients, optimizer state or workspaces): 585.94 KiB live at "
            "the peak (activation: linear.py:forward <- linear 585.94 KiB)") in out
    assert main(["peak", write_snapshot(training(steps=3), "clean.pickle")]) == 0
    assert "kept from earlier steps" not in capsys.readouterr().out


def test_the_per_phase_table_in_memdiff_peak(write_snapshot, capsys):
    assert main(["peak", write_snapshot(training(steps=2))]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^peak in +the backward of step 1$", out, re.MULTILINE)
    table = out[out.index("  step"):].splitlines()
    assert table[0].split() == ["step", "forward", "peak", "backward", "peak", "optimizer", "peak"]
    assert table[2].split()[0] == "0" and table[3].split()[:2] == ["1", "*"]


@pytest.mark.parametrize("born, end, expected", [
    (None, 99, Lifetime("before_trace", "never", "trace")),
    (0, 5, Lifetime("forward", "forward", "none")),
    (0, 20, Lifetime("forward", "backward", "phase")),
    (0, 60, Lifetime("forward", "forward", "step")),
])
def test_lifetime_facts(write_snapshot, born, end, expected):
    from memdiff.analyse.lifetimes import Timeline
    from memdiff.model import PhaseSpan, Step

    runs = [PhaseSpan("forward", 0, 9), PhaseSpan("backward", 10, 49), PhaseSpan("forward", 50, 98)]
    timeline = Timeline(runs, [Step(0, 0, 49, runs[:2]), Step(1, 50, 98, runs[2:])], [0, 10, 50], [0, 0, 1])
    assert timeline.lifetime(born, end, 99) == expected


def validation(batches: int, keep_graphs: bool) -> Dict[str, Any]:
    """Two training steps, then a validation loop: each batch made by the loop, a forward of three
    100 kB activations; with `keep_graphs` (no torch.no_grad(), the losses summed with +=) every
    batch's activations stay live until the loop ends."""
    t = Trace()
    for k in range(2):
        t.step(first=k == 0, keep=None)
    kept = []
    for _ in range(batches):
        batch = t.new(1000, BATCH)
        acts = [t.new(100_000, FWD) for _ in range(3)]
        t.new(4, LOSS)  # the running sum: a scalar
        kept += acts
        if not keep_graphs:
            for a in acts:
                t.drop(a, 100_000, FWD)
        t.drop(batch, 1000, BATCH)
    for a in kept if keep_graphs else []:
        t.drop(a, 100_000, FWD)
    return t.snapshot()


def test_a_validation_loop_that_keeps_its_graphs_keeps_memory_from_earlier_forwards(write_snapshot):
    """Forwards of one code with nothing between them are one phase run of one step; what each
    made and the next still finds live is kept from earlier forwards (issue 32 item 1): 3 of 4
    batches' activations at the peak, counted as 3 forwards; the loop is no step of its own."""
    d = summary_of(write_snapshot, validation(4, keep_graphs=True))
    assert [s.step for s in d.steps] == [0, 1]
    assert (d.step_at_peak, d.phase_at_peak) == (1, "forward")
    kept = [g for g in d.groups if g.bytes_from_earlier_forwards]
    assert sum(g.bytes_from_earlier_forwards for g in kept) == 3 * 3 * 100_000
    assert max(g.earlier_forwards for g in kept) == 3
    clean = summary_of(write_snapshot, validation(4, keep_graphs=False))
    assert not [g for g in clean.groups if g.bytes_from_earlier_forwards or g.bytes_from_earlier_steps
                and g.category not in PERSISTENT]


def test_kept_forwards_are_named_in_the_peak_report_and_the_diff(write_snapshot, capsys):
    base = write_snapshot(validation(4, keep_graphs=False), "base.pickle")
    head = write_snapshot(validation(4, keep_graphs=True), "head.pickle")
    assert main(["peak", head]) == 0
    assert ("kept from earlier forwards (not parameters, gradients, optimizer state or workspaces): 878.91 KiB "
            "live at the peak, made by 3 earlier forwards") in capsys.readouterr().out
    main([base, head])
    headline = capsys.readouterr().out.splitlines()[0]
    assert headline.endswith("; kept from earlier forwards +878.91 KiB (new)")


@pytest.mark.parametrize("phases,starts", [
    # A forward cut from its backward by an optimizer run inside it is no step: it opens the next.
    (["forward", "backward", "optimizer", "forward", "optimizer", "forward", "backward", "optimizer"], [0, 3]),
    # Forwards after the last step with no backward (a validation loop) belong to that step.
    (["forward", "backward", "optimizer", "forward", "backward", "optimizer", "forward"], [0, 3]),
    # Between steps they open the next one, as an evaluation forward after step() does.
    (["forward", "backward", "optimizer", "forward", "other", "forward", "backward", "optimizer"], [0, 3]),
    # Inference: no optimizer, one step per backward-less trace.
    (["forward", "forward"], [0]),
])
def test_every_training_step_runs_a_backward(phases, starts):
    """Issue 32 item 4: steps are the loop's steps, never a forward with no backward."""
    from memdiff.analyse.lifetimes import _inferred_step_starts
    assert _inferred_step_starts(phases) == starts


ZERO_GRAD = prof("torch/optim/optimizer.py(1042): zero_grad", LOOP)


def plain_sgd(show: str, steps: int = 3) -> Dict[str, Any]:
    """A plain-SGD loop, whose in-place update allocates nothing: each step a batch, a forward, a
    backward making the weight's gradient, then the step shown only as `show` says: `zero_grad`
    freeing the gradient (set_to_none), the profiler's new version of the weight (the in-place
    update), the `Optimizer.step#SGD.step` scope, or `nothing` (a backward with no step after it)."""
    t = Trace()
    annotations: List[Dict[str, Any]] = []
    for _ in range(steps):
        batch = t.new(1000, BATCH)
        acts = [t.new(100_000, FWD) for _ in range(2)]
        backward_tmp = t.new(50_000, BWD)
        grad = t.new(4096, BWD)
        t.drop(backward_tmp, 50_000, BWD)
        for a in acts:
            t.drop(a, 100_000, FWD)
        time_us = len(t.events)
        if show == "scope":
            annotations += [{"name": "Optimizer.step#SGD.step", "stage": s, "device": 0, "time_us": time_us + k}
                            for k, s in enumerate(("START", "END"))]
        if show == "update":
            for addr, size in t.params:
                t.events += [free(addr, size, [], completed=False), free(addr, size, []), alloc(addr, size, [])]
        t.drop(grad, 4096, ZERO_GRAD if show == "zero_grad" else BWD)
        t.drop(batch, 1000, BATCH)
    for k, e in enumerate(t.events):
        e["time_us"] = k
    return {**t.snapshot(), "external_annotations": annotations}


@pytest.mark.parametrize("show", ["zero_grad", "update", "scope"])
def test_a_step_that_allocates_nothing_is_an_optimizer_phase_all_the_same(write_snapshot, show):
    """Issue 42 item 2: plain SGD's step shows by zero_grad's frees, the weight's new version or
    its scope; each step reads forward, backward, optimizer, and the gradient is one."""
    d = summary_of(write_snapshot, plain_sgd(show))
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 3
    optimizer = next(p for p in d.phase_peaks if p.phase == "optimizer")
    assert optimizer.categories.get("gradient") == 4096


def test_a_backward_with_no_step_after_it_makes_no_optimizer_phase(write_snapshot):
    d = summary_of(write_snapshot, plain_sgd("nothing"))
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward"]] * 3


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "offload"])
def test_deepspeeds_engine_step_is_the_optimizer_step(write_snapshot, offload):
    """DeepSpeed ZeRO: `engine.step` casts this rank's gradient partition and updates, inside
    DeepSpeed's own code (outside torch) and, with offload_optimizer, with no torch.optim frame on
    the device at all: still the optimizer phase of each step, not the backward's."""
    ds = SP + "deepspeed/runtime/"
    loop = py("/work/train.py:<module>")
    engine_step = py(f"{ds}zero/stage_1_and_2.py:step", f"{ds}engine.py:_take_model_step", f"{ds}engine.py:step")
    t = Trace()
    for k in range(2):
        act = t.new(100_000, py("torch/nn/modules/linear.py:forward", f"{ds}engine.py:forward") + loop)
        grads = t.new(50_000, cpp("at::_ops::empty::call") + py(f"{ds}zero/stage_1_and_2.py:setup_buckets",
                                                                 f"{ds}zero/stage_1_and_2.py:grad_handling_hook")
                      + ENGINE)
        t.drop(act, 100_000, ENGINE)
        partition = t.new(100_000, engine_step + loop)
        t.drop(grads, 50_000, engine_step + loop)
        if not offload:
            adam = py(f"{TORCH}adam.py:_init_group", f"{TORCH}adam.py:step", f"{TORCH}optimizer.py:wrapper")
            if k == 0:
                t.new(200_000, adam + engine_step + loop)
            t.drop(t.new(100_000, adam + engine_step + loop), 100_000, adam + engine_step + loop)
        t.drop(partition, 100_000, engine_step + loop)
    d = summary_of(write_snapshot, t.snapshot())
    assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 2
