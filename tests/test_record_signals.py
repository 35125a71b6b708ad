"""Ctrl-C and `memdiff record`: passed on to a launched job whenever it comes, and never cutting a
snapshot's write short (the jobs themselves: tests/test_record_ranks.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

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


def test_fit_stopping_a_launched_run_passes_the_ctrl_c_on_to_memdiff_record(tmp_path):
    # fit stops a value it no longer needs with Ctrl-C; the run's `memdiff record` of a launched job
    # (torchrun ...) must get it, to stop the launcher and its ranks and write what they recorded.
    # subprocess.run killed it instead, and torchrun and its ranks ran on, orphaned, to their end.
    import os
    import threading
    import time

    from memdiff.recording.fitrun import _wait_passing_interrupt

    ready, said = tmp_path / "ready", tmp_path / "said"
    record = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"def stop(*_):\n    open({str(said)!r}, 'w').write('interrupted')\n    sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(3600)\n")])

    def fit_stops_it() -> None:  # once the run is under way: this process is waiting for it by then
        while not ready.exists() and record.poll() is None:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fit_stops_it, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):  # raised on, for fit's run to end as interrupted
        _wait_passing_interrupt(record)
    assert record.returncode == 130 and said.read_text() == "interrupted"  # ended by the Ctrl-C, not killed
