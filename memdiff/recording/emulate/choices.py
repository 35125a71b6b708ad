"""A router's choices under emulation: balanced routing (docs/emulate.md, "A router's choices").

A mixture of experts picks each token's experts with `topk` of its router's logits, which are made
from weights and so have no values here. The sizes that follow depend on those picks: the counts a
router reads back to split its rows (JetMoE's `expert_size.tolist()`), the tokens `torch.where`
gives each expert (Mixtral's, Qwen2-MoE's, OLMoE's loops). So `topk` of a tensor without values
gives indices that have values: those of a perfectly balanced router, the goal of every
load-balancing loss and what capacity planning assumes. Row t's j-th choice among n is
(t * k + j) mod n: never the same index twice in a row (k <= n), and over T rows every index is
chosen T * k / n times (rounded down or up). Its values output stays without values: it is made from
the weights. Balanced indices are valid indices, so topk used elsewhere (a sampler's, accuracy@k)
still runs.

What is computed from the picks (one_hot, scatter, sums, sorts, nonzero, bincount) keeps its values
at any size (values.py, `routed`): a policy that flipped with the batch would give one model two
answers. Their host copies cost what the same tensors cost the GPU, and go when the tensors go.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch


def topk_dim(x: torch.Tensor, args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    """The dimension topk(self, k, dim=-1, largest, sorted) selects over, made non-negative."""
    dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
    return dim % max(1, x.dim())


def balanced(shape: Sequence[int], dim: int, n: int) -> torch.Tensor:
    """The int64 indices of shape `shape` that a balanced choice of `shape[dim]` among `n` gives: the
    rows (every other dimension, in order) choose (row * k + j) mod n for j < k."""
    shape = list(shape)
    if not shape:  # topk of a 0-d tensor: its one element
        return torch.zeros((), dtype=torch.long)
    k = shape[dim]
    moved = shape[:dim] + shape[dim + 1:] + [k]
    rows = 1
    for size in moved[:-1]:
        rows *= size
    if rows * k == 0:
        return torch.zeros(shape, dtype=torch.long)
    picks = (torch.arange(rows, dtype=torch.long)[:, None] * k + torch.arange(k, dtype=torch.long)) % n
    return picks.reshape(moved).movedim(-1, dim).contiguous()
