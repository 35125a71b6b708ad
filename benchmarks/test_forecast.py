"""memdiff forecast against the cost of reading its runs: three 1M-event snapshots of one loop
at batch 1, 2 and 4 (benchmarks/knob.py), forecast at 8 and 16 with a budget search.

Run with: python -m pytest benchmarks/test_forecast.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_speed import interleaved, load_code, memdiff_code, report

KNOB = Path(__file__).resolve().parent / "knob.py"


@pytest.fixture(scope="session")
def batch_series(grown):
    """Paths of one grown 1M-event run at batch 1, 2 and 4."""
    base = grown(1_000_000)
    paths = []
    for value in (1, 2, 4):
        out = f"{base}.b{value}.pickle"
        if not Path(out).exists():
            subprocess.run([sys.executable, str(KNOB), base, str(value), out], check=True)
        paths.append(out)
    return paths


def test_forecast_of_three_runs_costs_at_most_one_and_a_half_readings(benchmark, batch_series):
    runs = [f"{p}={v}" for p, v in zip(batch_series, (1, 2, 4))]
    reading = ("from memdiff.read.inputs import read_summaries\nfrom memdiff.analyse.classify import load_rules\n"
               f"read_summaries({batch_series!r}, load_rules([]))")
    best = interleaved(benchmark, reading, memdiff_code(["forecast", *runs, "--at", "8", "16", "--budget", "80GiB",
                                                         "--format", "json"]))
    loads = min(__import__("test_speed").timed(load_code(*batch_series))[0] for _ in range(2))
    (read_s, read_kib), (forecast_s, forecast_kib) = best["reference"], best["measured"]
    report(benchmark, read_summaries_s=read_s, three_pickle_loads_s=loads, forecast_s=forecast_s,
           time_ratio=forecast_s / read_s, ratio_to_pickle_loads=forecast_s / loads,
           memory_ratio=forecast_kib / read_kib)
    assert forecast_s / read_s <= 1.5
