"""What a zoo gives the sweep (sweep.py): its models as cases, and the case it cannot make."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Case(NamedTuple):
    """A model of a zoo: `build()` makes it and `loss(model)` runs its forward on a batch and returns a
    scalar loss, both under `torch.device` of the sweep's device (their factories make on it)."""
    name: str
    build: Callable[[], Any]
    loss: Callable[[Any], Any]


class Skip(Exception):
    """A case the zoo cannot make as the sweep asks (a config that does not shrink): `skipped`, not run."""
