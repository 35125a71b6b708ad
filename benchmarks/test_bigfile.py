"""Issue 35: a big snapshot against the cost of reading it, and against its own size.

Grown from the real training snapshot to 1M and 4.16M events (77 MB and 316 MB of pickle), each
command runs in a fresh interpreter as CI runs it, the reference (a bare `pickle.load`) right
before `memdiff summarize` in every round, and the minimums are compared. Time is both wall time
and CPU time (user + system of the child): on a shared machine other work stretches wall times by
2-3x from one minute to the next while CPU times move by a few percent, so the assertions read
CPU time. memdiff's CPU time includes the sha256 of the file, which runs on a second thread and
costs no wall time on an idle machine. Peak memory is VmHWM, against the file's size in bytes.

The issue's targets (time at most 0.5x `pickle.load`, peak memory at most 1.0x the file) hold
at 4.16M events with the optional C reader (docs/performance.md, "Big snapshots"), and are
asserted there. With MEMDIFF_PURE=1 it measures the pure-Python path instead, which does not
reach them: run that way, the targets test is skipped with the reason, and what the pure path
holds is checked plainly: no slower than the load, memory within 1.2x the load's.

Run with: python -m pytest benchmarks/test_bigfile.py -s   (about 3 minutes; 4M events need 2 GB)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest
from test_speed import PEAK_MEMORY, load_code, memdiff_code, report

from memdiff.read import accel

ROUNDS = 3
TARGET_TIME = 0.5  # x pickle.load of the same file
TARGET_MEMORY = 1.0  # x the file's size
SIZES = [1_000_000, 4_160_000]


def timed(code: str) -> Tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak memory in KiB) of `python -c code` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + "\n" + PEAK_MEMORY], capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode in (0, 1), done.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, int(done.stderr.strip().splitlines()[-1])


def measure(benchmark, grown, events: int) -> Dict[str, float]:
    path = grown(events)
    runs: Dict[str, List[Tuple[float, float, int]]] = {"load": [], "memdiff": []}
    benchmark.pedantic(lambda: runs["memdiff"].append(timed(memdiff_code(["summarize", path, "-o", "/dev/null"]))),
                       setup=lambda: runs["load"].append(timed(load_code(path))), rounds=ROUNDS, iterations=1)
    best = {k: [min(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
    (load_wall, load_cpu, load_kib), (wall, cpu, kib) = best["load"], best["memdiff"]
    size = os.path.getsize(path)
    figures = dict(events=events, file_mib=size / 2**20, pickle_load_wall_s=load_wall, summarize_wall_s=wall,
                   pickle_load_cpu_s=load_cpu, summarize_cpu_s=cpu, cpu_vs_pickle_load=cpu / load_cpu,
                   wall_vs_pickle_load=wall / load_wall, pickle_load_mib=load_kib / 1024, summarize_mib=kib / 1024,
                   memory_vs_file=kib * 1024 / size, memory_vs_pickle_load=kib / load_kib)
    report(benchmark, **figures)
    return figures


@pytest.mark.parametrize("events", SIZES)
def test_a_big_snapshot_costs_no_more_than_loading_it(benchmark, grown, events):
    f = measure(benchmark, grown, events)
    assert f["cpu_vs_pickle_load"] <= 1.25  # as benchmarks/test_speed.py: about a pickle.load
    assert f["memory_vs_pickle_load"] <= 1.2


def test_issue_35_targets_at_4m_events(benchmark, grown):
    if accel.reader() is None:
        pytest.skip("issue 35's targets are for the C reader (pure path: about 1.0x and 5.6x); it is not built "
                    "or MEMDIFF_PURE is set")
    f = measure(benchmark, grown, SIZES[-1])
    assert f["cpu_vs_pickle_load"] <= TARGET_TIME, f
    assert f["memory_vs_file"] <= TARGET_MEMORY, f
