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
can be pinned), `is_pinned()` is false, and torch.multiprocessing sends a device tensor to a child
process as its shape (rebuilt there on the emulated GPU, outside the child's allocator, as memory a
CUDA IPC handle maps is).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from memdiff.recording.emulate import swap


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
