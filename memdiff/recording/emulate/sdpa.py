"""scaled_dot_product_attention as PyTorch runs it on a GPU: the backend its selection code picks,
read from a rule table per torch version (kernels.json, `sdpa_select`: sdpa_select.py, which
the what-if reads too), and what that backend runs.

The table holds each backend's checks from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
and sdp_utils_cpp.h as conditions over the call's facts (`facts`): a backend is taken when none
of its checks rejects the call, trying them in PyTorch's priority order for the GPU. Where the
math backend is picked, `math` runs the ops at::native::_scaled_dot_product_attention_math runs,
with the GPU's fused dropout, so the emulated GPU allocates what the real one does.
"""

from __future__ import annotations

import math as _math
from typing import Any, Dict, List, Optional

import torch

from memdiff.recording.emulate.gpus import kernels
from memdiff.recording.emulate.sdpa_select import Condition, exact, select, table

__all__ = ["Condition", "exact", "select", "table", "facts", "boolean_mask", "efficient_mask", "math"]

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}


def _offset_bytes(x: torch.Tensor) -> int:
    return int(x.storage_offset()) * x.element_size()


def facts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout: float,
          causal: bool, gqa: bool, major: int, minor: int) -> Dict[str, Any]:
    """What PyTorch's checks read of a call (sdp_params, the GPU's compute capability, the global
    context's switches), by the names kernels.json's conditions use."""
    four = q.dim() == 4 and k.dim() == 4 and v.dim() == 4

    def size(x: torch.Tensor, dim: int) -> int:
        return int(x.shape[dim]) if four else 0

    grad_mode = torch.is_grad_enabled()
    out: Dict[str, Any] = {
        "major": major, "minor": minor,
        "enabled_cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "enabled_flash": torch.backends.cuda.flash_sdp_enabled(),
        "enabled_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "enabled_math": torch.backends.cuda.math_sdp_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
        "four_d": four, "same_dtype": q.dtype == k.dtype == v.dtype, "dtype": DTYPE_NAMES.get(q.dtype, str(q.dtype)),
        "esize": q.element_size(),
        "bq": size(q, 0), "bk": size(k, 0), "bv": size(v, 0),
        "hq": size(q, 1), "hk": size(k, 1), "hv": size(v, 1),
        "sq": size(q, 2), "sk": size(k, 2),
        "dq": int(q.shape[-1]), "dk": int(k.shape[-1]), "dv": int(v.shape[-1]),
        "qkv_last_stride_1": q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
        "q_offset": _offset_bytes(q), "k_offset": _offset_bytes(k), "v_offset": _offset_bytes(v),
        "empty": q.numel() == 0 or k.numel() == 0 or v.numel() == 0,
        "grad": grad_mode and (q.requires_grad or k.requires_grad or v.requires_grad),
        "dropout": float(dropout), "causal": bool(causal), "gqa": bool(gqa),
        "mask": mask is not None,
        "mask_grad": False, "mask_dim": 0, "mask_b": 1, "mask_h": 1, "mask_q": 1, "mask_k": 1,
        "mask_last_stride_1": True, "mask_bool": False,
    }
    if mask is not None:
        shape = [1] * max(0, 4 - mask.dim()) + [int(n) for n in mask.shape]
        out.update(mask_grad=bool(mask.requires_grad), mask_dim=mask.dim(), mask_b=shape[-4], mask_h=shape[-3],
                   mask_q=shape[-2], mask_k=shape[-1], mask_last_stride_1=mask.stride(-1) == 1,
                   mask_bool=mask.dtype == torch.bool)
    return out


def boolean_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """convert_boolean_attn_mask (attention.cpp): a bool mask as the additive mask the kernels take,
    -inf where it is False."""
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -_math.inf, zero)


def efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (attention.cpp): a mask whose strides (but the last) are not multiples of 8
    elements, or whose last is not 1, is padded on its last dimension to a multiple of 8 (a new
    tensor, sliced back), then expanded to (B, H, Sq, Sk) for the memory-efficient kernel."""
    alignment = kernels()["sdpa_select"]["_mem_eff_mask_alignment"]
    aligned = all(mask.stride(i) % alignment == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        last = int(mask.shape[-1])
        mask = torch.nn.functional.pad(mask, (0, alignment - last % alignment))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout: float,
         causal: bool, scale: Optional[float], gqa: bool, context: List[str]) -> torch.Tensor:
    """at::native::_scaled_dot_product_attention_math's ops (torch 2.11 to 2.13), with CUDA's fused
    dropout (a bool mask; at::dropout takes the fused kernel on a CUDA tensor, not the composite a
    meta tensor would run). `context` is the emulator's stack of running ops, which the GPU's
    frames name. Half-precision inputs are computed in fp32 (copies of q, k and v), the output and
    the attention weights (its second output, dropped by the caller) cast back, unless
    `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` was set: the real H200's T5 in
    bf16 holds 1,918 MiB at its peak, 312 MiB more than this path read without the copies."""
    origin = q.dtype
    if origin in (torch.float16, torch.bfloat16) and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
    negative = scale is not None and scale < 0
    factor = _math.sqrt(abs(scale) if scale is not None else 1.0 / _math.sqrt(q.shape[-1]))
    query = q * (-factor if negative else factor)
    if causal:
        ones = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        mask = boolean_mask(ones.tril(), q.dtype)
    if gqa and q.shape[-3] != k.shape[-3]:
        # pre_process_group_query_attention_input: the key and value heads repeated to the query's
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    context.append("matmul")
    try:
        attn = torch.matmul(query, k.transpose(-2, -1) * factor)
    finally:
        context.pop()
    if mask is not None:
        attn.add_(mask)
    scores, attn = attn, torch._safe_softmax(attn, -1)
    # _safe_softmax (SoftMax.cpp) runs whole on the meta device, which hides the temporaries its
    # CUDA run allocates after the softmax: the rows that are all -inf, found through a bool copy
    # of the scores, and a zero to put there (the real H100's T5 window shows each, freed at once).
    context.append("_safe_softmax")
    try:
        with torch.no_grad():
            masked = scores.isneginf()
            rows = masked.all(-1, keepdim=True)
            zero = torch.scalar_tensor(0.0, dtype=attn.dtype, device=attn.device)
            del zero, rows, masked
    finally:
        context.pop()
    del scores
    if dropout > 0.0:
        context.append("dropout")
        try:
            attn = torch.native_dropout(attn, dropout, True)[0]
        finally:
            context.pop()
    context.append("matmul")
    try:
        out = torch.matmul(attn, v)
    finally:
        context.pop()
    weights = attn.to(origin)  # the math op's second output, which scaled_dot_product_attention drops
    del weights
    return out.to(origin)
