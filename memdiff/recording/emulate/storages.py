"""The emulated GPU's storages as a script handles them itself, past torch's ops: their address
(`data_ptr`) and their size (`resize_`, FSDP2's free and regrowth of each all-gathered weight)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from memdiff.recording.emulate import swap
from memdiff.recording.emulate.runtime import Emulator


@contextlib.contextmanager
def storage_methods(emulator: Emulator) -> Iterator[None]:
    """UntypedStorage.data_ptr and resize_ answering for the emulated GPU's (meta) storages, for the block."""
    pointer, resize = torch.UntypedStorage.data_ptr, torch.UntypedStorage.resize_

    def data_ptr(self: Any) -> int:
        return emulator.address(self) if self.device.type == "meta" else pointer(self)

    def resize_(self: Any, size: int) -> Any:
        # Storage methods are no ops: neither mode sees them, so the allocator hears of it here.
        out = resize(self, size)
        if self.device.type == "meta" and id(self) in emulator.placement.of:
            emulator.resized(self)
        return out
    with swap.replaced([(torch.UntypedStorage, "data_ptr", data_ptr), (torch.UntypedStorage, "resize_", resize_)]):
        yield
