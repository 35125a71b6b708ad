"""Stress Ctrl-C on `memdiff record` under load: cancelled at a random moment, it ends, and writes what was recorded.

    python benchmarks/stress_cancel.py --runs 10 [--modes file launcher emulated-file emulated-launcher]
                                       [--within 60] [--latest 20] [--keep DIR]

Starts `nproc` busy-loop processes for the whole run, then for each mode records a job that keeps
4 MiB on its device and then sleeps for an hour (it ends early only if the Ctrl-C reaches it):

- file: `memdiff record -o run.pickle -- python job.py` (one process, recorded in memdiff's own)
- folder: `memdiff record -o runs/ -- python job.py` as rank 0 of 1 (one process, a child of memdiff's)
- launcher: `memdiff record -o runs/ -- python -m torch.distributed.run --nproc-per-node 2 job.py`
- emulated-file, emulated-launcher: the same with `--emulate h100` (the job's tensors on "cuda")

Each run sends SIGINT at a random moment within --latest seconds of the start (while memdiff starts,
while the job starts, imports torch, or sleeps), to memdiff alone (a CI runner's cancel) or to its
whole process group (a terminal's Ctrl-C), or to memdiff started with SIGINT ignored (the
background of a shell script), chosen at random. The job says when it has allocated (a
file per process): a run cancelled after that must write every snapshot. Prints one line per run and
per mode the counts: cancels, ended within --within seconds, exit 130, and snapshots written of the
runs cancelled after the job allocated. Exits 1 if any run did not end in time, exited otherwise
than 130, or lost a snapshot it had recorded. Not part of the default test run (it takes minutes);
docs/recording.md gives its last figures.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
MODES = ("file", "folder", "launcher", "emulated-file", "emulated-launcher")

JOB = """
import os, pathlib, sys, time, torch
kept = torch.ones(1 << 20, device=sys.argv[1])
pathlib.Path(f"allocated-{os.getpid()}").touch()
time.sleep(3600)
"""
BUSY = "while True: pass"
# Whom the Ctrl-C reaches: memdiff (a CI runner's cancel), its process group (a terminal's Ctrl-C), or
# memdiff started with SIGINT ignored (in the background of a shell script), which must still stop.
TO = ("memdiff", "its process group", "memdiff started with SIGINT ignored")


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(mode: str, folder: Path) -> List[str]:
    """The memdiff record command line of a mode, run in `folder`."""
    emulate = ["--emulate", "h100"] if mode.startswith("emulated") else []
    device = "cuda" if emulate else "cpu"
    if mode == "folder":
        return [sys.executable, "-m", "memdiff", "record", "-o", "runs/", "--", sys.executable, "job.py", device]
    if mode.endswith("launcher"):
        job = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), "job.py", device]
        return [sys.executable, "-m", "memdiff", "record", *emulate, "-o", "runs/", "--", *job]
    return [sys.executable, "-m", "memdiff", "record", *emulate, "-o", "run.pickle", "--", sys.executable,
            "job.py", device]


def one_run(mode: str, folder: Path, rng: random.Random, within: float, latest: float) -> Dict[str, object]:
    """Cancel one recording at a random moment: what happened."""
    folder.mkdir(parents=True)
    (folder / "job.py").write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if mode == "folder":  # the rank of a job of one, as tests/test_record_ranks.py's Ctrl-C test runs it
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    ranks = 2 if mode.endswith("launcher") else 1
    to = rng.choice(TO)
    delay = rng.uniform(0, latest)
    # A session of its own: the group a terminal's Ctrl-C would reach, and all of it killed if it hangs.
    child = subprocess.Popen(command(mode, folder), cwd=folder, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=_sigint_ignored if to == TO[2] else None)
    start = time.monotonic()
    while time.monotonic() - start < delay and child.poll() is None:
        time.sleep(0.01)
    allocated = len(list(folder.glob("allocated-*")))
    # Each rank process (and, under a launcher, the launcher itself allocates nothing) touches one file.
    after_allocation = allocated >= ranks
    if to == TO[1]:
        os.killpg(child.pid, signal.SIGINT)
    else:
        child.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        _, err = child.communicate(timeout=within)
        ended = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, err = child.communicate()
        ended = None
    (folder / "stderr.txt").write_text(err)
    if mode == "folder" or mode.endswith("launcher"):
        written = sum((folder / "runs" / f"rank{r}.pickle").is_file() for r in range(ranks))
    else:
        written = int((folder / "run.pickle").is_file())
    return {"delay": delay, "to": to, "after_allocation": after_allocation,
            "ended": ended, "status": child.returncode, "written": written, "ranks": ranks,
            "last": (err.strip().splitlines() or [""])[-1][:160]}


def stopped(run: Dict[str, object]) -> bool:
    """Whether the run ended as Ctrl-C ends a command: exit 130, or killed by SIGINT before memdiff's
    own code ran (Python starting), which a shell reports as 130 too."""
    return run["status"] in (130, -signal.SIGINT)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="cancels per mode (default: 10)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--within", type=float, default=60, help="seconds a cancelled run may take to end (default: 60)")
    p.add_argument("--latest", type=float, default=30,
                   help="the Ctrl-C comes at a random moment up to this many seconds after the start (default: 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="keep each run's folder here (default: a temporary folder)")
    args = p.parse_args(argv)
    # Our children start with Ctrl-C at its default, whatever this process inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    base = args.keep or Path(tempfile.mkdtemp(prefix="memdiff-cancel-"))
    rng = random.Random(args.seed)
    load = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(os.cpu_count() or 1)]
    bad = 0
    try:
        for mode in args.modes:
            runs = []
            for i in range(args.runs):
                run = one_run(mode, base / f"{mode}-{i}", rng, args.within, args.latest)
                runs.append(run)
                problem = ("did not end" if run["ended"] is None else f"exit {run['status']}" if not stopped(run)
                           else "lost a snapshot" if run["after_allocation"] and run["written"] < run["ranks"]
                           else "")
                bad += bool(problem)
                ended = "-" if run["ended"] is None else f"{run['ended']:.1f} s"
                print(f"{mode} #{i + 1}: SIGINT to {run['to']} at {run['delay']:.1f} s "
                      f"({'after' if run['after_allocation'] else 'before'} the job allocated): ended in {ended}, "
                      f"exit {run['status']}, {run['written']}/{run['ranks']} written"
                      + (f"  <- {problem}: {run['last']}" if problem else ""), flush=True)
            after = [r for r in runs if r["after_allocation"]]
            print(f"{mode}: {len(runs)} cancels, {sum(r['ended'] is not None for r in runs)} ended within "
                  f"{args.within:.0f} s (slowest {max((r['ended'] or args.within) for r in runs):.1f} s), "
                  f"{sum(stopped(r) for r in runs)} exit 130; {len(after)} cancelled after the job "
                  f"allocated: {sum(r['written'] == r['ranks'] for r in after)} wrote every snapshot", flush=True)
    finally:
        for busy in load:
            busy.kill()
            busy.wait()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
