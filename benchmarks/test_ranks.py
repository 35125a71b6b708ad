"""`memdiff ranks` on a 64-rank job: the parallel efficiency of the map, and its memory.

The job: ranks 1 to 63 are the real ctx128 training snapshot grown to 100k events; rank 0 is the
same model's ctx256 run grown to 100k events too, so it costs the same to read but peaks about
25% higher (activations): the report has a real heaviest rank, a spread and two roles, and the
test checks that it finds them. The rank files are symbolic links to those two files; each path
is opened, decoded and summarized on its own, as with 64 distinct files (all are in the page
cache either way, having just been written).

Every round measures, in alternation (the machine is shared, so both see the same load):

    T_one   summarizing one 100k-event rank file (`read_summary`), in a fresh interpreter,
            start-up excluded: the minimum of 3 calls; its peak memory (VmHWM) is that of
            summarizing one file alone
    T_job   `memdiff ranks JOB --format json` (what `python -m memdiff` runs), the whole
            command in a fresh interpreter, start-up included, timed from outside

    efficiency = (T_one * 64 / workers) / T_job, workers as memdiff sizes its pool here

and the minimums over the rounds are compared. Peak memory of the command: the parent's own
VmHWM, and the largest worker's ru_maxrss (RUSAGE_CHILDREN reports the largest single
descendant, not a sum: the whole tree holds at most the parent plus `workers` times that).

Run with: python -m pytest benchmarks/test_ranks.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from test_speed import PEAK_MEMORY, report

RANKS = 64
EVENTS = 100_000
ROUNDS = 3
GROW = Path(__file__).resolve().parent / "grow.py"
HEAVY_SOURCE = Path(__file__).resolve().parents[2] / "shared" / "snapshots" / "cs336-medium-ctx256-train.pickle"

ONE = """
import sys, timeit
from memdiff.analyse.classify import load_rules
from memdiff.read.inputs import read_summary
rules = load_rules()
print(min(timeit.repeat(lambda: read_summary(sys.argv[1], rules), number=1, repeat=3)))
"""
# `python -m memdiff ranks JOB --format json`, then the parent's peak (PEAK_MEMORY) and the
# largest worker's, its pool having been joined by then.
JOB = """
import resource, sys
from memdiff.cli import main
code = main(["ranks", sys.argv[1], "--format", "json"])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
"""


def make_job(folder: Path, rank_file: str, heavy_file: str) -> Path:
    job = folder / "job"
    job.mkdir()
    for rank in range(RANKS):
        os.symlink(heavy_file if rank == 0 else rank_file, job / f"rank{rank}.pickle")
    return job


def test_ranks_of_a_64_rank_job_run_in_parallel_in_bounded_memory(benchmark, grown, tmp_path):
    from memdiff.read.inputs import PARALLEL_MIN_BYTES, worker_count

    rank_file = grown(EVENTS)
    if not HEAVY_SOURCE.is_file():
        pytest.skip(f"the real snapshot to grow is missing: {HEAVY_SOURCE}")
    heavy_file = str(tmp_path / f"ctx256-{EVENTS}.pickle")
    subprocess.run([sys.executable, str(GROW), str(HEAVY_SOURCE), str(EVENTS), heavy_file], check=True)
    job = make_job(tmp_path, rank_file, heavy_file)
    sizes = [os.path.getsize(job / f"rank{rank}.pickle") for rank in range(RANKS)]
    workers = worker_count(sizes)  # as read_summaries sizes its pool for this job
    assert workers >= 2 and sum(sizes) >= PARALLEL_MIN_BYTES, "the job would be read serially here"

    runs: Dict[str, List[Tuple[float, ...]]] = {"one": [], "job": []}
    outputs: List[str] = []

    def one_rank() -> None:
        done = subprocess.run([sys.executable, "-c", ONE + PEAK_MEMORY, rank_file], capture_output=True, text=True,
                              check=True)
        runs["one"].append((float(done.stdout), int(done.stderr.strip().splitlines()[-1])))

    def whole_job() -> None:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", JOB + PEAK_MEMORY, str(job)], capture_output=True, text=True)
        wall = time.perf_counter() - start
        assert done.returncode == 0, done.stderr
        worker_kib, parent_kib = (int(line) for line in done.stderr.strip().splitlines()[-2:])
        runs["job"].append((wall, parent_kib, worker_kib))
        outputs.append(done.stdout)

    benchmark.pedantic(whole_job, setup=one_rank, rounds=ROUNDS, iterations=1)
    t_one, one_kib = (min(column) for column in zip(*runs["one"]))
    t_job, parent_kib, worker_kib = (min(column) for column in zip(*runs["job"]))
    efficiency = t_one * RANKS / workers / t_job
    report(benchmark, cores=os.cpu_count() or 1, workers=workers, job_mb=sum(sizes) / 1e6, one_rank_s=t_one,
           ideal_s=t_one * RANKS / workers, job_s=t_job, efficiency=efficiency, one_rank_mib=one_kib / 1024,
           job_parent_mib=parent_kib / 1024, job_largest_worker_mib=worker_kib / 1024,
           job_tree_at_most_mib=(parent_kib + workers * worker_kib) / 1024)

    result = json.loads(outputs[-1])
    assert [r["rank"] for r in result["ranks"]] == list(range(RANKS))
    assert result["heaviest_rank"] == 0 and result["max_over_median"] > 1.1  # the ctx256 rank, found
    assert efficiency > 0.5
    # Only summaries cross back: neither the parent nor a worker holds more than one rank's worth,
    # however many ranks the job has.
    assert parent_kib < 3 * one_kib and worker_kib < 3 * one_kib
