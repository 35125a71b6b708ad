"""DeepSpeed's fused CUDA optimizers on the emulated GPU: FusedAdam, FusedLamb and FusedLion.

DeepSpeed's default optimizer on a GPU (`"optimizer": {"type": "Adam"}` or `"AdamW"`) is FusedAdam, and
`"Lamb"` and `"Lion"` are FusedLamb and FusedLion: each asks its op builder (FusedAdamBuilder,
FusedLambBuilder, FusedLionBuilder in deepspeed/ops/op_builder) to `load()` a CUDA extension, which
DeepSpeed builds with nvcc the first time (`jit_load`) unless it was built at install. Under the
emulator `load()` gives those three a stand-in of our own before anything is imported or built, so no
CUDA toolkit is needed; its functions do to the emulated GPU's memory what the CUDA code does
(DeepSpeed 0.19.8's csrc, read):

- `multi_tensor_adam` (csrc/adam/multi_tensor_adam.cu) and `multi_tensor_lion`
  (csrc/lion/multi_tensor_lion.cu) update the parameters and moments in place, chunk by chunk, through
  multi_tensor_apply.cuh, which passes the tensors' addresses as kernel arguments: they allocate nothing
  on the device. The state (`exp_avg`, `exp_avg_sq`) is made by the optimizer's Python code.
- `lamb` (csrc/lamb/fused_lamb_cuda.cpp) allocates two 512-element buffers for the weight's and the
  update's partial L2 norms, freed when it returns, and a one-element LAMB coefficient it returns
  (FusedLamb keeps it in `lamb_coeffs` until its next step); fp32 for an fp16 parameter, else the
  parameter's dtype.

Each runs the checks the CUDA code runs before its kernels (devices, contiguity, sizes, the dtypes the
kernels are built for), with its errors. Nothing is computed: the emulated tensors hold no data, so the
parameters and moments keep the stand-in values they had, as they do under torch's own optimizers.

The host optimizers' builders (DeepSpeedCPUAdam's, DeepSpeedCPUAdagrad's, DeepSpeedCPULion's: ZeRO's
`offload_optimizer`) get the stand-ins of deepspeed_host_ops.py, which compute their updates with torch's
ops, so no C++ compiler is needed either. Any other op builder whose sources hold CUDA kernels (.cu
files: DeepSpeed's transformer, inference, quantizer kernels) is refused at `load()` in one line naming
it, before nvcc is run; other host-side builders (async I/O's, pinned memory's) load as DeepSpeed loads
them.
"""

from __future__ import annotations

import contextlib
import traceback
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from memdiff.recording.emulate import deepspeed_host_ops
from memdiff.recording.emulate.deepspeed_host_ops import dtype_name
from memdiff.recording.emulate.escapes import extension_refusal
from memdiff.recording.emulate.on_import import Setting, patched_on_import

# Where OpBuilder lives: DeepSpeed's package, or its source tree's `op_builder` (a local install).
BUILDERS = ("deepspeed.ops.op_builder.builder", "op_builder.builder")
# lamb's norm buffers: 512 elements each, the threads of one of its blocks (fused_lamb_cuda.cpp).
LAMB_PARTIALS = 512
INT32_MAX = (1 << 31) - 1
# The dtypes DISPATCH_DOUBLE_FLOAT_AND_HALF (csrc/includes/type_shim.h) builds the kernels for.
MULTI_TENSOR_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check_lists(tensor_lists: Sequence[Sequence[torch.Tensor]], depth: int, name: str) -> None:
    """multi_tensor_apply's checks (multi_tensor_apply.cuh) and the dispatch on the first tensor's dtype."""
    if len(tensor_lists) != depth:
        raise RuntimeError("tensor_lists.size() != depth")
    first = tensor_lists[0]
    if len(first) == 0:
        raise RuntimeError("tensor_lists[0].size() is not > 0")
    device = first[0].device
    if device.type != "cuda":
        raise RuntimeError("expected input to be on cuda")
    for tensors in tensor_lists:
        if len(tensors) != len(first):
            raise RuntimeError("Size mismatch among tensor lists")
        for tensor, reference in zip(tensors, first):
            if not (tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last)):
                raise RuntimeError("A tensor was not contiguous.")
            if tensor.device != device:
                raise RuntimeError("A tensor was not on the same device as the first tensor")
            if tensor.numel() != reference.numel():
                raise RuntimeError("Size mismatch")
    if first[0].dtype not in MULTI_TENSOR_DTYPES:
        raise RuntimeError(f"\"{name}\" not implemented for '{dtype_name(first[0].dtype)}'")


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                      lr: float, beta1: float, beta2: float, epsilon: float, step: int, mode: int,
                      bias_correction: int, weight_decay: float) -> None:
    """FusedAdam's update of [grads, params, exp_avg, exp_avg_sq] in place: no device memory."""
    _check_lists(tensor_lists, 4, "adam")


