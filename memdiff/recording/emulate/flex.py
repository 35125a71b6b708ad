"""FlexAttention (`torch.nn.attention.flex_attention`) on the emulated GPU.

flex_attention and its backward are higher-order operators: they reach a dispatch mode whole, and
the emulator's AllocMode had no rule for them ("There was no rule registered for HigherOrderOperator
flex_attention": torchtitan's Llama 3 runs every attention through it). On a GPU they run one of two
ways, and so they do here:

- called eagerly (not under torch.compile), torch runs its dense implementation (`sdpa_dense` and
  `sdpa_dense_backward`, with its warning that it "materializes the full scores matrix"): its ops
  run through the emulator as they run on the GPU, score matrices included;
- inside a torch.compile that the emulator runs eagerly (Inductor `options`, as torchtitan compiles
  flex_attention; a graph Inductor could not plan here), the GPU runs Inductor's fused FlexAttention
  kernels, which never hold the scores: their outputs are what torch's own fake implementations of
  the two operators give (`register_fake` in torch/_higher_order_ops/flex_attention.py): the
  output, the logsumexp and the row maxima in float32, and in the backward the gradients of query,
  key, value and the score_mod's captured buffers (key and value's broadcast over the query's batch
  first, then summed, as there). Those are the allocations made, under the operator's name. The
  kernels' own scratch (the backward's float32 `delta` rows, one per query row) is not modelled: an
  estimate of at most B x Hq x Sq x 4 bytes.

A compile the emulator lowers itself (default mode, no options) traces the operator into Inductor's
plan and never reaches this module.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from typing import Any, Iterator, List, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

_fused = [0]  # how deep the script is inside compiled functions the emulator runs eagerly
# the storages of fused forwards' outputs (autograd saves them and gives the backward other tensor
# objects on them), whose backward (run later, outside the compiled call) is fused too
_fused_outputs: Set[int] = set()


@contextlib.contextmanager
def fused() -> Iterator[None]:
    """FlexAttention inside the block runs as Inductor's fused kernels (a torch.compile run eagerly)."""
    _fused[0] += 1
    try:
        yield
    finally:
        _fused[0] -= 1


def _allocated(mode: Any, name: str, out: Any, args: Tuple[Any, ...]) -> Any:
    """The meta outputs of a FlexAttention operator, each storage an allocation on the GPU of its
    inputs (`args`)."""
    emulator = mode.emulator
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_meta]
    index = emulator.placement.for_new(args, {})
    seen = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if id(storage) not in seen:  # a view (the summed key gradient's) is its base's storage
            seen.add(id(storage))
            emulator.track(storage, name, (), index)
    return out


@contextlib.contextmanager
def flex_attention_kernels(mode_type: type) -> Iterator[None]:
    """flex_attention and flex_attention_backward handled by `mode_type` (AllocMode) for the block."""
    try:  # the module, which the package's attribute of the same name (the operator) hides
        flex = importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:  # a torch without FlexAttention
        yield
        return
    forward_fake, backward_fake = flex.flex_attention_fake_impl, flex.flex_attention_backward_fake_tensor_mode

    def forward(mode: Any, *args: Any, **kwargs: Any) -> Any:
        if not _fused[0]:
            with mode:
                return flex.sdpa_dense(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            out = _allocated(mode, "flex_attention", forward_fake(*args, **kwargs), args)
        storage = out[0].untyped_storage()
        _fused_outputs.add(id(storage))
        weakref.finalize(storage, _fused_outputs.discard, id(storage))
        return out

    def backward(mode: Any, *args: Any, **kwargs: Any) -> Any:
        output = args[3] if len(args) > 3 else kwargs.get("out")
        if not isinstance(output, torch.Tensor) or id(output.untyped_storage()) not in _fused_outputs:
            with mode:
                return flex.sdpa_dense_backward(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return _allocated(mode, "flex_attention_backward", backward_fake(*args, **kwargs), args)

    registered: List[Tuple[Any, Any]] = []
    for operator, handler in ((flex.flex_attention, forward), (flex.flex_attention_backward, backward)):
        if mode_type not in operator.python_key_table:
            operator.py_impl(mode_type)(handler)
            registered.append((operator, mode_type))
    try:
        yield
    finally:
        for operator, key in registered:
            operator.python_key_table.pop(key, None)
            operator._dispatch_cache.clear()
