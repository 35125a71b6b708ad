"""Stopping memdiff: SIGTERM (a CI runner's cancel, `timeout`) and SIGHUP (a closed terminal) stop a
command as Ctrl-C does, so that what Ctrl-C runs on its way out runs for them too: the script's snapshot
is written, the runs and jobs memdiff started are stopped and waited for (never orphaned), temporary
files are removed. The exit status is the shell's for the signal: 130, 143, 129 (docs/recording.md,
'Stopping memdiff')."""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

# The signals that stop a command as Ctrl-C does (SIGINT raises KeyboardInterrupt already).
TERMINATING: Tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)
STOPPING: Tuple[int, ...] = (signal.SIGINT, *TERMINATING)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.5  # how often ending_with looks for its process where no pidfd can watch it


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C raises KeyboardInterrupt; every `except KeyboardInterrupt`
    that ends a run and keeps what it recorded treats it alike."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(exc: BaseException) -> int:
    """The exit status of a command stopped by `exc`: 128 + the signal, as a shell says (Ctrl-C: 130)."""
    return 128 + exc.signum if isinstance(exc, Stopped) else 130


def _raise(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def raising_from_now() -> Dict[int, Any]:
    """From now on, SIGTERM and SIGHUP raise Stopped in the main thread (a process's entry: fit's runs); the
    handlers they had. A signal the process was started ignoring stays ignored (`nohup` ignores SIGHUP: a
    job under it must outlive the terminal); off the main thread, where no handler can be set, nothing
    changes."""
    previous: Dict[int, Any] = {}
    try:
        for s in TERMINATING:
            if signal.getsignal(s) == signal.SIG_DFL:
                previous[s] = signal.signal(s, _raise)
    except ValueError:  # not the main thread
        pass
    return previous


def a_run_fit_stops() -> None:
    """For a run fit (or whatif) forked and stops with SIGINT when it no longer needs it (fitrun.stop):
    SIGINT raises KeyboardInterrupt whatever memdiff was started with, and SIGTERM and SIGHUP raise
    Stopped (raising_from_now). A memdiff started in a shell script's background inherits SIGINT
    ignored, and its runs with it: fit's stop did nothing, each run was killed STOP_S later, its
    snapshot unwritten and the job its `memdiff record` had started left running."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raising_from_now()


@contextlib.contextmanager
def terminating_as_interrupt() -> Iterator[None]:
    """While in the block, SIGTERM and SIGHUP raise Stopped in the main thread, as raising_from_now."""
    previous = raising_from_now()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def wanted(s: int) -> bool:
    """Whether memdiff acts on signal `s` (passes it on, holds it during a write): SIGINT always (started
    with it ignored, in a shell script's background, Ctrl-C still stops the run, as documented); SIGTERM and
    SIGHUP unless the process was started ignoring them."""
    return s == signal.SIGINT or signal.getsignal(s) != signal.SIG_IGN


def dying_with_us() -> Optional[Callable[[], None]]:
    """A `preexec_fn` for a child memdiff starts and waits for (a launcher, a repeat, a rank run alone): on
    Linux the child is sent SIGTERM when memdiff dies, SIGKILL included (a CI runner's last resort after its
    SIGTERM's grace), so that it stops and writes what it recorded rather than run on, orphaned; elsewhere
    None. Set between fork and exec; a memdiff already dead by then is seen by the child's new parent."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # memdiff died before the line above: nobody will send it
            os.kill(os.getpid(), signal.SIGTERM)
    return in_child


def ending_with(pid: int) -> None:
    """From now on, this process is sent SIGTERM as soon as process `pid` ends, SIGKILL included: for a run fit
    (or whatif) forked, `pid` being fit's, which SIGTERM stops as fit's own stop does, writing its snapshot
    (a_run_fit_stops). Its parent is fit's forkserver, not fit, and the forkserver outlives a SIGKILLed fit
    while any run lives (each run holds the pipe whose end tells it fit is gone): PR_SET_PDEATHSIG would wait
    for the runs themselves, which trained on, orphaned, to their end. A thread waits on a pidfd of `pid`
    (Linux 5.3+: it is readable once `pid` has ended, reaped or not); elsewhere it looks every POLL_S. A
    process forked from this one (a DataLoader's worker) has no such thread: it ends with this one."""
    # bound now: the emulator patches the file world once the run starts
    kill, me, wait, alive = os.kill, os.getpid(), select.select, _alive
    try:
        watched: Optional[int] = os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
    except ProcessLookupError:  # ended already
        kill(me, signal.SIGTERM)
        return
    except (AttributeError, OSError):  # no pidfd here: looked at every POLL_S
        watched = None

    def watch() -> None:
        if watched is not None:
            while not wait([watched], [], [])[0]:
                pass
        else:
            while alive(pid):
                time.sleep(POLL_S)
        kill(me, signal.SIGTERM)
    _thread.start_new_thread(watch, ())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: the pid was taken again
        return False
    return True
