"""Patterns of public training scripts (pytorch/examples' vision scripts, PEFT's and accelerate's
examples) that drifted under `memdiff record --emulate`, each as a small scenario of our own: the
script exits 0 and the emulated GPU holds what PyTorch's own rules say it holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _emulate(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o run.pickle -- python train.py` of a script written from `source`."""
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def _said(out: str) -> dict:
    """The `name value` lines a scenario prints, as integers."""
    return {k: int(v) for k, v in (line.split() for line in out.splitlines() if line.count(" ") == 1)}


# A style-transfer loop's checkpoint: every few steps the model goes to the host for torch.save and
# back to the GPU, while the step's loss is still named (it is reassigned only by the next step).
CHECKPOINT_TO_HOST = """
import torch

model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, bias=False), torch.nn.ReLU(),
                            torch.nn.Conv2d(32, 3, 3, bias=False)).cuda()
optimizer = torch.optim.Adam(model.parameters())
held = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in model.parameters())
for step in range(3):
    optimizer.zero_grad()
    if step == 2:
        print("after_zero_grad", torch.cuda.memory_allocated())
    loss = model(torch.randn(2, 3, 32, 32, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    if step == 0:
        before = torch.cuda.memory_allocated()
        model.eval().cpu()
        torch.save(model.state_dict(), "checkpoint.pt")
        print("freed", before - torch.cuda.memory_allocated())
        model.cuda().train()
        print("back", torch.cuda.memory_allocated() - before)
print("held", held)
print("same", int(all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"]))))
"""


@pytest.mark.slow
def test_moving_a_model_to_the_host_frees_its_weights_and_gradients_while_a_loss_is_named(tmp_path):
    # pytorch/examples' fast_neural_style: `transformer.eval().cpu()` for a checkpoint kept the weights
    # and gradients on the GPU while the step's graph lived (the swap left them in the tensor its
    # AccumulateGrad holds), and `.cuda()` added a second copy: 6.41 MiB twice over through the next
    # step's forward, where its peak is. A GPU's `param.data = moved` frees both at once.
    done = _emulate(tmp_path, CHECKPOINT_TO_HOST)
    assert done.returncode == 0, done.stderr[-3000:]
    said = _said(done.stdout)
    held = said["held"]  # the weights' bytes, each rounded to the allocator's 512-byte blocks
    assert said["freed"] == 2 * held  # the weights and their gradients
    assert said["back"] == 0  # both come back, nothing more
    assert said["same"] == 1  # the optimizer steps the module's weights, as on the GPU
    # after zero_grad: the weights, Adam's two moments and the last step's loss (one 512-byte block)
    assert said["after_zero_grad"] == 3 * held + 512

