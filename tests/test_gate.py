"""Baselines and `memdiff gate`: thresholds at their boundaries, failure paths, atomic updates."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from unittest import mock

import pytest
from conftest import ROOT, block, cli, segment, weights_and_activations

import memdiff
from memdiff.cli import main
from memdiff.compare.findings import BY_CODE
from memdiff.errors import InputError
from memdiff.render import render

MiB = 2**20



def snapshot(path: Path, activation: int, parameter: int = 100 * MiB) -> Path:
    return weights_and_activations(path, activation, parameter)


run = cli


@pytest.fixture
def baseline(tmp_path, capsys):
    """baselines/train.json of a run with 100 MiB of weights and 100 MiB of activations."""
    folder = tmp_path / "baselines"
    folder.mkdir()

    def make(*flags, activation=100 * MiB):
        snap = snapshot(tmp_path / "base.pickle", activation)
        code, _, err = run(capsys, "baseline", snap, "-o", folder / "train.json", *flags)
        assert code == 0, err
        return folder / "train.json"
    return make


def gate(capsys, tmp_path, baseline_file, activation, *flags):
    head = snapshot(tmp_path / "train.pickle", activation)
    return run(capsys, "gate", head, "--baseline", baseline_file, *flags)


# --- boundaries: exactly at a limit passes, one byte over fails ---------------------------------

@pytest.mark.parametrize("flags, at_limit", [
    (["--fail-over", "10MiB"], 10 * MiB),                              # absolute
    (["--fail-over-pct", "5"], 10 * MiB),                              # 5% of the 200 MiB peak
    (["--fail-over", "4MiB", "--fail-over-pct", "5"], 10 * MiB),       # both: the larger binds
    (["--fail-over", "12MiB", "--fail-over-pct", "5"], 12 * MiB),
    (["--category-fail-over", "activation=3MiB", "--fail-over", "1GiB"], 3 * MiB),
    (["--category-fail-over", "activation=20%", "--fail-over", "1GiB"], 20 * MiB),
])
def test_threshold_boundaries(baseline, tmp_path, capsys, flags, at_limit):
    b = baseline(*flags)
    assert gate(capsys, tmp_path, b, 100 * MiB + at_limit)[0] == 0
    code, out, _ = gate(capsys, tmp_path, b, 100 * MiB + at_limit + 1)
    assert code == 1 and "FAIL  device 0" in out


def test_site_threshold_boundary(baseline, tmp_path, capsys):
    b = baseline("--fail-over", "1GiB")
    data = json.loads(b.read_text())
    data["thresholds"]["sites"] = [{"site": "^model\\.py:forward$", "fail-over": "2MiB"}]
    b.write_text(json.dumps(data))
    code, out, _ = gate(capsys, tmp_path, b, 102 * MiB)
    assert code == 0 and ("PASS  device 0 sites /^model\\.py:forward$/ (highest at the forward peak in both): "
                          "100.00 MiB -> 102.00 MiB") in out
    code, out, _ = gate(capsys, tmp_path, b, 102 * MiB + 1)
    assert code == 1 and "FAIL  device 0 sites /^model\\.py:forward$/" in out
    assert "matches no group" not in out
    # A pattern that matches no group of the baseline (misspelt, or the code moved) is said, not
    # silently checked as 0 B -> 0 B.
    data["thresholds"]["sites"] = [{"site": "^model\\.py:forwrad$", "fail-over": "2MiB"}]
    b.write_text(json.dumps(data))
    code, out, _ = gate(capsys, tmp_path, b, 200 * MiB)
    assert "warning: G004 device 0: sites /^model\\.py:forwrad$/ matches no group of the base run, so its limit " \
           "only sees groups that are new" in out.splitlines() and BY_CODE["G004"].example_output in out


def test_command_line_flags_override_the_file(baseline, tmp_path, capsys):
    b = baseline("--fail-over", "1MiB", "--fail-over-pct", "0")
    assert gate(capsys, tmp_path, b, 110 * MiB)[0] == 1
    assert gate(capsys, tmp_path, b, 110 * MiB, "--fail-over", "10MiB")[0] == 0


def test_a_decrease_passes_and_suggests_updating_the_baseline(baseline, tmp_path, capsys):
    b = baseline()
    code, out, _ = gate(capsys, tmp_path, b, 50 * MiB)
    assert code == 0
    assert (f"device 0: peak went down by 50.00 MiB (25%): consider updating the baseline: "
            f"memdiff baseline {tmp_path / 'train.pickle'} -o {b}") in out


def test_a_run_against_its_own_baseline_is_all_same(baseline, tmp_path, capsys):
    b = baseline()
    code, data = gate(capsys, tmp_path, b, 100 * MiB, "--format", "json")[:2]
    (data,) = json.loads(data)  # a list, one document per run, however many runs
    assert code == 0 and {r["status"] for r in data["devices"][0]["rows"]} == {"SAME"}
    assert (data["run"], data["baseline"], data["schema_version"]) == (str(tmp_path / "train.pickle"), str(b), 1)


# --- the baseline file --------------------------------------------------------------------------

def test_update_keeps_name_and_thresholds_and_rewrites_figures(baseline, tmp_path, capsys):
    b = baseline("--name", "nightly", "--fail-over", "3MiB", "--category-fail-over", "activation=5%")
    baseline(activation=150 * MiB)
    data = json.loads(b.read_text())
    assert data["name"] == "nightly"
    assert data["thresholds"]["peak"] == {"fail-over": "3MiB"}
    assert data["thresholds"]["categories"] == {"activation": {"fail-over-pct": 5.0}}
    assert data["devices"][0]["peak_bytes"] == 250 * MiB


def test_baselines_are_small_and_stable(baseline, shared, tmp_path, capsys):
    out = tmp_path / "real.json"
    assert run(capsys, "baseline", shared / "cs336-medium-ctx256-train.pickle", "-o", out)[0] == 0
    first = out.read_text()
    assert len(first) < 12_000  # the largest 25 groups at the peak and at each other phase's peak
    assert run(capsys, "baseline", shared / "cs336-medium-ctx256-train.pickle", "-o", out)[0] == 0
    strip = [l for l in first.splitlines() if '"created"' not in l]
    assert [l for l in out.read_text().splitlines() if '"created"' not in l] == strip


def test_an_interrupted_update_leaves_the_old_file_intact(baseline, tmp_path, capsys, monkeypatch):
    b = baseline()
    before = b.read_bytes()

    def broken_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_rename)
    code, _, err = run(capsys, "baseline", snapshot(tmp_path / "new.pickle", 300 * MiB), "-o", b)
    assert code == 2 and err == f"memdiff: {b}: cannot write: No space left on device\n"
    assert b.read_bytes() == before
    assert sorted(p.name for p in b.parent.iterdir()) == ["train.json"]  # no temporary file left behind


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.replace('"name"', '"name":', 1), "invalid JSON at line 3 column 10: Expecting value"),
    (lambda t: t.replace('"fail-over": "64MiB"', '"fail-over": "5 parsecs"'),
     "thresholds.peak.fail-over: '5 parsecs' is not a size"),
    (lambda t: t.replace('"fail-over-pct": 1.0', '"fail-over-pct": -1'),
     "not a valid memdiff baseline: thresholds.peak.fail-over-pct: a value below the schema's minimum of 0"),
    (lambda t: t.replace('"thresholds": {', '"thresholds": {"findings": {"fail-on": ["K003"], "ignore": ["k003"]}, '),
     "thresholds.findings: K003 in both fail-on and ignore: a finding either fails or is ignored"),
    (lambda t: t.replace('"schema_version": 1', '"schema_version": 7'),
     "baseline schema_version 7 is not one this memdiff reads (1, 2, 3)"),
    (lambda t: t.replace('"device": 0', '"device": 1'),
     "the baseline has devices [1] and the run has [0]: they cannot be gated against each other"),
])
def test_broken_baselines_exit_2_and_nothing_is_written(baseline, tmp_path, capsys, mutate, message):
    b = baseline()
    b.write_text(mutate(b.read_text()))
    broken = b.read_bytes()
    code, out, err = gate(capsys, tmp_path, b, 100 * MiB)
    assert code == 2 and out == ""
    assert err.startswith(f"memdiff: {b}: ") and message in err, err
    if "cannot be gated" not in message:
        code, _, err = run(capsys, "baseline", tmp_path / "train.pickle", "-o", b)
        assert code == 2 and message in err
        assert b.read_bytes() == broken


def test_a_baseline_limit_of_plain_bytes_is_written_with_its_unit_and_an_older_one_still_reads(baseline, tmp_path,
                                                                                                 capsys):
    """Sizes need a unit now (`--fail-over 80` is refused), and a limit of plain bytes was stored as a bare
    number ("1000"): a baseline writes "1000B", and one an older memdiff wrote still gates as 1000 bytes."""
    b = baseline("--fail-over", "1000B")
    assert json.loads(b.read_text())["thresholds"]["peak"]["fail-over"] == "1000B"
    b.write_text(b.read_text().replace('"1000B"', '"1000"'))
    assert gate(capsys, tmp_path, b, 100 * MiB + 1000)[0] == 0
    assert gate(capsys, tmp_path, b, 100 * MiB + 1001)[0] == 1


def _spread(doc, low, high, median):
    """A spread over 3 runs, as `memdiff baseline RUN1 RUN2 RUN3` stores it (version 2)."""
    doc["schema_version"] = 2
    doc["devices"][0]["spread"] = {"runs": 3, "peak": {"min": low, "max": high, "median": median}}


@pytest.mark.parametrize("mutate, message", [
    # The spread's lowest run above its highest (by 2 bytes: GiB would show them alike).
    (lambda d, peak: _spread(d, peak + 1, peak - 1, peak),
     "devices.0.spread.peak: min 209,715,201 B, median 209,715,200 B and max 209,715,199 B are out of order"),
    # A highest run of 8 EiB: under the noise rule every run passed.
    (lambda d, peak: _spread(d, peak, 2**63 - 1, peak),
     "devices.0.spread.peak.max: 9,223,372,036,854,775,807 bytes is more than any device holds (at most 1 PiB"),
    (lambda d, peak: _spread(d, peak + 10 * MiB, peak + 20 * MiB, peak + 15 * MiB),
     "devices.0.spread.peak: the stored run's 209,715,200 B is outside the spread's"),
    # One group of 300 MiB in a category of 100 MiB, on a device whose peak is 200 MiB.
    (lambda d, peak: d["devices"][0]["groups"][0].update(bytes=300 * MiB),
     "devices.0.groups.0.bytes: the stored groups of category 'activation' hold 300.00 MiB by this one, more than "
     "the category's 100.00 MiB at the peak"),
    (lambda d, peak: d["devices"][0]["categories"].update(activation=150 * MiB),
     "devices.0.categories: the categories add up to 250.00 MiB, more than the peak (devices.0.peak_bytes, "
     "200.00 MiB)"),
    (lambda d, peak: d["devices"][0]["categories"].update(activation=2**60),
     "devices.0.categories.activation: 1,152,921,504,606,846,976 bytes is more than any device holds"),
    # Static memory (live all through) above the peak, and a reserved peak below the allocated one:
    # a run's reserved memory holds its tensors.
    (lambda d, peak: d["devices"][0].update(static_bytes=peak + 1),
     "devices.0.static_bytes: 200.00 MiB is above the device's peak (devices.0.peak_bytes, 200.00 MiB)"),
    (lambda d, peak: d["devices"][0].update(reserved_peak_bytes=10, fragmentation_bytes=0),
     "devices.0.reserved_peak_bytes: 10 B is below what was reserved at the peak, 200.00 MiB "
     "(devices.0.peak_bytes 200.00 MiB plus devices.0.fragmentation_bytes 0 B)"),
], ids=["min-above-max", "max-8-EiB", "stored-run-outside", "group-above-category", "categories-above-peak",
        "category-2**60", "static-above-peak", "reserved-below-peak"])
def test_a_baseline_whose_figures_contradict_each_other_is_refused(baseline, tmp_path, capsys, mutate, message):
    b = baseline()
    doc = json.loads(b.read_text())
    assert [g["category"] for g in doc["devices"][0]["groups"]][0] == "activation"
    mutate(doc, doc["devices"][0]["peak_bytes"])
    b.write_text(json.dumps(doc))
    for command in (["gate", snapshot(tmp_path / "train.pickle", 100 * MiB), "--baseline", b],
                    ["baseline", "--check", b]):
        code, out, err = run(capsys, *command)
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"memdiff: {b}: {message}"), err
    assert "rather than editing its figures" in err


def test_every_baseline_memdiff_writes_of_the_real_snapshots_reads_back(shared, tmp_path, capsys):
    for snap in sorted(shared.glob("*.pickle")):
        code, _, err = run(capsys, "baseline", snap, "-o", tmp_path / f"{snap.stem}.json")
        assert code == 0, err
    code, out, err = run(capsys, "baseline", "--check", tmp_path)
    assert code == 0 and out.count("ok  ") == len(list(shared.glob("*.pickle"))) >= 13, err


@pytest.mark.parametrize("where", ["peak", "category", "site"])
def test_a_limit_with_a_misspelt_part_is_bad_input_not_no_limit(baseline, tmp_path, capsys, where):
    # `fail_over` for `fail-over`, hand-edited in review: the limit read as none, and a run that doubled passed.
    b = baseline("--fail-over", "10MiB", "--category-fail-over", "activation=10MiB")
    doc = json.loads(b.read_text())
    limits = doc["thresholds"]
    limits["sites"] = [{"site": "forward", "fail-over": "10MiB"}]
    limit = {"peak": limits["peak"], "category": limits["categories"]["activation"], "site": limits["sites"][0]}[where]
    limit["fail_over"] = limit.pop("fail-over")
    b.write_text(json.dumps(doc))
    code, out, err = gate(capsys, tmp_path, b, 200 * MiB)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "none of the fields fail-over, fail-over-pct, or-fail-over-pct; one is required" in err
    limit["fail-over-pct"] = 5  # with a part spelt right, the misspelt one is named as unknown
    b.write_text(json.dumps(doc))
    code, _, err = run(capsys, "baseline", "--check", b)
    assert code == 2 and "a field the schema does not define (it defines " in err


def test_a_baseline_that_is_no_file_is_named_as_a_baseline(tmp_path, capsys):
    # It was "is a directory, not a snapshot file" and "write the snapshot to a file", of a baseline.
    (tmp_path / "train.json").mkdir()
    os.mkfifo(tmp_path / "eval.json")
    code, _, err = run(capsys, "baseline", "--check", tmp_path)
    assert code == 2 and err.splitlines() == [
        f"memdiff: {tmp_path / 'eval.json'}: is a FIFO (a pipe), not a regular file: write a baseline to a file "
        f"and give that", f"memdiff: {tmp_path / 'train.json'}: is a directory, not a baseline file"]


def test_a_run_without_a_trace_is_not_gated_against_a_traced_baseline(baseline, tmp_path, capsys):
    # The same training run dumped without memory history: its activations (300 MiB, freed by the
    # dump) are not in it, only the 100 MiB of weights live at the dump. Gated, it read as a peak
    # that fell from 200 MiB to 100 MiB and passed.
    b = baseline()
    dumped = tmp_path / "train.pickle"
    dumped.write_bytes(pickle.dumps({"segments": [segment(0, 1 << 30, [block(1 << 30, 100 * MiB)])],
                                     "device_traces": [[]]}, 4))
    for flags in ([], ["--format", "markdown", "--github"]):
        code, out, err = run(capsys, "gate", dumped, "--baseline", b, *flags)
        # No report; under --github the one line is also the step's annotation.
        said = f"::error title=memdiff::{err[len('memdiff: '):]}" if "--github" in flags else ""
        assert code == 2 and out == said and err.count("\n") == 1, err
        assert err.startswith(f"memdiff: {b}: the run (train.pickle) has no trace on device 0 and the baseline has one")


def test_check_names_each_broken_baseline(baseline, tmp_path, capsys):
    b = baseline()
    shutil.copy(b, b.parent / "good.json")
    (b.parent / "bad.json").write_text("{")
    (b.parent / "worse.json").write_text(b.read_text().replace('"name": "train"', '"name": 3'))
    code, out, err = run(capsys, "baseline", "--check", b.parent)
    assert code == 2
    assert out.count("ok  ") == 2
    assert f"memdiff: {b.parent / 'bad.json'}: invalid JSON at line 1 column 2" in err
    assert f"memdiff: {b.parent / 'worse.json'}: not a valid memdiff baseline: name: a value of type integer, where the schema wants string" in err


def test_the_repositorys_own_baselines_are_valid(capsys):
    code, out, err = run(capsys, "baseline", "--check", ROOT / "baselines")
    assert code == 0, err
    assert "gpt-cpu" in out


# --- several runs ------------------------------------------------------------------------------

def test_baselines_folder_matches_runs_by_stem(baseline, tmp_path, capsys):
    b = baseline()
    head = snapshot(tmp_path / "train.pickle", 100 * MiB)
    other = snapshot(tmp_path / "eval.pickle", 100 * MiB)
    code, out, err = run(capsys, "gate", "--baselines", b.parent, head, other)
    assert code == 0
    assert f"== {head} against {b}" in out
    make = f"make it with `memdiff baseline {other} -o {b.parent / 'eval.json'}`"
    assert err == (f"memdiff: warning: G008 {other}: no baseline at {b.parent / 'eval.json'}: {make} (not gated; "
                   f"--require-baseline makes this fail)\n")
    # A required baseline that is missing is bad input, not a regression: nothing was compared.
    code, _, err = run(capsys, "gate", "--baselines", b.parent, "--require-baseline", head, other)
    assert code == 2 and err == (f"memdiff: error: G008 {other}: no baseline at {b.parent / 'eval.json'}: {make} "
                                 "(the gate fails: --require-baseline)\n")
    # Nor is a gate green when no run had its baseline, whatever the flags.
    code, _, _ = run(capsys, "gate", "--baselines", b.parent, other)
    assert code == 2


def test_a_run_that_does_not_train_against_a_training_baseline_fails_and_is_never_made_the_baseline(
        shared, tmp_path, capsys):
    # cs336-medium's inference run gated against its training run's baseline: PyTorch's trace has no
    # backward and no optimizer step in it, so its peak (1.62 GiB) is below the baseline's (6.53 GiB)
    # whatever it allocates. It passed with a hint to replace the training baseline by it (G003); it
    # then passed with a warning a green check hides. A test that stopped training judged none of the
    # memory its baseline was judged on: it fails by default, saying so first.
    base = tmp_path / "train.json"
    assert run(capsys, "baseline", shared / "cs336-medium-ctx128-train.pickle", "-o", base)[0] == 0
    code, out, err = run(capsys, "gate", shared / "cs336-medium-ctx128-infer.pickle", "--baseline", base,
                         "--format", "json")
    assert code == 1, err
    report = json.loads(out)[0]  # the gate's document lists one report per run
    codes = [f["code"] for f in report["findings"]]
    assert "P002" in codes and "G003" not in codes, codes
    lost = next(f for f in report["findings"] if f["code"] == "P002")
    assert lost["data"]["phases"] == ["backward", "optimizer"]
    warned = "\n".join(report["warnings"])
    assert "device 0: the head runs no backward or optimizer step where the base does: " in warned
    assert [(c["code"], c["source"]) for c in report["finding_checks"]] == [("P002", "default")]
    assert report["headline"].startswith("P002 phases-missing fails the gate; peak -4.91 GiB")
    # Meant to stop training: --ignore P002 judges the peak alone, which fell.
    code, out, _ = run(capsys, "gate", shared / "cs336-medium-ctx128-infer.pickle", "--baseline", base,
                       "--ignore", "P002")
    assert code == 0 and "P002 is ignored (--ignore)" in out and "FAIL" not in out, out
    # A training run of more work against the same baseline: the phases are there, no warning.
    code, out, _ = run(capsys, "gate", shared / "cs336-medium-ctx256-train.pickle", "--baseline", base,
                       "--format", "json")
    assert "P002" not in [f["code"] for f in json.loads(out)[0]["findings"]]


def test_a_gate_that_compared_nothing_says_so_on_its_one_line(shared, tmp_path, capsys):
    # The first CI run of a repository: a real run (nn.Linear(10000, 50000), 3 forwards) and no
    # baseline yet. Exit 2, and its one line on stderr must say that nothing was compared and
    # that this fails the gate, not read as a warning beside a passing gate: an error, as exit 2 is.
    folder = tmp_path / "baselines"
    folder.mkdir()
    run_file = tmp_path / "train.pickle"
    shutil.copyfile(shared / "linear-grad.pickle", run_file)
    code, out, err = run(capsys, "gate", "--baselines", folder, run_file)
    assert code == 2 and out == ""
    assert err == (f"memdiff: error: G008 {run_file}: no baseline at {folder / 'train.json'}: make it with "
                   f"`memdiff baseline {run_file} -o {folder / 'train.json'}` (no run had its baseline: nothing was "
                   "compared, so the gate fails)\n")


def test_a_regression_beside_a_required_missing_baseline_is_exit_1_and_the_docs_say_so(baseline, tmp_path,
                                                                                         capsys):
    b = baseline()
    grown = snapshot(tmp_path / "train.pickle", 300 * MiB)
    other = snapshot(tmp_path / "eval.pickle", 100 * MiB)
    code, out, err = run(capsys, "gate", "--baselines", b.parent, "--require-baseline", grown, other)
    assert code == 1 and "FAIL" in out and "no baseline at" in err  # the regression first, deliberately
    cli = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in cli.splitlines() if line.startswith("| `--require-baseline`"))
    assert "exit 2, or 1 when another run regressed" in row
    # commands.md's rule on missing output folders names the commands that make theirs
    commands = " ".join((ROOT / "docs" / "commands.md").read_text().split())
    assert "a missing folder, except for `memdiff baseline -o` and `record -o`, which make their output's folder" \
        in commands
    code, _, err = run(capsys, "baseline", other, "-o", tmp_path / "new" / "dir" / "eval.json")
    assert code == 0 and (tmp_path / "new" / "dir" / "eval.json").is_file(), err


def test_the_first_run_without_a_baseline_says_how_to_make_it_on_github(tmp_path, capsys):
    run_file = snapshot(tmp_path / "train.pickle", 100 * MiB)
    outputs, summary = tmp_path / "outputs", tmp_path / "summary.md"
    env = {"GITHUB_ACTIONS": "true", "GITHUB_OUTPUT": str(outputs), "GITHUB_STEP_SUMMARY": str(summary),
           "RUNNER_TEMP": str(tmp_path)}
    for folder in (tmp_path / "empty", tmp_path / "not-yet"):  # an empty folder, and none at all
        if folder.name == "empty":
            folder.mkdir()
        with mock.patch.dict(os.environ, env):
            code, out, err = run(capsys, "gate", "--baselines", folder, "--require-baseline", run_file, "--github")
        assert code == 2
        wanted = folder / "train.json"
        assert f"::error title=memdiff G008 no-baseline::{run_file}: no baseline at {wanted}: make it with" in out
        text = summary.read_text()
        assert f"### memdiff: no baseline for `{run_file}`" in text and f"memdiff baseline {run_file} -o {wanted}" in text
        assert ("mkdir -p" in text) == (folder.name == "not-yet")
        assert "verdict=no-baseline\npeak-delta-bytes=\n" in outputs.read_text()  # no 0 that reads as unchanged
        summary.unlink()
        outputs.unlink()


# --- the real pair ------------------------------------------------------------------------------

def test_real_ctx128_baseline_against_ctx256(shared, tmp_path, capsys):
    b = tmp_path / "train.json"
    assert run(capsys, "baseline", shared / "cs336-medium-ctx128-train.pickle", "-o", b)[0] == 0
    head = shared / "cs336-medium-ctx256-train.pickle"
    code, out, _ = run(capsys, "gate", head, "--baseline", b)
    assert code == 1
    assert "FAIL  device 0 peak: 6.53 GiB -> 8.48 GiB, +1.95 GiB (+29.8%)" in out
    assert ("device 0: peak grew by 1.95 GiB; top growth: functional.py:einsum <- einsum <- bmm +787.53 MiB, "
            "model.py:forward <- mul_Tensor +776.00 MiB") in out
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--fail-over", "3GiB")
    assert code == 0 and "PASS  device 0 peak" in out


def test_a_failure_on_a_finding_alone_never_says_memory_regressed(shared, tmp_path):
    # The pytest plugin's first line (what pytest's short summary shows) said "device memory regressed"
    # of the inference run whose peak fell 75% and which failed on P002 alone.
    base = tmp_path / "train.json"
    memdiff.write_baseline(shared / "cs336-medium-ctx128-train.pickle", base)
    stopped = memdiff.gate(shared / "cs336-medium-ctx128-infer.pickle", base)
    assert stopped.passed is False and all(c.passed for c in stopped.checks)
    assert (stopped.failure, stopped.verdict_word) == ("failed on a finding", "failed on a finding")
    # Every output opens with the report's word for it (renderers never word a verdict of their own).
    assert render(stopped, "text").startswith("memdiff: failed on a finding: P002 phases-missing fails")
    assert "❌ memdiff: failed on a finding" in render(stopped, "markdown")
    assert "memdiff: failed on a finding</p>" in memdiff.html_report(stopped)
    grown = memdiff.gate(shared / "cs336-medium-ctx256-train.pickle", base)  # its peak grew 1.95 GiB
    assert (grown.failure, grown.verdict_word) == ("device memory regressed", "regression")
    same = memdiff.gate(shared / "cs336-medium-ctx128-train.pickle", base)
    assert (same.failure, same.verdict_word) == (None, "no regression")


def test_a_gate_never_says_a_baseline_recorded_no_steps(shared, tmp_path, capsys):
    # The training run took one optimizer step inside its trace (PyTorch recorded the scope
    # Optimizer.step#AdamW.step there); the inference run of the same model records 3,840 events
    # to its 19,136, in one step too (its forward). A baseline stores its run's step count, 1, never
    # 0: the gate says of the event counts what the diff of the two runs says, nothing (P002 says
    # what differs: the inference run stopped training).
    b = tmp_path / "train.json"
    train, infer = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx128-infer.pickle"
    assert run(capsys, "baseline", train, "-o", b)[0] == 0
    assert json.loads(b.read_text())["devices"][0]["step_count"] == 1
    code, out, _ = run(capsys, "gate", infer, "--baseline", b)
    assert code == 1 and "FAIL  finding P002" in out, out  # it stopped training (test above)
    _, diffed, _ = run(capsys, train, infer)
    assert "T010" not in out and "T010" not in diffed and "0 -> 1 steps" not in out


def test_one_rank_against_a_jobs_baseline_is_bad_input_not_a_crash(tmp_path, capsys):
    # The real two-rank DDP job of GPT-2 recorded on H100s (tests/data/cuda/ddp): its baseline
    # keeps each rank's run. Gating rank 0's file alone against it was exit 3 (KeyError).
    job = ROOT / "tests" / "data" / "cuda" / "ddp"
    b = tmp_path / "job.json"
    assert run(capsys, "baseline", f"{job}/", "-o", b)[0] == 0
    code, out, err = run(capsys, "gate", job / "rank0.pickle.gz", "--baseline", b)
    assert (code, out) == (2, "")
    assert err == (f"memdiff: {b}: is the baseline of a job (2 ranks) and rank0.pickle.gz is one run: gate the "
                   "job's folder against it, or make a baseline of the run alone\n")
    assert run(capsys, "gate", f"{job}/", "--baseline", b)[0] == 0


def test_a_jobs_baseline_is_never_replaced_by_one_runs_unasked(tmp_path, capsys):
    # `memdiff baseline rank0.pickle -o job.json` replaced the job's baseline (every rank gated) with
    # rank 0's alone and printed only "updated": the other rank was no longer gated.
    job = ROOT / "tests" / "data" / "cuda" / "ddp"
    b = tmp_path / "job.json"
    assert run(capsys, "baseline", f"{job}/", "-o", b)[0] == 0
    kept = b.read_bytes()
    code, out, err = run(capsys, "baseline", job / "rank0.pickle.gz", "-o", b)
    assert (code, out) == (2, "") and err == (
        f"memdiff: {b}: holds the baseline of a job (2 ranks), and this is one run: writing it would replace one "
        f"kind of baseline with the other; give another -o, or pass --replace to write over it\n")
    assert b.read_bytes() == kept
    code, _, err = run(capsys, "baseline", job / "rank0.pickle.gz", "-o", b, "--replace")
    # Said as a replacement: "updated" read as if the job's ranks were still gated.
    assert code == 0 and err.startswith(f"memdiff: replaced the baseline of a job (2 ranks) in {b}: baseline ")
    assert "ranks" not in json.loads(b.read_text())
    code, _, err = run(capsys, "baseline", f"{job}/", "-o", b)  # and back: one run's is not replaced by a job's
    assert code == 2 and "holds the baseline of one run, and this is a job (2 ranks)" in err
    assert run(capsys, "baseline", f"{job}/", "-o", b, "--replace")[0] == 0
    assert len(json.loads(b.read_text())["ranks"]) == 2


def test_a_job_against_one_runs_baseline_names_a_command_that_works(tmp_path, capsys):
    # The gate told a user whose baseline is rank 0's alone to run `memdiff baseline JOB -o FILE`,
    # which `memdiff baseline` refuses over one run's baseline without --replace.
    job = ROOT / "tests" / "data" / "cuda" / "ddp"
    b = tmp_path / "job.json"
    assert run(capsys, "baseline", job / "rank0.pickle.gz", "-o", b)[0] == 0
    code, out, err = run(capsys, "gate", f"{job}/", "--baseline", b)
    assert (code, out) == (2, "")
    advised = err.split("`")[1].split()
    assert advised[:2] == ["memdiff", "baseline"]
    assert run(capsys, *advised[1:])[0] == 0
    assert run(capsys, "gate", f"{job}/", "--baseline", b)[0] == 0


def test_category_limits_compare_each_category_at_its_height_in_both_runs(shared, tmp_path, capsys):
    # ctx128's peak is in its optimizer step (activations freed), ctx256's in its forward: at the
    # two peaks activations read 19.53 MiB -> 3.73 GiB (x195.7). At each run's forward peak, where
    # activations are highest, they grew 1.68 -> 3.73 GiB: +122.4%, under a 150% limit.
    b = tmp_path / "train.json"
    assert run(capsys, "baseline", shared / "cs336-medium-ctx128-train.pickle", "-o", b,
               "--category-fail-over", "activation=150%")[0] == 0
    head = shared / "cs336-medium-ctx256-train.pickle"
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--fail-over", "3GiB",
                       "--category-fail-over", "gradient=1%")
    assert code == 0, out
    assert ("PASS  device 0 activation (highest at the forward peak in both): 1.68 GiB -> 3.73 GiB, +2.05 GiB "
            "(+122.4%), limit: more than 150%") in out
    assert "PASS  device 0 gradient (highest at the optimizer peak in both): 1.58 GiB -> 1.58 GiB" in out
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--fail-over", "3GiB",
                       "--category-fail-over", "activation=100%")
    assert code == 1 and "FAIL  device 0 activation (highest at the forward peak in both)" in out


def test_a_baseline_keeps_where_its_peak_was(shared, tmp_path, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    baseline = tmp_path / "ctx128.json"
    assert main(["baseline", str(base), "-o", str(baseline)]) == 0
    assert json.loads(baseline.read_text())["devices"][0]["at_peak"] == {
        "phase": "optimizer", "step": 0, "scope": "Optimizer.step#AdamW.step"}
    capsys.readouterr()
    assert main(["gate", "--baseline", str(baseline), str(head)]) == 1
    out = capsys.readouterr().out
    # As the plain diff of the pair says it; the gate has no --at, the report compares like with like.
    assert ("base peak in the optimizer step of step 0 (scope Optimizer.step#AdamW.step); "
            "head peak in the forward of step 0") in out
    assert ("the peaks are in different phases: base in the optimizer step of step 0, head in the forward of "
            "step 0; rows compare different moments (compare like with like: the phase peaks below, the "
            "like-for-like view of the markdown and HTML reports, or the gate's --phase-fail-over)") in out


def test_a_misspelt_category_is_bad_input_wherever_it_is_given(baseline, tmp_path, capsys):
    b = baseline()
    head = snapshot(tmp_path / "train.pickle", 400 * MiB)  # activations x4: a real limit would fail
    code, _, err = run(capsys, "gate", head, "--baseline", b, "--category-fail-over", "activatoin=10%")
    assert code == 2 and err.count("\n") == 1
    assert "--category-fail-over: no rule gives the category 'activatoin' (did you mean 'activation'?)" in err
    assert "activation, autograd" in err
    code, _, err = run(capsys, "baseline", head, "-o", tmp_path / "new.json", "--category-fail-over", "activatoin=10%")
    assert code == 2 and not (tmp_path / "new.json").exists()
    # A category a rules file adds is known, and its limit checks it.
    code, _, err = run(capsys, "baseline", head, "-o", tmp_path / "kv.json", "--custom-profile", '{"kv_cache": "kv"}',
                       "--category-fail-over", "kv_cache=10%")
    assert code == 0, err
    # One stored in a baseline file (by hand, or by rules the gate was not given) is named there.
    doc = json.loads(b.read_text())
    doc["thresholds"]["categories"] = {"activatoin": {"fail-over-pct": 10}}
    b.write_text(json.dumps(doc))
    code, _, err = run(capsys, "gate", head, "--baseline", b)
    assert code == 2 and err.startswith(f"memdiff: {b}: no rule gives the category 'activatoin'")
    code, _, err = run(capsys, "baseline", "--check", b.parent)
    assert code == 2 and err.startswith(f"memdiff: {b}: no rule gives the category 'activatoin'")
    # The API, which the pytest marker's categories go through.
    doc["thresholds"]["categories"] = {}
    b.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="no rule gives the category 'activatoin'"):
        memdiff.gate(str(head), str(b), categories={"activatoin": "10%"})
    assert not memdiff.gate(str(head), str(b), categories={"activation": "10%"}).passed


def test_site_limits_compare_each_site_at_its_height_in_both_runs(shared, tmp_path, capsys):
    # At the two peaks (base's in its optimizer step, head's in its forward) softmax reads 0 B -> 890 MiB
    # and any percent limit fails. Each run's softmax groups at their highest, the forward peak of
    # both, is the comparison a reviewer means; the baseline keeps each phase's largest groups for it.
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    b = tmp_path / "train.json"
    assert run(capsys, "baseline", base, "-o", b)[0] == 0
    data = json.loads(b.read_text())
    assert set(data["devices"][0]["phase_groups"]) == {"forward", "backward"}  # the optimizer's is the peak's
    data["thresholds"]["sites"] = [{"site": "softmax", "fail-over-pct": 300}]
    b.write_text(json.dumps(data))
    truth = [sum(g.bytes for g in memdiff.summarize(run_).devices[0].at("forward").groups if "softmax" in g.site)
             for run_ in (base, head)]
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--fail-over", "3GiB", "--format", "json")
    check = next(c for c in json.loads(out)[0]["checks"] if "softmax" in c["subject"])
    assert check["subject"] == "device 0 sites /softmax/ (highest at the forward peak in both)"
    assert check["head_bytes"] == truth[1] and check["passed"] and code == 0
    # The baseline's side counts the stored groups: what it leaves out are the softmax groups too
    # small to be stored, each no larger than the smallest it stores.
    stored = data["devices"][0]["phase_groups"]["forward"]
    left_out = [g.bytes for g in memdiff.summarize(base).devices[0].at("forward").groups
                if "softmax" in g.site and g.signature not in {s["signature"] for s in stored}]
    assert truth[0] - check["base_bytes"] == sum(left_out)
    assert all(b <= min(s["bytes"] for s in stored) for b in left_out)
    data["thresholds"]["sites"][0]["fail-over-pct"] = 200
    b.write_text(json.dumps(data))
    assert run(capsys, "gate", head, "--baseline", b, "--fail-over", "3GiB")[0] == 1


def test_a_gate_against_a_baseline_shows_the_like_for_like_view(shared, tmp_path, capsys):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    b = tmp_path / "train.json"
    assert run(capsys, "baseline", base, "-o", b)[0] == 0
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--format", "markdown")
    assert code == 1
    assert "<summary>Like with like: device 0: forward peak 6.42 GiB -> 8.48 GiB (+2.05 GiB, +32.0%)" in out
    assert "at the forward peak of both, activation +2.05 GiB (+122.4%)" in out.splitlines()[2]


def test_a_peak_flag_replaces_the_stored_peak_rule_whole(baseline, tmp_path, capsys):
    # A baseline that stores 512 MiB: `--fail-over-pct 5` is the rule "more than 5%", not "more than
    # 5% and by more than 512 MiB", under which a small run could never fail.
    b = baseline("--fail-over", "512MiB")
    code, out, _ = gate(capsys, tmp_path, b, 120 * MiB, "--fail-over-pct", "5")
    assert ("rule: fail when the peak of a device grows by more than 5%; findings K003, K004, A002, P002 fail "
            "(default)\n") in out
    assert code == 1 and "limit: more than 5%\n" in out


def test_the_first_baseline_of_a_repository_makes_its_folder(tmp_path, capsys, monkeypatch):
    # What the gate tells a new repository to run works as told, the folder included.
    monkeypatch.chdir(tmp_path)
    run_ = snapshot(tmp_path / "train.pickle", 100 * MiB)
    code, _, err = run(capsys, "gate", "--baselines", "baselines", run_)
    assert code == 2 and "(the folder baselines does not exist yet; that command makes it)" in err
    command = err.split("make it with `")[1].split("`")[0]
    assert run(capsys, *command.split()[1:])[0] == 0
    assert run(capsys, "gate", "--baselines", "baselines", run_)[0] == 0


def test_a_gate_is_never_green_when_neither_side_holds_device_memory(write_snapshot, tmp_path, capsys):
    """A snapshot of nothing (a recording around code that ran elsewhere): no baseline of it is
    written, and no verdict on two of them is given: exit 2, one line each."""
    from memdiff.cli import main

    nothing = write_snapshot({"segments": [], "device_traces": [[]]}, "nothing.pickle")
    assert main(["baseline", nothing, "-o", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "the run records no device memory: a baseline of nothing would pass every gate" in err
    assert err.count("\n") == 1 and not (tmp_path / "b.json").exists()
    assert main([nothing, nothing]) == 2
    err = capsys.readouterr().err
    assert "no device memory in either run, so nothing to gate" in err and err.count("\n") == 1
    # A baseline of nothing written by an earlier memdiff gates nothing either.
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema_version": 1, "name": "old", "created": "2026-01-01T00:00:00Z",
                                 "source": {"file": "nothing.pickle", "sha256": "0" * 64, "generation": "no-trace",
                                            "allocator_settings": None, "git_sha": None},
                                 "thresholds": {"peak": {"fail-over-pct": 1.0}}, "devices": []}))
    assert main(["gate", "--baseline", str(empty), nothing]) == 2
    assert "nothing to gate" in capsys.readouterr().err


def test_a_run_against_its_own_baseline_counts_the_allocations_the_baseline_pools(shared, tmp_path):
    """A baseline stores the 25 largest groups and pools the rest per category: the rest rows count
    the pooled groups' allocations as the run's own rows do (they counted one per category), so the
    rows of a run gated against its own baseline read N -> N allocations, N the run's count at its peak."""
    snap = shared / "cs336-medium-ctx256-train.pickle"
    live = memdiff.summarize(snap).devices[0]
    assert len(live.groups) > 25  # some groups are pooled
    memdiff.write_baseline(snap, tmp_path / "b.json")
    rows = memdiff.gate(snap, tmp_path / "b.json").diff.devices[0].rows
    assert sum(r.base_count for r in rows) == sum(r.head_count for r in rows) == sum(g.count for g in live.groups)


