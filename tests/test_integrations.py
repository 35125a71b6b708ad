"""Step windows and the training-framework callbacks, run for real on CPU (docs/integrations.md).

Which steps a recording holds is checked against markers the run itself allocates at the start
of each optimizer step (tests/scenarios/marked.py), never against memdiff's own step reading.
The framework examples are the ones docs/integrations.md shows, run as written.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest
from conftest import ROOT, missing_capture_dependency

import memdiff
from memdiff.read.load import decode
from memdiff.recording.capture import StepWindow, parse_steps

SCENARIOS = ROOT / "tests" / "scenarios"
MARKED = SCENARIOS / "marked.py"
MARK = 1_000_003  # tests/scenarios/marked.py
GIB = 1 << 30
DOCS = ROOT / "docs" / "integrations.md"


def test_step_windows_read_as_python_slices():
    assert parse_steps("3:5") == StepWindow(3, 5) and parse_steps("3:5").count == 2
    assert parse_steps(":2") == StepWindow(0, 2)
    assert parse_steps("3") == StepWindow(3, 4)
    for bad in ("5:3", "3:3", "a:b", "-1:2", "1:2:3", ""):
        with pytest.raises(ValueError, match="steps"):
            parse_steps(bad)


def test_importing_memdiff_imports_no_framework():
    code = "import sys, memdiff, memdiff.recording.integrations; print(sorted({'transformers', 'lightning', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]"


def test_a_bad_window_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--steps", "5:3", "-o", str(tmp_path / "r.pickle"),
                           "--", "python", str(SCENARIOS / "plain_loop.py"), "2"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "STOP must be past START" in done.stderr
    assert not list(tmp_path.iterdir())


def marked_steps(path: Path) -> List[int]:
    """The steps whose markers the snapshot's trace holds, in the order allocated."""
    snapshot = decode(str(path))[0]
    return [e["size"] - MARK for trace in snapshot["device_traces"] for e in trace
            if e["action"] == "alloc" and MARK <= e["size"] < MARK + 1000]


