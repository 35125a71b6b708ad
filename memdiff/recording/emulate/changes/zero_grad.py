"""`zero-grad=none|zeros`: every `zero_grad()` the script calls (an optimizer's or a module's) made with
`set_to_none=True` (none) or `False` (zeros)."""

from __future__ import annotations

from typing import Any


def install(session: Any, value: str) -> None:
    """Force `set_to_none` in Optimizer.zero_grad and Module.zero_grad."""
    import torch

    to_none = value == "none"
    session.pending["zero-grad"] = "the script calls no zero_grad()"
    for owner in (torch.optim.Optimizer, torch.nn.Module):
        original = owner.zero_grad

        def forced(self: Any, set_to_none: bool = True, _original: Any = original) -> None:
            if "zero-grad" in session.pending:
                session.pending.pop("zero-grad")
                session.notes.append(f"zero_grad(set_to_none={to_none}) in place of the script's "
                                     f"(set_to_none={set_to_none})")
            _original(self, set_to_none=to_none)

        session.patch(owner, "zero_grad", forced)
