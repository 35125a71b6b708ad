"""torch.nn.RMSNorm and F.rms_norm under `memdiff record --emulate` (emulate/rmsnorm.py): a CUDA build
runs `_fused_rms_norm`'s kernel under its autograd formula, which saves the input, the weight and an
inverse RMS per row in float32 (the accumulate type), where the meta device would decompose it and
keep one more activation per norm. The sizes asserted are the model's shapes and the kernel's
contract (cuda/layer_norm_kernel.cu `_fused_rms_norm_cuda`, derivatives.yaml), and the saved tensors
are read from the autograd node torch itself builds."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip("torch")

SCRIPT = """
import json, sys
import torch
import torch.nn as nn
import torch.nn.functional as F

out, norm, dtype, autocast = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4] == "autocast"
layers, batch, length, width = (int(a) for a in sys.argv[5:9])
weights = torch.float32 if autocast else dtype


class Decomposed(nn.Module):
    # RMSNorm as Hugging Face's Llama writes it (pow, mean, rsqrt, mul): what the meta device ran
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return F.rms_norm(x, (width,), self.weight, 1e-6)


NORMS = {"module": lambda: nn.RMSNorm(width, eps=1e-6), "functional": Functional, "decomposed": Decomposed}
model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width, bias=False), NORMS[norm]())])
model = model.to("cuda", weights)
x = torch.randn(batch, length, width, device="cuda", dtype=weights)
with torch.no_grad():
    model[0](x)  # the cuBLAS workspace, made at the first product, before the measured forward
torch.cuda.memory._record_memory_history()
before = torch.cuda.memory_allocated()
with torch.autocast("cuda", dtype=dtype, enabled=autocast):
    y = model(x)
forward = torch.cuda.memory_allocated() - before
node = y.grad_fn
saved = {}
for name in dir(node):
    t = getattr(node, name) if name.startswith("_saved_") else None
    if isinstance(t, torch.Tensor):
        saved[name[len("_saved_"):]] = [list(t.shape), str(t.dtype).split(".")[-1]]
y.float().sum().backward()
torch.cuda.memory._dump_snapshot(out)
print(json.dumps({"node": node.name(), "saved": saved, "forward": forward, "out": str(y.dtype).split(".")[-1],
                  "max": torch.cuda.max_memory_allocated()}))
"""

LAYERS, BATCH, LENGTH, WIDTH = 4, 8, 512, 1024
ROWS = BATCH * LENGTH


def _run(tmp_path: Path, norm: str, dtype: str = "float32", autocast: bool = False,
         shape: tuple = (LAYERS, BATCH, LENGTH, WIDTH)) -> Dict[str, Any]:
    script = tmp_path / "norms.py"
    script.write_text(SCRIPT)
    own = tmp_path / f"{norm}.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / f"{norm}.rec.pickle"), "--", sys.executable, str(script), str(own), norm,
                           dtype, "autocast" if autocast else "plain", *map(str, shape)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    with open(own, "rb") as f:
        facts["trace"] = list(pickle.load(f)["device_traces"][0])
    return facts


def _inside(trace: List[Dict[str, Any]], op: str) -> List[int]:
    """Sizes of the allocations made inside `op` (its frame in the stack), in order."""
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(f"at::_ops::{op}::" in frame["name"] for frame in e["frames"])]


@pytest.fixture(scope="module")
def decomposed(tmp_path_factory) -> Dict[str, Any]:
    """Hugging Face's decomposed RMSNorm, run once for both forms of the fused one it is set beside."""
    return _run(tmp_path_factory.mktemp("decomposed"), "decomposed")


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["module", "functional"])
def test_rms_norm_keeps_what_the_fused_kernel_keeps(tmp_path, norm, decomposed):
    """Four Linear + RMSNorm blocks, 8 x 512 tokens of 1,024 fp32 features: the norm's autograd node is
    FusedRmsNormBackward0, saving the input (the product's output) and rstd, one float32 per token
    (8 x 512 x 1); each block keeps the product's output, rstd and the norm's output, which the next
    product saves (the last is the model's). The norm's own allocations are its output and rstd,
    and in the backward dX and dgamma, with a contiguous copy of a strided gradient. Hugging Face's
    decomposed RMSNorm, which the meta device ran, keeps the normalized activation as well: one
    activation more per block."""
    act = ROWS * WIDTH * 4
    rstd = ROWS * 4
    fused = _run(tmp_path, norm)
    assert fused["node"] == "FusedRmsNormBackward0"
    assert fused["saved"]["input"] == [[BATCH, LENGTH, WIDTH], "float32"]
    assert fused["saved"]["result1"] == [[BATCH, LENGTH, 1], "float32"]
    assert fused["forward"] == LAYERS * (2 * act + rstd)
    assert _inside(fused["trace"], "_fused_rms_norm") == [act, rstd] * LAYERS
    # the last norm's gradient is sum's, expanded: RMSNormBackwardKernelImpl's dY.contiguous() copies it
    backward = [act, WIDTH * 4, act] + [act, WIDTH * 4] * (LAYERS - 1)
    assert _inside(fused["trace"], "_fused_rms_norm_backward") == backward
    assert not _inside(fused["trace"], "pow") and not _inside(fused["trace"], "rsqrt")

    assert decomposed["forward"] == LAYERS * (3 * act + rstd)
    assert decomposed["max"] - fused["max"] >= LAYERS * act


