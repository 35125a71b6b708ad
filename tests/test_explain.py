"""The diff explains: where each peak is, like for like, one row per site, labels, honest numbers."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest
from conftest import alloc, free

from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.compare.differ import GREW, diff
from memdiff.read.inputs import read_summary
from memdiff.report.build import device_report

REAL_PAIRS = [
    ("cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle"),
    ("cs336-ctx128-fwd-fp32.pickle", "cs336-ctx128-fwd-mixed.pickle"),
    ("linear-nograd.pickle", "linear-grad.pickle"),
    ("cs336-medium-ctx128-infer.pickle", "cs336-medium-ctx128-train.pickle"),
]


def prof(*names: str) -> List[Dict[str, Any]]:
    return [{"filename": "none", "line": 0, "name": n} for n in names]


def opposite_pairs(rows) -> List[str]:
    """Labels shown by two rows that moved in opposite directions."""
    by_label: Dict[str, List[int]] = {}
    for r in rows:
        by_label.setdefault(r.label, []).append(r.delta_bytes)
    return [label for label, deltas in by_label.items() if max(deltas) > 0 > min(deltas)]


@pytest.mark.parametrize("base, head", REAL_PAIRS)
def test_no_two_rows_read_alike_and_move_apart_on_real_pairs(shared, base, head):
    rules = load_rules()
    b, h = read_summary(str(shared / base), rules), read_summary(str(shared / head), rules)
    for forward, back in ((b, h), (h, b)):
        for d in diff(forward, back).devices:
            assert opposite_pairs(d.rows) == []
            assert sum(r.delta_bytes for r in d.rows) == d.peak_delta_bytes
            assert opposite_pairs([r.row for r in device_report(d, top=20, min_delta=0).rows]) == []


def test_the_peaks_in_different_phases_are_named_and_compared_like_for_like(shared, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    assert main([str(base), str(head), "--top", "5"]) == 1
    out = capsys.readouterr().out
    assert ("warning: P001 device 0: the peaks are in different phases: base in the optimizer step of step 0, head in "
            "the forward of step 0; rows compare different moments (compare like with like: --at forward)") in out
    assert ("base peak in the optimizer step of step 0 (scope Optimizer.step#AdamW.step); "
            "head peak in the forward of step 0") in out
    phases = out[out.index("phase peak"):].splitlines()
    assert phases[2].split() == ["forward", "6.42", "GiB", "8.48", "GiB", "+2.05", "GiB", "+32.0%"]
    assert phases[4].split()[0] == "optimizer" and phases[4].split()[-1] == "+0.3%"

    # At the forward peak of both runs nothing is GONE: the activations grew.
    assert main([str(base), str(head), "--top", "5", "--at", "forward", "--format", "json"]) == 1
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert (d["at"], d["base_peak_bytes"], d["head_peak_bytes"]) == ("forward", 6_897_672_192, 9_103_544_320)
    assert (d["base_peak_phase"], d["head_peak_phase"], d["base_peak_step"], d["head_peak_step"]) == (
        "optimizer", "forward", 0, 0)
    top = d["rows"][:5]
    assert all(r["status"] == GREW and r["category"] == "activation" for r in top)
    assert {c["category"]: c["delta_bytes"] for c in d["categories"]}["optimizer_state"] == 0
    assert sum(r["delta_bytes"] for r in d["rows"]) == d["peak_delta_bytes"]


def test_at_a_phase_a_run_lacks_is_bad_input(shared, capsys):
    infer, train = shared / "cs336-medium-ctx128-infer.pickle", shared / "cs336-medium-ctx128-train.pickle"
    assert main([str(infer), str(train), "--at", "optimizer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memdiff: --at optimizer: the base run has no optimizer phase on device 0") and \
        err.count("\n") == 1


def test_percentages_past_999_read_as_ratios(shared, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    main([str(base), str(head)])
    out = capsys.readouterr().out
    activation = next(line for line in out.splitlines() if line.startswith("activation"))
    assert activation.split()[-1] == "x195.7" and "%" not in activation


FWD = "torch/nn/modules/linear.py(130): forward"


def profiler_run(layers: Dict[str, int], repeat: int = 1, size_of=None) -> Dict[str, Any]:
    """A forward pass on the profiler route: for each module, `repeat` allocations of `layers[module]` bytes."""
    events, addr = [], 0
    for module, size in layers.items():
        for _ in range(repeat):
            addr += 0x1000
            events.append(alloc(addr, size, prof("<built-in function linear>", FWD, f"nn.Module: {module}_0",
                                                 "modeling_bert.py(480): forward", "train.py(9): <module>")))
    return {"device_traces": [events], "segments": []}


def test_labels_tell_modules_apart_only_when_needed(write_snapshot, capsys):
    base = write_snapshot(profiler_run({"BertIntermediate": 1000, "BertSelfAttention": 3000}), "base.pickle")
    head = write_snapshot(profiler_run({"BertIntermediate": 2000, "BertSelfAttention": 3500}), "head.pickle")
    main([base, head, "--format", "json"])
    rows = json.loads(capsys.readouterr().out)["devices"][0]["rows"]
    assert [(r["label"], r["delta_bytes"]) for r in rows] == [
        ("linear.py:forward <- linear [BertIntermediate]", 1000),
        ("linear.py:forward <- linear [BertSelfAttention]", 500)]
    # Moving in opposite directions, the two read as one row: the member groups keep the detail.
    head = write_snapshot(profiler_run({"BertIntermediate": 2000, "BertSelfAttention": 1000}), "head2.pickle")
    main([base, head, "--format", "json"])
    rows = json.loads(capsys.readouterr().out)["devices"][0]["rows"]
    assert [(r["label"], r["delta_bytes"], len(r["members"])) for r in rows] == [
        ("linear.py:forward <- linear", -1000, 4)]
    # A site with one row reads by its site alone.
    small = write_snapshot(profiler_run({"BertIntermediate": 1000}), "small.pickle")
    large = write_snapshot(profiler_run({"BertIntermediate": 2000}), "large.pickle")
    main([small, large, "--format", "json"])
    assert [r["label"] for r in json.loads(capsys.readouterr().out)["devices"][0]["rows"]] == [
        "linear.py:forward <- linear"]


def test_a_count_that_falls_while_bytes_grow_says_why(write_snapshot, capsys):
    base = write_snapshot(profiler_run({"Linear": 100}, repeat=5), "base.pickle")
    head = write_snapshot(profiler_run({"Linear": 200}, repeat=4), "head.pickle")
    main([base, head])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("GREW"))
    assert "5 -> 4 (fewer, larger)" in row


def test_a_site_split_into_groups_in_one_run_is_one_row(write_snapshot, capsys):
    """Dropout's mask from two call paths in head, one in base: one row, not NEW + SHRANK."""
    drop = "torch/nn/functional.py(1425): dropout"

    def run(name: str, callers: List[str]) -> str:
        events = [alloc(0x1000 * (k + 1), 1000, prof("<built-in method bernoulli_>", drop, caller, "train.py(9): <module>"))
                  for k, caller in enumerate(callers)]
        return write_snapshot({"device_traces": [events], "segments": []}, name)

    base = run("base.pickle", ["model.py(10): forward"] * 8)
    head = run("head.pickle", ["model.py(10): forward"] * 4 + ["model.py(20): attention"] * 4)
    main([base, head, "--format", "json"])
    rows = json.loads(capsys.readouterr().out)["devices"][0]["rows"]
    assert [(r["status"], r["base_count"], r["head_count"], r["delta_bytes"]) for r in rows] == [("SAME", 8, 8, 0)]
    assert sorted((m["side"], m["count"]) for m in rows[0]["members"]) == [("base", 8), ("head", 4), ("head", 4)]


