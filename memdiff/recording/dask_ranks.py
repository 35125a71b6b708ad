"""Ranks of an emulated job run as tasks on an existing Dask cluster (`memdiff record --emulate GPU
-o DIR/ --ranks all --dask ADDRESS -- torchrun ...`).

Each rank is one task: the worker that takes it runs the rank's process (the command and environment
memdiff record gives a rank it runs alone) and returns how it ended, with the tail of what it printed;
but ranks that hear each other as they run (a pipeline's stages) are one task, which runs their
processes side by side on its worker.
The rank's own hook writes its snapshot and status into the job's folder, so the workers must see the
folder, the script, the overlay and the Python environment at the paths this machine sees them (a
shared filesystem). A cluster runs as many tasks at once as its workers have threads, often fewer than
the job has ranks; record.py therefore never tells a rank run here that a rank which may not have
started runs with it, but the ranks of its own task, and no rank waits for another (exchange.py) but those.

Ctrl-C (or SIGTERM) sets a Dask Event that every task waits on between looks at its rank (the signal
in a Variable of the same name): a running rank is passed the signal and writes what it recorded, a task
that starts afterwards returns without running its rank. A second one stops waiting for the tasks.

No rank outlives what runs it. Dask never stops a running task (a thread), so each task watches for
itself: when its worker closes (as a worker does when its scheduler is gone), when the scheduler no
longer wants the task (its client is gone: the worker marks it cancelled), or when the scheduler
cannot be asked, the task kills its rank (SIGKILL: no one is left to read what a rank would write).
A worker that dies cannot: its rank holds the read end of a pipe whose only write end is the worker's,
and the rank's hook kills the rank when that pipe ends (LEASE_FD). Dask runs the task of a worker that
died again elsewhere; a rank's task starts its rank once a run (an exclusive file, `.rank{R}.task`),
so the second run returns that the rank did not finish instead of running it again into its files.
When the client loses the scheduler, the ranks whose tasks had not ended are said (RankEnded.lost).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import CancelledError
from dataclasses import asdict, dataclass
from typing import IO, Any, Callable, Dict, List, Optional, Sequence

from memdiff.cluster import connect
from memdiff.errors import EXIT_BAD_INPUT
from memdiff.units import count_of, format_bytes

POLL_S = 1.0  # how often a task asks whether to stop, and the client whether it was signalled
TAIL = 64 * 1024  # the bytes of each of a rank's streams sent back: enough for its traceback
# The rank hook's: the descriptor of the pipe that ends when the rank's worker is gone (rank_hook).
LEASE_FD = "MEMDIFF_RECORD_LEASE_FD"
CLOSE_S = 5  # how long a client that lost its scheduler may take to close


@dataclass(frozen=True)
class RankTask:
    """What a worker needs to run one rank: its command, environment and folder, and the job's folder."""

    rank: int
    command: List[str]
    env: Dict[str, str]
    cwd: str
    folder: str


@dataclass(frozen=True)
class RankEnded:
    """What became of one rank's task."""

    status: Optional[int]  # the rank's exit status; None: its task was stopped before the rank started
    output: str = ""  # the tail of its stdout
    errors: str = ""  # the tail of its stderr
    failed: Optional[str] = None  # why its process did not run on the worker (a path the worker lacks)
    lost: Optional[str] = None  # why how it ended is not known (its worker died, the scheduler was lost)


def run_ranks(tasks: List[Dict[str, Any]], stop: str) -> List[Dict[str, Any]]:
    """The task of one rank, or of ranks that hear each other as they run, run on a worker: each rank's
    process, side by side, passed the signal the client sets (the Event `stop`, waited on POLL_S at a
    time), and killed when no one is left to wait for them; RankEnded's fields of each, in order, plain
    data for any serializer. The ranks start together or not at all (one started alone would wait for
    the others until its process group's timeout)."""
    from distributed import get_worker

    if _stopped(stop):
        return [asdict(RankEnded(None)) for _ in tasks]
    where = get_worker().address
    for what, path in (("job's folder", tasks[0]["folder"]), ("working folder", tasks[0]["cwd"])):
        if not os.path.isdir(path):
            return [asdict(RankEnded(EXIT_BAD_INPUT, failed=f"the {what} {path} is not on worker {where}: the "
                                                             f"workers must see it at the same path (a shared "
                                                             f"filesystem)")) for _ in tasks]
    before = [_first_run(task["folder"], task["rank"], where) for task in tasks]
    earlier = next((worker for worker in before if worker is not None), None)
    if earlier is not None:
        return [asdict(RankEnded(EXIT_BAD_INPUT, lost=f"its worker {earlier} died while it ran (Dask ran its task "
                                                      f"again, on {where}, which did not run the rank twice)"))
                for _ in tasks]
    with contextlib.ExitStack() as held:
        outputs = [(held.enter_context(tempfile.TemporaryFile()), held.enter_context(tempfile.TemporaryFile()))
                   for _ in tasks]
        children: List["subprocess.Popen[bytes]"] = []
        try:
            for task, (out, err) in zip(tasks, outputs):
                lease, kept = os.pipe()  # both ends closed at exec in any other child of the worker
                held.callback(os.close, kept)  # the rank's lease ends with this task
                try:
                    children.append(subprocess.Popen(
                        task["command"], env={**task["env"], LEASE_FD: str(lease)}, cwd=task["cwd"],
                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(lease,)))
                finally:
                    os.close(lease)
        except OSError as exc:  # its Python is not at this path on the worker
            _kill(children)
            return [asdict(RankEnded(EXIT_BAD_INPUT, failed=f"cannot start `{task['command'][0]}` on worker "
                                                            f"{where}: {exc.strerror or exc}")) for task in tasks]
        try:
            codes = _watch(children, stop)
        finally:  # whatever ended the watch (the worker closing under it): the ranks end with it
            _kill(children)
        # killed by a signal: as a shell says it
        return [asdict(RankEnded(code if code >= 0 else 128 - code, _tail(out), _tail(err)))
                for code, (out, err) in zip(codes, outputs)]