@pytest.mark.slow
def test_bf16_weights_keep_a_float32_rstd(tmp_path):
    """The same blocks in bfloat16: the output and the saved input are bf16, rstd stays float32
    (acc_type of bf16 on CUDA)."""
    act = ROWS * WIDTH * 2
    facts = _run(tmp_path, "module", "bfloat16")
    assert facts["node"] == "FusedRmsNormBackward0" and facts["out"] == "bfloat16"
    assert facts["saved"]["input"] == [[BATCH, LENGTH, WIDTH], "bfloat16"]
    assert facts["saved"]["result1"] == [[BATCH, LENGTH, 1], "float32"]
    assert facts["forward"] == LAYERS * (2 * act + ROWS * 4)


@pytest.mark.slow
def test_autocast_runs_rms_norm_in_float32(tmp_path):
    """fp32 weights under autocast(bfloat16): rms_norm is on CUDA autocast's float32 list, so the bf16
    product's output is cast to float32 and that copy is what the fused kernel saves; its output is
    float32. Per block: the product's bf16 input cast, the float32 copy of its output and rstd (the
    bf16 output itself is freed after the cast), the last block's norm output, and autocast's cached
    bf16 weights."""
    facts = _run(tmp_path, "module", "bfloat16", autocast=True)
    assert facts["node"] == "FusedRmsNormBackward0" and facts["out"] == "float32"
    assert facts["saved"]["input"] == [[BATCH, LENGTH, WIDTH], "float32"]
    assert facts["saved"]["result1"] == [[BATCH, LENGTH, 1], "float32"]
    assert _inside(facts["trace"], "_fused_rms_norm")[:2] == [ROWS * WIDTH * 4, ROWS * 4]


@pytest.mark.slow
def test_many_rows_of_few_features_sum_the_weight_gradient_by_blocks(tmp_path):
    """Past 65,536 rows of fewer features than 32 x half the H100's 132 SMs, the backward's weight
    gradient is summed in two passes (LaunchGammaBetaBackwardCUDAKernel): per-block partial sums,
    ceil(rows / 32) blocks (at most 32,768 / ceil(features / 32)) of the features in the weight's
    dtype, then their sum(0). 2 x 40,000 rows of 64 fp32 features: 2,500 blocks, 640,000 B."""
    rows, width = 80000, 64
    facts = _run(tmp_path, "module", shape=(1, 2, 40000, width))
    sizes = _inside(facts["trace"], "_fused_rms_norm_backward")
    assert sizes[:2] == [rows * width * 4, width * 4]  # dX, dgamma
    assert 2500 * width * 4 in sizes[2:]


def test_a_strided_input_is_copied_for_the_kernel_and_nothing_stays_after_the_run(torch, tmp_path):
    """`_fused_rms_norm_cuda` and its backward take `input.expect_contiguous()`: a transposed input is
    copied inside each op, for the op. Under inference_mode too the fused kernel runs. After the
    emulated block, torch is as it was: an RMS norm of meta or CPU tensors decomposes as torch's CPU
    build does (the Meta kernel was the emulation's)."""
    import torch.nn.functional as F

    import memdiff

    with memdiff.record(str(tmp_path / "run.pickle"), emulate="h100"):
        x = torch.randn(1024, 8, 256, device="cuda", requires_grad=True)
        w = torch.ones(1024, device="cuda", requires_grad=True)
        y = F.rms_norm(x.transpose(0, 2), (1024,), w)  # 256 x 8 rows of 1,024 features, strided
        y.backward(torch.ones_like(y))
        with torch.inference_mode():  # autograd's keys skipped: rms_norm reaches the emulator whole
            F.rms_norm(x.transpose(0, 2).contiguous(), (1024,), w)
        del x, w, y
    with open(tmp_path / "run.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    act, rstd = 1024 * 8 * 256 * 4, 256 * 8 * 4
    forward = _inside(trace, "_fused_rms_norm")
    assert sorted(forward[:3]) == sorted([act, rstd, act])  # Y, rstd, the copy
    assert forward[3:] == [act, rstd]  # the fused kernel under inference_mode too, its input contiguous
    assert sorted(_inside(trace, "_fused_rms_norm_backward")) == sorted([act, 1024 * 4, act])  # dX, dgamma, copy

    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "Meta")
    for device in ("meta", "cpu"):
        x = torch.ones(4, 8, device=device, requires_grad=True)
        assert F.rms_norm(x, (8,), torch.ones(8, device=device)).grad_fn.name() == "MulBackward0"
