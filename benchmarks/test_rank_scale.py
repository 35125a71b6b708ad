"""Issue 59: one rank of a job on hundreds of GPUs costs what one rank costs, whatever the world size.

`memdiff record --emulate h100 --ranks LIST -- torchrun --nnodes N --nproc-per-node 8 train.py` runs
only the named ranks, each alone. So the CPU time and the peak memory of the command grow with the
ranks run, not with the ranks of the job: rank 0 of an FSDP2 job of 512 GPUs (64 nodes) costs about
what rank 0 of 8 GPUs costs, and two ranks cost about twice one.

Each figure is one `memdiff record` in a fresh process tree, measured from a wrapper process of its
own: CPU is user + system of every process in it (each waits for its children, so their times add
up), memory is the largest single process's peak RSS (RUSAGE_CHILDREN reports the largest
descendant). The job is tests/scenarios/fsdp_train.py (4 blocks of width 1,024, FSDP2, AdamW, two
steps), whose shards at world size 512 are two rows of each weight.

Run with: python -m pytest benchmarks/test_rank_scale.py -s   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

from test_speed import report

import memdiff

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scenarios" / "fsdp_train.py"
WIDTH = 1024
# The model's fp32 weights: 4 blocks of Linear(w, 2w) and Linear(2w, w), with their biases.
WEIGHT_BYTES = 4 * (WIDTH * 2 * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH + WIDTH) * 4

# Runs argv and prints the CPU seconds and the largest peak RSS (KiB) of its process tree.
MEASURE = """
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
used = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": done.returncode, "err": done.stderr[-3000:],
                  "cpu": used.ru_utime + used.ru_stime, "kib": used.ru_maxrss}))
"""


def record(tmp: Path, nodes: int, ranks: str) -> Dict[str, float]:
    """CPU seconds and peak RSS (KiB) of emulating `ranks` of an FSDP2 job of `nodes` x 8 GPUs."""
    out = tmp / f"n{nodes}-r{ranks.replace(',', '_')}"
    command = [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", f"{out}/", "--ranks", ranks,
               "--", "torchrun", "--nnodes", str(nodes), "--nproc-per-node", "8", str(SCRIPT), "--cuda",
               "--width", str(WIDTH)]
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout)
    assert figures["rc"] == 0, figures["err"]
    written = sorted(p.name for p in out.iterdir() if p.suffix == ".pickle")
    assert len(written) == len(ranks.split(",")), written
    # Each rank ran as a rank of the job asked for: FSDP2 gave it its shard of the weights.
    for name in written:
        device = memdiff.summarize(out / name).devices[0]
        assert device.categories["parameter"] == WEIGHT_BYTES // (nodes * 8), (name, device.categories)
    return figures


def test_one_rank_costs_the_same_at_8_and_512_gpus_and_two_ranks_twice_one(benchmark, tmp_path):
    def measure() -> Dict[str, Dict[str, float]]:
        return {"rank0_of_8": record(tmp_path, 1, "0"), "rank0_of_512": record(tmp_path, 64, "0"),
                "ranks_0_511_of_512": record(tmp_path, 64, "0,511")}

    runs = benchmark.pedantic(measure, rounds=1, iterations=1)
    small, large, two = runs["rank0_of_8"], runs["rank0_of_512"], runs["ranks_0_511_of_512"]
    report(benchmark, cpu_8_s=small["cpu"], cpu_512_s=large["cpu"], cpu_two_ranks_s=two["cpu"],
           cpu_ratio_512_over_8=large["cpu"] / small["cpu"], cpu_ratio_two_over_one=two["cpu"] / large["cpu"],
           rss_8_mib=small["kib"] / 1024, rss_512_mib=large["kib"] / 1024,
           rss_ratio_512_over_8=large["kib"] / small["kib"])
    # The world size is a number in each rank's environment, not work: within noise of one rank of 8.
    assert large["cpu"] / small["cpu"] < 1.3
    assert large["kib"] / small["kib"] < 1.2
    # Two ranks are two processes: about twice the CPU (the launcher's reading is shared), each no larger.
    assert 1.5 < two["cpu"] / large["cpu"] < 2.5
    assert two["kib"] / large["kib"] < 1.2
