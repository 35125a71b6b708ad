"""CUDA's autocast for emulated tensors: the meta device has no autocast of its own, so the casts
the GPU would make are made here, above autograd (so that the graph saves what the GPU's saves),
from the op lists in autocast.json, with autocast's cache of casted weights."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_map

_LISTS = json.loads((resources.files("memdiff") / "rules" / "autocast.json").read_text(encoding="utf-8"))["cuda"]
LOWER: Set[str] = set(_LISTS["lower"])
FP32: Set[str] = set(_LISTS["fp32"])
PROMOTE: Set[str] = set(_LISTS["promote"])
LOW = (torch.float16, torch.bfloat16)


class Autocast:
    """The casts `torch.autocast("cuda")` makes, read from torch's own autocast state."""

    def __init__(self) -> None:
        # id(weight) -> (weight, its cast): kept until the outermost autocast exits, as the GPU's cache is.
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def dtype() -> Optional[torch.dtype]:
        """The autocast dtype when CUDA autocast is on, else None."""
        if not torch.is_autocast_enabled("cuda"):
            return None
        return torch.get_autocast_dtype("cuda")

    def clear(self) -> None:
        """torch.clear_autocast_cache(): the outermost autocast region ended."""
        self.cache.clear()

    def _to(self, t: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(t, torch.Tensor) and t.is_meta and t.is_floating_point()):
            return t
        if t.dtype in (dtype, torch.float64):
            return t
        # torch's cached_cast: only an fp32 leaf that requires grad and is no view (under
        # inference_mode or no_grad, `weight.T` has no grad_fn and reads as a leaf: not cached).
        if t.dtype == torch.float32 and t.is_leaf and t.requires_grad and not t._is_view() \
                and torch.is_autocast_cache_enabled():
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            cast = t.to(dtype)
            self.cache[id(t)] = (t, cast)
            return cast
        return t.to(dtype)

    def cast(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict]]:
        """Op `name`'s arguments as autocast gives them, or None when it leaves the op alone."""
        dtype = self.dtype()
        if dtype is None:
            return None
        if name in LOWER:
            target = dtype
        elif name in FP32:
            if not any(isinstance(t, torch.Tensor) and t.is_meta and t.dtype in LOW for t in _tensors(args, kwargs)):
                return None
            target = torch.float32
        elif name in PROMOTE:
            floats = [t.dtype for t in _tensors(args, kwargs) if t.is_meta and t.is_floating_point()]
            if len(set(floats)) < 2:
                return None
            target = max(floats, key=lambda d: torch.finfo(d).bits)
        else:
            return None
        return tree_map(lambda t: self._to(t, target), args), tree_map(lambda t: self._to(t, target), kwargs)

    def attention(self, q: Any, k: Any, v: Any) -> Tuple[Any, Any, Any]:
        """scaled_dot_product_attention's inputs under autocast (it is on the lower list)."""
        dtype = self.dtype()
        if dtype is None:
            return q, k, v
        return self._to(q, dtype), self._to(k, dtype), self._to(v, dtype)


def _tensors(args: Any, kwargs: Any) -> list:
    out: list = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, (args, kwargs))
    return out
