"""The values collectives carry between the ranks of a launched job under emulation.

The fake process group (distributed.py) moves no data. Yet a receiving rank acts on what it receives:
`broadcast_object_list` and the other object collectives send a size, then the pickled object, and a
rank that got no size asked the host for a buffer of whatever its memory held. So in a launched job
(`memdiff record --emulate GPU -o DIR/`, where every rank shares the job's folder) a broadcast, an
all-gather, a gather and a scatter carry what each sending rank knows of its tensors (values.py: a
size, a pickled object, ids; None for an activation, whose values nobody has) to the ranks that
receive them, through a file per collective in the job's folder: `DIR/.collectives/`, removed by
`memdiff record` when the job ends. Every rank of the group takes part in each such collective, in
the order the script runs them, as NCCL requires; a rank waits for its senders as long as its process
group's timeout, and stops at once, with CUDA's kind of error, when the sender ended without sending.
A process outside a launched job (one rank run alone) has no one to hear from: its collectives leave
its own values (distributed.py's rule). So does a rank for the ranks `memdiff record --ranks` did not
run (launch.py): it hears only from the ranks that run.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pickle
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from memdiff.recording.launch import RANKS, STARTED_BY
from memdiff.recording.manifest import COLLECTIVES

# The hook's states for a process that has ended (rank_hook/sitecustomize.py): it will send nothing more.
ENDED = {"written", "failed", "nothing recorded", "no torch"}
# torch's default_pg_timeout: how long a rank waits for another when the script gave no timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
# The job's folder, read once: memdiff record sets it in every process it starts, and, under `-o FILE`,
# in the one that runs the script itself, for the processes the script starts (STARTED_BY). That one
# sends (a script that is rank 0 of the job it launches, as Lightning's launcher makes it, sends its
# ranks what they wait for) but hears from no one: it may be a rank run alone (RANK=1 set by hand),
# whose peers never send, and it keeps its own values, as a rank run alone does.
_JOB = os.environ.get("MEMDIFF_RECORD_DIR")
_HEARS = os.environ.get(STARTED_BY) != str(os.getpid())
# The real file functions, taken before the emulator's guards of the user's files replace them: these
# files are memdiff's own, in its output folder.
_open, _replace, _exists, _makedirs = open, os.replace, os.path.exists, os.makedirs


class Exchange:
    """The collectives of one process that carry values: numbered per group, in the order they run."""

    def __init__(self, folder: str, timeout: datetime.timedelta) -> None:
        self.folder = os.path.join(folder, COLLECTIVES)
        self.timeout = timeout
        self.counts: Dict[str, int] = {}
        self.lock = threading.Lock()

    def next(self, group: str) -> str:
        """The name of the next collective on `group` (the same on every rank of it)."""
        with self.lock:
            n = self.counts.get(group, 0)
            self.counts[group] = n + 1
        return f"g{group}.{n}"

    def send(self, name: str, rank: int, values: List[Optional[torch.Tensor]]) -> None:
        """What `rank` of the group sends in collective `name` (None where it knows no value)."""
        _makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"{name}.r{rank}")
        partial = f"{path}.{os.getpid()}.tmp"
        with _open(partial, "wb") as f:
            f.write(pickle.dumps([None if v is None else _encode(v) for v in values]))
        _replace(partial, path)  # whole or not there: a reader never sees half of it

    def receive(self, name: str, rank: int, global_rank: int, what: str) -> List[Optional[torch.Tensor]]:
        """What `rank` of the group (`global_rank` of the job) sent in collective `name`, once it has."""
        path = os.path.join(self.folder, f"{name}.r{rank}")
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 0.001
        while not _exists(path):
            if self._ended(global_rank) and not _exists(path):
                raise RuntimeError(f"{what}: rank {global_rank} ended without taking part in it (on a GPU the "
                                   f"collective would wait for it until the process group's timeout)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: rank {global_rank} did not take part in it within the process "
                                   f"group's timeout ({self.timeout})")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        with _open(path, "rb") as f:
            data = f.read()
        return [None if v is None else _decode(*v) for v in pickle.loads(data)]

    def _ended(self, global_rank: int) -> bool:
        """Whether the process that is `global_rank` has ended, as its status file says."""
        status = os.path.join(os.path.dirname(self.folder), f".rank{global_rank}.status")
        try:
            with _open(status, encoding="utf-8") as f:
                return json.load(f).get("state") in ENDED
        except (OSError, ValueError, pickle.UnpicklingError):  # not written yet, or being replaced
            return False


def _encode(value: torch.Tensor) -> Tuple[str, Tuple[int, ...], bytes]:
    """A host tensor as its dtype, shape and bytes: plain data (torch.save would be the script's save,
    which the emulator guards)."""
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    return str(flat.dtype).replace("torch.", ""), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes()


def _decode(dtype: str, shape: Tuple[int, ...], data: bytes) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


_exchange: List[Exchange] = []


def start(timeout: Optional[datetime.timedelta]) -> None:
    """The default process group was made (with the script's timeout): collectives carry values from
    here on, in a launched job."""
    _exchange[:] = [Exchange(_JOB, timeout or DEFAULT_TIMEOUT)] if _JOB else []


def hears_from(rank: int) -> bool:
    """Whether this process hears what global `rank` sends: it is a rank of a launched job (not the
    process of `-o FILE` that runs the script), and `rank` runs (all do, unless --ranks named some)."""
    ranks = _running()
    return current() is not None and _HEARS and (ranks is None or rank in ranks)


def running() -> Optional[frozenset]:
    """The ranks of the job that run with this one (--ranks), when this process hears from them; None
    when all run, or it hears from no one."""
    return _running() if _HEARS else None


def _running() -> Optional[frozenset]:
    """The ranks of the job that run, when only some do (memdiff record --ranks: launch.py; a job of
    several nodes whose Lightning launcher starts its first node's ranks here: launch_lightning.py);
    None: all. Read from the environment at each call, as the launcher sets it in its own process too."""
    return _parsed(os.environ.get(RANKS) or "")


@functools.lru_cache(maxsize=8)
def _parsed(ranks: str) -> Optional[frozenset]:
    return frozenset(int(r) for r in ranks.split(",")) if ranks else None


def current() -> Optional[Exchange]:
    """This process's exchange, None outside a launched job (or before a process group)."""
    return _exchange[0] if _exchange else None


# -- the collectives that carry values, by c10d op -----------------------------------------------

# all_to_all_single (one flat tensor each way, split on its first dimension) and all_to_all (a tensor
# per rank each way): what a rank receives is what its peers send it (all_to_all below)
ALL_TO_ALL = {"alltoall_base_", "alltoall_"}
CARRIED = {"broadcast_", "allgather_", "_allgather_base_", "gather_", "scatter_"} | ALL_TO_ALL


Sent = List[Optional[torch.Tensor]]  # what a rank sends in one collective: a value (or None) per tensor


def carry(base: str, args: Tuple, values: Any) -> bool:
    """After c10d op `base` ran on the fake group: give its received tensors what the senders sent, when
    this process is a rank of a launched job and the group has other ranks. False when it did not
    (the op, or the process, carries nothing), for distributed.follow's own rule."""
    exchange = current()
    if exchange is None or base not in CARRIED:
        return False
    pg = process_group(args[1] if base == "broadcast_" else args[2])
    if pg is None or pg.size() < 2:
        return False
    name = exchange.next(str(pg.group_name))

    def hear(rank: int) -> Optional[Sent]:
        """What group rank `rank` sent; None for a rank of the job that does not run (--ranks): this
        rank then keeps its own values for it, as a rank run alone does."""
        import torch.distributed as dist

        sender = dist.get_global_rank(pg, rank)
        if not hears_from(sender):
            return None
        return exchange.receive(name, rank, sender, f"{base.strip('_')} #{name}")

    def send(tensors: Any) -> Sent:
        sent = [known_value(values, t) for t in tensors]
        exchange.send(name, pg.rank(), sent)
        return sent
    if base == "broadcast_":
        _broadcast(values, args, pg.rank(), send, hear)
    elif base == "scatter_":
        _scatter(values, args, pg.rank(), send, hear)
    elif base in ALL_TO_ALL:
        all_to_all(values, base, args, pg.rank(), pg.size(), send, hear)
    else:
        _gather(values, base, args, pg.rank(), pg.size(), send, hear)
    return True


def _broadcast(values: Any, args: Tuple, me: int, send: Any, hear: Any) -> None:
    tensors, root = args[0], int(args[2])
    if me == root:
        send(tensors)
        return
    for t, value in zip(tensors, hear(root) or ()):  # a root that does not run: this rank's own values
        receive_into(values, t, value)


def _scatter(values: Any, args: Tuple, me: int, send: Any, hear: Any) -> None:
    """scatter_: the root sends each rank its slot of its list."""
    root = int(args[3])
    sent: Optional[Sent] = send(list(args[1][0]) if args[1] else []) if me == root else hear(root)
    if sent is None:  # a root that does not run: this rank keeps its own values
        return
    for t in args[0]:
        receive_into(values, t, sent[me] if len(sent) > me else None)


def _gather(values: Any, base: str, args: Tuple, me: int, size: int, send: Any, hear: Any) -> None:
    """allgather_ (a list of slots per input, a slot per rank), _allgather_base_ (one flat output: the
    ranks' inputs one after another), gather_ (allgather_'s slots, on the root only)."""
    mine: Sent = send([args[1]] if base == "_allgather_base_" else list(args[1]))
    if base == "gather_" and me != int(args[3]):
        return
    # a rank that does not run (--ranks) is taken to send what this one does, as a rank run alone takes it
    sent = [mine if r == me else _or(hear(r), mine) for r in range(size)]
    if base == "_allgather_base_":
        parts = [s[0] if s else None for s in sent]
        whole = None if any(p is None for p in parts) else torch.cat([p.reshape(-1) for p in parts if p is not None])
        fits = whole is not None and whole.numel() == args[0].numel()
        receive_into(values, args[0], whole.reshape(args[0].shape) if whole is not None and fits else None)
        return
    for i, slots in enumerate(args[0]):
        for r, slot in enumerate(slots):
            receive_into(values, slot, sent[r][i] if i < len(sent[r]) else None)


def all_to_all(values: Any, base: str, args: Tuple, me: int, size: int, send: Any, hear: Any) -> None:
    """alltoall_base_ (output, input, group, output splits, input splits: rank r's chunk of a rank's
    input, split on its first dimension, evenly where no splits are given, goes to rank r, and a rank's
    output is the chunks it receives in rank order) and alltoall_ (output and input lists, a tensor per
    rank). A rank this rank does not hear from (`hear` gives None: a rank run alone, or one --ranks did
    not run) is taken to send it what it sends that rank, every rank alike: an all-to-all of the token
    counts a balanced router gives receives what it sends, so a rank run alone receives as many tokens
    as it sends. The output is routed (values.py) where this rank's input is: what comes back from
    ranks that route alike."""
    if base == "alltoall_":
        outputs, inputs = list(args[0]), list(args[1])
        mine = send(inputs)
        for r, out in enumerate(outputs):
            heard = hear(r) if r != me else None
            value = heard[me] if heard is not None and me < len(heard) else mine[r] if r < len(mine) else None
            _received(values, out, value, inputs)
        return
    output, source, out_splits, in_splits = args[0], args[1], list(args[3]), list(args[4])
    value, sizes = send([source, torch.tensor(in_splits, dtype=torch.long)])
    mine = _chunks(value, sizes, size)
    parts: List[Optional[torch.Tensor]] = []
    for r in range(size):
        heard = hear(r) if r != me else None
        parts.append(_chunks(heard[0], heard[1], size)[me] if heard is not None else mine[r])
    expected = (out_splits or [int(output.shape[0]) // size] * size) if output.dim() else []
    fits = all(p is not None and p.dim() and int(p.shape[0]) == n for p, n in zip(parts, expected))
    whole = torch.cat([p for p in parts if p is not None]) if fits and len(parts) == len(expected) else None
    _received(values, output, whole, [source])


def _chunks(value: Optional[torch.Tensor], splits: Optional[torch.Tensor], size: int) -> List[Optional[torch.Tensor]]:
    """A sent flat input's chunk for each rank: split on its first dimension by `splits` (evenly where
    there are none); None for each where its values are not known or the splits do not add up."""
    if value is None or not value.dim():
        return [None] * size
    sizes = [int(n) for n in splits.tolist()] if splits is not None and splits.numel() else []
    sizes = sizes or [int(value.shape[0]) // size] * size
    if len(sizes) != size or sum(sizes) != int(value.shape[0]):
        return [None] * size
    return list(value.split(sizes))


def _received(values: Any, out: Any, value: Optional[torch.Tensor], inputs: List[Any]) -> None:
    """Tensor `out` received `value` in an all-to-all from `inputs`: routed where they are."""
    receive_into(values, out, value)
    if isinstance(out, torch.Tensor) and out.is_meta:
        values.constants.pop(out, None)  # written: no longer the number it was made with
        got = values.of(out)
        if got is not None:
            values.join(out, got, inputs)
        else:
            values.routed.pop(out, None)


def _or(heard: Optional[Sent], mine: Sent) -> Sent:
    return mine if heard is None else heard


def process_group(boxed: Any) -> Any:
    """The ProcessGroup a dispatched collective was given (boxed as a script object), or itself."""
    if isinstance(boxed, torch._C._distributed_c10d.ProcessGroup):
        return boxed
    try:
        return torch._C._distributed_c10d.ProcessGroup.unbox(boxed)
    except Exception:  # a torch that boxes groups otherwise: nothing carried
        return None


def known_value(values: Any, t: Any) -> Optional[torch.Tensor]:
    """What a rank knows of tensor `t`: a device tensor's known value, a host tensor's data."""
    if not isinstance(t, torch.Tensor):
        return None
    if t.is_meta:
        return values.of(t)
    return t.detach()


def receive_into(values: Any, t: Any, value: Optional[torch.Tensor]) -> None:
    """Tensor `t` received `value` (None: a value nobody knows). A host tensor holds it, or zeros, never
    what the host's allocator left in it."""
    if not isinstance(t, torch.Tensor):
        return
    fits = value is not None and tuple(value.shape) == tuple(t.shape)
    if t.is_meta:
        if value is not None and fits:
            values.known[t] = value.to(t.dtype).clone()
        else:
            values.known.pop(t, None)
    elif value is not None and fits:
        t.copy_(value)
    else:
        t.zero_()
