"""Ctrl-C and `memdiff record`: passed on to a launched job whenever it comes, and never cutting a
snapshot's write short (the jobs themselves: tests/test_record_ranks.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

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
    # fit stops a value it no longer needs with Ctrl-C to the process running it; that run's `memdiff
    # record` of a launched job (torchrun ...) must get it, to stop the launcher and its ranks and write
    # what they recorded. subprocess.run killed it instead, and torchrun and its ranks ran on, orphaned.
    # Both stand in as processes of their own, as fit's are (a signal reaches a process's main thread).
    ready, said = tmp_path / "ready", tmp_path / "said"
    record = ("import signal, sys, time\n"
              f"def stop(*_):\n    open({str(said)!r}, 'w').write('interrupted')\n    sys.exit(130)\n"
              "signal.signal(signal.SIGINT, stop)\n"
              f"open({str(ready)!r}, 'w').close()\n"
              "time.sleep(3600)\n")
    run = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "from memdiff.recording.fitrun import _wait_passing_interrupt\n"
        f"record = subprocess.Popen([sys.executable, '-c', {record!r}])\n"
        "try:\n    _wait_passing_interrupt(record)\n"
        "except KeyboardInterrupt:\n    print('interrupted', record.returncode)\n")],
        stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ready.exists():  # the run is under way, waiting for its record by then
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)  # fit's stop
    out, _ = run.communicate(timeout=600)
    assert out.split() == ["interrupted", "130"]  # raised on, for fit's run to end as interrupted
    assert said.read_text() == "interrupted"  # record ended by the Ctrl-C, not killed
