"""The GitHub Action's compare step, run as Actions runs it: bash, its inputs as environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT


def compare_script() -> str:
    steps = yaml.safe_load((ROOT / "action.yml").read_text())["runs"]["steps"]
    return next(s for s in steps if s.get("id") == "compare")["run"]


@pytest.fixture
def action(tmp_path):
    """Run the compare step with the given inputs; (its outputs, its log)."""
    shim = tmp_path / "bin" / "memdiff"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m memdiff "$@"\n')
    shim.chmod(0o755)

    def run(cwd, **inputs):
        outputs = tmp_path / "outputs.txt"
        outputs.write_text("")
        env = {**os.environ, "GITHUB_OUTPUT": str(outputs),
               "RUNNER_TEMP": str(tmp_path), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
               "HEAD": "", "BASE": "", "BASELINE": "", "FAIL_OVER": "", "FAIL_OVER_PCT": "", "CATEGORY_FAIL_OVER": "",
               "PHASE_FAIL_OVER": "", "HISTORY": "", "HISTORY_POINTS": "20", "REQUIRE_BASELINE": "true", "MIN_DELTA": "", "WHATIF": "false", "RULES": "", "FAIL_ON": "", "IGNORE": "", "TOP": "5", "HTML": "false",
               "MEMDIFF": str(shim), "GITHUB_JOB": "memory", "ARTIFACT_NAME": "", "COMMENT_TITLE": "memdiff",
               **{k.upper(): v for k, v in inputs.items()}}
        done = subprocess.run(["bash", "-c", compare_script()], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        pairs = [line.split("=", 1) for line in outputs.read_text().splitlines() if "=" in line]
        return dict(pairs), done.stdout + done.stderr
    return run


def test_a_head_that_matches_no_file_fails(action, tmp_path):
    (tmp_path / "baselines").mkdir()
    outputs, log = action(tmp_path, head="runs/*.pickle", baseline="baselines")
    assert outputs["exit-code"] == "2"
    assert "::error title=memdiff::head 'runs/*.pickle' matches no file: nothing to compare" in log


@pytest.mark.slow  # runs the action's steps
def test_a_run_without_its_baseline_fails_by_default(action, shared, tmp_path):
    (tmp_path / "baselines").mkdir()
    run = tmp_path / "train.pickle"
    run.write_bytes((shared / "linear-grad.pickle").read_bytes())
    outputs, log = action(tmp_path, head="*.pickle", baseline="baselines")
    assert outputs["exit-code"] == "2" and outputs["verdict"] == "no-baseline"
    assert "::error title=memdiff G008 no-baseline::train.pickle: no baseline at baselines/train.json" in log
    assert "memdiff baseline train.pickle -o baselines/train.json" in (tmp_path / "summary.md").read_text()
    # require-baseline: false reports the run without a baseline and gates the others ...
    (tmp_path / "eval.pickle").write_bytes(run.read_bytes())
    assert subprocess.run([sys.executable, "-m", "memdiff", "baseline", "eval.pickle", "-o", "baselines/eval.json"],
                          cwd=tmp_path).returncode == 0
    outputs, log = action(tmp_path, head="*.pickle", baseline="baselines", require_baseline="false")
    assert outputs["exit-code"] == "0" and outputs["verdict"] == "no-baseline"
    assert "::warning title=memdiff G008 no-baseline::train.pickle: no baseline at baselines/train.json" in log
    # ... but a gate where no run had its baseline compared nothing: never green.
    (tmp_path / "eval.pickle").unlink()
    outputs, _ = action(tmp_path, head="*.pickle", baseline="baselines", require_baseline="false")
    assert outputs["exit-code"] == "2"


def test_neither_base_nor_baseline_is_bad_input(action, shared, tmp_path):
    (tmp_path / "train.pickle").write_bytes((shared / "linear-grad.pickle").read_bytes())
    outputs, log = action(tmp_path, head="train.pickle")
    assert outputs["exit-code"] == "2" and "give the action a base or a baseline input" in log


@pytest.mark.slow  # runs the action's steps
def test_category_and_phase_limits_reach_the_gate(action, shared, tmp_path):
    for name in ("cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle"):
        (tmp_path / name).write_bytes((shared / name).read_bytes())
    base = str(tmp_path / "b.json")
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", "cs336-medium-ctx128-train.pickle", "-o", base],
                   cwd=tmp_path, check=True, capture_output=True)
    outputs, log = action(tmp_path, head="cs336-medium-ctx256-train.pickle", baseline=base, fail_over="3GiB",
                          category_fail_over="activation=10% gradient=1GiB", phase_fail_over="forward=1GiB",
                          min_delta="1MiB")
    assert outputs["exit-code"] == "1"
    assert "PASS  device 0 peak" in log
    assert "FAIL  device 0 forward peak" in log and "FAIL  device 0 activation" in log
    assert "PASS  device 0 gradient" in log


@pytest.mark.slow  # runs the action's steps
def test_the_html_report_is_written_where_the_upload_step_looks(action, shared, tmp_path):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    outputs, _ = action(tmp_path, head=str(head), base=str(base), html="true")
    assert outputs["exit-code"] == "1"
    assert outputs["html"] == str(tmp_path / "memdiff-html")
    assert (tmp_path / "memdiff-html" / "report.html").read_text().startswith("<!DOCTYPE html>")
    steps = yaml.safe_load((ROOT / "action.yml").read_text())["runs"]["steps"]
    upload = next(s for s in steps if s.get("id") == "upload")
    assert upload["uses"].startswith("actions/upload-artifact@") and "steps.compare.outputs.html" in upload["with"]["path"]
    # Each leg of a matrix uploads under its own name (one name twice fails the job), unless named.
    assert outputs["artifact"].startswith("memdiff-html-report-memory-")
    again, _ = action(tmp_path, head=str(head), base=str(base), html="true")
    assert again["artifact"] != outputs["artifact"]
    named, _ = action(tmp_path, head=str(head), base=str(base), html="true", artifact_name="gpt2-report")
    assert named["artifact"] == "gpt2-report"
    assert upload["with"]["name"] == "${{ steps.compare.outputs.artifact }}"
    outputs, _ = action(tmp_path, head=str(head), base=str(base), html="false")
    assert "html" not in outputs and "artifact" not in outputs


def test_the_action_leaves_the_jobs_python_alone():
    steps = yaml.safe_load((ROOT / "action.yml").read_text())["runs"]["steps"]
    setup = next(s for s in steps if str(s.get("uses", "")).startswith("actions/setup-python@"))
    assert setup["with"]["update-environment"] is False
    # memdiff is called through the path its own virtual environment gives, never through PATH.
    for step in steps:
        if "memdiff" in step.get("run", "") and step.get("id") != "install":
            assert step["env"]["MEMDIFF"] == "${{ steps.install.outputs.memdiff }}"
            assert "GITHUB_PATH" not in step["run"]


@pytest.mark.slow  # runs the action's steps
def test_a_job_folder_is_gated_rank_by_rank(action, shared, tmp_path):
    # runs/train/ holds one snapshot per rank; its baseline is baselines/train.json.
    for name, runs in (("cs336-medium-ctx128-train.pickle", "base"), ("cs336-medium-ctx256-train.pickle", "head")):
        job = tmp_path / runs / "train"
        job.mkdir(parents=True)
        for rank in range(2):
            (job / f"rank{rank}.pickle").symlink_to(shared / name if rank == 1 else shared / "cs336-medium-ctx128-train.pickle")
    (tmp_path / "baselines").mkdir()
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", "base/train", "-o", "baselines/train.json"],
                   cwd=tmp_path, check=True, capture_output=True)
    outputs, log = action(tmp_path, head="head/train", baseline="baselines", html="true")
    assert outputs["exit-code"] == "1" and "FAIL: 2 ranks compared, failing: 1" in log
    assert (tmp_path / "memdiff-html" / "report.html").read_text().startswith("<!DOCTYPE html>")
    outputs, log = action(tmp_path, head="head/train", base="base/train")
    assert outputs["exit-code"] == "1" and "worst rank: 1" in log


def _uses() -> list:
    """Every `uses:` of the action and of the project's workflows."""
    found = []
    for path in [ROOT / "action.yml", *sorted((ROOT / ".github" / "workflows").glob("*.yml"))]:
        doc = yaml.safe_load(path.read_text())
        steps = doc["runs"]["steps"] if "runs" in doc else [s for j in doc["jobs"].values() for s in j["steps"]]
        found += [(path.name, s["uses"]) for s in steps if "uses" in s]
    return found


