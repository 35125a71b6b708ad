"""A failed backward's queued nodes dropped as soon as it fails, as a GPU's autograd thread drops them.

autograd's engine runs a GPU's nodes on that device's worker thread, which pops its queue for the
life of the process: when a node raises (an out-of-memory error in the middle of `loss.backward()`),
the graph is marked failed and the worker pops every node still queued for it and drops it unrun,
with the gradients it was handed and the part of the graph behind it (saved activations, the
parameters AccumulateGrad holds). The emulator's tensors are meta, whose nodes the engine queues on
the calling thread's own CPU queue (`Engine::ready_queue`), and that thread stops popping as soon as
the graph has failed (`thread_main` returns once the graph's future is done). The queued nodes then
stayed in the thread's queue until its next backward popped them: a script that caught the error
and dropped its model (a sweep over a model zoo, accelerate's find_executable_batch_size) still saw
the model's memory allocated, where a GPU's `memory_allocated()` drops back (issue 58).

So when a backward raises, the thread runs one more backward at once, of a node made on a new
thread: the sequence number that orders a queue is counted per thread, so that node's is the
lowest, and the queue (highest number first) pops every stale node, dropping it, before it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List

import torch
from torch.utils._python_dispatch import _disable_current_modes


def _oldest_node() -> torch.Tensor:
    """A scalar whose grad_fn has sequence number 0 (made first on a thread of its own), on the CPU."""
    leaf = torch.zeros((), requires_grad=True)
    made: List[torch.Tensor] = []

    def make() -> None:
        # A thread started now runs under the emulator's modes (threads.py): this CPU op needs none.
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.enable_grad():
            made.append(leaf * 1)

    thread = threading.Thread(target=make, name="memdiff-autograd-drain")
    thread.start()
    thread.join()
    return made[0]


def drop_queued_nodes() -> None:
    """Pop and drop the nodes a failed backward left in this thread's CPU queue (module docstring)."""
    out = _oldest_node()
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        # the engine itself, not torch.autograd.backward (patched by the emulator, and its hooks)
        torch.autograd.Variable._execution_engine.run_backward(
            (out,), (torch.ones(()),), False, False, (), True, True)


def dropping_queued_nodes(engine: Callable[..., Any]) -> Callable[..., Any]:
    """autograd's `_engine_run_backward` that, when the backward raises, drops the nodes it left queued."""
    @functools.wraps(engine)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return engine(*args, **kwargs)
        except BaseException:
            # Inside another node (a reentrant checkpoint's backward), the queue also holds the outer
            # graph's live nodes: the outermost backward drops them all once the error reaches it.
            if torch._C._current_autograd_node() is None:
                drop_queued_nodes()
            raise
    return run