def _kill(children: List["subprocess.Popen[bytes]"]) -> None:
    """End every process of `children` still running, and wait for it."""
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def _first_run(folder: str, rank: int, where: str) -> Optional[str]:
    """None when this is the first task of `rank` this run (its claim made, naming worker `where`);
    else the worker of the task that ran it before (one that died: Dask runs its tasks again)."""
    path = os.path.join(folder, f".rank{rank}.task")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        with open(path, encoding="utf-8", errors="replace") as earlier:
            return earlier.read().strip() or "(unknown)"
    with os.fdopen(fd, "w") as claim:
        claim.write(where)
    return None


def _watch(children: List["subprocess.Popen[bytes]"], stop: str) -> List[int]:
    """Wait for the ranks' processes, passing them the signal the client sets; their exit codes. They are
    killed as soon as their task is orphaned: the worker closing, the task cancelled, the scheduler
    unreachable (an exception out of here, which the caller's kill answers)."""
    passed: Optional[int] = None
    while True:
        try:
            for child in children:
                child.wait(timeout=0.05 if passed is None else POLL_S / len(children))
            return [child.wait() for child in children]
        except subprocess.TimeoutExpired:
            pass
        if _orphaned():
            _kill(children)
            return [child.wait() for child in children]
        if passed is None:
            passed = _asked(stop, POLL_S)
            if passed is not None:
                for child in children:
                    if child.poll() is None:
                        child.send_signal(passed)


def _orphaned() -> bool:
    """Whether this task's result has no one left to take it: its worker is closing (a worker closes
    when it loses its scheduler), or the scheduler released the task (its client is gone), which the
    worker marks cancelled (a running task is never stopped by Dask itself)."""
    from distributed import get_worker
    from distributed.core import Status

    worker = get_worker()
    if worker.status in (Status.closing, Status.closed, Status.failed):
        return True
    state = worker.state.tasks.get(worker.get_current_task())
    return state is None or state.state in ("cancelled", "released", "forgotten")


def _stopped(stop: str) -> bool:
    """Whether the client has passed on a signal: asked of the scheduler, not waited for (a wait of no
    time can end before the scheduler answers, on a loaded machine, and a rank would then start after
    the signal was passed on, and be given it while Python starts, where it can be lost)."""
    from distributed import Event

    return bool(Event(stop).is_set())


def _asked(stop: str, timeout: float) -> Optional[int]:
    """The signal the client passed on, waiting up to `timeout` seconds on the scheduler; None when none.
    (An Event's wait times out quietly, where a Variable's get logs an error on the scheduler.)"""
    from distributed import Event, Variable

    return int(Variable(stop).get()) if Event(stop).wait(timeout=timeout) else None


def _tail(stream: IO[bytes]) -> str:
    """The last TAIL bytes a stream took, said to be a tail when it is one."""
    size = stream.seek(0, os.SEEK_END)
    stream.seek(max(0, size - TAIL))
    text = stream.read().decode("utf-8", errors="replace")
    return text if size <= TAIL else f"[memdiff: the first {format_bytes(size - TAIL)} of it left out]\n{text}"


def cluster(address: str) -> Any:
    """The client of the cluster at `address` (InputError when it cannot be reached), connected before
    anything runs; said when it has no workers yet (an adaptive cluster starts them on demand)."""
    client = connect(address)
    if not client.scheduler_info().get("workers"):
        print(f"memdiff: --dask {address}: the scheduler has no workers yet: the ranks wait for some "
              f"(Ctrl-C twice to give up)", file=sys.stderr)
    return client