def training_steps(steps: int, events_per_step: int) -> Dict[str, Any]:
    fwd = prof("<built-in function linear>", FWD, "train.py(9): <module>")
    bwd = prof("<built-in method run_backward of x>", "torch/autograd/graph.py(966): _engine_run_backward")
    opt = prof("<built-in method zeros_like of x>", "torch/optim/adam.py(139): _init_group")
    events, addr = [], 0
    for _ in range(steps):
        for frames in ([fwd] * events_per_step + [bwd] * events_per_step + [opt]):
            addr += 0x1000
            events += [alloc(addr, 64, frames), free(addr, 64, frames)]
    return {"device_traces": [events], "segments": []}


def test_event_counts_warn_only_when_the_steps_differ(write_snapshot, capsys):
    base = write_snapshot(training_steps(3, 10), "base.pickle")
    more_work = write_snapshot(training_steps(3, 40), "accum.pickle")  # 4 micro-batches a step
    more_steps = write_snapshot(training_steps(12, 10), "longer.pickle")
    main([base, more_work])
    assert "event counts differ" not in capsys.readouterr().out
    main([base, more_steps])
    assert "event counts differ 4.0x (126 -> 504 events, 3 -> 12 steps)" in capsys.readouterr().out


@pytest.mark.parametrize("limit, code", [("2KiB", 0), ("2047B", 1)])
def test_a_phase_threshold_is_inclusive(write_snapshot, tmp_path, capsys, limit, code):
    base = write_snapshot(profiler_run({"Linear": 1000}), "base.pickle")
    head = write_snapshot(profiler_run({"Linear": 1000 + 2048}), "head.pickle")
    path = str(tmp_path / "b.json")
    assert main(["baseline", base, "-o", path, "--phase-fail-over", f"forward={limit}", "--fail-over", "1GiB"]) == 0
    assert json.loads(open(path).read())["thresholds"]["phases"]["forward"]
    assert main(["gate", head, "--baseline", path]) == code
    out = capsys.readouterr().out
    assert f"{'PASS' if code == 0 else 'FAIL'}  device 0 forward peak: 1000 B -> 2.98 KiB, +2.00 KiB" in out


