"""nn.DataParallel over the emulated GPUs of one process: scatter, replicate, gather as on the GPU.

A CUDA build runs DataParallel's copies between GPUs in C++ (torch/csrc/cuda/comm.cpp, reached as
`torch._C._scatter`, `_broadcast_coalesced`, `_gather`, and NCCL's `torch._C._nccl_*`), which makes
device tensors the emulator never sees; a CPU build has none of them. Here each is the same work in
torch ops, so every buffer is a request to the allocator of the GPU it is made on:

- broadcast: a tensor of the source's size on every other GPU (`at::empty`, filled by NCCL);
- broadcast_coalesced (replicate's weights): per chunk of at most `buffer_size` bytes of one type,
  the chunk flattened on the source GPU (`cat`, freed after the chunk; a lone tensor is its own
  flat view) and broadcast; each other GPU's tensors are views of its flat copy;
- scatter: the input split along `dim`, each chunk copied to its GPU (the source GPU keeps its view);
- gather: one tensor on the destination GPU, each input copied into its slice;
- NCCL's collectives move nothing (no values are known), and allocate nothing of PyTorch's.

parallel_apply runs the replicas in turn on this thread, each under its GPU as the current device:
a GPU runs them at once on their own GPUs, whose allocators are apart, so each GPU's trace is the
same; torch's modes, which the emulator runs in, are per thread and would not reach a new thread.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from memdiff.recording.emulate import swap
from memdiff.recording.emulate.runtime import EmulationError

COMM = ("_broadcast", "_broadcast_out", "_broadcast_coalesced", "_scatter", "_scatter_out", "_gather", "_gather_out")
NCCL = ("_nccl_all_reduce", "_nccl_reduce", "_nccl_broadcast", "_nccl_all_gather", "_nccl_reduce_scatter")


def _source(tensor: torch.Tensor) -> int:
    """The GPU a tensor is on, -1 for the host."""
    return int(tensor.get_device()) if tensor.is_cuda else -1


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> List[torch.Tensor]:
    """torch._C._broadcast: the tensor on each of `devices` (itself where it already is)."""
    here = _source(tensor)
    return [tensor if index == here else
            torch.empty(tensor.shape, dtype=tensor.dtype, device=f"cuda:{index}").copy_(tensor)
            for index in devices]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """torch._C._broadcast_out: the tensor copied into each of `out`."""
    for target in out:
        target.copy_(tensor)
    return out


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                        buffer_size: int = 10485760) -> List[List[torch.Tensor]]:
    """torch._C._broadcast_coalesced: `tensors` (on devices[0]) on every GPU of `devices`, moved a
    flat chunk at a time."""
    from torch._utils import _flatten_dense_tensors, _reorder_tensors_as, _take_tensors, _unflatten_dense_tensors

    if any(t.is_sparse for t in tensors):
        raise EmulationError("DataParallel", "sparse weights or buffers are not emulated")
    outputs: List[List[torch.Tensor]] = [list(tensors)] + [[] for _ in devices[1:]]
    types = {(t.dtype, t.layout) for t in tensors}
    for chunk in _take_tensors(list(tensors), buffer_size):
        copies = broadcast(_flatten_dense_tensors(chunk), devices)
        for i in range(1, len(devices)):
            with torch.cuda.device(devices[i]):
                # .data: each its own version counter, as comm.cpp re-wraps them
                outputs[i].extend(t.data for t in _unflatten_dense_tensors(copies[i], chunk))
    if len(types) > 1:  # chunks are taken per type: back in the order given
        outputs = [list(_reorder_tensors_as(o, tensors)) for o in outputs]
    return outputs


def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Optional[Sequence[int]] = None,
            dim: int = 0, streams: Any = None) -> Tuple[torch.Tensor, ...]:
    """torch._C._scatter: `tensor` split along `dim`, each piece on its GPU."""
    pieces = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(devices), dim)
    here = _source(tensor)
    return tuple(piece if index == here else piece.to(f"cuda:{index}", non_blocking=True)
                 for piece, index in zip(pieces, devices))


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int = 0,
                streams: Any = None) -> Sequence[torch.Tensor]:
    """torch._C._scatter_out: `tensor` split along `dim` into `out`."""
    for target, piece in zip(out, tensor.split([t.shape[dim] for t in out], dim)):
        target.copy_(piece)
    return out


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Optional[int] = None) -> torch.Tensor:
    """torch._C._gather: `tensors` concatenated along `dim` on the destination (None: the current GPU,
    -1: the host)."""
    first = tensors[0]
    shape = list(first.shape)
    shape[dim] = sum(int(t.shape[dim]) for t in tensors)
    device = "cpu" if destination == -1 else "cuda" if destination is None else f"cuda:{destination}"
    out = torch.empty(shape, dtype=first.dtype, device=device, memory_format=_memory_format(first))
    return gather_out(tensors, out, dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """torch._C._gather_out: `tensors` copied into their slices of `out`."""
    for piece, source in zip(out.split([int(t.shape[dim]) for t in tensors], dim), tensors):
        piece.copy_(source)
    return out


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """What at::Tensor::suggest_memory_format() gives: channels-last for a channels-last 4-d or 5-d tensor."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _nothing_moves(*args: Any, **kwargs: Any) -> None:
    """An NCCL collective between the emulated GPUs: nothing is moved, nothing of PyTorch's allocated."""


def parallel_apply(modules: Sequence[Any], inputs: Sequence[Any], kwargs_tup: Optional[Sequence[Any]] = None,
                   devices: Optional[Sequence[Any]] = None) -> List[Any]:
    """torch.nn.parallel.parallel_apply: each replica on its GPU, in turn on this thread."""
    from torch._utils import _get_device_index
    from torch.nn.parallel.parallel_apply import get_a_var

    if len(modules) != len(inputs):
        raise AssertionError(f"The number of modules {len(modules)} is not equal to the number of inputs "
                             f"{len(inputs)}")
    kwargs_tup = list(kwargs_tup) if kwargs_tup is not None else [{}] * len(modules)
    devices = list(devices) if devices is not None else [None] * len(modules)
    outputs = []
    for module, args, kwargs, device in zip(modules, inputs, kwargs_tup, devices):
        if device is None:
            found = get_a_var(args)
            if found is None:
                raise RuntimeError("no device was provided and no tensor input was found; device cannot be resolved")
            device = found.get_device()
        with torch.cuda.device(_get_device_index(device, True)):
            outputs.append(module(*(args if isinstance(args, (list, tuple)) else (args,)), **(kwargs or {})))
    return outputs


@contextlib.contextmanager
def data_parallel() -> Iterator[None]:
    """For the block: torch's C++ copies between GPUs and NCCL's collectives as the ops above, and
    parallel_apply on this thread."""
    own = {"_broadcast": broadcast, "_broadcast_out": broadcast_out, "_broadcast_coalesced": broadcast_coalesced,
           "_scatter": scatter, "_scatter_out": scatter_out, "_gather": gather, "_gather_out": gather_out}
    own.update({name: _nothing_moves for name in NCCL})
    replaced: List[Tuple[Any, str, Any]] = [(torch._C, name, value) for name, value in own.items()]
    # the package's `parallel_apply` is the function, which hides its module of that name
    real = importlib.import_module("torch.nn.parallel.parallel_apply").parallel_apply
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("torch.nn.parallel") and getattr(module, "parallel_apply", None) is real:
            replaced.append((module, "parallel_apply", parallel_apply))
    with swap.replaced(replaced):
        yield
