"""Ops whose CUDA kernels refuse operands of two dtypes refuse them under `memdiff record --emulate`
too (emulate/dtypes.py): their meta kernels computed a result, so a script that stops on the GPU (a
float32 batch into bfloat16 weights outside autocast) ran on, and a what-if measured it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

# Each case run on `device`, caught: what the op gives, or the first words of its error.
CASES = """
import sys
import torch
import torch.nn.functional as F

device = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(4, 8, device=device)
bf16 = torch.nn.Linear(8, 16).to(device, torch.bfloat16)
half_conv = torch.nn.Conv2d(3, 4, 3, bias=False).to(device, torch.float16)
image = torch.randn(1, 3, 8, 8, device=device)
bf16_conv = torch.nn.Conv2d(3, 4, 3).to(device, torch.bfloat16)
bf16_conv.bias.data = bf16_conv.bias.data.float()  # a bias left in float32 (a module cast, then its bias reset)
cases = {
    "linear": lambda: bf16(x),
    "matmul 3-d": lambda: x[None].expand(2, 4, 8) @ bf16.weight.t(),
    "addmm": lambda: torch.addmm(bf16.bias, x.to(torch.bfloat16), bf16.weight.t().float()),
    "conv": lambda: half_conv(image),
    "conv, float32 bias": lambda: bf16_conv(image.to(torch.bfloat16)),
    "linear, one dtype": lambda: bf16(x.to(torch.bfloat16)),
    "conv, one dtype": lambda: half_conv(image.half()) if device == "cuda" else torch.zeros((), dtype=torch.half),
}
for name, case in cases.items():
    try:
        print(f"{name}: {case().dtype}")
    except RuntimeError as error:
        print(f"{name}: refused: {str(error).splitlines()[0]}")
if device == "cuda":
    with torch.autocast("cuda", dtype=torch.bfloat16):
        print(f"linear under autocast: {bf16(x).dtype}")
"""


def test_products_and_convolutions_of_two_dtypes_are_refused_as_on_the_gpu(tmp_path):
    script = tmp_path / "dtypes.py"
    script.write_text(CASES)
    # Ground truth: torch's own CPU kernels refuse the same calls (CUDA's do too, in the words below).
    cpu = subprocess.run([sys.executable, str(script), "cpu"], capture_output=True, text=True, check=True).stdout
    refused_on_cpu = {line.split(":")[0] for line in cpu.splitlines() if ": refused: " in line}
    assert refused_on_cpu == {"linear", "matmul 3-d", "addmm", "conv", "conv, float32 bias"}, cpu
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script), "cuda"],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    # CUDA's words (aten/src/ATen/native/cuda/Blas.cpp, aten/src/ATen/native/Convolution.cpp)
    assert lines["linear"] == "refused: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16"
    assert lines["matmul 3-d"] == lines["linear"]
    assert lines["addmm"] == ("refused: expected mat1 and mat2 to have the same dtype, but got: "
                              "c10::BFloat16 != float")
    assert lines["conv"] == ("refused: Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.HalfTensor) "
                             "should be the same")
    # A bias of another dtype than the input: conv1d, conv2d and conv3d check it first, in the
    # composite that every device runs before `convolution` (Convolution.cpp's conv2d: "Input type
    # (...) and bias type (...)", dtype names), so CUDA's words are the CPU's, before cuDNN's own check
    assert lines["conv, float32 bias"] == "refused: Input type (c10::BFloat16) and bias type (float) should be the same"
    assert dict(line.split(": ", 1) for line in cpu.splitlines())["conv, float32 bias"] == lines["conv, float32 bias"]
    # one dtype, or autocast's casts before the op: they run
    assert lines["linear, one dtype"] == lines["linear under autocast"] == "torch.bfloat16"
    assert lines["conv, one dtype"] == "torch.float16"
