"""`memdiff BASE HEAD`: alignment, the report, the rule and exit codes, on real and hand-built runs."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any, Dict, List

import pytest
from conftest import alloc, py_frames

from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.compare.differ import BY_SITE, GONE, GREW, NEW, SAME, SHRANK, diff
from memdiff.compare.findings import BY_CODE
from memdiff.compare.limits import Limit, Thresholds
from memdiff.read.inputs import read_summary
from memdiff.read.load import decode


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def json_diff(capsys, base, head, *extra):
    code, out, err = run(capsys, base, head, "--format", "json", *extra)
    assert err == "", err
    return code, json.loads(out)


def raw(path) -> Dict[str, Any]:
    return decode(str(path))[0]


def write(tmp_path, name, obj) -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=4))
    return str(path)


def all_frames(snapshot: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every distinct frame dict (real snapshots share them between events)."""
    seen: Dict[int, Dict[str, Any]] = {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            for f in e.get("frames") or []:
                seen[id(f)] = f
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            for f in b.get("frames") or []:
                seen[id(f)] = f
    return list(seen.values())


# --- real pairs ---------------------------------------------------------------------------------

def test_ctx128_to_ctx256_training(shared, expected, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    code, data = json_diff(capsys, base, head)
    d = data["devices"][0]
    want = expected[head.name]["0"]["peak_bytes"] - expected[base.name]["0"]["peak_bytes"]
    assert d["peak_delta_bytes"] == want == sum(r["delta_bytes"] for r in d["rows"])
    assert code == 1 and data["verdict"] == "fail"
    # The growth is activations: the largest growing rows are forward-pass allocations.
    growing = [r for r in d["rows"] if r["status"] in (NEW, GREW)][:6]
    assert all(any(f["name"] in ("forward", "einsum", "silu", "softmax") for f in r["frames"]) for r in growing)
    # Attention scores: 48 of 16 MiB more, one row for the site in the module (model.py line 39).
    assert (growing[0]["site"], growing[0]["base_count"], growing[0]["head_count"]) == (
        "functional.py:einsum <- einsum <- bmm", 1, 49)


def test_inference_to_training_adds_gradients_and_optimizer_state(shared, capsys):
    code, data = json_diff(capsys, shared / "cs336-medium-ctx128-infer.pickle",
                           shared / "cs336-medium-ctx128-train.pickle")
    d = data["devices"][0]
    assert code == 1 and d["peak_delta_bytes"] == 7013335044 - 1736962048
    sites = {r["site"]: r for r in d["rows"] if r["status"] == NEW}
    assert sites["AccumulateGrad <- new_empty_strided"]["head_count"] == 169
    assert any(s.startswith("freed at optimizer.py:step") for s in sites)


def test_fp32_to_mixed_precision_forward(shared, capsys):
    code, data = json_diff(capsys, shared / "cs336-ctx128-fwd-fp32.pickle", shared / "cs336-ctx128-fwd-mixed.pickle")
    d = data["devices"][0]
    assert d["peak_delta_bytes"] == 23873313792 - 19352504320 == sum(r["delta_bytes"] for r in d["rows"])
    # Autocast adds bf16 copies (`_to_copy`) that fp32 never makes, and the activations halve.
    top = d["rows"][0]
    assert (top["status"], top["site"], top["head_count"]) == (NEW, "functional.py:einsum <- einsum <- _to_copy", 384)
    bmm = next(r for r in d["rows"] if r["site"] == "functional.py:einsum <- einsum <- bmm")
    assert (bmm["status"], bmm["matched_by"], bmm["base_count"], bmm["head_count"]) == (SHRANK, BY_SITE, 66, 66)
    halved = [r for r in d["rows"] if r["status"] == SHRANK and r["head_bytes"] * 2 == r["base_bytes"]]
    assert len(halved) >= 4


def test_linear_no_grad_to_grad(shared, capsys):
    code, out, _ = run(capsys, shared / "linear-nograd.pickle", shared / "linear-grad.pickle")
    assert code == 1
    assert "peak 3.94 GiB -> 4.13 GiB (+190.73 MiB, +4.7%)" in out
    assert "FAIL  device 0 peak" in out


def test_identity_is_all_same_and_passes(shared, capsys):
    path = shared / "cs336-medium-ctx256-train.pickle"
    code, data = json_diff(capsys, path, path)
    assert code == 0 and data["verdict"] == "pass"
    assert {r["status"] for r in data["devices"][0]["rows"]} == {SAME}


def test_swapping_inputs_negates_every_delta(shared):
    rules = load_rules()
    a = read_summary(str(shared / "cs336-medium-ctx128-train.pickle"), rules)
    b = read_summary(str(shared / "cs336-medium-ctx256-train.pickle"), rules)
    fwd, back = diff(a, b).devices[0], diff(b, a).devices[0]
    mirror = {NEW: GONE, GONE: NEW, GREW: SHRANK, SHRANK: GREW, SAME: SAME}
    assert back.peak_delta_bytes == -fwd.peak_delta_bytes
    assert sorted((r.signature, r.delta_bytes, r.status) for r in back.rows) == sorted(
        (r.signature, -r.delta_bytes, mirror[r.status]) for r in fwd.rows)


# --- robustness --------------------------------------------------------------------------------

def test_shifting_every_line_number_changes_nothing(shared, tmp_path, capsys):
    snap = raw(shared / "cs336-medium-ctx128-train.pickle")
    base = write(tmp_path, "base.pickle", snap)
    for f in all_frames(snap):
        if f["line"]:
            f["line"] += 7
    code, data = json_diff(capsys, base, write(tmp_path, "head.pickle", snap))
    assert code == 0
    assert {r["status"] for r in data["devices"][0]["rows"]} == {SAME}


def test_another_install_prefix_and_checkout_change_nothing(shared, tmp_path, capsys):
    snap = raw(shared / "cs336-medium-ctx128-train.pickle")
    base = write(tmp_path, "base.pickle", snap)
    for f in all_frames(snap):
        f["filename"] = (f["filename"]
                         .replace("/home/lin/cs336/assignment2-systems/.venv/lib/python3.12", "C:\\Python313\\Lib")
                         .replace("/home/lin/cs336/assignment2-systems", "D:\\ci\\checkout")
                         .replace("/", "\\"))
    code, data = json_diff(capsys, base, write(tmp_path, "head.pickle", snap))
    assert code == 0
    assert {r["status"] for r in data["devices"][0]["rows"]} == {SAME}


def test_an_edited_outer_caller_matches_by_site(tmp_path, capsys):
    inner = ["model.py:10:forward", "layers.py:30:block"]
    base = {"segments": [], "device_traces": [[alloc(i, 2**20, py_frames(*inner, "train.py:5:main")) for i in range(3)]]}
    head = {"segments": [], "device_traces": [[alloc(i, 2**20, py_frames(*inner, "train.py:9:run_epoch"))
                                               for i in range(4)]]}
    code, data = json_diff(capsys, write(tmp_path, "a.pickle", base), write(tmp_path, "b.pickle", head),
                           "--fail-over", "2MiB")
    [row] = data["devices"][0]["rows"]
    assert (row["status"], row["matched_by"], row["base_count"], row["head_count"]) == (GREW, BY_SITE, 3, 4)
    assert code == 0
    _, out, _ = run(capsys, tmp_path / "a.pickle", tmp_path / "b.pickle")
    assert "model.py:forward (matched by site)" in out


# --- the seed scenario: abandoned debug projections on a real run -------------------------------

ADAM = "/home/lin/cs336/assignment2-systems/.venv/lib/python3.12/site-packages/torch/optim/adam.py"
NATIVE = [{"name": "torch::unwind::unwind()", "filename": "??", "line": 0},
          {"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)",
           "filename": "CUDACachingAllocator.cpp", "line": 0}]


def zeros_like_frames():
    return NATIVE + [
        {"name": "at::_ops::empty_like::call(at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "at::_ops::zeros_like::call(at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "_PyEval_EvalFrameDefault", "filename": "??", "line": 0},
        {"name": "_init_group", "filename": ADAM, "line": 139},
        {"name": "step", "filename": ADAM, "line": 214},
        {"name": "main", "filename": "/home/lin/cs336/assignment2-systems/train.py", "line": 88}]


def addmm_backward_frames():
    return NATIVE + [
        {"name": "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "torch::autograd::generated::AddmmBackward0::apply(std::vector<at::Tensor>&&)", "filename": "??", "line": 0},
        {"name": "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&)", "filename": "??", "line": 0},
        {"name": "__clone", "filename": "??", "line": 0}]


def linear_forward_frames():
    site = "/home/lin/cs336/assignment2-systems/.venv/lib/python3.12/site-packages/torch/nn/modules/linear.py"
    return NATIVE + [
        {"name": "at::_ops::addmm::call(at::Tensor const&, at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "at::_ops::linear::call(at::Tensor const&, at::Tensor const&)", "filename": "??", "line": 0},
        {"name": "forward", "filename": site, "line": 125},
        {"name": "forward", "filename": "/home/lin/cs336/assignment2-systems/cs336-basics/cs336_basics/model.py",
         "line": 390}]


def inject(snap: Dict[str, Any], allocations: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Allocations at fresh addresses, made before the trace's first event and never freed."""
    out = copy.deepcopy(snap)
    out["device_traces"][0][:0] = allocations
    return out


def test_abandoned_debug_projections_are_named_exactly(shared, tmp_path, capsys):
    real = raw(shared / "cs336-medium-ctx128-train.pickle")
    fresh = 1 << 50
    state = 4 * 2**20  # one AdamW moment of a 1024x1024 fp32 projection
    opt = zeros_like_frames()  # one shared list per run, as real snapshots share them
    base = inject(real, [alloc(fresh + i * state, state, opt) for i in range(148)])
    grads, fwd = addmm_backward_frames(), linear_forward_frames()
    head = inject(real, [alloc(fresh + i * state, state, opt) for i in range(172)]
                  + [alloc(fresh + 2**40 + i * 2 * state, 2 * state, grads) for i in range(10)]
                  + [alloc(fresh + 2**41 + i * 4 * state, 4 * state, fwd) for i in range(12)])
    code, data = json_diff(capsys, write(tmp_path, "base.pickle", base), write(tmp_path, "head.pickle", head))
    rows = [r for r in data["devices"][0]["rows"] if r["status"] != SAME]
    assert [(r["status"], r["site"], r["base_count"], r["head_count"], r["base_bytes"], r["head_bytes"])
            for r in rows] == [
        (NEW, "linear.py:forward <- linear <- addmm", 0, 12, 0, 12 * 4 * state),
        (GREW, "adam.py:_init_group <- zeros_like", 148, 172, 148 * state, 172 * state),
        (NEW, "AddmmBackward0 <- mm", 0, 10, 0, 10 * 2 * state),
    ]
    assert data["devices"][0]["peak_delta_bytes"] == 48 * state + 24 * state + 20 * state
    assert code == 1


# --- the report ---------------------------------------------------------------------------------

def test_top_and_min_delta_fold_rows_but_keep_the_total(shared, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    _, out, _ = run(capsys, base, head, "--top", "3", "--min-delta", "100MiB")
    table = out.split("\n\nlike with like:")[0].split("\n\n")[-1].splitlines()
    assert len([l for l in table if l.startswith(("NEW", "GONE", "GREW", "SHRANK", "SAME"))]) == 3
    others = next(l for l in table if l.rstrip().endswith("others"))
    total = next(l for l in table if l.rstrip().endswith("TOTAL"))
    assert "+1.95 GiB" in total and "+29.8%" in total
    _, data = json_diff(capsys, base, head)
    rows = data["devices"][0]["rows"]
    assert others.rstrip().endswith(f"{len(rows) - 3} others")
    # the peaks are in different phases: the comparison the headline quotes, at head's (the forward), folds alike
    like = out.split("\n\nlike with like:")[1].split("\n\n")[2].splitlines()
    assert len([l for l in like if l.startswith(("NEW", "GONE", "GREW", "SHRANK", "SAME"))]) == 3
    assert "+2.05 GiB" in next(l for l in like if l.rstrip().endswith("TOTAL"))
    assert data["devices"][0]["like_for_like"]["at"] == "forward"


def test_markdown_report(shared, capsys):
    code, out, _ = run(capsys, shared / "linear-nograd.pickle", shared / "linear-grad.pickle", "--format", "markdown")
    assert code == 1
    assert out.startswith("### ❌ memdiff: regression\n\n**peak +190.73 MiB (+4.7%), in the forward: input +190.73 MiB")
    assert "#### device 0: peak 3.94 GiB -> 4.13 GiB (+190.73 MiB, +4.7%)" in out
    assert "| 🆕 NEW " in out and "profile_grad.py:\\<module> <- randn" in out
    assert "**Rule:** fail when the peak of a device grows by more than 1% and by more than 64.00 MiB" in out
    assert "```mermaid\nxychart-beta" in out and out.count("    line [") == 2


def test_a_markdown_report_of_a_run_against_itself_folds_no_empty_stacks(shared, capsys):
    # No group changed, so no row has a stack to show: the job summary held an empty
    # "Stacks of the rows above" fold that a reviewer opened for nothing.
    code, out, _ = run(capsys, shared / "linear-grad.pickle", shared / "linear-grad.pickle", "--format", "markdown")
    assert code == 0 and "| TOTAL" in out
    assert "Stacks of the rows above" not in out
    code, out, _ = run(capsys, shared / "linear-nograd.pickle", shared / "linear-grad.pickle", "--format", "markdown")
    assert out.count("<details><summary>Stacks of the rows above</summary>") == 1


def test_a_summary_json_stands_in_for_its_snapshot(shared, tmp_path, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    summary = tmp_path / "base.json"
    assert main(["summarize", str(base), "-o", str(summary)]) == 0
    capsys.readouterr()
    from_pickles = json_diff(capsys, base, head)[1]
    from_summary = json_diff(capsys, summary, head)[1]
    assert from_summary["devices"] == from_pickles["devices"]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_a_summary_saved_with_a_byte_order_mark_is_read(shared, tmp_path, capsys, encoding):
    # A Windows editor saves UTF-8 with a BOM, Windows PowerShell's `>` writes UTF-16: such a summary
    # read as 'neither a pickle, JSON, gzip, bz2 nor xz', where a baseline saved so was read.
    run = shared / "linear-grad.pickle"
    summary = tmp_path / "run.json"
    assert main(["summarize", str(run), "-o", str(summary)]) == 0
    summary.write_bytes(summary.read_text(encoding="utf-8").encode(encoding))
    capsys.readouterr()
    code, data = json_diff(capsys, summary, run)
    assert code == 0 and data["devices"][0]["base_peak_bytes"] == data["devices"][0]["head_peak_bytes"] == 4434803008


def test_a_run_without_a_trace_is_not_judged_against_a_traced_one(shared, tmp_path, capsys):
    # The same training run dumped with memory history off: only what was live at the dump
    # (6.34 GiB) is in it, not the AdamW step's temporaries that made the traced peak (6.53 GiB).
    # It read as "no regression: peak -195.31 MiB", exit 0, and the other way round as a regression.
    traced = shared / "cs336-medium-ctx128-train.pickle"
    raw = pickle.loads(traced.read_bytes())
    raw["device_traces"] = [[] for _ in raw["device_traces"]]
    dumped = write(tmp_path, "dumped.pickle", raw)
    summary = tmp_path / "dumped.json"
    assert main(["summarize", dumped, "-o", str(summary)]) == 0
    capsys.readouterr()
    for base, head, untraced, other in ((traced, dumped, "head (dumped.pickle)", "base"),
                                        (dumped, traced, "base (dumped.pickle)", "head"),
                                        (traced, summary, "head (dumped.pickle)", "base")):
        for flags in ([], ["--format", "json"], ["--format", "markdown"]):
            code, out, err = run(capsys, base, head, *flags)
            assert code == 2 and out == "" and err.count("\n") == 1, err
            assert f"the {untraced} has no trace on device 0 and the {other} " in err, err
    # Two runs dumped alike compare what each held at its dump.
    assert run(capsys, dumped, summary)[0] == 0


def test_runs_that_do_not_compare_are_flagged(tmp_path, capsys):
    frames = py_frames("model.py:1:forward")
    base = {"segments": [], "device_traces": [[alloc(1, 100, frames)]],
            "allocator_settings": {"expandable_segments": False}}
    head = {"segments": [], "device_traces": [[{"action": "free_completed", "addr": 9, "size": 5, "frames": frames},
                                               alloc(1, 100, frames)], [alloc(1, 10, frames)]],
            # A newer torch writes a setting the older did not: not recorded, not None (it read `None -> False`).
            "allocator_settings": {"expandable_segments": True, "graph_capture_record_stream_reuse": False}}
    _, data = json_diff(capsys, write(tmp_path, "a.pickle", base), write(tmp_path, "b.pickle", head))
    assert data["warnings"] == [  # in the report's one order: by code (T003, T005, T008), as every output shows them
        "device 0: only the head trace starts mid-run (its ring buffer dropped events), so its static memory "
        "includes what the other run shows as allocations",
        "devices differ: base has [0], head has [0, 1]",
        "allocator settings differ (expandable_segments: False -> True, graph_capture_record_stream_reuse: "
        "not recorded -> False)",
    ]


def test_a_trace_that_overflowed_its_ring_buffer_is_said_in_peak_and_warned_in_the_diff(tmp_path, capsys):
    # torch 2.12+ says so in allocator_settings when the ring buffer of max_entries wrapped.
    frames = py_frames("model.py:1:forward")
    settings = {"expandable_segments": False, "trace_alloc_max_entries": 2, "trace_alloc_overflowed": False}
    base = {"segments": [], "device_traces": [[alloc(1, 100, frames)]], "allocator_settings": settings}
    head = {"segments": [], "device_traces": [[{"action": "free_completed", "addr": 9, "size": 5, "frames": frames},
                                               alloc(1, 100, frames)]],
            "allocator_settings": dict(settings, trace_alloc_overflowed=True)}
    b, h = write(tmp_path, "a.pickle", base), write(tmp_path, "b.pickle", head)
    said = ("the trace overflowed its ring buffer of 2 entries: its first events are gone, so memory allocated "
            "before them counts as static and their stacks are unknown (record with a larger max_entries)")
    page = tmp_path / "peak.html"
    code, out, _ = run(capsys, "peak", h, "--html", page)
    assert code == 0 and f"warning: T001 {said}" in out.splitlines() and BY_CODE["T001"].example_output in out
    # The page shows what the text shows of the run as a whole (it showed only each device's findings).
    assert f'<a class="mono" href="#rule-t001">T001</a> {said}</p>' in page.read_text()
    assert "overflowed" not in run(capsys, "peak", b)[1]
    _, data = json_diff(capsys, b, h)
    # Named once, as what it is; never as allocator settings that differ.
    assert data["warnings"][0] == f"head: {said}"
    assert not any("allocator settings differ" in w for w in data["warnings"])
    assert [(f["code"], f["run"], f["message"], f["data"].get("max_entries")) for f in data["findings"]] == \
        [("T001", "head", said, 2), ("T003", None, "only the head trace starts mid-run (its ring buffer dropped events), "
                                     "so its static memory includes what the other run shows as allocations", None)]


# --- the rule and exit codes ---------------------------------------------------------------------

def peak_pair(tmp_path, base_bytes, head_bytes):
    f = py_frames("model.py:1:forward")
    return (write(tmp_path, "a.pickle", {"segments": [], "device_traces": [[alloc(1, base_bytes, f)]]}),
            write(tmp_path, "b.pickle", {"segments": [], "device_traces": [[alloc(1, head_bytes, f)]]}))


@pytest.mark.parametrize("flags, base, head, code", [
    (["--fail-over", "1MiB"], 10 * 2**20, 11 * 2**20, 0),              # exactly at the limit
    (["--fail-over", "1MiB"], 10 * 2**20, 11 * 2**20 + 1, 1),          # one byte over
    (["--fail-over-pct", "10"], 1000, 1100, 0),
    (["--fail-over-pct", "10"], 1000, 1101, 1),
    (["--fail-over-pct", "0.5"], 2000, 2010, 0),
    (["--fail-over-pct", "0.5"], 2000, 2011, 1),
    (["--fail-over", "200B", "--fail-over-pct", "10"], 1000, 1101, 0),  # pct over, bytes not: both needed
    (["--fail-over", "50B", "--fail-over-pct", "10"], 1000, 1060, 0),   # bytes over, pct not
    (["--fail-over", "50B", "--fail-over-pct", "10"], 1000, 1101, 1),   # both over
    ([], 100 * 2**30, 101 * 2**30, 0),                                  # default: exactly 1% is not over it
    ([], 100 * 2**30, 101 * 2**30 + 1, 1),                              # 1% and 64 MiB both exceeded
    ([], 100 * 2**30, 100 * 2**30 + 65 * 2**20, 0),                     # 64 MiB exceeded, 1% not
    ([], 2**30, 2**30 + 64 * 2**20 + 1, 1),
    ([], 2**30, 2**30 + 64 * 2**20, 0),
    ([], 4 * 2**30, 3 * 2**30, 0),                                      # shrinking never fails
])
def test_peak_rule_boundaries(tmp_path, capsys, flags, base, head, code):
    a, b = peak_pair(tmp_path, base, head)
    got, data = json_diff(capsys, a, b, *flags)
    assert got == code and data["verdict"] == ("pass" if code == 0 else "fail")


def test_the_rule_applied_is_printed(tmp_path, capsys):
    a, b = peak_pair(tmp_path, 1000, 2000)
    _, out, _ = run(capsys, a, b, "--fail-over", "0.5GiB")
    assert "rule: fail when the peak of a device grows by more than 512.00 MiB" in out
    assert "PASS  device 0 peak: 1000 B -> 1.95 KiB, +1000 B (+100.0%), limit: more than 512.00 MiB" in out
    assert Thresholds(Limit.from_options(None, None)).describe() == (
        "fail when the peak of a device grows by more than 1% and by more than 64.00 MiB, or by more than 50%; "
        "findings K003, K004, A002, P002 fail (default)")


@pytest.mark.parametrize("base_bytes, head_bytes, fails", [
    (1_572_864, 16 * 1_572_864, True),  # a 1.5 MiB test grown 16x (Linear(256) -> Linear(1024))
    (1_572_864, 2 * 1_572_864, True),  # a doubling, at any size
    (80 << 30, 160 << 30, True),
    (1_572_864, 1_572_864, False),  # an identical rerun
    (1_572_864, 1_572_864 + 512, False),  # one more allocator block of rounding
    (100 << 20, 140 << 20, False),  # +40%, under 64 MiB: small runs get room to move
    (10 << 30, (10 << 30) + (200 << 20), True),  # +200 MiB, +2%: as before on large runs
    (10 << 30, (10 << 30) + (80 << 20), False),  # +80 MiB but +0.8%: under 1%, as before
])
def test_the_default_rule_scales_with_the_run(tmp_path, capsys, base_bytes, head_bytes, fails):
    # The same rule the report prints is the one applied, from the pytest size of a test to a GPU's.
    a, b = peak_pair(tmp_path, base_bytes, head_bytes)
    code, out, _ = run(capsys, a, b)
    assert code == (1 if fails else 0)
    assert "rule: fail when the peak of a device grows by more than 1% and by more than 64.00 MiB, or by more " \
           "than 50%" in out


@pytest.mark.parametrize("flags, message", [
    (["--fail-over", "5 parsecs"], "argument --fail-over: '5 parsecs' is not a size"),
    (["--fail-over-pct", "-3"], "argument --fail-over-pct: '-3' is not a percentage: it is negative"),
    (["--fail-over-pct", "٥"], "argument --fail-over-pct: '٥' is not a percentage (digits 0-9, as in 2.5 or 5%)"),
    (["--top", "0"], "argument --top: 0 is not a positive count"),
])
def test_bad_flags_exit_2(tmp_path, capsys, flags, message):
    a, b = peak_pair(tmp_path, 1, 2)
    with pytest.raises(SystemExit) as e:
        main([a, b, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.update(schema_version=99), "summary schema_version 99 is not one this memdiff reads (1 or 2); re-create it with `memdiff summarize`"),
    (lambda s: s["devices"][0].update(peak_bytes="lots"), "not a valid memdiff summary: devices.0.peak_bytes: a value of type string, where the schema wants integer"),
])
def test_a_broken_summary_input_exits_2(tmp_path, capsys, mutate, message):
    a, b = peak_pair(tmp_path, 1, 2)
    assert main(["summarize", a, "-o", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    mutate(data)
    (tmp_path / "s.json").write_text(json.dumps(data))
    code, out, err = run(capsys, tmp_path / "s.json", b)
    assert code == 2 and out == ""
    assert err == f"memdiff: {tmp_path / 's.json'}: {message}\n"


def test_explicit_diff_command_and_debug_before_it(tmp_path, capsys):
    a, b = peak_pair(tmp_path, 1000, 1001)
    assert main(["diff", a, b]) == 0
    assert main(["--debug", a, b]) == 0
    capsys.readouterr()
    assert main(["--debug", a, str(tmp_path / "missing.pickle")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_snapshots_from_different_torch_versions_are_flagged(shared, capsys):
    # cs336-ctx128-fwd-fp32 predates compile_context and user_metadata; ctx128-infer has them.
    _, data = json_diff(capsys, shared / "cs336-ctx128-fwd-fp32.pickle", shared / "cs336-medium-ctx128-infer.pickle")
    assert ("snapshot keys differ, so the torch versions may too (only head has trace.compile_context, "
            "trace.user_metadata)") in data["warnings"]


def test_a_site_key_keeps_as_many_callers_with_module_frames_between_them():
    # CPU captures put the profiler's `nn.Module: X` frames between the Python ones; the key must
    # count callers among the frames it keeps, or it keeps one caller too many per module frame.
    from memdiff.compare.differ import _site_key
    from memdiff.model import Frame, Group

    def group(*names):
        frames = [Frame("none", 0, n) if n.startswith("nn.Module: ") else Frame(f"{n}.py", 1, n) for n in names]
        return Group("sig", "linear.py:forward <- linear", frames, 1, 64, "activation")
    plain = group("linear", "block", "model", "train")
    nested = group("linear", "nn.Module: Linear_0", "block", "nn.Module: Block_1", "model", "train")
    for callers in (0, 1, 2):
        assert _site_key(callers)(nested) == _site_key(callers)(plain)
    assert _site_key(1)(nested)[2:] == (("linear.py", "linear"), ("block.py", "block"))


def test_a_context_never_names_line_0():
    from memdiff.compare.differ import context_of
    from memdiff.model import Frame

    assert context_of([Frame("train.py", 0, "<module>")]) == "train.py"
    assert context_of([Frame("model.py", 12, "forward")]) == "model.py:12"
