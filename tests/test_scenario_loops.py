"""Issue 32: explanations that hold on the loops teams write (LOOPS in tests/scenario_suite.py).

Each test states what a reviewer must conclude from the first screen of the text report and from
the JSON, and checks it against facts from the model (tests/scenarios/train.py writes them beside
each snapshot: bytes of the weights, of the trainable ones, of the optimizer's state, of each
validation batch's saved tensors, of an EMA) or against the ground truth of the run's own
record_function scopes, never against memdiff's own answer.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
from scenario_suite import LOOPS, facts, summaries_of, truth_of

from memdiff.analyse.classify import PERSISTENT, load_rules
from memdiff.api import diff as report_of
from memdiff.cli import main
from memdiff.compare.differ import DeviceDiff, diff
from memdiff.model import Summary
from memdiff.predict.forecast.course import read_course
from memdiff.units import format_bytes

# Slow (the fast loop, -m "not slow", leaves it out): captures of the scenario models.
pytestmark = pytest.mark.slow

FIRST_SCREEN = 25  # lines of the text report a reviewer reads before scrolling


@pytest.fixture(scope="module")
def runs(scenarios) -> Dict[str, Path]:
    return scenarios(*sorted(set(LOOPS) | {"gpt2-base", "gpt2-sgd", "gpt2-accum", "gpt2-autocast",
                                           "gpt2-checkpoint", "bert-base", "distilbert-base"}))


@pytest.fixture(scope="module")
def summaries(runs) -> Dict[str, Summary]:
    return summaries_of(runs)


def category_delta(d: DeviceDiff, name: str) -> int:
    return next((c.delta_bytes for c in d.categories if c.category == name), 0)


def first_screen(runs: Dict[str, Path], base: str, head: str, capsys) -> str:
    main([str(runs[base]), str(runs[head])])
    return "\n".join(capsys.readouterr().out.splitlines()[:FIRST_SCREEN])


def close(ours: int, theirs: int) -> bool:
    """Equal to within a few scalars (a loss, a step counter)."""
    return abs(ours - theirs) <= 256


def test_a_validation_loop_without_no_grad_keeps_memory_from_earlier_forwards(runs, summaries, capsys):
    """Item 1: 4 validation batches without torch.no_grad(), their losses summed with +=: at the
    peak the graphs of the 3 batches before the last are kept, their saved tensors' bytes as
    autograd itself counts them (saved_tensors_hooks, the weights left out); the headline, the kept
    line and the JSON say so. The same loop in torch.no_grad() keeps nothing."""
    saved = facts(runs, "gpt2-val-grad")["val_saved_bytes"]
    assert len(saved) == 4 and min(saved) > 0
    expected = sum(saved[:-1])
    head = summaries["gpt2-val-grad"].devices[0]
    kept = sum(g.bytes_from_earlier_forwards for g in head.groups if g.category not in PERSISTENT)
    assert abs(kept - expected) <= 0.001 * expected, (kept, expected)
    assert max(g.earlier_forwards for g in head.groups) == len(saved) - 1
    base = summaries["gpt2-val"].devices[0]
    assert not [g for g in base.groups if g.bytes_from_earlier_forwards]
    screen = first_screen(runs, "gpt2-val", "gpt2-val-grad", capsys)
    headline = screen.splitlines()[0]
    assert "; kept from earlier forwards +" in headline
    assert f"made by {len(saved) - 1} earlier forwards" in screen
    data = report_of(summaries["gpt2-val"], summaries["gpt2-val-grad"]).to_dict()
    assert data["headline"] in headline
    k = data["devices"][0]["kept"]
    assert k["base_forward_bytes"] == 0 and abs(k["head_forward_bytes"] - expected) <= 0.001 * expected
    # The validation loop is no training step of its own: the run has the steps it ran.
    assert [s.step for s in head.steps] == list(range(facts(runs, "gpt2-val-grad")["steps"]))


def test_a_training_loop_summing_its_losses_keeps_a_few_bytes(runs, summaries):
    """Item 1: `total += loss` after backward() frees each graph's saved tensors: a few bytes."""
    d = diff(summaries["gpt2-base"], summaries["gpt2-sum-loss"]).devices[0]
    assert 0 <= d.peak_delta_bytes <= 64
    head = summaries["gpt2-sum-loss"].devices[0]
    assert sum(g.bytes_from_earlier_steps for g in head.groups if g.category not in PERSISTENT) <= 64


