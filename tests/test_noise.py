"""Baselines from repeated runs (their measured spread gates), and the caching allocator's reserved memory."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest
from conftest import alloc, block, cli, free, py_frames, segment, weights_and_activations

from memdiff.analyse.classify import load_rules
from memdiff.compare.baseline import _stored_summary, comparable_pair, read_baseline
from memdiff.compare.findings import BY_CODE
from memdiff.read.inputs import read_summary
from memdiff.report.build import Run, Settings, compare

MiB = 2**20
INIT = py_frames("model.py:3:__init__", "train.py:4:<module>")
FWD = py_frames("site-packages/torch/nn/modules/linear.py:125:forward", "model.py:9:forward", "train.py:8:<module>")
CUDA = Path(__file__).parent / "data" / "cuda"
REPO = Path(__file__).resolve().parent.parent



def snapshot(path: Path, activation: int, parameter: int = 100 * MiB) -> Path:
    return weights_and_activations(path, activation, parameter, forward=FWD)


run = cli


def repeats(tmp_path: Path, capsys, *flags, activations=(100 * MiB, 104 * MiB, 102 * MiB)) -> Path:
    runs = [snapshot(tmp_path / f"run{k}.pickle", a) for k, a in enumerate(activations)]
    code, _, err = run(capsys, "baseline", *runs, "-o", tmp_path / "b.json", *flags)
    assert code == 0, err
    return tmp_path / "b.json"


# --- the spread and its limit, by hand --------------------------------------------------------

def test_a_baseline_of_repeats_stores_the_median_run_and_the_spread(tmp_path, capsys):
    path = repeats(tmp_path, capsys)
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2
    device = doc["devices"][0]
    # The runs peak at 200, 204 and 202 MiB: the median run (202 MiB) is stored.
    assert device["peak_bytes"] == 202 * MiB and doc["source"]["file"].endswith("run2.pickle")
    assert device["spread"]["runs"] == 3
    assert device["spread"]["peak"] == {"min": 200 * MiB, "max": 204 * MiB, "median": 202 * MiB}
    assert device["spread"]["categories"]["activation"] == {"min": 100 * MiB, "max": 104 * MiB, "median": 102 * MiB}
    assert device["spread"]["categories"]["parameter"] == {"min": 100 * MiB, "max": 100 * MiB, "median": 100 * MiB}


@pytest.mark.parametrize("flags, allowed", [
    # Past the highest run (204 MiB, 2 MiB over the stored 202) by 1% of 202 MiB, rounded down.
    ([], 2 * MiB + (202 * MiB) // 100),
    (["--noise-margin", "1MiB"], 3 * MiB),
    (["--noise-margin", "0%"], 2 * MiB),  # never tighter than the measured spread
])
def test_the_default_rule_over_repeats_is_the_spread_plus_the_margin(tmp_path, capsys, flags, allowed):
    path = repeats(tmp_path, capsys, *flags)
    for extra, expected in ((allowed, 0), (allowed + 1, 1)):
        head = snapshot(tmp_path / "head.pickle", 102 * MiB + extra)
        code, out, err = run(capsys, "gate", head, "--baseline", path)
        assert code == expected, out + err
    assert "grows past the highest of the baseline's 3 runs" in out


def test_a_run_inside_the_spread_says_so_and_passes(tmp_path, capsys):
    path = repeats(tmp_path, capsys)
    head = snapshot(tmp_path / "head.pickle", 103 * MiB)
    code, out, _ = run(capsys, "gate", head, "--baseline", path)
    assert code == 0
    # +1 MiB over 202 MiB is +0.5%; the runs span 200 to 204 MiB: -1.0% to +1.0% of it.
    assert "peak +1.00 MiB (+0.5%) (within the spread of 3 runs, -1.0% to +1.0%)" in out.splitlines()[0]
    assert "measured noise: peak +0.5%: within the spread of 3 runs, -1.0% to +1.0% (200.00 MiB to 204.00 MiB)" in out
    assert ("note: G001 device 0: the peak's change (+0.5%) is within the spread of the baseline's 3 runs "
            "(-1.0% to +1.0%)") in out.splitlines() and BY_CODE["G001"].example_output in out


def test_the_api_gates_with_the_spread_as_the_cli_does(tmp_path, capsys):
    import memdiff

    path = repeats(tmp_path, capsys)
    head = snapshot(tmp_path / "head.pickle", 103 * MiB)
    report = memdiff.gate(str(head), str(path))
    code, out, _ = run(capsys, "gate", head, "--baseline", path)
    assert report.passed and code == 0 and report.headline in out
    assert report.devices[0].noise is not None and report.devices[0].noise in out


def test_an_explicit_peak_limit_replaces_the_noise_rule(tmp_path, capsys):
    path = repeats(tmp_path, capsys)
    head = snapshot(tmp_path / "head.pickle", 103 * MiB)
    code, out, _ = run(capsys, "gate", head, "--baseline", path, "--fail-over", "512KiB")
    assert code == 1 and "limit: more than 512.00 KiB" in out


def test_zero_spread_keeps_the_default_rule(tmp_path, capsys):
    """The two identical CUDA base runs: a baseline of both gates exactly as a baseline of one."""
    base, again = CUDA / "gpt2-base.pickle.gz", CUDA / "gpt2-base-again.pickle.gz"
    assert run(capsys, "baseline", base, again, "-o", tmp_path / "two.json")[0] == 0
    assert run(capsys, "baseline", base, "-o", tmp_path / "one.json")[0] == 0
    # one peak, no spread: the one-run form, version 1, as docs/baselines.md says
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["schema_version"] == 1 and "spread" not in two["devices"][0]
    verdicts = []
    for name in ("two", "one"):
        code, out, _ = run(capsys, "gate", CUDA / "gpt2-batch8.pickle.gz", "--baseline", tmp_path / f"{name}.json",
                           "--format", "json")
        doc = json.loads(out)[0]
        verdicts.append((code, doc["verdict"], doc["rule"], [(c["subject"], c["limit"], c["passed"])
                                                             for c in doc["checks"]]))
    assert verdicts[0] == verdicts[1] and verdicts[0][0] == 1


def test_the_committed_old_baseline_still_gates_as_before(capsys):
    """baselines/gpt-cpu.json was written before spreads: version 1, no spread, the stored rule."""
    path = REPO / "baselines" / "gpt-cpu.json"
    assert json.loads(path.read_text())["schema_version"] == 1
    b = read_baseline(str(path))
    assert b.spreads() == {}
    stored = _stored_summary(b)
    grown = stored.devices[0]
    grown.peak_bytes += 64 * MiB + 1  # over 64 MiB and over 1% of 80.85 MiB: fails the stored default rule
    base, head = comparable_pair(str(path), b, stored)
    with_spreads = compare([Run(base)], [Run(head)], Settings(thresholds=b.thresholds, spreads=b.spreads()))
    without = compare([Run(base)], [Run(head)], Settings(thresholds=b.thresholds))
    assert with_spreads.verdict == without.verdict
    assert with_spreads.rule == b.thresholds.describe() and with_spreads.passed is False
    assert all(d.noise is None for d in with_spreads.devices)
    assert run(capsys, "baseline", "--check", path)[0] == 0


def test_repeats_need_the_same_devices(tmp_path, capsys, write_snapshot):
    one = snapshot(tmp_path / "a.pickle", MiB)
    other = write_snapshot({"segments": [], "device_traces": [[], [alloc(1, MiB, INIT)]]}, "b.pickle")
    code, _, err = run(capsys, "baseline", one, other, "-o", tmp_path / "b.json")
    assert code == 2 and "same devices" in err and not (tmp_path / "b.json").exists()


def test_the_same_file_twice_is_not_two_repeats(tmp_path, capsys):
    one = snapshot(tmp_path / "a.pickle", MiB)
    other = snapshot(tmp_path / "b.pickle", 2 * MiB)
    code, _, err = run(capsys, "baseline", one, other, tmp_path / "." / "a.pickle", "-o", tmp_path / "b.json")
    assert code == 2 and "given twice" in err and err.count("\n") == 1 and not (tmp_path / "b.json").exists()


OPT = py_frames("site-packages/torch/optim/adam.py:1:step", "train.py:9:<module>")
BWD = py_frames("site-packages/torch/autograd/__init__.py:1:backward", "train.py:10:<module>")


def training(path: Path, activations) -> Path:
    """A training loop, one step per activation size: weights, the forward's activations, a
    gradient in the backward, an optimizer temporary."""
    trace = [alloc(1, 100 * MiB, INIT)]
    for k, a in enumerate(activations):
        act, grad, tmp = 10 + 3 * k, 11 + 3 * k, 12 + 3 * k
        trace += [alloc(act, a, FWD), alloc(grad, 100 * MiB, BWD), free(act, a, BWD),
                  alloc(tmp, MiB, OPT), free(tmp, MiB, OPT), free(grad, 100 * MiB, OPT)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, 4))
    return path


def test_runs_of_other_sizes_are_not_repeats(tmp_path, capsys):
    # Each run's steps peak alike, yet the runs differ by 20%: not the workload's noise.
    fixed = [training(tmp_path / f"fixed{k}.pickle", [a] * 3) for k, a in enumerate((100 * MiB, 140 * MiB))]
    code, _, err = run(capsys, "baseline", *fixed, "-o", tmp_path / "b.json")
    assert code == 2 and "not repeats of one workload" in err and err.count("\n") == 1
    # A loop whose steps vary with the data may spread as much between runs.
    varying = [training(tmp_path / f"var{k}.pickle", [100 * MiB, a, 100 * MiB])
               for k, a in enumerate((120 * MiB, 160 * MiB))]
    code, _, err = run(capsys, "baseline", *varying, "-o", tmp_path / "b.json")
    assert code == 0, err
    assert json.loads((tmp_path / "b.json").read_text())["schema_version"] == 2
    # Runs without steps show nothing either way: their spread is taken as given.
    loose = []
    for k, size in enumerate((100 * MiB, 150 * MiB)):
        loose.append(tmp_path / f"loose{k}.pickle")
        loose[-1].write_bytes(pickle.dumps({"segments": [], "device_traces": [[alloc(1, size)]]}, 4))
    code, _, err = run(capsys, "baseline", *loose, "-o", tmp_path / "d.json")
    assert code == 0, err
    # A run without a training step beside training runs
    infer = snapshot(tmp_path / "infer.pickle", 100 * MiB)
    code, _, err = run(capsys, "baseline", varying[0], infer, "-o", tmp_path / "c.json")
    assert code == 2 and "not a repeat of var0.pickle: device 0 has 1 step, var0.pickle has 3" in err


def test_real_runs_of_two_contexts_or_train_and_infer_are_not_repeats(shared, tmp_path, capsys):
    ctx128, ctx256, infer = (shared / f"cs336-medium-{n}.pickle" for n in ("ctx128-train", "ctx256-train",
                                                                           "ctx128-infer"))
    code, _, err = run(capsys, "baseline", ctx128, ctx256, "-o", tmp_path / "b.json")
    assert code == 2 and "not repeats of one workload" in err and "29.8%" in err
    code, _, err = run(capsys, "baseline", ctx128, infer, "-o", tmp_path / "b.json")
    assert code == 2 and "not a repeat of cs336-medium-ctx128-train.pickle" in err
    assert not (tmp_path / "b.json").exists()


# --- real repeats: a loop whose memory depends on the data --------------------------------------

@pytest.mark.slow
def test_real_repeats_gate_with_their_measured_spread(scenarios, tmp_path, capsys):
    """Three CPU captures of one GPT-2 loop, each batch its own sequence length (a different seed
    per run): the peaks differ, so the spread is real."""
    runs = scenarios("gpt2-repeat-1", "gpt2-repeat-2", "gpt2-repeat-3", "gpt2-batch2x")
    repeat_paths = [runs[f"gpt2-repeat-{k}"] for k in (1, 2, 3)]
    rules = load_rules([], None)
    peaks = sorted(read_summary(str(p), rules).devices[0].peak_bytes for p in repeat_paths)
    assert peaks[0] < peaks[-1]
    code, _, err = run(capsys, "baseline", *repeat_paths, "-o", tmp_path / "b.json")
    assert code == 0, err
    device = json.loads((tmp_path / "b.json").read_text())["devices"][0]
    assert device["spread"]["peak"] == {"min": peaks[0], "max": peaks[2], "median": peaks[1]}
    assert device["peak_bytes"] == peaks[1]
    for p in repeat_paths:  # every repeat passes against the baseline of all three
        code, out, _ = run(capsys, "gate", p, "--baseline", tmp_path / "b.json")
        assert code == 0, out
        assert "within the spread of 3 runs" in out
    code, out, _ = run(capsys, "gate", runs["gpt2-batch2x"], "--baseline", tmp_path / "b.json")
    assert code == 1 and "beyond the spread of 3 runs" in out


# --- reserved beside allocated ------------------------------------------------------------------

def _segmented(write_snapshot, name: str, segments: int) -> str:
    """A run that allocates and frees the same 1 MiB twice; the allocator holds `segments` 2 MiB
    segments (made in the trace), all free at the dump."""
    trace = [alloc(0x1000, MiB, FWD), free(0x1000, MiB, FWD), alloc(0x1000, MiB, FWD), free(0x1000, MiB, FWD)]
    made = [{"action": "segment_alloc", "addr": 0x100000 * (k + 1), "size": 2 * MiB, "stream": 0, "frames": []}
            for k in range(segments)]
    segs = [segment(0, 0x100000 * (k + 1), [block(0x100000 * (k + 1), 2 * MiB, "inactive")]) for k in range(segments)]
    return write_snapshot({"segments": segs, "device_traces": [made + trace]}, name)


def test_reserved_moves_while_allocated_does_not(write_snapshot, capsys):
    base, head = _segmented(write_snapshot, "base.pickle", 1), _segmented(write_snapshot, "head.pickle", 3)
    rules = load_rules([], None)
    b = read_summary(base, rules).devices[0]
    assert (b.peak_bytes, b.reserved_peak_bytes, b.fragmentation_bytes) == (MiB, 2 * MiB, MiB)
    code, out, _ = run(capsys, base, head)
    assert code == 0
    assert ("reserved by the caching allocator: peak 2.00 MiB -> 6.00 MiB, +4.00 MiB (+200.0%); fragmentation at the "
            "peak (reserved minus allocated) 1.00 MiB -> 5.00 MiB") in out
    # Why reserved moved is a finding of its own, under its code.
    assert ("note: A001 device 0: reserved moved while the allocated peak is unchanged: the tensors need the same "
            "memory, and the allocator caches more blocks no tensor holds (its pool's history: the order of "
            "allocations and frees, block sizes, streams). The gate judges allocated memory; --reserved-fail-over "
            "gates reserved memory too.") in out.splitlines() and BY_CODE["A001"].example_output in out
    code, out, _ = run(capsys, base, head, "--reserved-fail-over", "50%")
    assert code == 1 and "FAIL  device 0 reserved peak: 2.00 MiB -> 6.00 MiB" in out


def test_a_baseline_keeps_reserved_and_the_gate_can_limit_it(write_snapshot, tmp_path, capsys):
    base, head = _segmented(write_snapshot, "base.pickle", 1), _segmented(write_snapshot, "head.pickle", 2)
    assert run(capsys, "baseline", base, "-o", tmp_path / "b.json", "--reserved-fail-over", "2MiB")[0] == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["devices"][0]["reserved_peak_bytes"] == 2 * MiB and doc["devices"][0]["fragmentation_bytes"] == MiB
    assert doc["thresholds"]["reserved"] == {"fail-over": "2MiB"}
    code, out, _ = run(capsys, "gate", head, "--baseline", tmp_path / "b.json")
    assert code == 0, out  # exactly 2 MiB more reserved: at the limit
    code, out, _ = run(capsys, "gate", _segmented(write_snapshot, "h3.pickle", 3), "--baseline", tmp_path / "b.json")
    assert code == 1 and "FAIL  device 0 reserved peak" in out


def test_a_reserved_limit_on_a_run_without_segments_is_bad_input(tmp_path, capsys):
    a, b = snapshot(tmp_path / "a.pickle", MiB), snapshot(tmp_path / "b.pickle", MiB)
    code, _, err = run(capsys, a, b, "--reserved-fail-over", "1MiB")
    assert code == 2 and "no allocator segments" in err


def test_reserved_on_a_real_cuda_run():
    """gpt2-base frees no segment (no empty_cache): its reserved peak is the dump's segments' total."""
    raw = pickle.loads(gzip.decompress((CUDA / "gpt2-base.pickle.gz").read_bytes()))
    assert not any(e["action"] in ("segment_free", "segment_unmap") for e in raw["device_traces"][0])
    d = read_summary(str(CUDA / "gpt2-base.pickle.gz"), load_rules([], None)).devices[0]
    assert d.reserved_peak_bytes == sum(s["total_size"] for s in raw["segments"])
    # Segments made after the peak did not exist at the peak.
    made_after = sum(e["size"] for e in raw["device_traces"][0][d.peak_event_index + 1:]
                     if e["action"] == "segment_alloc")
    assert d.fragmentation_bytes == d.reserved_peak_bytes - made_after - d.peak_bytes


@pytest.mark.slow  # three child processes that import torch
def test_record_repeat_makes_repeats_a_baseline_reads(torch, tmp_path, capsys):
    """A script whose memory depends on its data: each run reads how many it follows from a file."""
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text("import pathlib, torch\nf = pathlib.Path('runs.txt')\nk = int(f.read_text()) if f.exists() else 0\n"
                      "f.write_text(str(k + 1))\nkeep = torch.zeros(4096 * (k + 1))\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", "runs/loop.pickle", "--repeat", "3", "--",
                           "python", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    paths = [tmp_path / "runs" / f"loop-{k}.pickle" for k in (1, 2, 3)]
    assert all(p.exists() for p in paths) and not (tmp_path / "runs" / "loop.pickle").exists()
    assert "memdiff baseline runs/loop-1.pickle runs/loop-2.pickle runs/loop-3.pickle -o baselines/loop.json" \
        in done.stderr
    rules = load_rules([], None)
    peaks = [read_summary(str(p), rules).devices[0].peak_bytes for p in paths]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3  # each run kept 16 KiB more: a real spread
    assert run(capsys, "baseline", *paths, "-o", tmp_path / "b.json")[0] == 0
    spread = json.loads((tmp_path / "b.json").read_text())["devices"][0]["spread"]["peak"]
    assert spread == {"min": peaks[0], "max": peaks[2], "median": peaks[1]}


def test_a_noise_margin_on_a_baseline_without_a_spread_says_it_gates_nothing(shared, tmp_path, capsys):
    """`--noise-margin 5%` on one run was stored and silently had no effect (the default rule gates a baseline
    without a spread): the write says so now."""
    from memdiff.cli import main

    out = str(tmp_path / "b.json")
    assert main(["baseline", str(shared / "linear-grad.pickle"), "-o", out, "--noise-margin", "5%"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1].startswith("memdiff: note: --noise-margin is kept in the thresholds but gates "
                                               "nothing here")
    assert json.loads(Path(out).read_text())["thresholds"]["noise-margin"] == {"fail-over-pct": 5.0}
    assert "spread" not in json.loads(Path(out).read_text())["devices"][0]
    assert main(["baseline", str(shared / "linear-grad.pickle"), "-o", str(tmp_path / "c.json")]) == 0
    assert len(capsys.readouterr().err.splitlines()) == 1  # no margin given: nothing to say


def test_a_gate_says_when_its_noise_margin_gates_nothing(tmp_path, capsys):
    """`gate --noise-margin 5%` against a baseline of one run (no spread: the H100 GPT-2 run) judged the peak by
    the default rule and said nothing of the margin; every output shows G012 now. Over repeats whose peaks
    differ the margin is the rule, and nothing is said."""
    one = tmp_path / "one.json"
    assert run(capsys, "baseline", CUDA / "gpt2-base.pickle.gz", "-o", one)[0] == 0
    head = CUDA / "gpt2-base-again.pickle.gz"
    line = BY_CODE["G012"].example_output
    code, out, _ = run(capsys, "gate", head, "--baseline", one, "--noise-margin", "5%")
    assert code == 0 and line in out.splitlines()
    code, out, _ = run(capsys, "gate", head, "--baseline", one, "--noise-margin", "5%", "--format", "markdown")
    assert code == 0 and "G012" in out and "the noise margin (5%) gates nothing" in out
    code, out, _ = run(capsys, "gate", head, "--baseline", one, "--noise-margin", "5%", "--format", "json")
    found = [n for n in json.loads(out)[0]["notes"] if "noise margin" in n]  # the judge's findings' sentences
    assert code == 0 and len(found) == 1 and line.endswith(found[0])
    # A limit of the peak's own replaces the rule the margin widens: said so.
    code, out, _ = run(capsys, "gate", head, "--baseline", one, "--noise-margin", "5%", "--fail-over", "1GiB")
    assert code == 0 and "G012 device 0: the noise margin (5%) gates nothing: the peak has a limit of its own" in out
    # No margin set: nothing to say; over repeats that differ, the margin gates.
    assert "G012" not in run(capsys, "gate", head, "--baseline", one)[1]
    spread = repeats(tmp_path, capsys)
    code, out, _ = run(capsys, "gate", snapshot(tmp_path / "head.pickle", 103 * MiB), "--baseline", spread,
                       "--noise-margin", "5%")
    assert code == 0 and "G012" not in out


def test_the_report_file_and_the_comment_keep_the_noise_and_reserved_lines(tmp_path, write_snapshot, capsys):
    # --report, the job summary and the sticky comment render the report refolded to fit GitHub's limit;
    # refolding rebuilt each device and dropped what the report adds to it: where the peak's change falls
    # in the repeats' spread, and the caching allocator's reserved memory, which --format markdown shows.
    b = repeats(tmp_path, capsys)
    head = snapshot(tmp_path / "head.pickle", 103 * MiB)
    report = tmp_path / "r.md"
    code, shown, _ = run(capsys, "gate", head, "--baseline", b, "--format", "markdown", "--report", report)
    assert code == 0 and "within the spread of 3 runs" in shown and report.read_text() == shown
    base, more = _segmented(write_snapshot, "base.pickle", 1), _segmented(write_snapshot, "more.pickle", 3)
    code, shown, _ = run(capsys, base, more, "--format", "markdown", "--report", report)
    assert code == 0 and "reserved by the caching allocator: peak 2.00 MiB -> 6.00 MiB" in shown
    assert report.read_text() == shown