def run(*argv: str, cwd: Path, env: Dict[str, str] = None) -> subprocess.CompletedProcess:
    """A command in a fresh process, memdiff importable from this checkout."""
    return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_record_steps_holds_only_those_steps(torch, tmp_path):
    done = run(sys.executable, "-m", "memdiff", "record", "--steps", "2:4", "-o", "w.pickle", "--",
               "python", str(MARKED), str(SCENARIOS / "plain_loop.py"), "6", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "optimizer steps 2:4" in done.stderr
    assert marked_steps(tmp_path / "w.pickle") == [2, 3]


@pytest.mark.slow
def test_record_steps_in_every_process_of_a_launch(torch, tmp_path):
    # A folder: the command runs as a child, recorded by the rank hook (RANK makes it rank 0).
    done = run(sys.executable, "-m", "memdiff", "record", "--steps", "1:2", "-o", "runs/", "--",
               sys.executable, str(MARKED), str(SCENARIOS / "plain_loop.py"), "3", cwd=tmp_path,
               env={"RANK": "0", "WORLD_SIZE": "1"})
    assert done.returncode == 0, done.stderr
    assert marked_steps(tmp_path / "runs" / "rank0.pickle") == [1]
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["ranks"][0]["state"] == "written" and manifest["ranks"][0]["at"] == "steps 1:2"


@pytest.mark.slow
def test_a_window_never_reached_writes_nothing_and_says_why(torch, tmp_path):
    done = run(sys.executable, "-m", "memdiff", "record", "--steps", "10:12", "-o", "w.pickle", "--",
               "python", str(SCENARIOS / "plain_loop.py"), "3", cwd=tmp_path)
    assert done.returncode == 2
    assert "the window 10:12 was not reached: training ran 3 optimizer step(s)" in done.stderr
    assert not (tmp_path / "w.pickle").exists()


def example(heading: str) -> str:
    """The python block of docs/integrations.md's section `heading`, as a user copies it."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index(f"## {heading}\n"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def framework(name: str) -> None:
    if sys.version_info < (3, 11) and name == "transformers":
        pytest.skip("the test extra's transformers 5.23 needs Python 3.11+")
    try:
        __import__(name)
    except ImportError:
        missing_capture_dependency(f"{name} is not installed (pip install -e '.[test]')")


def gate_against_own_baseline(folder: Path, cwd: Path) -> None:
    """`memdiff baseline` of a callback's job folder, then `memdiff gate` of the folder against it."""
    made = run(sys.executable, "-m", "memdiff", "baseline", str(folder), "-o", "base.json", cwd=cwd)
    assert made.returncode == 0, made.stderr
    gated = run(sys.executable, "-m", "memdiff", "gate", str(folder), "--baseline", "base.json", cwd=cwd)
    assert gated.returncode == 0, gated.stdout + gated.stderr
    assert "PASS" in gated.stdout


def check_job(folder: Path, window: Set[int]) -> int:
    """The job folder a callback wrote: rank 0's snapshot holds exactly the window's steps, and the
    manifest says so; the snapshot's size."""
    assert sorted(set(marked_steps(folder / "rank0.pickle"))) == sorted(window)
    # memdiff reads the window's optimizer steps as its steps, each with its forwards and backwards
    # (Lightning runs the last micro-batch inside optimizer.step(closure))
    steps = memdiff.summarize(folder / "rank0.pickle").devices[0].steps
    assert len(steps) == len(window)
    assert all({"forward", "backward", "optimizer"} <= {p.phase for p in s.phases} for s in steps)
    manifest = json.loads((folder / "memdiff-job.json").read_text())
    assert manifest["world_size"] == 1
    assert manifest["ranks"] == [{"rank": 0, "state": "written", "file": "rank0.pickle", "at": "steps 2:4"}]
    return (folder / "rank0.pickle").stat().st_size


def check_peaks(rows: Dict[int, Dict[str, float]], weights: int) -> None:
    """Per-interval peaks at steps 2, 4 and 6; the 512 MiB spike of step 0 in the first interval
    only (the peak was reset after it); the window's peak, once, at least the AdamW step's
    parameters, gradients and two moments."""
    assert sorted(rows) == [2, 4, 6] and weights > 0
    rss = {step: rows[step]["memory/peak_rss_gib"] for step in rows}
    assert rss[2] - rss[4] > 0.25 and rss[2] - rss[6] > 0.25, rss
    windows = {step: row["memory/window_peak_allocated_gib"] for step, row in rows.items()
               if row.get("memory/window_peak_allocated_gib") is not None}
    assert list(windows) == [4]
    assert windows[4] * GIB >= 4 * weights


@pytest.mark.slow
def test_the_trainer_example_records_its_window_and_logs_peaks(torch, tmp_path):
    framework("transformers")
    (tmp_path / "train_hf.py").write_text(example("Hugging Face Trainer"))
    done = run(sys.executable, str(MARKED), "train_hf.py", cwd=tmp_path,
               env={"MARK_SPIKE_STEP": "0", "MARK_FACTS": "facts.json", "TRANSFORMERS_VERBOSITY": "error"})
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {row["step"]: row for row in history if "loss" in row}
    check_peaks(rows, json.loads((tmp_path / "facts.json").read_text())["weight_bytes"])
    folder = tmp_path / "out-hf" / "memdiff"
    check_job(folder, {2, 3})
    gate_against_own_baseline(folder, tmp_path)


@pytest.mark.slow
def test_the_lightning_example_records_its_window_and_logs_peaks(torch, tmp_path):
    framework("lightning")
    (tmp_path / "train_lightning.py").write_text(example("Lightning"))
    done = run(sys.executable, str(MARKED), "train_lightning.py", cwd=tmp_path,
               env={"MARK_SPIKE_STEP": "0", "MARK_FACTS": "facts.json"})
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "out-lightning" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = {int(r["step"]): {k: float(v) for k, v in r.items() if v and k != "step"} for r in csv.DictReader(f)}
    check_peaks(rows, json.loads((tmp_path / "facts.json").read_text())["weight_bytes"])
    folder = tmp_path / "out-lightning" / "memdiff"
    check_job(folder, {2, 3})
    gate_against_own_baseline(folder, tmp_path)


@pytest.mark.slow
def test_the_extras_allow_no_version_older_than_the_examples_ran_on():
    """Issue 42 item 10: the transformers and lightning extras allow nothing older than the versions
    the test extra pins, which the examples above run on (CI runs them again on the newest):
    `transformers>=4.40` allowed 5.17, where the Trainer example fails (no activation_checkpointing)."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    pins = {r.name: r.specifier for r in map(Requirement, extras["test"])}
    for extra in ("transformers", "lightning"):
        for requirement in map(Requirement, extras[extra]):
            (pin,) = list(pins[requirement.name])
            assert pin.operator == "==", (requirement, pin)
            (floor,) = [s for s in requirement.specifier if s.operator == ">="]
            assert Version(floor.version) == Version(pin.version), (requirement, pin)


def test_a_failed_dump_is_one_warning_and_training_goes_on(torch, tmp_path):
    from memdiff.recording.integrations.monitor import Monitor

    (tmp_path / "rank0.pickle").mkdir()  # where the snapshot goes: it cannot be written
    warnings: List[str] = []
    monitor = Monitor(str(tmp_path), "1:2", rank=0, world_size=1, warn=warnings.append)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.begin(0)
    for step in range(1, 4):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        monitor.step_done(step)
    monitor.end()
    assert len(warnings) == 1 and "could not write" in warnings[0] and "training goes on" in warnings[0]
    manifest = json.loads((tmp_path / "memdiff-job.json").read_text())
    assert manifest["ranks"][0]["state"] == "failed" and "could not write" in manifest["ranks"][0]["error"]


def test_a_folder_that_cannot_be_made_is_one_warning(tmp_path):
    from memdiff.recording.integrations.monitor import Monitor

    (tmp_path / "taken").write_text("a file where the job folder goes")
    warnings: List[str] = []
    monitor = Monitor(str(tmp_path / "taken"), "0:1", rank=0, world_size=1, warn=warnings.append)
    monitor.begin(0)
    monitor.step_done(1)
    monitor.end()
    assert len(warnings) == 1 and "cannot record into" in warnings[0]


@pytest.mark.slow
def test_a_block_that_fails_inside_its_window_writes_what_led_to_it(torch, tmp_path):
    from memdiff.recording.capture import record

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "w.pickle"
    with pytest.raises(RuntimeError, match="out of memory"):
        with record(str(path), steps="1:3"):
            for step in range(3):
                torch.zeros(MARK + step, dtype=torch.uint8)
                model(torch.randn(4, 8)).sum().backward()
                if step == 1:
                    raise RuntimeError("out of memory (as the training would see it)")
                optimizer.step()
    assert marked_steps(path) == [1]


@pytest.mark.slow
def test_the_trainer_callback_runs_ahead_of_the_reporting_callbacks():
    # The Trainer hands each callback's on_log the same dict, reporting integrations (TensorBoard,
    # W&B) before the callbacks passed in: the peaks reach them only from a callback ahead of them.
    framework("transformers")
    from transformers import TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    from memdiff.recording.integrations.transformers import MemdiffCallback

    class Reporter(TrainerCallback):
        seen: List[str] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.extend(logs)

    class Peaks:
        def peaks(self) -> Dict[str, float]:
            return {"memory/peak_allocated_gib": 1.5}

    ours = MemdiffCallback()
    handler = CallbackHandler([DefaultFlowCallback(), Reporter(), ours], None, None, None, None)
    state, control = TrainerState(), TrainerControl()
    handler.on_init_end(None, state, control)
    assert handler.callbacks[0] is ours
    ours.monitor = Peaks()
    state.global_step = 2
    state.log_history.append({"loss": 1.0, "step": 2})
    handler.on_log(None, state, control, {"loss": 1.0})
    assert "memory/peak_allocated_gib" in Reporter.seen
    assert state.log_history[-1]["memory/peak_allocated_gib"] == 1.5


def test_cuda_peaks_are_read_per_device_used():
    # No GPU here: torch.cuda's peak counters, as a process on two devices (current: 1) reads them.
    from types import SimpleNamespace

    from memdiff.recording.integrations.monitor import read_peaks

    allocated, reserved = {0: 3 * GIB, 1: GIB // 2, 2: 0}, {0: 4 * GIB, 1: GIB, 2: 0}
    cuda = SimpleNamespace(device_count=lambda: 3, is_initialized=lambda: True, current_device=lambda: 1,
                           max_memory_allocated=allocated.get, max_memory_reserved=reserved.get)
    assert read_peaks(SimpleNamespace(cuda=cuda)) == {
        "memory/peak_allocated_gib": 0.5, "memory/peak_reserved_gib": 1.0,
        "memory/cuda0/peak_allocated_gib": 3.0, "memory/cuda0/peak_reserved_gib": 4.0,
        "memory/cuda1/peak_allocated_gib": 0.5, "memory/cuda1/peak_reserved_gib": 1.0}
    reserved[0] = 0  # one device used: its figures under the plain keys only
    assert read_peaks(SimpleNamespace(cuda=cuda)) == {"memory/peak_allocated_gib": 0.5,
                                                      "memory/peak_reserved_gib": 1.0}