@pytest.mark.parametrize("base,head", [("gpt2-sgd-plain", "gpt2-sgd"), ("bert-base", "bert-lora")])
def test_weights_older_than_the_trace_keep_one_row(runs, summaries, base, head, capsys):
    """Item 3: the same weights, told a weight by the update order in one run and guessed in the
    other (frozen under LoRA; SGD's momentum buffers beside them), read as one row of the
    parameter category, which moves by what the model's parameter bytes moved (LoRA's adapters)."""
    f_base, f_head = facts(runs, base), facts(runs, head)
    d = diff(summaries[base], summaries[head]).devices[0]
    assert category_delta(d, "parameter") == f_head["parameter_bytes"] - f_base["parameter_bytes"]
    stackless = [r for r in d.rows if r.site.startswith("<no stack") and r.delta_bytes]
    assert len(stackless) <= 1
    assert sum(abs(r.delta_bytes) for r in stackless) <= abs(f_head["parameter_bytes"] - f_base["parameter_bytes"])
    # SGD's momentum is one buffer per trainable weight, made in the trace: the state that grew.
    if head == "gpt2-sgd":
        assert close(category_delta(d, "optimizer_state"), f_head["state_bytes"] - f_base["state_bytes"])
        assert f_head["state_bytes"] == f_head["trainable_bytes"]
    screen = first_screen(runs, base, head, capsys)
    assert "<no stack: live before the trace, category guessed>  " not in screen


def test_an_averaged_model_built_before_training_is_no_optimizer_state(runs, summaries, capsys):
    """Item 5: AveragedModel(model) built before recording and updated after each step is one more
    copy of the weights (parameter or other), never optimizer state."""
    f_base, f_head = facts(runs, "convnext-base"), facts(runs, "convnext-ema-averaged")
    d = diff(summaries["convnext-base"], summaries["convnext-ema-averaged"]).devices[0]
    assert category_delta(d, "optimizer_state") == 0 and f_head["state_bytes"] == f_base["state_bytes"]
    assert close(category_delta(d, "parameter") + category_delta(d, "other"), f_head["ema_bytes"])
    head = summaries["convnext-ema-averaged"].devices[0]
    assert close(head.categories.get("optimizer_state", 0), f_head["state_bytes"])
    assert "optimizer_state +" not in first_screen(runs, "convnext-base", "convnext-ema-averaged", capsys)


@pytest.mark.parametrize("name", ["distilbert-keep-grads", "bart-keep-grads", "bart-base", "bart-keep-grads-warm"])
def test_gradients_kept_through_the_forward_keep_the_loop_s_steps(runs, summaries, name):
    """Item 4: zero_grad(set_to_none=False): the run has the steps the loop ran, and the peak is
    in the step and phase the run's own scopes say."""
    d = summaries[name].devices[0]
    truth = truth_of(runs[name])
    assert [s.step for s in d.steps] == list(range(facts(runs, name)["steps"]))
    assert (d.step_at_peak, d.phase_at_peak) == tuple(truth[d.peak_event_index])


@pytest.mark.parametrize("base,head", [("bart-base", "bart-keep-grads"), ("distilbert-base", "distilbert-keep-grads"),
                                       ("bart-warm", "bart-keep-grads-warm")])
def test_gradients_kept_through_the_forward_read_as_gradients(runs, summaries, base, head):
    """Item 4: the gradients kept through the next forward are gradients: compared at the forward
    peak they are what grew, by the trainable weights' bytes, and at the peak the largest growing
    category is gradient. Issue 42 item 8: also when recording starts after a warm-up step, where
    the kept gradients are older than the trace and the backward accumulates into them in place
    (they read as parameter +3.14 MiB)."""
    grads = facts(runs, head)["trainable_bytes"]
    at_forward = diff(summaries[base], summaries[head], at="forward").devices[0]
    assert close(category_delta(at_forward, "gradient"), grads)
    d = diff(summaries[base], summaries[head]).devices[0]
    assert max(d.categories, key=lambda c: c.delta_bytes).category == "gradient"


