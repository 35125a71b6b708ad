"""torch's legacy CUDA tensor types on the emulated GPU: `torch.cuda.FloatTensor(n)`,
`t.type(torch.cuda.FloatTensor)`, `t.type("torch.cuda.LongTensor")`, `isinstance(t,
torch.cuda.FloatTensor)` and `t.type()`, as older training scripts use them. torch makes these in
its Python binding, before any op is dispatched: the CUDA build asks the driver there, the CPU build
has no CUDA type to make."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

DTYPES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
          "BFloat16Tensor": torch.bfloat16, "ByteTensor": torch.uint8, "CharTensor": torch.int8,
          "ShortTensor": torch.int16, "IntTensor": torch.int32, "LongTensor": torch.int64, "BoolTensor": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _emulated(t: Any) -> bool:
    with torch._C.DisableTorchFunction():  # the device mode says an emulated tensor is not meta
        return isinstance(t, torch.Tensor) and t.is_meta


class _LegacyType(type):
    """A `torch.cuda.XTensor` standing in: emulated tensors of its dtype are its instances."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return _emulated(obj) and obj.dtype == cls.dtype

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        """`torch.cuda.FloatTensor(2, 3)`, `(torch.Size)`, `([1.0, 2.0])` or `()`: a tensor on the GPU."""
        if kwargs.get("device") is not None:
            raise TypeError(f"{cls.__name__}: legacy constructors take no device")
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and not isinstance(args[0], torch.Size):
            return torch.tensor(args[0], dtype=cls.dtype, device="cuda")
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0].to(device="cuda", dtype=cls.dtype)
        sizes = tuple(args[0]) if len(args) == 1 and isinstance(args[0], torch.Size) else args
        return torch.empty(sizes, dtype=cls.dtype, device="cuda")


def _legacy_types() -> Dict[str, Any]:
    return {name: _LegacyType(name, (), {"dtype": dtype, "__module__": "torch.cuda", "is_cuda": True})
            for name, dtype in DTYPES.items()}


def _target(kind: Any) -> Optional[torch.dtype]:
    """The dtype a `.type()` argument names on the GPU: a stand-in type or `"torch.cuda.XTensor"`."""
    if isinstance(kind, _LegacyType):
        return kind.dtype
    if isinstance(kind, str) and kind.startswith("torch.cuda."):
        return DTYPES.get(kind[len("torch.cuda."):])
    return None


def handles(func: Any) -> bool:
    """Whether `func` is one this module answers for (Tensor.type)."""
    return func is torch.Tensor.type


def call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Tensor.type: the emulated GPU's type name, or a move to the GPU for a CUDA type."""
    t = args[0]
    kind = args[1] if len(args) > 1 else kwargs.get("dtype")
    if kind is None:
        if _emulated(t) and t.dtype in NAMES:
            return f"torch.cuda.{NAMES[t.dtype]}"
        return func(*args, **kwargs)
    dtype = _target(kind)
    if dtype is None:
        return func(*args, **kwargs)
    non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    # called with the device mode off (from its handler): the emulated GPU is the meta device here
    return t.to(device=torch.device("meta"), dtype=dtype, non_blocking=non_blocking)


@contextlib.contextmanager
def legacy_cuda_types() -> Iterator[None]:
    """torch.cuda's legacy tensor types as the emulated GPU's, for the block."""
    saved = {name: getattr(torch.cuda, name) for name in DTYPES if hasattr(torch.cuda, name)}
    for name, value in _legacy_types().items():
        if name in saved:
            setattr(torch.cuda, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