def test_every_action_used_is_pinned_by_commit():
    # A tag can be moved to other code; a commit cannot. Local actions (./) are this checkout.
    uses = _uses()
    assert uses
    loose = [(f, u) for f, u in uses if not u.startswith("./") and not re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", u)]
    assert not loose


def test_the_action_installs_memdiff_with_its_dependencies_pinned():
    steps = yaml.safe_load((ROOT / "action.yml").read_text())["runs"]["steps"]
    install = next(s for s in steps if s.get("id") == "install")["run"]
    assert '-c "$ACTION_PATH/.github/constraints.txt"' in install
    pins = {}
    for line in (ROOT / ".github" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, marker = line.partition(";")
            package, version = name.strip().split("==")
            pins.setdefault(package.lower(), []).append(marker.strip())
    pyproject = (ROOT / "pyproject.toml").read_text()
    runtime = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    names = re.findall(r'^\s+"([A-Za-z0-9_.-]+)', runtime, re.M)
    assert names and all(n.lower() in pins for n in names), (names, sorted(pins))
    # Each pin holds for every Python the action can be given: one version, or one per side of 3.11.
    for package, markers in pins.items():
        assert markers in ([""], ['python_version >= "3.11"', 'python_version < "3.11"'],
                           ['python_version < "3.11"']), (package, markers)


@pytest.mark.slow  # runs the action's steps
def test_the_history_input_puts_the_trend_in_the_comment(action, shared, tmp_path):
    (tmp_path / "baselines").mkdir()
    run = tmp_path / "train.pickle"
    run.write_bytes((shared / "linear-grad.pickle").read_bytes())
    memdiff = [sys.executable, "-m", "memdiff"]
    assert subprocess.run([*memdiff, "baseline", "train.pickle", "-o", "baselines/train.json"], cwd=tmp_path).returncode == 0
    outputs, log = action(tmp_path, head="train.pickle", baseline="baselines", history="main.jsonl")
    assert outputs["exit-code"] == "0"
    assert "::warning title=memdiff G010 history-not-yet::history main.jsonl does not exist yet" in log
    for sha in ("a" * 40, "b" * 40):
        assert subprocess.run([*memdiff, "history", "append", "train.pickle", "--to", "main.jsonl", "--commit", sha],
                              cwd=tmp_path).returncode == 0
    outputs, log = action(tmp_path, head="train.pickle", baseline="baselines", history="main.jsonl")
    assert outputs["exit-code"] == "0"
    report = open(outputs["report"]).read()
    assert "#### Peak on the main branch" in report
    assert "train, device 0: the last 2 peaks on main" in report and f"latest 4.13 GiB at {'b' * 12}" in report


@pytest.mark.slow  # runs the action's steps
def test_the_whatif_input_puts_what_buys_it_back_in_the_summary(action, shared, tmp_path):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    outputs, _ = action(tmp_path, head=str(head), base=str(base), whatif="true")
    assert outputs["exit-code"] == "1"
    summary = (tmp_path / "summary.md").read_text()
    assert "#### What buys it back" in summary and "weights=bf16: " in summary
    (tmp_path / "summary.md").unlink()
    outputs, _ = action(tmp_path, head=str(head), base=str(base))  # whatif: false, the default
    assert outputs["exit-code"] == "1" and "What buys it back" not in (tmp_path / "summary.md").read_text()


@pytest.mark.slow  # runs the action's steps
def test_findings_fail_or_are_ignored_through_the_inputs_and_say_so_in_the_outputs(action, tmp_path):
    # A loss kept as a tensor each step (gpt2-log-tensor) against its clean run, under a peak rule
    # that allows the growth: the kept memory growing step over step (K004) fails it by default.
    cuda = ROOT / "tests" / "data" / "cuda"
    stored = tmp_path / "b.json"
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", str(cuda / "gpt2-base.pickle.gz"), "-o", str(stored),
                    "--fail-over-pct", "1000"], cwd=tmp_path, check=True, capture_output=True)
    head = str(cuda / "gpt2-log-tensor.pickle.gz")
    outputs, log = action(tmp_path, head=head, baseline=str(stored))
    assert (outputs["exit-code"], outputs["verdict"]) == ("1", "fail")
    assert (outputs["findings"], outputs["failed-findings"]) == ("K004 K002", "K004")  # the report's order: the error first
    assert "::error title=memdiff K004 kept-grows-per-step::device 0: memory kept from earlier steps" in log
    outputs, log = action(tmp_path, head=head, baseline=str(stored), fail_on="K002")
    assert outputs["exit-code"] == "1" and outputs["failed-findings"] == "K002 K004"
    outputs, log = action(tmp_path, head=head, baseline=str(stored), ignore="K")
    assert (outputs["exit-code"], outputs["verdict"], outputs["findings"], outputs["failed-findings"]) == (
        "0", "pass", "", "")
    assert "K004" not in log.replace("are ignored (--ignore)", "").replace("K004, ", "")


