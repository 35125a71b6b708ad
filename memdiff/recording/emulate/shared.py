"""Shared memory of a device tensor: what CUDA makes a no-op is a no-op on the emulated GPU.

torch moves a CPU storage to POSIX shared memory (`share_memory_`) so that processes can share it;
a CUDA storage needs no move (other processes open it by CUDA IPC), so `Tensor.share_memory_()`,
`nn.Module.share_memory()` and `UntypedStorage.share_memory_()` of one return it unchanged, and
`is_shared()` is always true for it (torch/storage.py, torch/_tensor.py). torch tells the two apart
by the storage's device, and an emulated tensor's storage is on the meta device, which torch sends
down the CPU's path: `_share_fd_: only available on CPU` (Hogwild training with `--cuda`, pytorch/
examples' mnist_hogwild). Here an emulated storage takes CUDA's path.

The other device-dependent calls of the same files already answer as CUDA does under emulation, and
are left alone: `pin_memory()` of a device tensor or storage raises (on a GPU too: only CPU memory
can be pinned) and `is_pinned()` is false.

A device tensor sent to another process (an `mp.Process`'s arguments, a queue) goes as CUDA's does:
torch pickles a CUDA tensor as an IPC handle that the receiver opens on the sender's GPU
(rebuild_cuda_tensor), and a meta tensor as its shape, rebuilt on the meta device
(rebuild_meta_tensor). An emulated tensor's storage is on the meta device, so torch sends it as a meta
tensor, and the receiver, seeing a tensor made on the meta device by name, would take it for one of
the script's own meta tensors (on no GPU, `device` meta). Here a tensor of the emulated GPU is sent to
be rebuilt on the emulated GPU it is on; the script's own meta tensors still go as meta tensors. The
receiver's allocator counts the storage it rebuilds (CUDA maps it by IPC outside the allocator).
"""

from __future__ import annotations

import contextlib
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator, Tuple

import torch
from torch.multiprocessing import reductions

from memdiff.recording.emulate import swap
from memdiff.recording.emulate.devices import Placement


def _emulated(storage: Any) -> bool:
    return getattr(storage, "device", None) is not None and storage.device.type == "meta"


def _share(real: Callable[..., Any]) -> Callable[..., Any]:
    def share_memory_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _emulated(self):  # CUDA's path: nothing to move
            return self
        return real(self, *args, **kwargs)
    share_memory_.__doc__ = real.__doc__
    share_memory_.__wrapped__ = real  # type: ignore[attr-defined]
    return share_memory_


def _is_shared(real: Callable[..., Any]) -> Callable[..., Any]:
    def is_shared(self: Any) -> bool:
        if _emulated(self):  # a CUDA storage is always shared (by IPC)
            return True
        return bool(real(self))
    is_shared.__doc__ = real.__doc__
    is_shared.__wrapped__ = real  # type: ignore[attr-defined]
    return is_shared


@contextlib.contextmanager
def device_storages_shared() -> Iterator[None]:
    """For the block: an emulated storage is shared as a CUDA one is (no move, always shared).
    Tensor.share_memory_, Module.share_memory and TypedStorage all come down to UntypedStorage's."""
    storage = torch.UntypedStorage
    with swap.replaced([(storage, "share_memory_", _share(storage.share_memory_)),
                        (storage, "is_shared", _is_shared(storage.is_shared))]):
        yield


def rebuilt_on_gpu(index: int, cls: type, size: Tuple[int, ...], stride: Tuple[int, ...], offset: int,
                   dtype: torch.dtype, nbytes: int, requires_grad: bool) -> torch.Tensor:
    """In the receiving process: a tensor of emulated GPU `index` that another process sent (the
    arguments of torch's rebuild_meta_tensor after the index), rebuilt on that GPU as CUDA's
    rebuild_cuda_tensor rebuilds one on the sender's device."""
    with torch.cuda.device(index):  # set_ puts its new storage on the current GPU
        tensor = torch.empty(0, dtype=dtype, device="cuda")
        tensor.set_(torch.UntypedStorage(nbytes, device="meta"), offset, size, stride)
    if cls is torch.nn.Parameter:  # requires_grad in its constructor, as torch's rebuild: an integer one must be False
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad = requires_grad
    return tensor


def _sent(real: Callable[..., Any], placement: Placement) -> Callable[..., Any]:
    def reduce_tensor(tensor: torch.Tensor) -> Any:
        rebuild, args = real(tensor)
        # torch sends every tensor whose storage is on the meta device as a meta tensor: one of the
        # emulated GPU's goes to be rebuilt there instead, on the GPU it is on
        if rebuild is reductions.rebuild_meta_tensor and not placement.on_meta(tensor):
            return rebuilt_on_gpu, (placement.tensor_index(tensor), *args)
        return rebuild, args
    reduce_tensor.__wrapped__ = real  # type: ignore[attr-defined]
    return reduce_tensor


@contextlib.contextmanager
def device_tensors_sent(placement: Placement) -> Iterator[None]:
    """For the block: a tensor of the emulated GPU that the script sends to another process arrives
    there on the same emulated GPU (torch.multiprocessing's reducers of Tensor and Parameter)."""
    reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    saved = {cls: reduce for cls, reduce in reducers.items() if reduce is reductions.reduce_tensor}
    reducers.update({cls: _sent(reduce, placement) for cls, reduce in saved.items()})
    try:
        yield
    finally:
        reducers.update(saved)
