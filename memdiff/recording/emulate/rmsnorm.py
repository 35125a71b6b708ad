"""torch.nn.RMSNorm and F.rms_norm on the emulated GPU take CUDA's fused kernel.

`rms_norm` is made of other ops (aten/src/ATen/native/layer_norm.cpp `rms_norm_symint`, read at a
fork of pytorch main, cyyever/pytorch 0660972, the pytorch repository being too large to fetch at
its tag): past its own checks (a channels-last or complex input, a weight of another dtype than the
input, which torch 2.13's CPU build warns of: `rms_norm_composite`'s pow, mean, rsqrt and muls) it
calls `_fused_rms_norm` on every device. A CUDA build has a CUDA kernel for that op
(cuda/layer_norm_kernel.cu `_fused_rms_norm_cuda`), so autograd runs its derivatives.yaml formula:
FusedRmsNormBackward0 saves the input, the weight and the second output, the inverse RMS (torch
2.13's generated node, read on the meta device with this module's kernel). The meta device has no
kernel for the op, so its CompositeImplicitAutograd decomposition runs above autograd and keeps the
decomposition's activations (the input, its normalized copy, the inverse RMS; an fp32 copy of a
16-bit input besides): one or two more activations of the input's size per norm than the GPU.

`fused_kernel()` gives `_fused_rms_norm` a Meta kernel while the emulator runs: with a kernel for
the backend, the dispatcher runs the op's autograd kernel, as it does for CUDA, and torch's own
`rms_norm` makes the choice a GPU makes. The backward, `_fused_rms_norm_backward`, has a meta
kernel in torch already. The kernel's own buffers (a contiguous copy of a strided input, the
backward's per-block partial sums of the weight's gradient) are scratch.py's rules.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

FUSED = "_fused_rms_norm"


# The fused op's overload; None in an older torch that has none, where a GPU runs rms_norm's
# decomposition as the meta device does.
_OP = getattr(getattr(torch.ops.aten, FUSED, None), "default", None)


def fused(func: Any) -> bool:
    """Whether `func` is the fused op, which runs whole on the emulated GPU though torch could
    decompose it (a Meta kernel stands for its CUDA kernel while the emulator runs)."""
    return _OP is not None and func is _OP


def _check(x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor]) -> Tuple[int, int]:
    """_check_layer_norm_inputs (native/layer_norm.h), which `_fused_rms_norm_cuda` runs: the rows M
    and the features N, with torch's errors."""
    shape = [int(s) for s in normalized_shape]
    if not shape:
        raise RuntimeError("Expected normalized_shape to be at least 1-dimensional, i.e., containing at least "
                           f"one element, but got normalized_shape = {shape}")
    if weight is not None and list(weight.shape) != shape:
        raise RuntimeError(f"Expected weight to be of same shape as normalized_shape, but got weight of shape "
                           f"{list(weight.shape)} and normalized_shape = {shape}")
    axis = x.dim() - len(shape)
    if axis < 0 or list(x.shape[axis:]) != shape:
        raise RuntimeError(f"Given normalized_shape={shape}, expected input with shape [*, "
                           f"{', '.join(map(str, shape))}], but got input of size{list(x.shape)}")
    rows = 1
    for size in x.shape[:axis]:
        rows *= int(size)
    features = 1
    for size in shape:
        features *= size
    return rows, features


def _fused_rms_norm_meta(x: torch.Tensor, normalized_shape: List[int], weight: Optional[torch.Tensor] = None,
                         eps: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`_fused_rms_norm_cuda`'s outputs: Y like the input, contiguous, in its dtype, and rstd, one value
    per row in the accumulate type (float32 for float16, bfloat16 and float32; float64 for float64),
    viewed as the input's leading dimensions followed by ones."""
    rows, _ = _check(x, normalized_shape, weight)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise RuntimeError(f"\"LayerNormKernelImpl\" not implemented for {x.dtype}")  # AT_DISPATCH's floating types
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    axis = x.dim() - len(normalized_shape)
    out = torch.empty(x.shape, dtype=x.dtype, device="meta")
    rstd = torch.empty((rows,), dtype=acc, device="meta").view(*x.shape[:axis], *([1] * len(normalized_shape)))
    return out, rstd


@contextlib.contextmanager
def fused_kernel() -> Iterator[None]:
    """`_fused_rms_norm` has a Meta kernel for the block, and none after it."""
    if _OP is None:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        # torch.library's `impl` refuses a Meta kernel for an op that has a CompositeImplicitAutograd
        # one (a rule for torch's own meta registrations, which should let such ops decompose): here
        # the meta device stands for a GPU that does not decompose it, so the kernel is registered
        # with the dispatcher directly, and the library's end takes it away again.
        library.m.impl(FUSED, "Meta", _fused_rms_norm_meta, False)
        yield
    finally:
        library._destroy()