def test_a_generic_module_is_named_with_its_parent(write_snapshot, capsys):
    # Issue 26: two rows read `linear.py:forward <- linear [Linear]` for the LM head and an MLP
    # projection; the module they sit in tells them apart.
    def run(head_bytes: int, mlp_bytes: int) -> str:
        events = [alloc(0x1000, head_bytes, prof("<built-in function linear>", FWD, "nn.Module: Linear_7",
                                                 "nn.Module: GPT2LMHeadModel_0", "train.py(9): <module>")),
                  alloc(0x2000, mlp_bytes, prof("<built-in function linear>", FWD, "nn.Module: Linear_2",
                                                "nn.Module: GPT2MLP_0", "nn.Module: GPT2Block_0",
                                                "nn.Module: GPT2LMHeadModel_0", "train.py(9): <module>"))]
        return write_snapshot({"device_traces": [events], "segments": []}, f"r{head_bytes}.pickle")

    main([run(4096, 1024), run(8192, 3072), "--format", "json"])
    rows = json.loads(capsys.readouterr().out)["devices"][0]["rows"]
    assert sorted(r["label"] for r in rows) == ["linear.py:forward <- linear [Linear in GPT2LMHeadModel]",
                                                "linear.py:forward <- linear [Linear in GPT2MLP]"]


def test_node_temporaries_at_peaks_in_different_nodes_are_one_row():
    """The backward's peak falls while some node runs, and its temporaries are that node's working
    set: when the peak instant moves to another node, rows of such memory moving both ways would
    say which node ran, not what changed (bert with debug projections: AddmmBackward0 -384 KiB,
    MeanBackward0 +1 MiB new, ...). They are one row, by the largest; gradients stay apart."""
    from memdiff.compare.differ import TEMPORARIES, align
    from memdiff.model import Frame, Group

    def group(site: str, size: int, outlives: str = "none", category: str = "autograd") -> Group:
        return Group(signature=f"{site}/{outlives}", site=site, frames=[Frame("", 0, site)], count=1, bytes=size,
                     category=category, lifetime={"born": "backward", "freed": "backward", "outlives": outlives})
    base = [group("AddmmBackward0 <- mm", 512 << 10), group("MulBackward0 <- mul", 128 << 10),
            group("AddmmBackward0 <- sum", 4096, "phase", "gradient")]
    head = [group("AddmmBackward0 <- mm", 128 << 10), group("MeanBackward0 <- div", 1 << 20),
            group("AddmmBackward0 <- sum", 8192, "phase", "gradient")]
    rows = align(base, head)
    temporaries = [r for r in rows if r.category == "autograd"]
    assert len(temporaries) == 1
    r = temporaries[0]
    assert (r.matched_by, r.site, r.delta_bytes) == (TEMPORARIES, "MeanBackward0 <- div", 512 << 10)
    assert len(r.members) == 4
    assert [(x.site, x.delta_bytes) for x in rows if x.category == "gradient"] == [("AddmmBackward0 <- sum", 4096)]
    # Temporaries that all moved one way are what changed: each keeps its row.
    grown = align(base[:2], [group("AddmmBackward0 <- mm", 1 << 20), group("MulBackward0 <- mul", 256 << 10)])
    assert sorted(x.site for x in grown) == ["AddmmBackward0 <- mm", "MulBackward0 <- mul"]


