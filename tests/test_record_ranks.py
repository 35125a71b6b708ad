"""`memdiff record -o DIR/ -- LAUNCHER ...`: every Python process the launcher starts is recorded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from memdiff.read.load import load

# Slow (the fast loop, -m "not slow", leaves it out): launches recorded jobs (torchrun).
pytestmark = pytest.mark.slow

DDP_TRAIN = ROOT / "tests" / "scenarios" / "ddp_train.py"


def record(cwd: Path, output: str, *command: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", output, "--", *command], cwd=cwd,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def torchrun(*args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *args]


def as_rank(rank: int, world_size: int) -> dict:
    """The environment a launcher gives rank `rank`: a plain script run this way is that rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_records_every_rank_and_rank0s_extra_buffer_tops_memdiff_ranks(torch, tmp_path):
    done = record(tmp_path, "runs/", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(DDP_TRAIN))
    assert done.returncode == 0, done.stderr
    runs = tmp_path / "runs"
    # The launcher's own process imports torch but allocates nothing: it writes no file.
    assert sorted(p.name for p in runs.iterdir()) == ["memdiff-job.json", "rank0.pickle", "rank1.pickle"]
    assert "memdiff: wrote 2 snapshots of a job of 2 ranks to runs/ (rank0.pickle" in done.stderr
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    # Each rank stopped recording when the script destroyed its process group, before gloo's
    # threads were joined.
    assert manifest["world_size"] == 2
    assert [(r["rank"], r["state"], r["at"]) for r in manifest["ranks"]] == [
        (0, "written", "destroy_process_group"), (1, "written", "destroy_process_group")]
    for rank in (0, 1):
        assert any(load(str(runs / f"rank{rank}.pickle")).device_traces)
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", str(runs)], capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr
    lines = ranks.stdout.splitlines()
    assert next(line for line in lines if line.startswith("0 ")).startswith("0 heaviest")
    first_row = lines[lines.index(next(line for line in lines if line.startswith("status"))) + 2]
    assert first_row.startswith("NEW") and "ddp_train.py:keep_rank0_buffer" in first_row and "+8.00 MiB" in first_row


