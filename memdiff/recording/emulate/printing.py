"""Emulated device tensors formatted and printed as a GPU's are: `f"{loss:.4f}"`, `str`, `repr`.

torch's own printing runs with the device mode off (a torch function's handler always does), so it
would see a meta tensor and print `tensor(..., device='meta', size=...)`, and `Tensor.__format__`
refuses a format spec for one. Here the numbers come from the emulator's read-back rule (values.py:
the values it knows, else what a host copy reads), formatted by torch's own formatter, and the rest of the text
(device, dtype, grad_fn, requires_grad) is torch's own too, read with the device mode on, so it
says `device='cuda:0'`.

A GPU formats a number by copying it to the host (`item()`), which allocates nothing on the device.
Printing a whole tensor runs torch's formatter on the device: a few small temporaries (isfinite,
masked_select, abs, min, max of at most the printed elements), freed before the print returns.
The emulator formats from the host copy, so a print leaves no block in the snapshot.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memdiff.recording.emulate.values import MAX_ELEMENTS


def formatted(mode: Any, t: torch.Tensor, spec: str) -> str:
    """`format(t, spec)` of emulated device tensor `t`, as Tensor.__format__ gives it on a GPU: a 0-dim
    tensor formats its number, any other formats its str() (and refuses a non-empty spec, as on a GPU)."""
    if t.dim() == 0 and type(t) is torch.Tensor:
        return format(t.detach().item(), spec)
    with mode:  # object.__format__ calls str(t), which must come back here
        return object.__format__(t, spec)


def printed(mode: Any, t: torch.Tensor, contents: Optional[str] = None) -> str:
    """`repr(t)` of emulated device tensor `t`, as torch prints it on the GPU, numbers as read back."""
    if contents is None:
        prefix = "tensor(" if type(t) in (torch.Tensor, torch.nn.Parameter) else f"{type(t).__name__}("
        host = _read_back(mode, t)
        with _disable_current_modes():
            contents = torch._tensor_str._tensor_str(host, len(prefix))
    with torch.no_grad(), mode:
        return torch._tensor_str._str_intern(t, tensor_contents=contents)


def _read_back(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A host tensor holding what `t.cpu()` would: its known values, else Values.read_back_host's. A
    tensor too large to have known values is that without being made (a GPU's print reads only the
    elements it shows)."""
    with torch.no_grad():
        if t.numel() <= MAX_ELEMENTS:
            return t.detach().to("cpu")
        return mode.emulator.values.read_back_host((), t.dtype).expand(t.shape)
