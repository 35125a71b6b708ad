"""The random-state operators of checkpointed code under torch.compile, on the emulated GPU.

A compiled graph that recomputes a random op in its backward (activation checkpointing inside
torch.compile: the Trainer's `gradient_checkpointing=True` with `torch_compile=True`) saves the
generator's state in the forward and replays it in the backward through two higher-order operators of
torch/_prims/rng_prims.py, `run_and_save_rng_state(op, *args)` and `run_with_rng_state(state, op,
*args)`, which Inductor's wrapper code calls as they are. They reached the emulator's AllocMode whole,
with no rule for them. On the GPU (their CUDA implementations) they read or set the device generator's
state, a host tensor, and run `op`: here the state is the stand-in generator's (patches.py) and the op
runs through the emulator like any other, so its outputs are allocations of the emulated GPU (and a
small draw's values are drawn from the state given, values.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

import torch


def _save_and_run(mode: Any, op: Any, *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, Any]:
    state = torch.cuda.get_rng_state()
    with mode:
        return state, op(*args, **kwargs)


def _run(mode: Any, rng_state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    # As the CUDA implementation: the saved state replayed, then the generator's own put back, so a
    # small draw recomputed in the backward has the values it had in the forward (values.py).
    current = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(rng_state)
    try:
        with mode:
            return op(*args, **kwargs)
    finally:
        torch.cuda.set_rng_state(current)


@contextlib.contextmanager
def rng_state_operators(mode_type: type) -> Iterator[None]:
    """run_and_save_rng_state and run_with_rng_state handled by `mode_type` (AllocMode) for the block."""
    try:
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    except ImportError:  # a torch without them
        yield
        return
    registered: List[Any] = []
    for operator, handler in ((run_and_save_rng_state, _save_and_run), (run_with_rng_state, _run)):
        if mode_type not in operator.python_key_table:
            operator.py_impl(mode_type)(handler)
            registered.append(operator)
    try:
        yield
    finally:
        for operator in registered:
            operator.python_key_table.pop(mode_type, None)
            operator._dispatch_cache.clear()
