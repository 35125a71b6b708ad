"""memdiff against the cost of reading the file: ratios measured in one run, on this machine.

Each command runs in a fresh interpreter, as CI runs it, and reports its own peak memory
(VmHWM, which exec resets; ru_maxrss can carry the parent's). Every round runs the reference
(a bare pickle.load) right before memdiff, and the minimums over the rounds are compared:
the figures least disturbed by other load on a shared machine.

Run with: python -m pytest benchmarks
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

ROUNDS = 5
PEAK_MEMORY = """
import resource, sys
try:
    kib = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))
except OSError:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(kib, file=sys.stderr)
"""


def timed(code: str) -> Tuple[float, int]:
    """(wall seconds, peak memory in KiB) of `python -c code` in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + "\n" + PEAK_MEMORY], capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert done.returncode in (0, 1), done.stderr
    return wall, int(done.stderr.strip().splitlines()[-1])


def load_code(*paths: str) -> str:
    return "import pickle\n" + "".join(f"pickle.load(open({p!r}, 'rb'))\n" for p in paths)


def memdiff_code(argv: List[str]) -> str:
    return f"from memdiff.__main__ import run\nrun({argv!r})  # as the memdiff command runs"


def interleaved(benchmark, reference: str, measured: str, rounds: int = ROUNDS) -> Dict[str, Tuple[float, int]]:
    """Best (time, memory) of `reference` and `measured`, run in alternation; memdiff's timed by pytest-benchmark."""
    runs: Dict[str, List[Tuple[float, int]]] = {"reference": [], "measured": []}
    benchmark.pedantic(lambda: runs["measured"].append(timed(measured)),
                       setup=lambda: runs["reference"].append(timed(reference)), rounds=rounds, iterations=1)
    return {k: (min(w for w, _ in v), min(m for _, m in v)) for k, v in runs.items()}


def report(benchmark, **figures: float) -> None:
    benchmark.extra_info.update({k: round(v, 3) for k, v in figures.items()})
    print("\n" + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))


@pytest.mark.parametrize("events", [20_000, 200_000, 1_000_000])
def test_summarize_costs_about_a_pickle_load(benchmark, grown, events):
    path = grown(events)
    best = interleaved(benchmark, load_code(path), memdiff_code(["summarize", path, "-o", "/dev/null"]))
    (load_s, load_kib), (summ_s, summ_kib) = best["reference"], best["measured"]
    report(benchmark, pickle_load_s=load_s, summarize_s=summ_s, time_ratio=summ_s / load_s,
           pickle_load_mib=load_kib / 1024, summarize_mib=summ_kib / 1024, memory_ratio=summ_kib / load_kib)
    if events == 1_000_000:
        assert summ_s / load_s <= 1.25
        assert summ_kib / load_kib <= 1.2


def test_diff_of_two_runs_costs_less_than_loading_both(benchmark, grown):
    a, b = grown(1_000_000), grown(1_000_000, copy="-head")
    best = interleaved(benchmark, load_code(a, b), memdiff_code([a, b, "--top", "5"]))
    (load_s, _), (diff_s, _) = best["reference"], best["measured"]
    report(benchmark, two_pickle_loads_s=load_s, diff_s=diff_s, time_ratio=diff_s / load_s)
    assert diff_s / load_s <= 1.0


def test_gzip_costs_only_its_decompression(benchmark, grown):
    raw, gz = grown(1_000_000), grown(1_000_000, gz=True)
    best = interleaved(benchmark, memdiff_code(["summarize", raw, "-o", "/dev/null"]),
                       memdiff_code(["summarize", gz, "-o", "/dev/null"]))
    decompress = min(timed(f"import gzip\ngzip.open({gz!r}).read()")[0] - timed("pass")[0] for _ in range(ROUNDS))
    extra = best["measured"][0] - best["reference"][0]
    report(benchmark, summarize_s=best["reference"][0], summarize_gzip_s=best["measured"][0], extra_s=extra,
           decompression_s=decompress)
    assert extra <= decompress * 1.1 + 0.05  # two timings' worth of noise


def test_cost_grows_linearly(benchmark, grown):
    """In-process, start-up excluded: seconds per event at 1M within 1.5x of those at 20k."""
    code = ("import sys, time\nfrom memdiff.analyse.classify import load_rules\nfrom memdiff.read.inputs import read_summary\n"
            "rules = load_rules()\nbest = min(__import__('timeit').repeat(lambda: read_summary(sys.argv[1], rules), "
            "number=1, repeat=3))\nprint(best / int(sys.argv[2]))")

    def per_event(events: int) -> float:
        done = subprocess.run([sys.executable, "-c", code, grown(events), str(events)], capture_output=True,
                              text=True, check=True)
        return float(done.stdout)

    small = per_event(20_000)
    large = benchmark.pedantic(lambda: per_event(1_000_000), rounds=1, iterations=1)
    report(benchmark, us_per_event_20k=small * 1e6, us_per_event_1m=large * 1e6, ratio=large / small)
    assert large / small <= 1.5


def test_html_report_of_two_runs_costs_at_most_a_quarter_more_than_the_diff(benchmark, grown, tmp_path):
    a, b = grown(1_000_000), grown(1_000_000, copy="-head")
    page = tmp_path / "report.html"
    best = interleaved(benchmark, memdiff_code([a, b, "--top", "5"]),
                       memdiff_code([a, b, "--top", "5", "--html", str(page)]))
    (diff_s, diff_kib), (html_s, html_kib) = best["reference"], best["measured"]
    size_mib = page.stat().st_size / 2**20
    report_figures = dict(diff_s=diff_s, html_s=html_s, time_ratio=html_s / diff_s, report_mib=size_mib,
                          diff_mib=diff_kib / 1024, html_mib=html_kib / 1024)
    report(benchmark, **report_figures)
    assert html_s / diff_s <= 1.25
    assert size_mib < 2