def test_list_inputs_take_comma_lists_as_the_cli_does(action, tmp_path):
    # gpt2-log-tensor shows K002 and fails on K004 (the test above); both ignored through one input
    # written as a comma list with a space, the run passes and shows neither.
    cuda = ROOT / "tests" / "data" / "cuda"
    stored = tmp_path / "b.json"
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", str(cuda / "gpt2-base.pickle.gz"), "-o", str(stored),
                    "--fail-over-pct", "1000"], cwd=tmp_path, check=True, capture_output=True)
    head = str(cuda / "gpt2-log-tensor.pickle.gz")
    outputs, log = action(tmp_path, head=head, baseline=str(stored), ignore="K002, K004")
    assert (outputs["exit-code"], outputs["verdict"], outputs["findings"]) == ("0", "pass", ""), log
    outputs, log = action(tmp_path, head=head, baseline=str(stored), fail_on="K004,", ignore="K002,K004")
    assert outputs["exit-code"] == "2" and "memdiff: --ignore: K004 also given to --fail-on" in log


def test_a_glob_of_heads_gets_a_page_each_though_one_has_no_baseline_yet(action, shared, tmp_path):
    # A pull request that adds a second workload: its run has no baseline yet. The step made the
    # HTML folder for the glob and memdiff read it as one page's name ("memdiff-html: is a folder",
    # exit 2): no summary, no verdict, no G008 with the command that makes the baseline.
    runs, stored = tmp_path / "runs", tmp_path / "baselines"
    runs.mkdir()
    for name in ("train", "eval"):
        (runs / f"{name}.pickle").write_bytes((shared / "linear-grad.pickle").read_bytes())
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", "runs/train.pickle", "-o", "baselines/train.json"],
                   cwd=tmp_path, check=True, capture_output=True)
    outputs, log = action(tmp_path, head="runs/*.pickle", baseline="baselines/", html="true", require_baseline="false")
    assert (outputs["exit-code"], outputs["verdict"]) == ("0", "no-baseline"), log
    assert "G008" in log and "is a folder" not in log
    assert [p.name for p in (tmp_path / "memdiff-html").iterdir()] == ["train.html"]
    (stored / "train.json").unlink()  # the first run of both: nothing compared, and G008 says so
    outputs, log = action(tmp_path, head="runs/*.pickle", baseline="baselines/", html="true")
    assert (outputs["exit-code"], outputs["verdict"]) == ("2", "no-baseline") and "is a folder" not in log


