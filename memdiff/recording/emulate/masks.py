"""Boolean-mask indices (`x[mask]`, `x[mask] = v`, `index_put_` and the backward of `x[mask]`) as
CUDA's indexing kernels take them.

CUDA's `index` and `index_put_` (native/TensorAdvancedIndexing.cpp) first turn every bool or uint8
mask into long indices, one per masked dimension: `expandTensors` (native/IndexingUtils.h) runs
`nonzero` of the mask and indexes with its columns. So the sizes follow the data-dependent policy
nonzero follows here (docs/emulate.md: the true count where the mask's values are known, else every
element), and the snapshot holds nonzero's output and buffers inside the op, as a GPU's does. One
exception, as on the GPU: a put of one value through one mask without accumulating is `masked_fill_`
(canDispatchToMaskedFill), which makes no indices.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

# The ops whose CUDA kernels expand masks (index, its puts, and the put autograd's IndexBackward0 runs)
OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _is_mask(index: Any) -> bool:
    import torch

    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) and index.is_meta


def expands(base: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """Whether op `base` with these arguments runs nonzero of a device mask inside its kernel."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    masks = [i for i in indices if _is_mask(i)]
    if not masks:
        return False
    if base == "index":
        return True
    value = args[2] if len(args) > 2 else kwargs["values"]
    accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
    filled = not accumulate and value.numel() == 1 and len(masks) == 1 and all(
        i is None or _is_mask(i) for i in indices)
    return not filled  # the GPU's masked_fill_ route makes no indices


def expanded(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with each device mask replaced by its nonzero's columns (run by the caller's mode,
    so nonzero is sized and allocated as the emulated GPU's)."""
    import torch

    def expand(indices: Sequence[Any]) -> List[Any]:
        out: List[Any] = []
        for index in indices:
            if _is_mask(index):
                found = torch.nonzero(index)
                out.extend(found.select(1, d) for d in range(index.dim()))
            else:
                out.append(index)
        return out

    if len(args) > 1:
        return (args[0], expand(args[1]), *args[2:]), kwargs
    return tuple(args), {**kwargs, "indices": expand(kwargs["indices"])}
