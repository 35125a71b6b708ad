"""What `memdiff fit` tells a user whose script is a public one, written for a real GPU: how to keep each run
short, and where to search when the script stops working at large values for another reason than memory.

Each value the fit tries is the whole script, run once: a script that trains for thousands of steps or
evaluates on hundreds of batches (nanoGPT's `train_shakespeare_char` config: `eval_iters = 200`, 38.6 s a
run where `--eval_iters=2` takes 4 s) makes a fit of some twenty runs take a quarter of an hour, while the
peak of a training step shows within its first steps.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

# A run longer than this is worth a word: the fit's own scenario and the public scripts the project ran
# with few steps take 3.5 to 8 s a run on the shared 2-core machine (docs/fit.md, "On public scripts").
LONG_RUN_S = 20.0


def long_run(gpu: str, knob: str, value: int, sent: Dict[str, Any], log: str) -> str:
    """The note said once when a run took LONG_RUN_S or more: how long, how many steps it held, and what
    to pass the script."""
    steps, at = sent.get("steps"), sent.get("step")
    held = ""
    if steps:
        held = f", {steps:,} training step{'s' if steps != 1 else ''}" + (
            f", its peak in step {at:,}" if at is not None else "")
    return (f"fit: the run of {gpu} at {knob} {value:,} took {sent['seconds']:.1f} s{held}; the fit runs the "
            f"whole script once per value it tries (often 5 to 15 per GPU): pass the script's own flags for a "
            f"few steps and a short evaluation, as a step's peak shows in the first steps (its output: {log})")


def failed_above(gpu: str, knob: str, value: int, fitting: Sequence[int]) -> str:
    """The clause a failure for another reason than memory carries when smaller values ran and fit: the
    largest of them, and the --range between it and the value that failed (a script whose data runs out at
    large batches, or that refuses them, fails there and not for lack of memory: the fit stops, as a
    failure is never taken for out of memory, and the range lets it search where the script runs)."""
    below = [v for v in fitting if v < value]
    if not below:
        return ""
    return (f"{gpu} trained at {knob} {max(below):,}: to search below {value:,}, give "
            f"--range {knob}={max(below)}:{value - 1}; ")