def test_a_baseline_whose_figures_were_edited_by_hand_is_said_in_every_gate(baseline, tmp_path, capsys):
    # A pull request that raises its baseline's peak by hand lets the regression it was raised for
    # pass: the figures no longer match the digest memdiff wrote beside them, and the gate says so.
    b = baseline()
    head = snapshot(tmp_path / "train.pickle", 300 * MiB)  # +200 MiB of activations: fails as stored
    assert run(capsys, "gate", head, "--baseline", b)[0] == 1
    doc = json.loads(b.read_text())
    assert len(doc["figures_sha256"]) == 64
    doc["name"], doc["thresholds"]["peak"] = "renamed", {"fail-over-pct": 150.0}  # a team's to set: no warning
    b.write_text(json.dumps(doc, indent=4))  # and reformatted, as an editor may
    code, out, _ = run(capsys, "gate", head, "--baseline", b)
    assert code == 0 and "G013" not in out
    for d in doc["devices"]:
        d["peak_bytes"] += 512 * MiB
        d["categories"]["activation"] += 512 * MiB
    doc["thresholds"].pop("peak")
    b.write_text(json.dumps(doc))
    code, out, _ = run(capsys, "gate", head, "--baseline", b)
    assert code == 0  # the edited figure still decides: the warning says so, it does not fail
    assert (f"warning: G013 baseline renamed (base.pickle): its measured figures were edited by hand (they no "
            f"longer match figures_sha256, the digest memdiff wrote beside them)") in out
    code, out, _ = run(capsys, "gate", head, "--baseline", b, "--format", "json")
    assert [f["code"] for f in json.loads(out)[0]["findings"]].count("G013") == 1
    # written again from a run, the digest holds; a baseline written before the digest says nothing
    assert run(capsys, "baseline", head, "-o", b)[0] == 0
    assert "G013" not in run(capsys, "gate", head, "--baseline", b)[1]
    doc = json.loads(b.read_text())
    del doc["figures_sha256"]
    doc["devices"][0]["peak_bytes"] += MiB
    b.write_text(json.dumps(doc))
    assert "G013" not in run(capsys, "gate", head, "--baseline", b)[1]
