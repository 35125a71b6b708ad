"""A safetensors file opened onto the emulated GPU: its tensors made from the header, never read."""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, Optional

import torch


class OnDevice:
    """A safetensors file opened onto the emulated GPU (`safe_open(..., device="cuda")`, which
    `load_file(..., device="cuda")` uses): each tensor from the header's shape and dtype, an
    allocation on the device where the GPU makes it; its bytes are never read."""

    def __init__(self, opened: Any) -> None:
        self.opened = opened

    def __enter__(self) -> "OnDevice":
        self.opened.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.opened.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, on the emulated GPU."""
        view = self.opened.get_slice(name)
        return torch.empty(view.get_shape(), dtype=_safetensors_dtype(view.get_dtype()), device="meta")

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor of the file, on the emulated GPU."""
        return {name: self.get_tensor(name) for name in self.opened.keys()}

    def get_slice(self, name: str) -> "_SliceOnDevice":
        """A slice of `name` that reads as the GPU's: indexing it allocates only what it selects."""
        return _SliceOnDevice(self.opened.get_slice(name))

    def __getattr__(self, name: str) -> Any:  # keys, metadata, offset_keys: the file's own
        return getattr(self.opened, name)


class _SliceOnDevice:
    def __init__(self, view: Any) -> None:
        self.view = view

    def __getitem__(self, index: Any) -> torch.Tensor:
        dtype = _safetensors_dtype(self.view.get_dtype())
        # the shape indexing gives, from a host tensor that holds one element
        shape = torch.zeros((), dtype=dtype).expand(self.view.get_shape())[index].shape
        return torch.empty(shape, dtype=dtype, device="meta")

    def __getattr__(self, name: str) -> Any:  # get_shape, get_dtype
        return getattr(self.view, name)


def _safetensors_dtype(name: str) -> Any:
    from safetensors.torch import _getdtype

    return _getdtype(name)


def write_shapes(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]], path: str) -> None:
    """A safetensors file of `tensors` at `path` whose data is a hole: the header a real save writes
    (names, dtypes, shapes, offsets, `metadata`), then the data's length unwritten, which the file
    system keeps sparse. It loads as a real file does; its values read as zeros."""
    from safetensors.torch import _TYPES

    names = {dtype: name for name, dtype in _TYPES.items()}
    header: Dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    # the order safetensors writes: larger elements first, then by name
    for name, t in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
