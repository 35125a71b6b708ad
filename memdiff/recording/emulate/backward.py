"""Autograd formulas that write into the zeros they made, as the GPU runs them.

Several of torch's derivative formulas (autograd/FunctionsManual.cpp) make a zero-filled gradient and
scatter into it in place (`scatter_add_`, `scatter_`, `index_add_`), except for "tensor-subclass-like"
tensors, for which they call the out-of-place op: a second full-size buffer, the zeros copied into it,
both live until the formula returns. `isTensorSubclassLike` is true for every tensor while any
dispatch mode is on (`c10::impl::dispatch_mode_enabled()`) and for every meta tensor (the Meta
backend bit is in kTensorSubclassLike): both hold for every tensor the emulator runs, so each such
formula took its subclass branch. torch gives no switch for it, so the emulator runs the out-of-place
op of those formulas in place into the formula's own zeros, which no one else holds.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Optional

# node -> the out-of-place op its formula calls on the zeros it made (whose in-place twin the GPU runs)
FORMULAS: Dict[str, FrozenSet[str]] = {
    "GatherBackward0": frozenset({"scatter_add"}),  # gather_backward
    "CummaxBackward0": frozenset({"scatter_add"}),  # cummaxmin_backward
    "CumminBackward0": frozenset({"scatter_add"}),
    # value_selecting_reduction_backward: max/min along a dim, topk, sort, kthvalue, mode, median
    **{node: frozenset({"scatter"}) for node in (
        "MaxBackward0", "MinBackward0", "TopkBackward0", "SortBackward0", "SortBackward1",
        "KthvalueBackward0", "ModeBackward0", "MedianBackward1", "NanmedianBackward1")},
    "IndexSelectBackward0": frozenset({"index_add"}),  # index_select_backward
}
OPS = frozenset(op for ops in FORMULAS.values() for op in ops)


def in_place(func: Any, base: str) -> Optional[Any]:
    """The in-place twin of op `func` (named `base`) when the autograd node running now is one whose
    formula the GPU runs in place (FORMULAS); None otherwise."""
    import torch

    node = torch._C._current_autograd_node()
    if node is None or base not in FORMULAS.get(type(node).__name__, ()):
        return None
    return getattr(getattr(torch.ops.aten, base + "_"), func._overloadname)
