"""Patterns of public training scripts (nanoGPT, the PyTorch examples' DDP tutorials, minGPT),
each written here as a few lines of our own and run unmodified under `memdiff record --emulate
h100`, as a new user runs their script: it finishes with exit 0, prints what the script prints on a
GPU where that does not depend on the model's values, and the snapshot holds what the GPU would."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _emulate(tmp_path, source, *args, name="train.py"):
    """`memdiff record --emulate h100 -o run.pickle -- python NAME ARGS` of a script written from `source`."""
    script = tmp_path / name
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script), *args],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def _snapshot(tmp_path):
    with open(tmp_path / "run.pickle", "rb") as f:
        return pickle.load(f)


# nanoGPT's pattern: the compiled model returns (logits, loss); the loop logs `loss.item()` and an
# evaluation averages `loss.item()` over a few batches in a CPU tensor.
COMPILED_LOSS = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x, y):
        logits = self.body(x)
        return logits, F.cross_entropy(logits, y)


model = torch.compile(Net().cuda())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(16, 32, device="cuda")
y = torch.randint(0, 8, (16,), device="cuda")
for step in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step, repr(loss.item()), f"{loss.item():.4f}", tuple(logits.shape))
with torch.no_grad():
    losses = torch.zeros(4)
    for k in range(4):
        losses[k] = model(x, y)[1].item()
print("eval", repr(losses.mean().item()))
"""


@pytest.mark.slow
def test_a_compiled_models_loss_reads_back_as_every_unknown_value_does(tmp_path):
    """The loss a compiled graph computes is written by Triton kernels the emulator does not run:
    it has no value, and reads back 0.0 as every model-computed value does. It used to keep the
    uninitialised host memory of the buffer Inductor made for it (-1.9e+32 one run, -9e-09 the next)."""
    done = _emulate(tmp_path, COMPILED_LOSS)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = re.findall(r"^step (\d) (\S+) (\S+) (\(.*\))$", done.stdout, re.MULTILINE)
    assert steps == [(str(i), "0.0", "0.0000", "(16, 8)") for i in range(3)], done.stdout
    assert "eval 0.0" in done.stdout.splitlines()
    assert "Inductor's memory plan" in done.stderr  # the compiled route ran, not the eager fallback
