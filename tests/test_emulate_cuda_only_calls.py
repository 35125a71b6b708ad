"""Calls a CUDA build of torch sends to the CUDA runtime before any op is dispatched (so they fail
without a GPU there, and the CPU build has no CUDA backend to take them): under
`memdiff record --emulate` they answer as on the emulated GPU."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

pytest.importorskip("torch")


def _emulate(tmp_path: Path, name: str, source: str) -> Tuple[subprocess.CompletedProcess, Dict[str, Any]]:
    """`memdiff record --emulate h100` of a script written from `source`: the run and its snapshot."""
    script = tmp_path / name
    script.write_text(source)
    out = tmp_path / "run.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out), "--",
                           "python", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as f:
        return done, pickle.load(f)


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
    done, snapshot = _emulate(tmp_path, "train.py", DEFAULT_DEVICE)
    lines = done.stdout.splitlines()
    assert lines[0] == "cuda:0 cuda:0 cuda:0"
    trace = snapshot["device_traces"][0]
    sizes = {e["size"] for e in trace if e["action"] == "alloc"}
    # the weight, bias and input the default device made are device allocations, as on a GPU
    assert {256 * 512 * 4, 512 * 4, 64 * 256 * 4} <= sizes
    # memory_snapshot() is the emulated allocator's: at least the weight, bias, input and gradients
    assert int(lines[1]) >= 2 * (256 * 512 * 4 + 512 * 4) + 64 * 256 * 4


LEGACY_TYPES = """
import torch, torch.nn as nn
Tensor = torch.cuda.FloatTensor if torch.cuda.is_available() else torch.FloatTensor
D = nn.Sequential(nn.Linear(32, 1), nn.Sigmoid()).cuda()
imgs = torch.randn(8, 32)
valid = Tensor(imgs.size(0), 1).fill_(1.0)
real = imgs.type(Tensor)
labels = torch.randint(0, 2, (8,)).type("torch.cuda.LongTensor")
nn.BCELoss()(D(real), valid).backward()
print(real.type(), real.device, isinstance(real, torch.cuda.FloatTensor), isinstance(real, torch.cuda.LongTensor),
      isinstance(labels, torch.cuda.LongTensor), isinstance(imgs, torch.cuda.FloatTensor), Tensor([1.0, 2.0]).shape)
"""


@pytest.mark.slow
def test_legacy_cuda_tensor_types_make_and_move_tensors_on_the_emulated_gpu(tmp_path: Path):
    done, snapshot = _emulate(tmp_path, "gan.py", LEGACY_TYPES)
    assert done.stdout.splitlines()[-1] == "torch.cuda.FloatTensor cuda:0 True False True False torch.Size([2])"
    trace = snapshot["device_traces"][0]
    made = {(e["size"], e["frames"][0]["name"]) for e in trace if e["action"] == "alloc"}
    # `valid` (8 x 1 floats), `real` (8 x 32 floats moved by .type) and `labels` (8 longs) are device memory
    assert (8 * 4, "at::_ops::empty_memory_format::call") in made
    assert (8 * 32 * 4, "at::_ops::_to_copy::call") in made and (8 * 8, "at::_ops::_to_copy::call") in made


@pytest.mark.slow
def test_nvml_readings_module_to_a_bare_index_and_cuda_random_answer_as_the_emulated_gpu(tmp_path):
    # Log lines read NVML (an idle GPU here), DiT and the DDP tutorial move models with .to(rank), and
    # the Trainer saves its rng state through torch.cuda.random: each ran into the driver before.
    done, _ = _emulate(tmp_path, "train.py", textwrap.dedent("""
        import torch
        model = torch.nn.Linear(256, 256).to(0)
        other = torch.nn.Linear(256, 256).to(device=0)
        print(next(model.parameters()).device, next(other.parameters()).device)
        print("util", torch.cuda.utilization(), torch.cuda.temperature(), torch.cuda.memory_usage())
        print("state", tuple(torch.cuda.random.get_rng_state().shape), len(torch.cuda.random.get_rng_state_all()))
        torch.cuda.random.manual_seed(0)
        x = torch.randn(512, 512)
        y = x @ x  # a product on the host makes no cuBLAS workspace on the GPU
        print("allocated", torch.cuda.memory_allocated())
    """))
    lines = done.stdout.splitlines()
    assert lines[0] == "cuda:0 cuda:0"
    assert lines[1] == "util 0 0 0"
    assert lines[2].startswith("state (") and lines[2].endswith(" 1")
    # the two layers' weights and biases, each block rounded up to 512 bytes as the caching allocator does
    weights = 2 * (-(-256 * 256 * 4 // 512) * 512 + -(-256 * 4 // 512) * 512)
    assert lines[3] == f"allocated {weights}"


NVTX_ANNOTATED = """
import torch
import torch.cuda.nvtx as nvtx

model = torch.nn.Linear(256, 512).cuda()


@torch.cuda.nvtx.range("fwd")  # profiling code's decorator form
def forward(x):
    return model(x)


with nvtx.range("step {}", 3):  # the context-manager form, with range's format arguments
    loss = forward(torch.randn(64, 256, device="cuda")).sum()
print("push", nvtx.range_push("bwd"), "mark", nvtx.mark("here"))
loss.backward()
print("pop", nvtx.range_pop(), "start", nvtx.range_start("opt"), "end", nvtx.range_end(0))
"""


@pytest.mark.slow
def test_nvtx_ranges_as_decorator_and_context_manager_run_as_on_a_gpu_without_a_profiler(tmp_path: Path):
    # Profiling code decorates its forward with @torch.cuda.nvtx.range(...): the script stopped at import
    # before. NVTX with no profiler attached answers -2 (depth not tracked) to push and pop, 0 to start.
    done, snapshot = _emulate(tmp_path, "profiled.py", NVTX_ANNOTATED)
    lines = done.stdout.splitlines()
    assert lines[0] == "push -2 mark None"
    assert lines[1] == "pop -2 start 0 end None"
    outputs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc" and e["size"] == 64 * 512 * 4]
    # the decorated forward ran on the emulated GPU: its 64 x 512 output is made inside it
    assert any(f["name"] == "forward" and f["filename"].endswith("profiled.py") for e in outputs for f in e["frames"])