def test_gradients_kept_from_before_recording_are_told_from_weights_and_state(runs, summaries):
    """Issue 42 item 8: recorded after a warm-up step with zero_grad(set_to_none=False), the weights,
    their kept gradients and AdamW's state are all older than the trace; at the peak each category
    holds the model's and the optimizer's own byte counts (the gradients read as weights before)."""
    f = facts(runs, "bart-keep-grads-warm")
    categories = summaries["bart-keep-grads-warm"].devices[0].categories
    assert (categories.get("parameter"), categories.get("gradient"), categories.get("optimizer_state")) == (
        f["parameter_bytes"], f["trainable_bytes"], f["state_bytes"])


@pytest.mark.parametrize("head", ["gpt2-accum", "gpt2-autocast", "gpt2-checkpoint"])
def test_loops_that_change_no_weight_leave_weights_and_state_alone(runs, summaries, head, capsys):
    """Item 7: gradient accumulation, autocast and Hugging Face gradient checkpointing change no
    weight: parameter and optimizer state read unchanged; accumulation keeps the gradients
    through the second micro-batch's forward (the headline names them, by the trainable bytes),
    autocast and checkpointing move activations (the headline's cause)."""
    f_base, f_head = facts(runs, "gpt2-base"), facts(runs, head)
    assert (f_base["parameter_bytes"], f_base["state_bytes"]) == (f_head["parameter_bytes"], f_head["state_bytes"])
    d = diff(summaries["gpt2-base"], summaries[head]).devices[0]
    assert category_delta(d, "parameter") == category_delta(d, "optimizer_state") == 0
    data = report_of(summaries["gpt2-base"], summaries[head]).to_dict()
    headline = first_screen(runs, "gpt2-base", head, capsys).splitlines()[0]
    assert data["headline"] in headline
    if head == "gpt2-accum":
        assert f"gradient +{format_bytes(f_head['trainable_bytes'])} (new)" in headline
    else:
        assert ": activation -" in headline


@pytest.mark.parametrize("name", ["gpt2-base", "gpt2-foreach"])
def test_the_optimizer_s_temporaries_are_the_optimizer_step_s(runs, name):
    """Issue 42 item 7: what the run's own scopes say the optimizer step made and freed inside it
    (AdamW's update: `_single_tensor_adam`'s sqrt and division; foreach, `_multi_tensor_adam <-
    _foreach_sqrt`), with a stack of its own (the profiler writes a weight's new version without
    one), is the optimizer step's temporary memory, however PyTorch labels it by data flow
    (temporary, unknown, activation, parameter, input; never autograd_detail or gradient: no
    backward memory), and nothing made outside the step is."""
    course = read_course(str(runs[name]), 0, load_rules()).devices[0]
    trace = pickle.loads(runs[name].read_bytes())["device_traces"][0]
    truth = truth_of(runs[name])
    category = np.array(course.categories, dtype=object)[course.category]
    temporaries, pytorch = Counter(), Counter()
    for k in np.flatnonzero(~course.before).tolist():
        born, freed = int(course.start[k]), int(course.end[k])
        inside = (truth[born][1] == "optimizer" and freed < len(trace) and truth[freed] == truth[born]
                  and bool(trace[born].get("frames")) and trace[born].get("category") != "optimizer_state")
        if inside:
            temporaries[category[k]] += int(course.size[k])
            pytorch[trace[born].get("category")] += int(course.size[k])
        else:
            assert category[k] != "optimizer_temporary", (born, truth[born], trace[born].get("category"))
    assert set(temporaries) == {"optimizer_temporary"}, temporaries
    assert not {"autograd_detail", "gradient"} & set(pytorch), pytorch
