"""Point-to-point sends and receives between the ranks of a launched job under emulation.

A pipeline (torch.distributed.pipelining) sends each stage's activations to the next stage and the
gradients back, and before that votes on whether its stages' shapes are known (a flag sent down the
pipeline and back, read with `.item()`) and, when they are not, sends each stage's output shapes
(`send_object_list`: a size, then the pickled shapes). The receiving rank acts on those values. So in a
launched job a `send` writes what this rank knows of its tensors (values.py: a flag, a size, pickled
bytes; None for an activation) to the job's exchange folder (exchange.py), and a `recv` takes it from
there. Sends on a pair of ranks match receives in the order each rank runs them, as NCCL matches them.

A send completes at once, as every collective of the fake group does. A receive completes when its
sender has sent: its Work's future is set by a thread that waits for the sender, so a script that
posts a receive before its own send (`irecv`, then `isend`, then `wait()`; a batch in any order)
runs as on the GPU, and a read of the buffer before `wait()` sees no values, as on the GPU it sees
none yet.

A rank whose sender does not run (`--ranks`) hears what a group alike sends: the groups of one mesh
dimension are the same ranks moved by an offset (a pipeline of stages on ranks 3 and 7 is the one on
ranks 0 and 4 moved by 3), and their ranks in the same places send the same shapes and votes, as
`--ranks auto` takes ranks of one role to hold the same. So a receive on a group from a rank that
does not run takes the same message (the same group ranks, the same count) on the group whose rank
in the sender's place runs, the first such rank first. A rank with no such group (run alone, or no
group alike runs) receives values nobody knows, as the fake group leaves them.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from memdiff.recording.emulate import exchange, layout
from memdiff.recording.emulate.escapes import called_at
from memdiff.recording.emulate.runtime import EmulationError, python_frames

SEND, RECEIVE = "send", "recv_"

_counts: Dict[Tuple[str, int, int], int] = {}
_lock = threading.Lock()
# The name torch gave each group made in this process, by its global ranks: every rank names every
# group `new_group` makes, in the same order, whether it is in it or not, so a rank knows the names of
# the groups alike its own (a name counts up, or hashes the ranks).
_names: Dict[Tuple[int, ...], str] = {}


def _name(group: Any, src: int, dst: int) -> Tuple[str, int]:
    """The exchange's name of the next message from group rank `src` to `dst` (the same on both), and
    its count on that pair."""
    key = (str(group.group_name), src, dst)
    with _lock:
        n = _counts.get(key, 0)
        _counts[key] = n + 1
    return f"p{key[0]}.{src}-{dst}.{n}", n


def naming(real: Callable[..., Any]) -> Callable[..., Any]:
    """torch's `_process_group_name(ranks, use_hashed_name)`, noting each group's name by its ranks."""
    def name(ranks: Any, use_hashed_name: bool) -> Any:
        made = real(ranks, use_hashed_name)
        _names[tuple(sorted(int(r) for r in ranks))] = str(made)
        return made
    name.__wrapped__ = real  # type: ignore[attr-defined]
    return name


def stand_in(group: Any, peer: int) -> Optional[Tuple[str, int]]:
    """For a receive on `group` from its rank `peer`, whose process does not run: the name of the group
    alike (its ranks moved by one offset) whose rank in `peer`'s place runs, and that rank (global);
    None when no such group was made here, or every rank runs."""
    import torch.distributed as dist

    running = exchange.running()
    if running is None or exchange.current() is None:
        return None
    ranks = dist.get_process_group_ranks(group)
    sender, me = ranks[peer], dist.get_rank()
    for other in sorted(running):
        if other == me:  # a group alike in which this rank would hear itself: none of a mesh's (one a rank)
            continue
        offset = sender - other
        moved = tuple(r - offset for r in ranks)
        name = _names.get(moved) if offset and min(moved) >= 0 else None
        if name is not None and moved == tuple(sorted(moved)):
            return name, other
    return None


def carry(base: str, args: Tuple[Any, ...], values: Any) -> Optional[torch.futures.Future]:
    """After c10d op `base` ran on the fake group: a send's values written for its receiver; for a
    receive, the future its Work completes with once the sender's values are in its tensors. None for
    any other op, and for a receive that hears from no one (its values are then unknown)."""
    current = exchange.current()
    if base not in (SEND, RECEIVE) or current is None:
        return None
    import torch.distributed as dist

    tensors, group, peer = args[0], exchange.process_group(args[1]), int(args[2])
    if group is None:
        return None
    me = group.rank()
    if base == SEND:
        current.send(_name(group, me, peer)[0], me, [exchange.known_value(values, t) for t in tensors])
        return None
    sender = dist.get_global_rank(group, peer)
    name, count = _name(group, peer, me)
    if not exchange.hears_from(sender):
        alike = stand_in(group, peer)
        if alike is None:
            return None
        name, sender = f"p{alike[0]}.{peer}-{me}.{count}", alike[1]
    future: torch.futures.Future = torch.futures.Future()

    def receive() -> None:
        try:
            sent = current.receive(name, peer, sender, f"recv #{name}")
            # This thread runs under the emulator's modes (threads.py): with the device mode off, a meta
            # tensor says it is one.
            with torch._C.DisableTorchFunction():
                for t, value in zip(tensors, sent):
                    exchange.receive_into(values, t, value)
            future.set_result(list(tensors))
        except Exception as exc:  # the sender ended without sending: wait() raises it, as NCCL's would
            future.set_exception(exc)
    threading.Thread(target=receive, name=f"memdiff-recv-{name}", daemon=True).start()
    return future


def objects_from_sender(real: Callable[..., Any]) -> Callable[..., Any]:
    """`recv_object_list`, refused in one line on a rank that cannot hear from its sender nor from a
    group alike (a rank run alone, one whose sender `--ranks` did not run, or one run on Dask whose
    sender had not ended before it started: record.py's _dask_ranks): the objects (a pipeline
    stage's shapes, which torch infers on the stage before) are known only to the sender, and the
    received size would read as 0, which torch then fails to unpickle (`EOFError: Ran out of input`).
    Under `--ranks auto`'s first run of rank 0 the refusal is noted in the layout (layout.py), which
    then runs rank 0 again with its pipeline's ranks."""
    signature = inspect.signature(real)

    def call(*args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        try:
            given = signature.bind(*args, **kwargs).arguments
        except TypeError:  # torch's own error for the call
            return real(*args, **kwargs)
        src, group_src = given.get("src"), given.get("group_src")
        if src is None and group_src is not None and dist.is_initialized():
            src = dist.get_global_rank(given.get("group") or dist.group.WORLD, group_src)
        if src is None or not dist.is_initialized() or exchange.hears_from(src):
            return real(*args, **kwargs)  # from any source (or none): torch's own behaviour
        group = given.get("group") or dist.group.WORLD
        if stand_in(group, dist.get_group_rank(group, src)) is not None:
            return real(*args, **kwargs)  # its receives hear a group alike
        where = called_at([(f["filename"], f["line"]) for f in python_frames()])
        if layout.refused_from(src):
            raise EmulationError("recv_object_list", f"from rank {src}{where}: its pipeline stage's shapes come "
                                                     f"from rank {src}; memdiff runs this rank again with it")
        raise EmulationError("recv_object_list", f"from rank {src}, which does not run with this rank (a rank run "
                                                 f"alone, one --ranks did not name, or on --dask one that had not "
                                                 f"ended when this rank started){where}: what it sends (a pipeline "
                                                 f"stage's shapes) is known only to it; run rank {src} too, here")
    call.__wrapped__ = real  # type: ignore[attr-defined]
    return call
