"""F.ctc_loss under `memdiff record --emulate` (memdiff/recording/emulate/ctc.py): it was refused ("aten::_ctc_loss:
PyTorch has no meta kernel"), which stopped every CTC model (wav2vec2, HuBERT, Data2VecAudio... for CTC: 8 of the
transformers sweep's refusals). Held to the allocations CUDA's native kernels make (aten/src/ATen/native/cuda/
LossCTC.cu): log_alpha is (batch, T, 2 * longest target + 1) in the forward, log_beta like it and the gradient
like the log-probabilities in the backward, each kernel's three int64 length/offset copies, and the backward's
sums over the blanks past the kernel's size test."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip("torch")

T, B, C, S = 250, 8, 32, 40
KNOWN = [30, 12, 25, 7, 30, 19, 3, 28]  # the longest is 30

SCRIPT = f"""
import sys
import torch
import torch.nn.functional as F

x = torch.randn({T}, {B}, {C}, device="cuda", requires_grad=True)
targets = torch.randint(1, {C}, ({B}, {S}), device="cuda")
inputs = torch.full(({B},), {T}, dtype=torch.long).cuda()
torch.cuda.memory._record_memory_history()
for lengths, zero_infinity in ((torch.tensor({KNOWN}).cuda(), False),
                               # values unknown: a parameter's, which the emulator does not keep (values.py)
                               (torch.nn.Parameter(torch.randint(1, {S} + 1, ({B},), device="cuda"), False), True)):
    F.ctc_loss(x.log_softmax(2), targets, inputs, lengths, zero_infinity=zero_infinity).backward()
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def _inside(trace: List[Dict[str, Any]], op: str) -> List[int]:
    """Sizes asked for by the allocations made inside `op` (its frame in the stack), in order."""
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(f"at::_ops::{op}::" in frame["name"] for frame in e["frames"])]


@pytest.mark.slow
def test_ctc_loss_trains_and_allocates_what_cudas_kernels_allocate(tmp_path: Path):
    script, own = tmp_path / "ctc.py", tmp_path / "own.pickle"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script), str(own)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(own, "rb") as f:
        trace = list(pickle.load(f)["device_traces"][0])
    lengths = [B * 8] * 3  # the target and input lengths and the offsets, as int64 on the GPU
    grad = T * B * C * 4
    forward = _inside(trace, "_ctc_loss_Tensor")
    backward = _inside(trace, "_ctc_loss_backward_Tensor")
    for run, longest in enumerate((max(KNOWN), S)):  # known lengths, then the most the targets hold
        alpha = B * T * (2 * longest + 1) * 4
        assert sorted(forward[5 * run:5 * run + 5]) == sorted([B * 4, alpha, *lengths])
        # 2T + 24B/10 + 2C/10 = 525 > 450: the kernel sums alpha and beta at the blanks (longest + 1 of them)
        blanks, per_step = B * T * (longest + 1) * 4, B * T * 4
        expected = [grad, *lengths, alpha, blanks, per_step, blanks, per_step]
        if run == 1:  # zero_infinity: where(nll == inf, 0, grad) makes the gradient again
            expected += [grad, B, 4]
        got = backward[:len(expected)]
        backward = backward[len(expected):]
        assert sorted(got) == sorted(expected), run
    assert backward == []
