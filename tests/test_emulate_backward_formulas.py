"""Derivative formulas that scatter into the zeros they made run in place under `memdiff record
--emulate`, as on the GPU: gather's backward (`new_zeros` then `scatter_add_`) and max's along a
dimension (`zeros` then `scatter_`) hold one gradient-sized buffer, not two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = """
import torch

x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
idx = torch.randint(0, 1024, (4096, 1024), device="cuda")
torch.cuda.reset_peak_memory_stats()
y = x.gather(1, idx)
y.backward(torch.ones_like(y))
print(torch.cuda.max_memory_allocated())
del y
x.grad = None
torch.cuda.reset_peak_memory_stats()
values, indices = x.max(1)
values.backward(torch.ones_like(values))
print(torch.cuda.max_memory_allocated())
"""


@pytest.mark.slow
def test_gather_and_max_backward_scatter_into_their_zeros_in_place(tmp_path: Path):
    """By hand, in MiB (every size a multiple of 512 B, so the blocks are the tensors): x is 16
    (4,096 x 1,024 fp32), idx 32 (int64), gather's output 16 and its gradient 16; the backward's
    zeros 16 take the scatter in place and become x.grad: peak 96 MiB (112 when torch's out-of-place
    branch for tensor subclasses ran). max(1): x 16, idx 32, values and ones_like 16 KiB each,
    indices 32 KiB, then the zeros 16 MiB scattered in place: 64 MiB + 64 KiB (80 MiB + 64 KiB before)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    mib = 1 << 20
    gather_peak, max_peak = (int(line) for line in done.stdout.split())
    assert gather_peak == (16 + 32 + 16 + 16 + 16) * mib
    assert max_peak == (16 + 32 + 16) * mib + 64 * 1024