def test_the_docs_name_every_finding_that_fails_by_default():
    # The fail-on input's row said the defaults were K003 K004 A002, where P002 fails too.
    from memdiff.compare.findings import DEFAULT_FAIL_ON

    doc = (ROOT / "docs" / "github-action.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `fail-on` |"))
    described = yaml.safe_load((ROOT / "action.yml").read_text())["inputs"]["fail-on"]["description"]
    baselines = " ".join((ROOT / "docs" / "baselines.md").read_text().split())
    without = baselines[baselines.index("Without it memory kept"):][:300]
    for code in DEFAULT_FAIL_ON:
        assert code in row and code in described and code in without, code


def test_bad_input_is_an_annotation_and_in_the_job_summary(action, shared, tmp_path):
    # A baseline edited wrong in the pull request: the step failed with its one line in the log only,
    # under an empty job summary, and the comment step said "memdiff produced no report".
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "train.pickle").write_bytes((shared / "linear-grad.pickle").read_bytes())
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "train.json").write_text('{"name": ')
    outputs, log = action(tmp_path, head="runs/train.pickle", baseline="baselines/")
    assert outputs["exit-code"] == "2"
    assert "::error title=memdiff::baselines/train.json: invalid JSON at line 1" in log
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("### memdiff: nothing was gated: bad input\n\nbaselines/train.json: invalid JSON at line 1")
