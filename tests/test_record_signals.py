"""Ctrl-C and `memdiff record`: passed on to a launched job whenever it comes, and never cutting a
snapshot's write short (the jobs themselves: tests/test_record_ranks.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

from memdiff.commands.record import _Forwarding
from memdiff.recording.capture import sigint_held

SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


def test_a_ctrl_c_that_comes_before_the_job_exists_is_passed_on_once_it_does():
    # memdiff started in the background of a shell script inherits SIGINT ignored: the job it starts
    # must act on the Ctrl-C memdiff passes on all the same.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _Forwarding() as forwarding:
            signal.raise_signal(signal.SIGINT)  # memdiff is about to start the job
            child = subprocess.Popen(SLEEPER)
            forwarding.started(child)
            # Ended by the Ctrl-C (killed by SIGINT, or Python's KeyboardInterrupt, which ends so too),
            # not after its hour.
            assert child.wait(timeout=600) == -signal.SIGINT
        assert forwarding.received == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # put back as it was
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_a_snapshot_is_written_is_held_not_raised():
    before = signal.getsignal(signal.SIGINT)
    with sigint_held() as held:
        signal.raise_signal(signal.SIGINT)
        written = sum(range(1000))  # the write goes on
    assert held == [signal.SIGINT] and written == 499500
    assert signal.getsignal(signal.SIGINT) == before
