"""`memdiff ranks` on a 64-rank job: the parallel efficiency of the map, and its memory.

The job is the real training snapshot grown to 100k events, as rank 1 to 63, and the same grown
to 120k events as rank 0 (the heaviest, so the report has something to say). Each rank file is
its own path and is read and decoded on its own, as with any job.

    T_one   summarizing one 100k-event rank file, in a fresh interpreter, start-up excluded
    T_job   `memdiff ranks JOB`, the whole command
    efficiency = (T_one * 64 / workers) / T_job, workers as memdiff sizes its pool here

Run with: python -m pytest benchmarks/test_ranks.py
"""

from __future__ import annotations

import os
import subprocess
import sys

from test_speed import PEAK_MEMORY, report

RANKS = 64
ONE = """
import sys, timeit
from memdiff.classify import load_rules
from memdiff.inputs import read_summary
rules = load_rules()
print(min(timeit.repeat(lambda: read_summary(sys.argv[1], rules), number=1, repeat=3)))
"""
JOB = """
import resource, sys, time
from memdiff.cli import main
start = time.perf_counter()
code = main(["ranks", sys.argv[1], "--format", "json"])
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
"""


def test_ranks_of_a_64_rank_job_run_in_parallel_in_bounded_memory(benchmark, grown, tmp_path):
    from memdiff.inputs import worker_count

    rank_file, heavy = grown(100_000), grown(120_000)
    job = tmp_path / "job"
    job.mkdir()
    for rank in range(RANKS):
        os.symlink(heavy if rank == 0 else rank_file, job / f"rank{rank}.pickle")
    workers = worker_count([os.path.getsize(rank_file)] * RANKS)

    one = subprocess.run([sys.executable, "-c", ONE + PEAK_MEMORY, rank_file], capture_output=True, text=True,
                         check=True)
    t_one, one_kib = float(one.stdout), int(one.stderr.strip().splitlines()[-1])

    def whole_job():
        done = subprocess.run([sys.executable, "-c", JOB + PEAK_MEMORY, str(job)], capture_output=True, text=True,
                              check=True)
        timing, memory = done.stderr.strip().splitlines()[-2:]
        wall, worker_kib = timing.split()
        return float(wall), int(worker_kib), int(memory), done.stdout

    runs = [benchmark.pedantic(whole_job, rounds=1, iterations=1)] + [whole_job() for _ in range(1)]
    t_job, worker_kib, parent_kib, out = min(runs)
    efficiency = t_one * RANKS / workers / t_job
    report(benchmark, cores=os.cpu_count() or 1, workers=workers, one_rank_s=t_one, job_s=t_job,
           efficiency=efficiency, one_rank_mib=one_kib / 1024, job_parent_mib=parent_kib / 1024,
           job_worker_max_mib=worker_kib / 1024)
    assert '"heaviest_rank": 0' in out
    assert efficiency > 0.5
    # Only summaries cross back: neither the parent nor a worker holds more than one rank's worth.
    assert parent_kib < 3 * one_kib and worker_kib < 3 * one_kib