def test_a_process_that_never_imports_torch_is_not_slowed_and_writes_nothing(torch, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import sys\nprint('torch' in sys.modules)\n")
    existing = tmp_path / "runs" / "rank0.pickle"
    existing.parent.mkdir()
    existing.write_bytes(b"an earlier run")
    done = record(tmp_path, "runs/", sys.executable, str(script))
    assert done.returncode == 2 and done.stdout == "False\n"
    # The cause, from what the process said of itself, never a guess.
    assert f"`{sys.executable} {script}`) never imported torch; nothing written to runs/" in done.stderr
    assert "?" not in done.stderr
    assert existing.read_bytes() == b"an earlier run"  # never replaced by a recording of nothing


def test_a_lone_process_that_never_reaches_the_window_says_so(torch, tmp_path):
    """`-o DIR/` with a window, one process (no launcher, so no rank and no manifest): the process
    says the window was not reached and how many steps ran, and memdiff record no longer guesses
    that torch was never imported."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nw = torch.nn.Parameter(torch.ones(64))\nopt = torch.optim.SGD([w], lr=0.1)\n"
                      "for _ in range(6):\n    (w * 2).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--steps", "7:9", "-o", "runs/", "--",
                           sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr
    assert (f"`{sys.executable} {script}`) the window 7:9 was not reached: 6 optimizer step(s) ran; "
            f"nothing written to runs/") in done.stderr
    assert "none imported torch" not in done.stderr


def test_the_users_own_sitecustomize_still_runs(torch, tmp_path):
    mine = tmp_path / "site"
    mine.mkdir()
    # memdiff itself is a Python process on the same PYTHONPATH: only the recorded script says so.
    (mine / "sitecustomize.py").write_text("import sys\nif sys.argv[0].endswith('train.py'):\n"
                                           "    print('user sitecustomize ran')\n")
    script = tmp_path / "train.py"
    script.write_text("import torch\nkeep = torch.ones(1024)\n")
    done = record(tmp_path, "runs/", sys.executable, str(script), env={"PYTHONPATH": str(mine)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "user sitecustomize ran\n"
    [written] = (tmp_path / "runs").iterdir()  # no RANK in a plain run: named after the process
    assert written.name.startswith("pid") and written.name.endswith(".pickle")
    # No job to read with `memdiff ranks`: the hint names the file to read.
    assert f"read one with `memdiff peak {os.path.join('runs/', written.name)}`" in done.stderr


def test_a_launcher_with_a_file_output_or_a_missing_command_is_one_line(tmp_path):
    done = record(tmp_path, "run.pickle", "torchrun", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "give a folder: -o runs/" in done.stderr
    done = record(tmp_path, "runs/", "no-such-launcher", "train.py")
    assert done.returncode == 2 and "no-such-launcher: no such command" in done.stderr
    assert not (tmp_path / "runs").exists()


RAISING_RANK = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
kept = torch.ones(1 << 20)
dist.barrier()
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails")
dist.barrier()  # rank 0 waits here for a rank that is gone: torchrun ends it with SIGTERM
"""


def test_a_rank_that_raises_leaves_both_ranks_files_and_a_failing_exit(torch, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(RAISING_RANK)
    done = record(tmp_path, "runs/", *torchrun(str(script)))
    assert done.returncode != 0
    runs = tmp_path / "runs"
    for rank in (0, 1):  # the run people debug: every rank's memory up to the failure
        assert any(load(str(runs / f"rank{rank}.pickle")).device_traces), done.stderr
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    assert [r["state"] for r in manifest["ranks"]] == ["written", "written"]
    assert manifest["exit_status"] == done.returncode
    assert "has no snapshot" not in done.stderr
    # Read later, the job is what people debug, never a run to gate or to keep as a baseline.
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert ranks.returncode == 0 and f"the recorded job ended with exit status {done.returncode}" in ranks.stderr
    kept = subprocess.run([sys.executable, "-m", "memdiff", "baseline", "runs/", "-o", "b.json"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert kept.returncode == 2 and "so it is no run to gate or keep as a baseline" in kept.stderr
    assert not (tmp_path / "b.json").exists()


def test_sigterm_to_a_rank_writes_its_snapshot(torch, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, time, torch\nkept = torch.ones(1 << 20)\n"
                      "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(60)\n")
    done = record(tmp_path, "runs/", sys.executable, str(script), env=as_rank(0, 1))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr  # the rank's own end, passed on
    snapshot = load(str(tmp_path / "runs" / "rank0.pickle"))
    assert max(e["size"] for e in snapshot.device_traces[-1] if e["action"] == "alloc") == 4 << 20
    [rank] = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())["ranks"]
    assert (rank["state"], rank["at"]) == ("written", "SIGTERM")


PARENT = """
import subprocess, sys, torch
kept = torch.ones(1 << 20)  # 4 MiB: the rank's own
subprocess.run([sys.executable, "-c", "import torch; worker = torch.ones(4 << 20)"], check=True)  # 16 MiB
"""


def test_a_child_that_inherits_rank_never_overwrites_the_ranks_file(torch, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    done = record(tmp_path, "runs/", sys.executable, str(script), env=as_rank(0, 1))
    assert done.returncode == 0, done.stderr
    runs = tmp_path / "runs"
    [child_file] = [p.name for p in runs.iterdir() if p.name.startswith("pid")]
    # The spawned child inherited RANK=0 and wrote its own per-process file.
    assert sorted(p.name for p in runs.iterdir()) == ["memdiff-job.json", child_file, "rank0.pickle"]
    rank0 = load(str(runs / "rank0.pickle")).device_traces[-1]
    assert max(e["size"] for e in rank0 if e["action"] == "alloc") == 4 << 20
    child = load(str(runs / child_file)).device_traces[-1]
    assert max(e["size"] for e in child if e["action"] == "alloc") == 16 << 20
    # Reading the job takes the rank and says what it left out.
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", str(runs)], capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr
    assert f"1 per-process file ({child_file}) is no rank: not read" in ranks.stderr


def test_a_rank_without_a_snapshot_is_named_and_fails_the_recording(torch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nkept = torch.ones(1 << 20)\n")
    # Rank 0 of a job of 2 whose rank 1 never ran: the recording is not a success.
    done = record(tmp_path, "runs/", sys.executable, str(script), env=as_rank(0, 2))
    assert done.returncode == 2
    assert "memdiff: wrote 1 snapshot of a job of 2 ranks" in done.stderr
    assert "memdiff: rank 1 of 2 has no snapshot: its process never ran memdiff's hook" in done.stderr
    # Read later, the job's manifest still says a rank is missing, the last one included.
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert ranks.returncode == 2 and ranks.stderr.count("\n") == 1
    assert "1 rank missing of 0-1 (its memdiff-job.json says 2): 1" in ranks.stderr
    # A rank whose write fails (here its file's name is taken by a folder) is named with the reason.
    (tmp_path / "again" / "rank0.pickle").mkdir(parents=True)
    done = record(tmp_path, "again/", sys.executable, str(script), env=as_rank(0, 1))
    assert done.returncode == 2
    assert "memdiff: rank 0 of 1 has no snapshot: its snapshot could not be written: " in done.stderr


def _sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Whom the Ctrl-C reaches: memdiff alone (a CI runner's cancel); memdiff started with SIGINT ignored (in
# the background of a shell script: its job once inherited that and slept through the Ctrl-C memdiff
# passed on); the whole process group (a terminal's Ctrl-C: the job gets it twice, the second while
# it writes).
@pytest.mark.parametrize("to", ["memdiff", "memdiff, started with SIGINT ignored", "the process group"])
def test_ctrl_c_reaches_the_job_and_what_was_recorded_is_written(torch, tmp_path, to):
    script = tmp_path / "long.py"
    # The job says when it is under way (torch imported, memory allocated), then sleeps far longer than
    # the test could wait for it: it ends early only if the Ctrl-C reaches it.
    script.write_text("import pathlib, time, torch\nkept = torch.ones(1 << 20)\n"
                      "pathlib.Path('started').touch()\ntime.sleep(3600)\n")
    child = subprocess.Popen([sys.executable, "-m", "memdiff", "record", "-o", "runs/", "--", sys.executable,
                              str(script)], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **as_rank(0, 1)}, start_new_session=True,
                             preexec_fn=_sigint_ignored if "ignored" in to else None)
    try:
        while not (tmp_path / "started").exists():
            assert child.poll() is None, child.stderr.read()
            time.sleep(0.1)
        if to == "the process group":
            os.killpg(child.pid, signal.SIGINT)
        else:
            child.send_signal(signal.SIGINT)  # memdiff must pass it on
        assert child.wait(timeout=600) == 130, child.stderr.read()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert any(load(str(tmp_path / "runs" / "rank0.pickle")).device_traces)
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["exit_status"] == 130 and manifest["ranks"][0]["state"] == "written"


def test_peak_of_a_cpu_recording_shows_no_reserved_figure(torch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nkept = torch.ones(1 << 20)\nx = torch.ones(2 << 20)\n")
    done = record(tmp_path, "run.pickle", sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    peak = subprocess.run([sys.executable, "-m", "memdiff", "peak", "run.pickle"], capture_output=True, text=True,
                          cwd=tmp_path)
    at_dump = next(line for line in peak.stdout.splitlines() if line.startswith("at dump"))
    # The profiler's one synthetic segment spans terabytes of addresses; no allocator reserved them.
    assert "reserved" not in at_dump and "no caching allocator" in at_dump
    summary = json.loads(subprocess.run([sys.executable, "-m", "memdiff", "summarize", "run.pickle"],
                                        capture_output=True, text=True, cwd=tmp_path).stdout)
    assert summary["devices"][0]["reserved_bytes_at_dump"] is None


EXITING = """
import os, signal, threading, time, torch
kept = [torch.ones(16) for _ in range(10_000)]  # enough allocations that converting them takes seconds
done = threading.Event()

def terminate_while_exiting():  # torchrun's SIGTERM to the other ranks, while this one exits
    done.wait()
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=terminate_while_exiting, daemon=True).start()
done.set()
raise SystemExit(1)
"""


def test_sigterm_while_a_rank_writes_at_exit_waits_for_the_write(torch, tmp_path):
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    done = record(tmp_path, "runs/", sys.executable, str(script), env=as_rank(0, 1))
    assert done.returncode in (1, 128 + signal.SIGTERM), done.stderr
    assert any(load(str(tmp_path / "runs" / "rank0.pickle")).device_traces), done.stderr
    [rank] = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())["ranks"]
    assert rank["state"] == "written"
