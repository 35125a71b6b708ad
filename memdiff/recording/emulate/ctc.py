"""F.ctc_loss on the emulated GPU, as CUDA's native kernels allocate (aten/src/ATen/native/cuda/LossCTC.cu,
`ctc_loss_gpu_template` and `ctc_loss_backward_gpu_template`, read at torch 2.13's source).

The meta device has no kernel for `_ctc_loss.Tensor` (the overload `F.ctc_loss` calls with tensor lengths,
as Hugging Face's CTC heads do) nor for `_ctc_loss_backward`, and the shapes of their outputs depend on the
target lengths' values: the forward's `log_alpha` is (batch, T, 2 * max target length + 1). The lengths
follow the emulator's one policy for sizes that depend on values (docs/emulate.md): their values where the
emulator has them (lengths counted from the batch's labels and masks), else the most memory the kernel can
take: the longest target a 2-D target tensor can hold (its width), or all of a 1-D one's.

What each kernel allocates besides its outputs:
- forward: the target and input lengths and each sample's offset into the targets, copied to the GPU as
  int64 (batch x 8 B each), freed when the op returns; its outputs are the loss per sample and log_alpha;
- backward: the same three, `log_beta` like `log_alpha`, and its output, the gradient like `log_probs`.
  Past a size (`is_large`, the kernel's own test) it sums alpha and beta at the blanks' positions,
  (batch, T, max target length + 1), and `logsumexp` of that takes its max, the shifted copy and its
  result; with `zero_infinity` the gradient is replaced by `where(...)`'s new tensor of its size.
cuDNN's CTC (int32 targets on the host, every input as long as T, blank 0, fp32, targets up to 256) is
what a GPU runs instead when all of that holds; the emulator runs the native kernels.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

OPS = ("_ctc_loss", "_ctc_loss_backward")
_LONG = 8


def _lengths(given: Any, values: Any) -> Optional[List[int]]:
    """A lengths argument as ints: a list, a host tensor, or a device tensor whose values are known."""
    if isinstance(given, torch.Tensor):
        known = values.of(given) if given.is_meta else given
        return None if known is None else [int(v) for v in known.reshape(-1).tolist()]
    return [int(v) for v in given]


def _longest(targets: torch.Tensor, lengths: Optional[List[int]]) -> int:
    """The longest target: from the lengths where known, else the most the targets can hold."""
    if lengths is not None:
        return max(lengths, default=0)
    return int(targets.shape[1]) if targets.dim() == 2 else int(targets.numel())


def _empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(int(s) for s in shape), dtype=like.dtype, device="meta")


def run(base: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], values: Any) -> Tuple[Any, list]:
    """The op's outputs on the meta device, and the steps of the buffers its CUDA kernel allocates
    (scratch.play's)."""
    named = dict(kwargs)
    if base == "_ctc_loss":
        log_probs, targets, _, target_lengths = args[:4]
        longest = _longest(targets, _lengths(target_lengths, values))
        batch, steps = int(log_probs.shape[1]), _small(int(log_probs.shape[1]))
        out = (_empty((batch,), log_probs), _empty((batch, log_probs.shape[0], 2 * longest + 1), log_probs))
        return out, steps + [("free", label) for label in _SMALL]
    log_probs, log_alpha = args[1], args[6]
    zero_infinity = bool(args[8] if len(args) > 8 else named.get("zero_infinity", False))
    time, batch, labels = (int(s) for s in log_probs.shape)
    elem = log_probs.element_size()
    alpha = int(log_alpha.numel()) * elem
    steps = _small(batch) + [("alloc", "log_beta", alpha, ("empty_like",))]
    if 2 * time + (24 * batch) // 10 + (2 * labels) // 10 > 450:  # the kernel's is_large
        blanks = batch * time * (int(log_alpha.shape[2]) // 2 + 1) * elem
        steps += [("alloc", "alpha_beta", blanks, ("add",)), ("alloc", "max", batch * time * elem, ("amax",)),
                  ("alloc", "shifted", blanks, ("sub",)), ("alloc", "logsumexp", batch * time * elem, ("empty",)),
                  ("free", "shifted"), ("free", "max"), ("free", "alpha_beta"), ("free", "logsumexp")]
    if zero_infinity:  # grad = where(nll == inf, 0, grad): the first gradient is a buffer, freed
        steps += [("alloc", "gradient", time * batch * labels * elem, ("full_like",)),
                  ("alloc", "infinite", batch, ("eq",)), ("alloc", "zero", elem, ("zeros",)),
                  ("free", "infinite"), ("free", "zero"), ("free", "gradient")]
    return _empty(log_probs.shape, log_probs), steps + [("free", "log_beta")] + [("free", x) for x in _SMALL]


_SMALL = ("target_lengths", "input_lengths", "batch_offsets")


def _small(batch: int) -> list:
    return [("alloc", label, batch * _LONG, ("tensor",)) for label in _SMALL]
