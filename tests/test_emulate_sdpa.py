"""scaled_dot_product_attention's backend under `--emulate`: PyTorch's own selection
(select_sdp_backend in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and the checks of
sdp_utils_cpp.h), held as a rule table per torch version in kernels.json, and what the picked
backend allocates. Each expected backend below comes from reading those checks; the check that
decides is named beside it."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
H100, A100, L4 = (9, 0), (8, 0), (8, 9)


@pytest.fixture
def pick(torch):
    """The backend torch `version`'s rules pick on a GPU of compute capability `sm` for a call."""
    from memdiff.recording.emulate import sdpa

    def run(q, k, v, mask=None, dropout=0.0, causal=False, gqa=False, sm=H100, version="2.13.0"):
        _, rules = sdpa.table(version)
        chosen, _ = sdpa.select(rules, sdpa.facts(q, k, v, mask, dropout, causal, gqa, *sm))
        return chosen
    return run


def qkv(torch, batch=4, heads=12, length=512, head=64, dtype=None, kv_heads=None, kv_length=None, grad=True):
    """Query, key and value as a model makes them: a projection's output viewed as heads and
    transposed (B, H, S, D) with stride(-1) 1, on the meta device."""
    dtype = dtype or torch.float32
    out = []
    for h, s in ((heads, length), (kv_heads or heads, kv_length or length), (kv_heads or heads, kv_length or length)):
        x = torch.empty(batch, s, h * head, dtype=dtype, device="meta", requires_grad=grad)
        out.append(x.view(batch, s, h, head).transpose(1, 2))
    return out


def test_fp32_takes_the_memory_efficient_kernel_and_half_precision_cudnn_on_an_h100(torch, pick):
    # fp32: cuDNN's check_dtypes_low_precision and flash's check_dtypes_flash_attention refuse it.
    assert pick(*qkv(torch)) == "efficient"
    # bf16 and fp16 on sm90: check_prefer_cudnn_attention puts cuDNN first.
    assert pick(*qkv(torch, dtype=torch.bfloat16)) == "cudnn"
    assert pick(*qkv(torch, dtype=torch.float16)) == "cudnn"
    # On an A100 and an L4 the default order puts flash first (cuDNN last).
    assert pick(*qkv(torch, dtype=torch.bfloat16), sm=A100) == "flash"
    assert pick(*qkv(torch, dtype=torch.bfloat16), sm=L4) == "flash"
    # fp64 is no fused kernel's.
    assert pick(*qkv(torch, dtype=torch.float64)) == "math"


