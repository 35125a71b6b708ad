"""Calls a CUDA build of torch sends to the CUDA runtime before any op is dispatched (so they fail
without a GPU there, and the CPU build has no CUDA backend to take them): under
`memdiff record --emulate` they answer as on the emulated GPU."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

DEFAULT_DEVICE = """
import torch
torch.set_default_device("cuda")
model = torch.nn.Linear(256, 512)
x = torch.randn(64, 256)
model(x).sum().backward()
print(torch.get_default_device(), model.weight.device, x.device)
segments = torch.cuda.memory_snapshot()
print(sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"))
"""


@pytest.mark.slow
def test_a_cuda_default_device_allocates_on_the_emulated_gpu_and_memory_snapshot_reads_it(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(DEFAULT_DEVICE)
    out = tmp_path / "run.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out), "--",
                           "python", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "cuda:0 cuda:0 cuda:0"
    with open(out, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    sizes = {e["size"] for e in trace if e["action"] == "alloc"}
    # the weight, bias and input the default device made are device allocations, as on a GPU
    assert {256 * 512 * 4, 512 * 4, 64 * 256 * 4} <= sizes
    # memory_snapshot() is the emulated allocator's: at least the weight, bias, input and gradients
    assert int(lines[1]) >= 2 * (256 * 512 * 4 + 512 * 4) + 64 * 256 * 4
