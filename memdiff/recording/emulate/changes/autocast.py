"""`autocast=bf16|fp16`: the trained module's forward run under `torch.autocast("cuda", dtype)`, as a
script that wraps its `model(...)` call in the context does."""

from __future__ import annotations

import functools
from typing import Any

from memdiff.recording.emulate.changes.root import NO_ROOT

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def install(session: Any, value: str) -> None:
    """Run the trained root's forward under CUDA autocast to `value`'s dtype."""
    import torch

    dtype = getattr(torch, DTYPES[value])
    session.pending["autocast"] = NO_ROOT

    def wrap(root: Any) -> None:
        forward = root.forward

        @functools.wraps(forward)
        def under_autocast(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast("cuda", dtype=dtype):
                return forward(*args, **kwargs)

        # An attribute of the instance: the class and its other instances are untouched.
        root.forward = under_autocast
        session.pending.pop("autocast", None)
        session.notes.append(f"the forward of {type(root).__name__} run under torch.autocast('cuda', {dtype})")

    session.on_root(wrap)