def multi_tensor_lion(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                      lr: float, beta1: float, beta2: float, step: int, weight_decay: float) -> None:
    """FusedLion's update of [grads, params, exp_avg] in place: no device memory."""
    _check_lists(tensor_lists, 3, "lion")


def lamb(p: torch.Tensor, p_copy: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float,
         beta1: float, beta2: float, max_coeff: float, min_coeff: float, eps: float, grad_scale: float, step: int,
         mode: int, bias_correction: int, decay: float) -> torch.Tensor:
    """FusedLamb's update of one parameter in place: the two norm buffers, made and freed here, and
    the LAMB coefficient, returned."""
    checked = [("p", p), ("m", m), ("v", v), ("g", g)] + ([("p_copy", p_copy)] if p_copy.numel() > 0 else [])
    for name, tensor in checked:
        if tensor.device.type != "cuda":
            raise RuntimeError(f"{name} must be a CUDA tensor")
        if not tensor.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    for name, tensor in (("m", m), ("v", v), ("g", g)):
        if tensor.numel() != p.numel():
            raise RuntimeError(f"number of elements in {name} and p tensors should be equal")
    if p_copy.numel() not in (0, p.numel()):
        raise RuntimeError("number of elements in p_copy and p tensors should be equal, or p_copy should be empty")
    acc = torch.float32 if p.dtype == torch.float16 else p.dtype
    weight_norms = torch.empty(LAMB_PARTIALS, dtype=acc, device=p.device)
    update_norms = torch.empty(LAMB_PARTIALS, dtype=acc, device=p.device)
    coefficient = torch.empty(1, dtype=acc, device=p.device)
    if p.numel() > INT32_MAX:
        raise RuntimeError("parameter tensor is too large to be indexed with int32")
    if g.dtype == torch.float16 and p.dtype != torch.float32:
        raise RuntimeError("expected parameter to be of float type")
    if g.dtype not in (torch.float16, torch.float32, torch.float64):
        raise RuntimeError(f"\"lamb_cuda_kernel\" not implemented for '{dtype_name(g.dtype)}'")
    # freed as the C++ function's locals are destroyed, the later first
    del update_norms
    del weight_norms
    return coefficient


def _module(name: str, functions: Dict[str, Callable[..., Any]]) -> types.ModuleType:
    module = types.ModuleType(f"memdiff.emulated.{name}", f"memdiff's stand-in for DeepSpeed's {name} CUDA extension")
    for attribute, function in functions.items():
        setattr(module, attribute, function)
    return module


# By builder name (OpBuilder.name): the stand-in of the extension it loads.
STANDINS = {
    "fused_adam": _module("fused_adam", {"multi_tensor_adam": multi_tensor_adam}),
    "fused_lamb": _module("fused_lamb", {"lamb": lamb}),
    "fused_lion": _module("fused_lion", {"multi_tensor_lion": multi_tensor_lion}),
}

EMULATED = "DeepSpeed's FusedAdam, FusedLamb and FusedLion"


def _loading(real: Callable[..., Any], cuda_builder: Any) -> Callable[..., Any]:
    def load(self: Any, verbose: bool = False) -> Any:
        host = deepspeed_host_ops.standin(getattr(self, "name", None))
        if host is not None:
            return host
        if isinstance(self, cuda_builder):
            standin = STANDINS.get(getattr(self, "name", ""))
            if standin is not None:
                return standin
            if any(str(source).endswith(".cu") for source in self.sources()):
                frames = [(f.filename, f.lineno or 0) for f in reversed(traceback.extract_stack()[:-1])]
                raise extension_refusal(f"DeepSpeed's {self.name} op ({type(self).__name__})", frames, EMULATED)
        return real(self, verbose)
    load.__wrapped__ = real  # type: ignore[attr-defined]
    return load


@contextlib.contextmanager
def fused_optimizers() -> Iterator[None]:
    """For the block: DeepSpeed's op builders load the stand-ins above for FusedAdam, FusedLamb and
    FusedLion and deepspeed_host_ops.py's for its CPU optimizers, and refuse other CUDA kernels in one
    line, whether DeepSpeed is imported before the block or in it (never imported here)."""
    def patch(name: str, module: Any) -> Optional[Setting]:
        base, cuda_builder = getattr(module, "OpBuilder", None), getattr(module, "CUDAOpBuilder", None)
        real = getattr(base, "load", None)
        if base is None or cuda_builder is None or real is None or hasattr(real, "__wrapped__"):
            return None
        return base, "load", _loading(real, cuda_builder)
    with patched_on_import(BUILDERS, patch):
        yield
