"""Stress `memdiff record -o DIR/` on torchrun jobs: every rank's file, every time, and no hang.

    python benchmarks/stress_record.py --runs 30 --ranks 2 4 [--timeout 180] [--keep DIR]

Each run records tests/scenarios/ddp_train.py (the example GPT under DDP on gloo, CPU) with N
ranks under a wall-clock timeout, then checks what a CI job relies on: memdiff exits 0, every
rank 0..N-1 left rank{R}.pickle and memdiff-job.json says N ranks, all written. It prints one
line per run and the counts per rank count; it exits 1 if any run hung, lost a rank or failed.
Not part of the default test run (it takes minutes); docs/recording.md gives its last figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scenarios" / "ddp_train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(folder: Path, ranks: int, timeout: float) -> str:
    """'ok', or what went wrong: 'hung', 'exit N', 'missing ranks ...', 'manifest ...'."""
    command = [sys.executable, "-m", "memdiff", "record", "-o", f"{folder}/", "--", sys.executable, "-m",
               "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(SCRIPT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    # A session of its own, so that a hung job's every process can be killed.
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.communicate()
        return "hung"
    missing = [r for r in range(ranks) if not (folder / f"rank{r}.pickle").is_file()]
    if missing:
        return f"missing ranks {missing}: {err.strip().splitlines()[-1:]}"
    if child.returncode != 0:
        return f"exit {child.returncode}: {err.strip().splitlines()[-1:]}"
    manifest = json.loads((folder / "memdiff-job.json").read_text())
    states = [r["state"] for r in manifest["ranks"]]
    if manifest["world_size"] != ranks or states != ["written"] * ranks:
        return f"manifest says {manifest['world_size']} ranks, {states}"
    return "ok" if "refused this run's records" not in err else "ok (built from allocation events)"


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30, help="recordings per rank count (default: 30)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts (default: 2 4)")
    p.add_argument("--timeout", type=float, default=180, help="seconds before a run counts as hung")
    p.add_argument("--keep", type=Path, help="keep each run's folder here (default: a temporary folder)")
    args = p.parse_args(argv)
    base = args.keep or Path(tempfile.mkdtemp(prefix="memdiff-stress-"))
    bad = 0
    for ranks in args.ranks:
        outcomes: Counter = Counter()
        seconds = []
        for i in range(args.runs):
            start = time.monotonic()
            outcome = one_run(base / f"ranks{ranks}-run{i}", ranks, args.timeout)
            seconds.append(time.monotonic() - start)
            outcomes["ok" if outcome.startswith("ok") else outcome.split(":")[0]] += 1
            bad += not outcome.startswith("ok")
            print(f"{ranks} ranks, run {i + 1}/{args.runs}: {outcome} ({seconds[-1]:.1f} s)", flush=True)
        failed = ", ".join(f"{k}: {v}" for k, v in outcomes.items() if k != "ok")
        print(f"{ranks} ranks: {outcomes['ok']} of {args.runs} wrote every rank's file" + (f"; {failed}" if failed else "")
              + f" (median {sorted(seconds)[len(seconds) // 2]:.1f} s, max {max(seconds):.1f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
