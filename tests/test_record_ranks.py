"""`memdiff record -o DIR/ -- LAUNCHER ...`: every Python process the launcher starts is recorded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from memdiff.load import load

DDP_TRAIN = ROOT / "tests" / "scenarios" / "ddp_train.py"


def record(cwd: Path, output: str, *command: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", output, "--", *command], cwd=cwd,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


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
    assert sorted(p.name for p in runs.iterdir()) == ["rank0.pickle", "rank1.pickle"]
    assert "memdiff: wrote 2 snapshots to runs/ (rank0.pickle" in done.stderr
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
    assert "recorded an allocation (none imported torch?); nothing written to runs/" in done.stderr
    assert existing.read_bytes() == b"an earlier run"  # never replaced by a recording of nothing


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


def test_a_launcher_with_a_file_output_or_a_missing_command_is_one_line(tmp_path):
    done = record(tmp_path, "run.pickle", "torchrun", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "give a folder: -o runs/" in done.stderr
    done = record(tmp_path, "runs/", "no-such-launcher", "train.py")
    assert done.returncode == 2 and "no-such-launcher: no such command" in done.stderr
    assert not (tmp_path / "runs").exists()
