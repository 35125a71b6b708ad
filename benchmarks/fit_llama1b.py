"""Issue 50's speed bound: `memdiff fit` of the 1B Llama (../shared/cuda-truth/families.py's `llama1b`:
the same LlamaConfig, bf16 weights, AdamW, sequence 2048) across h100, a100-40gb and l4, in under 2
minutes on 2 cores. Not part of the test run (it takes minutes):

    python benchmarks/fit_llama1b.py [--jobs 2] [--seq 2048]

It prints each GPU's largest batch, the emulated runs made, the wall time and the CPU time (memdiff's
process and each run's own, user + system: wall time on a shared machine moves with other work).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "llama1b_train.py"


def main() -> int:
    """Run the fit once and print its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gpus", default="h100,a100-40gb,l4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "memdiff", "fit", "--emulate", args.gpus, "-o", out + "/",
                               "--range", "batch=1:256", "--jobs", str(args.jobs), "--format", "json", "--",
                               "python", str(SCRIPT), "--batch", "{batch}", "--seq", str(args.seq)],
                              capture_output=True, text=True, cwd=ROOT)
        wall = time.monotonic() - started
    if done.returncode not in (0, 1):
        print(done.stderr, file=sys.stderr)
        return done.returncode
    doc = json.loads(done.stdout)
    # memdiff's own process (the forecasts), waited for above, and each run's process as it measured itself.
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + sum(r["cpu_seconds"] for g in doc["gpus"] for r in g["runs"])
    for g in doc["gpus"]:
        fails = g["fails"]["value"] if g["fails"] else None
        print(f"{g['gpu']:<10} largest batch {g['value']}, next {fails} does not fit; "
              f"{len(g['runs'])} runs: {', '.join(str(r['value']) for r in g['runs'])}")
    print(f"runs {doc['runs']}, wall {wall:.1f} s, CPU {cpu:.1f} s: {cpu / 2:.1f} s on 2 idle cores "
          f"(bound: 120 s wall on 2 cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