def run_on_dask(client: Any, address: str, tasks: Dict[int, RankTask], signalled: Callable[[], List[int]],
                teams: Sequence[Sequence[int]] = ()) -> Dict[int, RankEnded]:
    """Run each rank's task on the cluster of `client`, the rank's output relayed as its task ends;
    how each ended. The ranks of each of `teams` (ranks that hear each other as they run) are one task,
    run side by side. `signalled`: the signals this process has received, polled (the first is passed
    to the ranks; at a second, the ranks not back yet are cancelled and left out). When the client
    loses the scheduler, the ranks whose tasks had not ended are `lost` (their tasks kill them), said
    in one line."""
    from distributed import Event, Variable, wait

    ended: Dict[int, RankEnded] = {}
    run = uuid.uuid4().hex[:12]
    stop = f"memdiff-record-stop-{run}"
    together = [[rank for rank in team if rank in tasks] for team in teams]
    alone = sorted(set(tasks) - {rank for team in together for rank in team})
    # a key per task: the dashboard names each after its ranks; pure=False: each run is new
    futures = {client.submit(run_ranks, [asdict(tasks[rank]) for rank in ranks], stop, pure=False,
                             key=f"memdiff-rank{'+'.join(map(str, ranks))}-{run}"): ranks
               for ranks in together + [[rank] for rank in alone] if ranks}
    pending, passed = list(futures), False
    try:
        while pending:
            try:
                done, left = wait(pending, timeout=POLL_S, return_when="FIRST_COMPLETED")
                pending = list(left)
            except TimeoutError:
                done = set()
            except (CancelledError, OSError) as exc:  # the client cancels every future when it loses the scheduler
                _lost(client, address, exc, [rank for f in pending for rank in futures[f]], ended)
                return ended
            # ours are cancelled only at a second Ctrl-C, which stops here: any other is the client's
            if client.status != "running" or any(f.cancelled() for f in pending):
                _lost(client, address, None, [rank for f in pending for rank in futures[f]], ended)
                return ended
            for future in done:
                ended.update(zip(futures[future], _ended(future, len(futures[future]))))
            received = signalled()
            if received and not passed:  # read by every task within POLL_S
                Variable(stop, client).set(received[0])  # before the Event: a task that sees it reads it
                Event(stop, client).set()
                passed = True
            elif len(received) > 1:  # a second Ctrl-C: stop waiting
                client.cancel(pending)
                break
    finally:
        if passed and client.status == "running":
            Event(stop, client).clear()  # the scheduler forgets both
            Variable(stop, client).delete()
    return ended


def _lost(client: Any, address: str, exc: Optional[Exception], ranks: List[int], ended: Dict[int, RankEnded]) -> None:
    """The client lost the scheduler at `address`: mark `ranks` (whose tasks had not ended) lost, say so in
    one line, and close the client (it would retry for its timeout, then log the failure at length)."""
    from memdiff.read.job import ranges  # here: a worker, which imports this module, never needs it

    why = (f"its task had not ended when memdiff lost the connection to the Dask scheduler {address} (its "
           f"worker stops it)")
    for rank in ranks:
        ended[rank] = RankEnded(EXIT_BAD_INPUT, lost=why)
    # the client's own cancellation of our futures says only that; anything else is worth its line
    cause = (f" ({type(exc).__name__}: {_first_line(exc)})"
             if exc is not None and str(exc) and not isinstance(exc, CancelledError) else "")
    print(f"memdiff: --dask {address}: lost the connection to the scheduler{cause} while the tasks of "
          f"{count_of(len(ranks), 'rank')} had not ended ({ranges(sorted(ranks))}): their workers stop them, "
          f"and the job's manifest marks each that wrote no snapshot not finished", file=sys.stderr)
    quiet = logging.getLogger("distributed.client")
    level, quiet.level = quiet.level, logging.CRITICAL + 1
    try:
        with contextlib.suppress(Exception):  # a client that fails to close is closed enough: never used again
            client.close(timeout=CLOSE_S)
    finally:
        quiet.setLevel(level)


def _first_line(exc: Exception) -> str:
    """An exception's first line (Dask's cancellations say much more)."""
    return str(exc).strip().splitlines()[0]


def _ended(future: Any, count: int) -> List[RankEnded]:
    """What a finished task says of each of its `count` ranks; a task that raised (its worker died under
    it) as ranks that failed."""
    if future.status == "finished":
        ended = [RankEnded(**document) for document in future.result()]
    else:
        exc = future.exception() if future.status == "error" else None
        ended = [RankEnded(EXIT_BAD_INPUT, failed=f"its task {future.status}: {type(exc).__name__}: {exc}"
                           if exc is not None else f"its task was {future.status}")] * count
    for rank in ended:
        sys.stdout.write(rank.output)
        sys.stderr.write(rank.errors)
    return ended
