"""Run a training script (`python marked.py SCRIPT ARGS`) with a marker at the start of each
optimizer step: ground truth, from the run itself, for which steps a recording holds.

The first forward after k optimizer steps allocates MARK + k bytes (the optimizer steps are
counted by torch's own global step hook, the forwards by a global module hook: the script is
not changed). With MARK_SPIKE_STEP=k that step also fills 512 MiB and frees it, which raises
the process's peak resident memory for that step's logging interval only. With MARK_FACTS=FILE
it writes there, at exit, the bytes of the largest module's weights (the model's, as the
forward of the outermost module sees them).
"""

import atexit
import json
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

MARK = 1_000_003
SPIKE = 512 << 20
steps, marked, weights = [0], [-1], [0]
spike_at = int(os.environ.get("MARK_SPIKE_STEP", "-1"))


def after_step(*_):
    steps[0] += 1


def before_forward(module, args):
    if not weights[0] or marked[0] != steps[0]:
        weights[0] = max(weights[0], sum(p.numel() * p.element_size() for p in module.parameters()))
    if marked[0] != steps[0]:
        marked[0] = steps[0]
        torch.zeros(MARK + steps[0], dtype=torch.uint8)  # written: torch's memory profile drops a tensor never written
        if steps[0] == spike_at:
            torch.ones(SPIKE, dtype=torch.uint8)


def write_facts():
    with open(os.environ["MARK_FACTS"], "w") as f:
        json.dump({"weight_bytes": weights[0]}, f)


if os.environ.get("MARK_FACTS"):
    atexit.register(write_facts)
register_optimizer_step_post_hook(after_step)
torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
