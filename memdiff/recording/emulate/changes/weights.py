"""`weights=bf16|fp16`: the model's floating parameters and buffers cast as `model.to(dtype)` does,
right after the script moves the model to the GPU."""

from __future__ import annotations

from typing import Any

from memdiff.recording.emulate.changes.root import NO_ROOT

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def install(session: Any, value: str) -> None:
    """Cast each module with parameters the script moves to the GPU to `value`'s dtype."""
    import torch

    dtype = getattr(torch, DTYPES[value])
    session.pending["weights"] = NO_ROOT

    def cast(module: Any) -> None:
        # `Module.to` is ours while the session runs: the dtype alone names no device, so no move is seen.
        module.to(dtype)
        session.pending.pop("weights", None)
        note = f"the model's floating parameters and buffers cast to {dtype} after its move to the GPU"
        if note not in session.notes:
            session.notes.append(note)

    session.on_move(cast)