def test_the_phase_that_moved_most_is_compared_like_for_like():
    """`zero_grad(set_to_none=False)` on a GRU (figures from a CPU capture): the gradients live
    through the forward (+1.74 MiB), the peak moves from the optimizer step into the backward by
    far less (+324.5 KiB). The forward is where the change is; a peak that moved less than the
    forward is compared at its own phase."""
    from memdiff.compare.differ import PhaseDelta
    from memdiff.report.build import _moved_phase

    def device(phases, base_phase, head_phase):
        base_peak = max(b for _, b, _ in phases)
        head_peak = max(h for _, _, h in phases)
        return diff_device(base_peak, head_peak, base_phase, head_phase,
                           [PhaseDelta(p, b, h, h - b) for p, b, h in phases])
    KiB = 1024
    gru = [("forward", 6410 * KiB, 8192 * KiB), ("backward", 7178 * KiB, 8438 * KiB),
           ("optimizer", 8110 * KiB, 8110 * KiB)]
    assert _moved_phase(device(gru, "optimizer", "backward")) == "forward"
    bigger_batch = [("forward", 17_790 * KiB, 29_390 * KiB), ("backward", 18_510 * KiB, 30_830 * KiB),
                    ("optimizer", 9_240 * KiB, 9_240 * KiB)]
    assert _moved_phase(device(bigger_batch, "backward", "backward")) is None
    # Accumulation: the peak grows a little in the backward, the forward by the held gradients.
    accumulation = [("forward", 3_990 * KiB, 5_100 * KiB), ("backward", 4_720 * KiB, 5_278 * KiB),
                    ("optimizer", 4_000 * KiB, 4_000 * KiB)]
    assert _moved_phase(device(accumulation, "backward", "backward")) == "forward"


def diff_device(base_peak, head_peak, base_phase, head_phase, phases):
    from memdiff.compare.differ import DeviceDiff
    return DeviceDiff(device=0, base_peak_bytes=base_peak, head_peak_bytes=head_peak,
                      peak_delta_bytes=head_peak - base_peak, base_static_bytes=0, head_static_bytes=0, rows=[],
                      categories=[], chart=[], base_peak_phase=base_phase, head_peak_phase=head_phase, phases=phases)


def test_gradients_made_by_other_nodes_to_the_same_total_are_one_row():
    """Autocast on Whisper (figures from a CPU capture): the weights' gradients now come out of
    `ToCopyBackward0` (the cast back to fp32) where `AddmmBackward0` and `EmbeddingBackward0` made
    them; the gradient bytes are the same. One SAME row, not a NEW beside three GONE. Gradients
    that moved both ways to another total (a frozen embedding and a new layer) keep their rows."""
    from memdiff.compare.differ import GRADIENTS, SAME, align
    from memdiff.model import Frame, Group

    def grad(site: str, size: int) -> Group:
        return Group(signature=site, site=site, frames=[Frame("", 0, site)], count=1, bytes=size, category="gradient",
                     lifetime={"born": "backward", "freed": "never", "outlives": "trace"})
    base = [grad("AddmmBackward0 <- mm", 320 << 10), grad("EmbeddingBackward0 <- add", 250 << 10),
            grad("MmBackward0 <- mm", 64 << 10)]
    rows = align(base, [grad("ToCopyBackward0 <- to <- _to_copy", 634 << 10)])
    assert [(r.status, r.matched_by, r.site, len(r.members)) for r in rows] == [
        (SAME, GRADIENTS, "ToCopyBackward0 <- to <- _to_copy", 4)]
    other = align(base, [grad("AddmmBackward0 <- mm", 320 << 10), grad("MmBackward0 <- mm", 64 << 10),
                         grad("AddmmBackward0 <- mm [new layer]", 128 << 10)])
    assert sorted((r.site, r.delta_bytes) for r in other if r.delta_bytes) == [
        ("AddmmBackward0 <- mm [new layer]", 128 << 10), ("EmbeddingBackward0 <- add", -(250 << 10))]
