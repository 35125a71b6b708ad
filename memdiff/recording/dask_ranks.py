"""Ranks of an emulated job run as tasks on an existing Dask cluster (`memdiff record --emulate GPU
-o DIR/ --ranks all --dask ADDRESS -- torchrun ...`).

Each rank is one task: the worker that takes it runs the rank's process (the command and environment
memdiff record gives a rank it runs alone) and returns how it ended, with the tail of what it printed.
The rank's own hook writes its snapshot and status into the job's folder, so the workers must see the
folder, the script, the overlay and the Python environment at the paths this machine sees them (a
shared filesystem). A cluster runs as many tasks at once as its workers have threads, often fewer than
the job has ranks; record.py therefore never tells a rank run here that a rank which may not have
started runs with it, and no rank waits for another (exchange.py).

Ctrl-C (or SIGTERM) sets a Dask Event that every task waits on between looks at its rank (the signal
in a Variable of the same name): a running rank is passed the signal and writes what it recorded, a task
that starts afterwards returns without running its rank. A second one stops waiting for the tasks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass
from typing import IO, Any, Callable, Dict, List, Optional

from memdiff.cluster import connect, failed
from memdiff.errors import EXIT_BAD_INPUT
from memdiff.units import format_bytes

POLL_S = 1.0  # how often a task asks whether to stop, and the client whether it was signalled
TAIL = 64 * 1024  # the bytes of each of a rank's streams sent back: enough for its traceback


@dataclass(frozen=True)
class RankTask:
    """What a worker needs to run one rank: its command, environment and folder, and the job's folder."""

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


def run_rank(task: Dict[str, Any], stop: str) -> Dict[str, Any]:
    """The task of one rank, run on a worker: the rank's process, passed the signal the client sets
    (the Event `stop`, waited on POLL_S at a time); RankEnded's fields, plain data for any serializer."""
    from distributed import get_worker

    if _asked(stop, 0) is not None:
        return asdict(RankEnded(None))
    where = get_worker().address
    for what, path in (("job's folder", task["folder"]), ("working folder", task["cwd"])):
        if not os.path.isdir(path):
            return asdict(RankEnded(EXIT_BAD_INPUT, failed=f"the {what} {path} is not on worker {where}: the "
                                                            f"workers must see it at the same path (a shared "
                                                            f"filesystem)"))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(task["command"], env=task["env"], cwd=task["cwd"], stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=err)
        except OSError as exc:  # its Python is not at this path on the worker
            return asdict(RankEnded(EXIT_BAD_INPUT, failed=f"cannot start `{task['command'][0]}` on worker "
                                                           f"{where}: {exc.strerror or exc}"))
        passed: Optional[int] = None
        while True:
            try:
                code = child.wait(timeout=0.05 if passed is None else None)
                break
            except subprocess.TimeoutExpired:
                passed = _asked(stop, POLL_S)
                if passed is not None:
                    child.send_signal(passed)
        status = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
        return asdict(RankEnded(status, _tail(out), _tail(err)))


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


def run_on_dask(client: Any, address: str, tasks: Dict[int, RankTask],
                signalled: Callable[[], List[int]]) -> Dict[int, RankEnded]:
    """Run each rank's task on the cluster of `client`, the rank's output relayed as its task ends;
    how each ended. `signalled`: the signals this process has received, polled (the first is passed
    to the ranks; at a second, the ranks not back yet are cancelled and left out)."""
    from distributed import Event, Variable, wait

    ended: Dict[int, RankEnded] = {}
    run = uuid.uuid4().hex[:12]
    stop = f"memdiff-record-stop-{run}"
    # a key per rank: the dashboard names each task after its rank; pure=False: each run is new
    futures = {client.submit(run_rank, asdict(task), stop, key=f"memdiff-rank{rank}-{run}", pure=False): rank
               for rank, task in tasks.items()}
    pending, passed = list(futures), False
    try:
        while pending:
            try:
                done, left = wait(pending, timeout=POLL_S, return_when="FIRST_COMPLETED")
                pending = list(left)
            except TimeoutError:
                done = set()
            except OSError as exc:
                raise failed(address, exc) from None
            for future in done:
                ended[futures[future]] = _ended(future)
            received = signalled()
            if received and not passed:  # read by every task within POLL_S
                Variable(stop, client).set(received[0])  # before the Event: a task that sees it reads it
                Event(stop, client).set()
                passed = True
            elif len(received) > 1:  # a second Ctrl-C: stop waiting
                client.cancel(pending)
                break
    finally:
        if passed:
            Event(stop, client).clear()  # the scheduler forgets both
            Variable(stop, client).delete()
    return ended


def _ended(future: Any) -> RankEnded:
    """What a finished task says; a task that raised (its worker died under it) as a rank that failed."""
    if future.status == "finished":
        document = future.result()
        ended = RankEnded(**document)
    else:
        exc = future.exception() if future.status == "error" else None
        ended = RankEnded(EXIT_BAD_INPUT, failed=f"its task {future.status}: {type(exc).__name__}: {exc}"
                          if exc is not None else f"its task was {future.status}")
    sys.stdout.write(ended.output)
    sys.stderr.write(ended.errors)
    return ended
