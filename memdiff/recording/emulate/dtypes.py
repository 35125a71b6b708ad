"""The dtype checks CUDA's products and convolutions make, which their meta kernels leave out.

On a GPU `mm` and `addmm` (what `F.linear` and `@` become below autograd) refuse operands of two
dtypes, since cuBLAS runs one type (aten/src/ATen/native/cuda/Blas.cpp: "expected mat1 and mat2 to
have the same dtype"), and a convolution refuses an input whose type is not its weight's or its
bias's (aten/src/ATen/native/Convolution.cpp). Their meta kernels give a result anyway, so a script
that stops on the GPU (a float32 batch into bfloat16 weights outside autocast) ran on under
emulation, and `whatif --emulate --change weights=bf16` measured a run the GPU never finishes.
Autocast casts before these ops are dispatched: under it they see one dtype, as on the GPU.
A bias of another dtype than the input is refused before any of this, by conv1d, conv2d and conv3d
themselves (composites every device runs, Convolution.cpp: "Input type (c10::BFloat16) and bias type
(float) should be the same"), so emulated and on CUDA alike; the bias check here is cuDNN's, for
what reaches `convolution` without them (`conv_transpose2d`, `torch.convolution`).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch

# op -> the positions of its two matrices
PRODUCTS: Dict[str, Tuple[int, int]] = {"mm": (0, 1), "addmm": (1, 2), "_addmm_activation": (1, 2)}
# How c10 names a dtype in the products' message (caffe2::TypeMeta), and the legacy tensor type a
# convolution's names (`torch.cuda.FloatTensor`).
_META_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
               torch.bfloat16: "c10::BFloat16"}
_TYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def check(base: str, args: Sequence[Any]) -> None:
    """Raise the RuntimeError CUDA's kernel raises for op `base` when its operands' dtypes differ."""
    where = PRODUCTS.get(base)
    if where is not None:
        first, second = (args[i] if i < len(args) else None for i in where)
        if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first.dtype != second.dtype:
            raise RuntimeError(f"expected mat1 and mat2 to have the same dtype, but got: "
                               f"{_META_NAMES.get(first.dtype, first.dtype)} != "
                               f"{_META_NAMES.get(second.dtype, second.dtype)}")
    elif base == "convolution" and len(args) >= 3:
        given, weight, bias = args[0], args[1], args[2]
        for name, other in (("weight", weight), ("bias", bias)):
            if isinstance(given, torch.Tensor) and isinstance(other, torch.Tensor) and given.dtype != other.dtype:
                raise RuntimeError(f"Input type ({_type(given)}) and {name} type ({_type(other)}) should be the same")


def _type(tensor: torch.Tensor) -> str:
    """A CUDA tensor's legacy type name, as a convolution's message gives it."""
    name = _TYPE_NAMES.get(tensor.dtype)
    return f"torch.cuda.{name}Tensor" if name is not None else f"torch.cuda.{tensor.dtype}"