def test_a_mask_that_requires_grad_is_not_cudnns_and_a_strided_one_is_no_fused_kernels(torch, pick):
    q, k, v = qkv(torch, dtype=torch.bfloat16, batch=2, heads=8, length=128)
    padding = torch.zeros(2, 1, 128, 128, dtype=torch.bfloat16, device="meta")
    # check_attn_mask_shape takes a (B, 1, Sq, Sk) mask that needs no grad.
    assert pick(q, k, v, padding) == "cudnn"
    # A learned bias (requires grad): check_attn_mask_shape refuses it, check_for_attn_mask refuses
    # any mask for flash; the memory-efficient kernel takes it (and computes its gradient).
    bias = torch.zeros(1, 8, 128, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    assert pick(q, k, v, bias) == "efficient"
    assert pick(q, k, v, bias, sm=A100) == "efficient"
    # T5's relative position bias as transformers 5.17 passes it: an embedding's (Sq, Sk, H) output
    # permuted to (1, H, Sq, Sk), whose last stride is H. check_last_dim_stride_equals_1_dense
    # wants stride 1 of a GPU backend's mask: math (as the real H100 ran T5's self-attention).
    table = torch.zeros(128, 128, 8, device="meta", requires_grad=True)
    t5_bias = table.permute(2, 0, 1).unsqueeze(0)
    assert t5_bias.stride(-1) == 8
    fq, fk, fv = qkv(torch, batch=8, heads=8, length=128)
    assert pick(fq, fk, fv, t5_bias, dropout=0.1) == "math"
    assert pick(fq, fk, fv, t5_bias, dropout=0.1, version="2.11.0") == "math"
    # The same bias made contiguous (transformers 5.23's create_position_bias_mask does) is the
    # memory-efficient kernel's; T5's cross-attention bias (zeros, no grad) too.
    assert pick(fq, fk, fv, t5_bias.contiguous(), dropout=0.1) == "efficient"
    assert pick(fq, fk, fv, torch.zeros(1, 8, 128, 128, device="meta"), dropout=0.1) == "efficient"
    # A 3-D mask is not of check_attn_mask_shape's shapes (2-D or 4-D): cuDNN passes it over.
    assert pick(q, k, v, torch.zeros(8, 128, 128, dtype=torch.bfloat16, device="meta")) == "efficient"


def test_dropout_head_sizes_and_causal_lengths(torch, pick):
    q, k, v = qkv(torch, dtype=torch.bfloat16)
    # check_cudnn_dropout: cuDNN's dropout comes in steps of 1/16.
    assert pick(q, k, v, dropout=0.1) == "flash"
    assert pick(q, k, v, dropout=0.125) == "cudnn"
    # check_cudnn_tensor_shapes: head sizes up to 128; flash (check_head_dim_size_flash) to 256;
    # the memory-efficient kernel any multiple of 8 in half precision (check_head_dim_size_mem_efficient).
    assert pick(*qkv(torch, dtype=torch.bfloat16, head=256, heads=4)) == "flash"
    assert pick(*qkv(torch, dtype=torch.bfloat16, head=288, heads=4)) == "efficient"
    # fp32 on sm80+: minimum_gemm_alignment is 4 elements.
    assert pick(*qkv(torch, head=100, heads=4)) == "efficient"
    assert pick(*qkv(torch, head=102, heads=4)) == "math"
    # check_flash_causal_non_square_seqlens: is_causal with Sq != Sk is not flash's.
    short = qkv(torch, dtype=torch.bfloat16, length=128, kv_length=512)
    assert pick(*short, causal=True, sm=A100) == "efficient"
    assert pick(*short, causal=False, sm=A100) == "flash"
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training with head size
    # 208 on an L4 (sm89) is not flash's, inference is.
    big = qkv(torch, dtype=torch.bfloat16, head=208, heads=4, grad=True)
    assert pick(*big, sm=L4) == "efficient"
    assert pick(*qkv(torch, dtype=torch.bfloat16, head=208, heads=4, grad=False), sm=L4) == "flash"


def test_grouped_query_attention_needs_enable_gqa(torch, pick):
    q, k, v = qkv(torch, dtype=torch.bfloat16, batch=2, heads=32, length=256, kv_heads=8)
    # check_batch_size_and_num_heads_dense: with enable_gqa the fused kernels take fewer key heads
    # that divide the query's; without it the heads must be equal, and only math is left.
    assert pick(q, k, v, gqa=True) == "cudnn"
    assert pick(q, k, v, gqa=True, sm=A100) == "flash"
    assert pick(q, k, v, gqa=False) == "math"
    # fp32 has no fused kernel for it: the memory-efficient kernel wants one number of heads
    # (check_batch_size_and_num_heads_dense<supports_gqa=false>) until PR #191085, after 2.13.
    fq, fk, fv = qkv(torch, batch=2, heads=32, length=256, kv_heads=8)
    assert pick(fq, fk, fv, gqa=True) == "math"
    assert pick(*qkv(torch, dtype=torch.bfloat16, heads=12, kv_heads=5), gqa=True) == "math"


def test_a_misaligned_storage_offset_is_refused_from_torch_2_13(torch, pick):
    # check_data_ptr_alignment_mem_efficient (PR #184258, after 2.11): on sm80+ each of q, k, v must
    # start at a multiple of minimum_gemm_alignment * element_size bytes (16 for fp32).
    base = torch.empty(4 * 12 * 512 * 64 + 1, device="meta", requires_grad=True)
    q = base[1:].view(4, 12, 512, 64)
    k, v = qkv(torch)[1:]
    assert q.storage_offset() == 1
    assert pick(q, k, v, version="2.13.0") == "math"
    assert pick(q, k, v, version="2.11.0") == "efficient"


def test_the_global_switches_and_no_available_kernel(torch, pick):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        assert pick(*qkv(torch, dtype=torch.bfloat16)) == "math"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert pick(*qkv(torch)) is None  # fp32 and only flash: PyTorch's "No available kernel"


def test_the_table_of_the_running_torch_or_the_nearest_older_one(torch):
    from memdiff.recording.emulate import sdpa

    assert sdpa.table("2.13.0+cpu")[0] == "2.13" and sdpa.exact("2.13.0+cu130")
    assert sdpa.table("2.11.0+cu130")[0] == "2.11" and sdpa.exact("2.11.0")
    assert sdpa.table("2.12.1")[0] == "2.11" and not sdpa.exact("2.12.1")
    assert sdpa.table("2.14.1")[0] == "2.13"
    assert sdpa.table("2.9.0")[0] == "2.11"  # before every table: the oldest


ENCODER = """
import torch, torch.nn as nn, torch.nn.functional as F

class Encoder(nn.Module):
    # Self-attention with a learned relative-position bias, as T5 computes it: an embedding of the
    # buckets of (query, key) distances, (S, S, H), permuted to (1, H, S, S).
    def __init__(self, dim=256, heads=8, buckets=32):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Embedding(buckets, heads)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        buckets = (pos[None, :] - pos[:, None]).clamp(-15, 16) + 15
        bias = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)
        if CONTIGUOUS:
            bias = bias.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.1)
        return self.out(y.transpose(1, 2).reshape(b, s, d))

model = Encoder().cuda().to(DTYPE)
x = torch.randn(4, 36, 256, device="cuda", dtype=DTYPE)
torch.cuda.memory._record_memory_history(max_entries=100000)
model(x).sum().backward()
torch.cuda.memory._dump_snapshot("own.pickle")
"""


def _emulated_trace(tmp_path, contiguous, dtype="float32"):
    script = tmp_path / "encoder.py"
    script.write_text(f"CONTIGUOUS = {contiguous}\nimport torch\nDTYPE = torch.{dtype}\n" + ENCODER)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "own.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    return [(e["size"], [fr["name"] for fr in e["frames"]]) for e in trace if e["action"] == "alloc"]


def _under(allocs, frame):
    return sorted({size for size, frames in allocs if f"at::_ops::{frame}::call" in frames})


@pytest.mark.slow
def test_a_learned_attention_bias_runs_the_math_path_with_its_ops(tmp_path, torch):
    """The bias's last stride is 8 (heads): no fused kernel takes it, and the emulated GPU runs
    _scaled_dot_product_attention_math's ops as the real H100 did for T5 (the scores' bmm, the
    _safe_softmax with its temporaries, the fused dropout's bool mask), not the efficient kernel."""
    B, H, S = 4, 8, 36
    allocs = _emulated_trace(tmp_path, contiguous=False)
    math = [(size, frames) for size, frames in allocs
            if "at::_ops::_scaled_dot_product_attention_math::call" in frames]
    assert math
    scores = B * H * S * S * 4
    assert scores in _under(math, "bmm")
    assert scores in _under(math, "_safe_softmax")
    assert B * H * S * S in _under(math, "isneginf")  # _safe_softmax's bool copy of the scores, as on the GPU
    assert B * H * S * S in _under(math, "native_dropout")  # the mask is bool, one byte an element
    assert not _under(allocs, "_scaled_dot_product_efficient_attention")


@pytest.mark.slow
def test_half_precision_on_the_math_path_computes_in_fp32_as_pytorch_does(tmp_path, torch):
    """In bf16 the math path keeps "query, key, value in high precision for accuracy" (PyTorch's
    _scaled_dot_product_attention_math, unless allow_fp16_bf16_reduction_math_sdp is set): fp32
    copies of q, k and v, fp32 scores, and the output and the attention weights cast back to bf16.
    Without the copies the emulated T5 in bf16 read 1,606 MiB against the real H200's 1,918 MiB."""
    B, H, S, D = 4, 8, 36, 32
    allocs = _emulated_trace(tmp_path, contiguous=False, dtype="bfloat16")
    math = [(size, frames) for size, frames in allocs
            if "at::_ops::_scaled_dot_product_attention_math::call" in frames]
    copies = [size for size, frames in math if "at::_ops::_to_copy::call" in frames]
    assert copies.count(B * H * S * D * 4) >= 3  # q, k and v in fp32
    assert B * H * S * D * 2 in copies and B * H * S * S * 2 in copies  # the output and the weights, in bf16
    assert B * H * S * S * 4 in _under(math, "bmm")


@pytest.mark.slow
def test_a_contiguous_learned_bias_runs_the_efficient_kernel_with_its_gradient(tmp_path, torch):
    """Made contiguous, the bias is the memory-efficient kernel's: preprocess_mask pads its last
    dimension to a multiple of 8 (36 -> 40, as its strides are not multiples of 8) and the
    backward gives its gradient (B, H, S, S) with the last dimension padded to 16 (36 -> 48)."""
    B, H, S = 4, 8, 36
    allocs = _emulated_trace(tmp_path, contiguous=True)
    assert not any("at::_ops::_scaled_dot_product_attention_math::call" in frames for _, frames in allocs)
    assert _under(allocs, "_scaled_dot_product_efficient_attention")
    assert H * S * 40 * 4 in _under(allocs, "constant_pad_nd")
    assert B * H * S * 48 * 4 in _under(allocs, "_scaled_dot_product_efficient_attention_backward")

