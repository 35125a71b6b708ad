"""How the ranks a script's own Lightning launcher starts stop while `memdiff record -o DIR/` records them: as
torchrun's do, each writing its snapshot up to the stop.

torchrun passes a Ctrl-C on to its ranks and gives them 30 s to end before it kills them (its agent's
shutdown_timeout): each rank's hook writes its snapshot at exit. Lightning's launcher (the launching
process is rank 0, which re-runs the script for the other local ranks) does neither. Its Trainer ends a
Ctrl-C in rank 0 by killing the ranks it started with SIGKILL ("Detected KeyboardInterrupt, attempting
graceful shutdown": lightning/pytorch/trainer/call.py), and its observer thread, once a rank ended with a
failing status (a rank's own Ctrl-C ends it with exit 1; one killed, -9), kills every rank, rank 0 among them,
with SIGKILL too (lightning/fabric/strategies/launchers/subprocess_script.py): rank 1's snapshot was never
written, and rank 0's was killed mid-write (CPU DDP: neither was written). Patched in each process the hook
records (rank_hook): the launcher passes the Ctrl-C on (SIGINT to each rank still running), leaves the
process group (a rank waiting in a collective for rank 0 is released, as torchrun's rank 0 releases it by
ending), waits up to GRACE_S for the ranks, then kills what is left as Lightning does (a rank stuck in a
collective that never returns); its observer, seeing a rank fail, stops the job so (SIGINT to rank 0, which
passes it on) and kills what is left GRACE_S later, never rank 0 once it is ending (writing its snapshot),
nor anything while rank 0 already passes a Ctrl-C on. A rank 0 that a Ctrl-C ends past the Trainer's
handling (a second one, before the Trainer ignores SIGINT), or Fabric's, which has none, stops its ranks so
as it exits (_at_exit): they ran on, orphaned.

Where memdiff runs the script in its own process (`memdiff record --emulate GPU -o FILE`, fit's runs), rank 0
is that process, which the rank hook never loads into: `patched_here` patches the launcher there, and its
observer then never kills that process (it writes the run's snapshot once the script ends), only what is left
of the ranks it started.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Collection, Iterator, List, Sequence

GRACE_S = 30.0  # torchrun's: how long its agent waits for the ranks it passed a signal on to

# This process passes a Ctrl-C on to its ranks (its launcher's kill): its observer kills nothing meanwhile.
_passing_on: List[bool] = []
# This process is ending (its exit handlers run, its snapshot's write among them): no one kills it.
_ending: List[bool] = []
# The observers of the ranks this process's launcher started (lightning.fabric's _ChildProcessObserver).
_observers: List[Any] = []
# This process is memdiff's own, running the script (patched_here): no observer kills it.
_in_memdiff: List[bool] = []


def stop_ranks(ranks: Sequence["subprocess.Popen[Any]"], grace_s: float = GRACE_S,
               then: Callable[[], None] = lambda: None) -> None:
    """Pass a Ctrl-C on to each of `ranks` still running, call `then`, and wait up to `grace_s` for them all
    to end."""
    running = [rank for rank in ranks if rank.poll() is None]
    for rank in running:
        rank.send_signal(signal.SIGINT)
    then()
    deadline = time.monotonic() + grace_s
    for rank in running:
        try:
            rank.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _leave_process_group() -> None:
    """Leave the job's process group (Lightning leaves it at exit), this rank's snapshot written first (the
    hook's stop at destroy_process_group): a rank that waits in a collective for this one is released with an
    error and takes its Ctrl-C, rather than wait for the group's timeout while this one waits for it. torchrun's
    rank 0 releases it by ending."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - left as it is: the wait for the ranks, then Lightning's kill, go on
        pass


def _passing_ctrl_c_on(real: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    def kill(self: Any, signum: int) -> None:
        if signum == signal.SIGKILL:  # the Trainer's end of a Ctrl-C (its SIGTERM is passed on as SIGTERM)
            _passing_on.append(True)
            stop_ranks(self.procs, then=_leave_process_group)
        real(self, signum)  # what is left, as Lightning would
    kill.__wrapped__ = real  # type: ignore[attr-defined]
    return kill


def _stopping_first(real: Callable[[Any], None]) -> Callable[[Any], None]:
    def _terminate_all(self: Any) -> None:
        if _passing_on:  # rank 0 passes a Ctrl-C on: the rank that ended was stopped, and rank 0 ends the rest
            return
        os.kill(self._main_pid, signal.SIGINT)  # the Trainer's rank 0 passes it on (kill above), and writes at exit
        stop_ranks(self._child_processes)
        if not (_passing_on or _ending or _in_memdiff):  # rank 0 never took the Ctrl-C: stuck (in a collective
            real(self)  # with the failed rank)
        elif not _passing_on:  # rank 0 ends (Fabric's, which passes nothing on): what is left of its ranks is killed
            for rank in self._child_processes:
                rank.send_signal(self._termination_signal)
    _terminate_all.__wrapped__ = real  # type: ignore[attr-defined]
    return _terminate_all


def _remembered(real: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        _observers.append(self)
    __init__.__wrapped__ = real  # type: ignore[attr-defined]
    return __init__


def _at_exit() -> None:
    """This process is ending: its observer kills it no more (it writes its snapshot now). Where a Ctrl-C ended
    it past the Trainer's own handling (a terminal's and the one memdiff passes on, the second before the
    Trainer ignores it: its KeyboardInterrupt escaped the handler), or Fabric's, which has none, its ranks are
    stopped as the Trainer's kill above stops them: it ended first, and its ranks ran on, orphaned."""
    _ending.append(True)
    if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        stop_started_ranks()


def stop_started_ranks() -> None:
    """This process's script ended of a Ctrl-C past the Trainer's handling of it (a second one), or Fabric's,
    which has none: the ranks its launcher started are stopped as the Trainer's kill above stops them, rather
    than train on, orphaned, or waited for (memdiff's own process waits for them: launch_lightning.py)."""
    if _passing_on:
        return
    _passing_on.append(True)
    for observer in _observers:
        stop_ranks(observer._child_processes, then=_leave_process_group)
        for rank in observer._child_processes:  # what is left, as the Trainer's kill (Popen skips those ended)
            rank.send_signal(signal.SIGKILL)


def patch(module: Any, at_exit: bool = True) -> None:
    """Lightning's launcher module `module` (its packages' strategies.launchers.subprocess_script) patched so,
    once: the Trainer's launcher's kill (lightning.pytorch's), its process observer (lightning.fabric's); with
    `at_exit`, its ranks stopped at this process's exit past the Trainer's handling of a Ctrl-C."""
    launcher: Any = getattr(module, "_SubprocessScriptLauncher", None)
    kill = getattr(launcher, "__dict__", {}).get("kill")
    if kill is not None and not hasattr(kill, "__wrapped__"):
        launcher.kill = _passing_ctrl_c_on(kill)
    observer: Any = getattr(module, "_ChildProcessObserver", None)
    terminate = getattr(observer, "__dict__", {}).get("_terminate_all")
    if terminate is not None and not hasattr(terminate, "__wrapped__"):
        observer._terminate_all = _stopping_first(terminate)
        observer.__init__ = _remembered(observer.__dict__["__init__"])
        if at_exit:  # after the hook's write at exit (torch is imported before Lightning's launcher): run before it
            atexit.register(_at_exit)


@contextlib.contextmanager
def patched_here(names: Collection[str]) -> Iterator[None]:
    """For the block, in memdiff's own process running a script whose rank 0 it is (record -o FILE, fit's
    runs): each Lightning launcher module of `names`, imported before the block or in it, patched as the rank
    hook patches it in a rank's process, so that a Ctrl-C is passed on to the ranks it starts and they write
    their snapshots, rather than die of Lightning's SIGKILL. The patch stays: Lightning's observer thread
    outlives the run, and as Lightning wrote it, it kills this process with SIGKILL once it sees a rank that
    ended failing (a rank's exit 1 of a Ctrl-C); after the block (every rank waited for) it does nothing."""
    from memdiff.recording.emulate.on_import import patched_on_import

    def apply(name: str, module: Any) -> None:
        patch(module, at_exit=False)
    if not _in_memdiff:
        _in_memdiff.append(True)
    _passing_on.clear()  # this run's Ctrl-C is its own
    _observers.clear()
    try:
        with patched_on_import(names, apply):
            yield
    finally:
        _passing_on.append(True)  # the run is over: an observer that sees a rank that failed does nothing
