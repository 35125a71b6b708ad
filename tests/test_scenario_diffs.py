"""The changes teams make, on three model families: the first screen of the diff names the cause.

Each test states what a reviewer must see and asserts it is in the header (where each peak
is, the phase table, memory kept from earlier steps, the categories) or in the top three rows.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
from scenario_suite import FAMILIES

from memdiff.analyse.classify import load_rules
from memdiff.compare.differ import GONE, GREW, NEW, SHRANK, DeviceDiff, diff
from memdiff.model import Summary
from memdiff.read.inputs import read_summary

# Slow (the fast loop, -m "not slow", leaves it out): captures of the scenario models.
pytestmark = pytest.mark.slow

# (base, head) scenario suffixes, and whether the change works in one direction only (then no
# row moves against the net change). Autocast (fp32 activations halve, bf16 weight copies
# appear), checkpointing (activations go, the later peak inside backward holds more gradients)
# and an optimizer swap (one optimizer's state goes, the other's comes) move memory both ways
# at different sites, so their rows add up to more than the net change without any cancelling.
PAIRS = {
    "batch": ("base", "batch2x", True),
    "autocast": ("base", "autocast", False),
    "adamw-to-sgd": ("base", "sgd", False),
    "sgd-to-adamw": ("sgd", "base", False),
    "checkpointing-on": ("base", "checkpoint", False),
    "checkpointing-off": ("checkpoint", "base", False),
    "debug-projections": ("base", "debug", True),
    "leaked-loss": ("log-item", "log-tensor", True),
    "eval-without-no-grad": ("eval-no-grad", "eval-grad", True),
    "gradient-accumulation": ("base", "accum", True),
}
HIDDEN, LAYERS = 128, 2  # tests/scenarios/train.py's models


@pytest.fixture(scope="module")
def summaries(scenarios) -> Dict[str, Summary]:
    names = {f"{family}-{part}" for family in FAMILIES for base, head, _ in PAIRS.values() for part in (base, head)}
    rules = load_rules()
    return {name: read_summary(str(path), rules) for name, path in scenarios(*sorted(names)).items()}


@pytest.fixture(scope="module")
def diffs(summaries) -> Dict[str, Dict[str, DeviceDiff]]:
    """change -> family -> device 0 of the diff."""
    return {change: {family: diff(summaries[f"{family}-{base}"], summaries[f"{family}-{head}"]).devices[0]
                     for family in FAMILIES}
            for change, (base, head, _) in PAIRS.items()}


def top3(d: DeviceDiff) -> List:
    return d.rows[:3]


def category_delta(d: DeviceDiff, name: str) -> int:
    return next((c.delta_bytes for c in d.categories if c.category == name), 0)


def test_every_diff_adds_up_and_no_rows_cancel(diffs):
    for change, by_family in diffs.items():
        one_way = PAIRS[change][2]
        for family, d in by_family.items():
            assert sum(r.delta_bytes for r in d.rows) == d.peak_delta_bytes
            labels: Dict[str, List[int]] = {}
            for r in d.rows:
                labels.setdefault(r.label, []).append(r.delta_bytes)
            assert not [label for label, deltas in labels.items() if max(deltas) > 0 > min(deltas)], (change, family)
            moved = sum(abs(r.delta_bytes) for r in d.rows)
            ratio = moved / abs(d.peak_delta_bytes)
            print(f"{change:>22} {family:>6}: rows move {ratio:.2f}x the net change, peaks in "
                  f"{d.base_peak_phase} / {d.head_peak_phase}")
            if one_way and d.base_peak_phase == d.head_peak_phase:
                assert ratio <= 1.25, (change, family, ratio)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bigger_batch_reads_as_activations_growing(diffs, family):
    d = diffs["batch"][family]
    assert max(d.categories, key=lambda c: c.delta_bytes).category == "activation"
    assert any(r.status == GREW and r.category == "activation" for r in top3(d))


@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_reads_as_smaller_activations(diffs, summaries, family):
    d = diffs["autocast"][family]
    if d.base_peak_phase != d.head_peak_phase:
        # The header says the peaks are in different phases; compared like with like, at the
        # base's peak phase in both runs (--at), activations shrink.
        d = diff(summaries[f"{family}-base"], summaries[f"{family}-autocast"], at=d.base_peak_phase).devices[0]
    assert category_delta(d, "activation") < 0
    assert any(r.status in (SHRANK, GONE) and r.category == "activation" for r in top3(d))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_optimizer_swap_reads_as_one_state_for_another(diffs, family):
    to_sgd, to_adamw = diffs["adamw-to-sgd"][family], diffs["sgd-to-adamw"][family]
    assert [(r.status, r.site) for r in top3(to_sgd)[:2]] == [
        (GONE, "adam.py:_init_group <- zeros_like"), (NEW, "sgd.py:_single_tensor_sgd <- clone")]
    assert [(r.status, r.site) for r in top3(to_adamw)[:2]] == [
        (NEW, "adam.py:_init_group <- zeros_like"), (GONE, "sgd.py:_single_tensor_sgd <- clone")]
    # AdamW keeps two moments per weight, SGD with momentum one buffer: the state halves.
    adam, sgd = top3(to_sgd)[0].base_bytes, top3(to_sgd)[1].head_bytes
    assert adam == 2 * sgd
    assert max(to_sgd.categories, key=lambda c: -c.delta_bytes).category == "optimizer_state"


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_reads_as_activations(diffs, family):
    on, off = diffs["checkpointing-on"][family], diffs["checkpointing-off"][family]
    assert min(on.categories, key=lambda c: c.delta_bytes).category == "activation"
    assert top3(on)[0].category == "activation" and top3(on)[0].delta_bytes < 0
    assert max(off.categories, key=lambda c: c.delta_bytes).category == "activation"
    assert top3(off)[0].category == "activation" and top3(off)[0].delta_bytes > 0
    assert [p.delta_bytes < 0 for p in on.phases if p.phase == "forward"] == [True]


@pytest.mark.parametrize("family", FAMILIES)
def test_debug_projections_read_as_their_weights_and_adamw_moments(diffs, family):
    d = diffs["debug-projections"][family]
    weights = LAYERS * (HIDDEN * 4 * HIDDEN + 4 * HIDDEN) * 4  # one fp32 Linear(h, 4h) per layer
    rows = {r.site: r for r in top3(d)}
    assert rows["<no stack: live before the trace>"].category == "parameter"
    assert rows["<no stack: live before the trace>"].delta_bytes == weights
    assert rows["adam.py:_init_group <- zeros_like"].delta_bytes == 2 * weights  # exp_avg, exp_avg_sq
    assert category_delta(d, "parameter") == weights


@pytest.mark.parametrize("family", FAMILIES)
def test_a_loss_logged_without_item_reads_as_memory_kept_from_earlier_steps(diffs, family):
    d = diffs["leaked-loss"][family]
    # The loop's `val` holds the last validation loss, and its graph, until the next replaces it:
    # in both runs kept from an earlier forward (issue 32: memory one forward made, live when the
    # next forward of the same code runs). Logged as a tensor, every step's graph is kept.
    assert d.kept is not None and d.kept.head_bytes > d.kept.base_bytes
    assert d.kept.base_bytes == d.kept.base_forward_bytes
    # Every byte of growth was allocated in an earlier step.
    assert d.kept.head_bytes - d.kept.base_bytes >= 0.9 * d.peak_delta_bytes
    assert d.kept.rows[0].category == "activation"


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_without_no_grad_reads_as_new_activations(diffs, family):
    d = diffs["eval-without-no-grad"][family]
    assert all(r.status in (NEW, GREW) and r.category == "activation" for r in top3(d))
    assert max(d.categories, key=lambda c: c.delta_bytes).category == "activation"


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_accumulation_reads_as_gradients_held_across_micro_batches(diffs, family):
    d = diffs["gradient-accumulation"][family]
    assert top3(d)[0].category == "gradient" and top3(d)[0].status in (NEW, GREW)
    assert max(d.categories, key=lambda c: c.delta_bytes).category == "gradient"
