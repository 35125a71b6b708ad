"""Custom ops whose output size depends on data: torchvision's `nms` (every detection model) and any
`torch.library` op whose fake implementation asks `torch.library.get_ctx().new_dynamic_size()`.

PyTorch runs such a fake on meta tensors only to raise ("this operator may return an output Tensor
with data-dependent shape ... please use FakeTensors"). The emulator runs it with a context of its
own that answers the size by the data-dependent policy of docs/emulate.md: where the values of every
device input are known, the op's own CPU kernel runs on them (the true size); else the most the op
can keep: the `max` the fake gives, else the bound this table knows (nms keeps at most every box),
else every element of its largest input. Kernel buffers inside the op are not modelled.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Dict, Optional, Sequence

from torch.utils._pytree import tree_leaves

# What PyTorch's meta kernel of a fake says when the fake asks for a data-dependent size (lower case).
ASKED = "may return an output tensor with data-dependent shape"


def _boxes(args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """nms(dets, scores, iou_threshold): it keeps at most every box."""
    return int(args[0].shape[0])


# The most an op can keep, where the op's own contract says it
BOUNDS: Dict[str, Callable[[Sequence[Any], Dict[str, Any]], int]] = {
    "torchvision::nms": _boxes,
    "torchvision::qnms": _boxes,
}


class Sizes:
    """torch's FakeImplCtx, as a fake implementation sees it, with sizes that are plain ints."""

    def __init__(self, bound: int) -> None:
        self.bound = bound

    def new_dynamic_size(self, *, min: int = 0, max: Optional[int] = None) -> int:  # noqa: A002 (torch's names)
        """The size a data-dependent output takes: its upper bound."""
        return max if max is not None else builtins.max(min, self.bound)

    def create_unbacked_symint(self, *, min: int = 2, max: Optional[int] = None) -> int:  # noqa: A002
        """The older name of new_dynamic_size (torchvision's nms asks it)."""
        return self.new_dynamic_size(min=min, max=max)


def sized(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], values: Any) -> Any:
    """Op `func`'s outputs on the meta device, sized by the policy (module docstring); `values` are the
    emulator's known values (values.Values), which the outputs' join where the CPU kernel ran."""
    import torch
    from torch._library.fake_impl import set_ctx_getter
    from torch._library.simple_registry import singleton

    devices = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_meta]
    known = [values.of(a) for a in devices]
    if devices and all(k is not None for k in known):
        swap = {id(a): k for a, k in zip(devices, known)}
        on_host = [swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args]
        value = func(*on_host, **{k: swap.get(id(v), v) for k, v in kwargs.items()})
        if isinstance(value, torch.Tensor):
            out = torch.empty(value.shape, dtype=value.dtype, device="meta")
            values.known[out] = value
            return out
    name = func._schema.name
    rule = BOUNDS.get(name)
    bound = rule(args, kwargs) if rule else max((int(a.numel()) for a in devices), default=0)
    fake = singleton.find(name).fake_impl.kernel
    with set_ctx_getter(lambda: Sizes(bound)):
        return fake(*args, **kwargs)
