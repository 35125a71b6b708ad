"""Ctrl-C and `memdiff record`: passed on to a launched job whenever it comes, and never cutting a
snapshot's write short (the jobs themselves: tests/test_record_ranks.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Tuple

import pytest
from conftest import missing_capture_dependency

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
    # fit started in a shell script's background (as CI steps may run it) hands its runs SIGINT ignored:
    # the run, fitrun.child, acts on fit's SIGINT all the same (stopping.a_run_fit_stops)
    run = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "from memdiff.recording.fitrun import _wait_passing_interrupt\n"
        "from memdiff.recording.stopping import a_run_fit_stops\n"
        "a_run_fit_stops()\n"
        f"record = subprocess.Popen([sys.executable, '-c', {record!r}])\n"
        "try:\n    _wait_passing_interrupt(record)\n"
        "except KeyboardInterrupt:\n    print('interrupted', record.returncode)\n")],
        stdout=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 600
    while not ready.exists():  # the run is under way, waiting for its record by then
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)  # fit's stop
    out, _ = run.communicate(timeout=600)
    assert out.split() == ["interrupted", "130"]  # raised on, for fit's run to end as interrupted
    assert said.read_text() == "interrupted"  # record ended by the Ctrl-C, not killed


# Stopping memdiff as a CI runner (SIGTERM) or a closed terminal (SIGHUP) does, driving memdiff as a process
# of its own (a test under xdist runs off the worker's main thread: never signal the test process).

SLEEPER_SCRIPT = ("import os, sys, time, torch\n"
                  "kept = torch.ones(1 << 20{device})  # 4 MiB\n"
                  "print('ready', os.getpid(), flush=True)\n"
                  "{mark}"
                  "time.sleep(3600)\n")


def _script(tmp_path, device: str = "", ready=None):
    script = tmp_path / "sleeps.py"
    mark = f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n" if ready is not None else ""
    script.write_text(SLEEPER_SCRIPT.format(device=device, mark=mark))
    return script


def _memdiff(tmp_path, *args: str, sigint_ignored: bool = False) -> subprocess.Popen:
    """memdiff started as a process group of its own: whatever of it a failing test leaves is ended (_ended).
    `sigint_ignored`: as a shell script's background starts it (a CI step's `memdiff ... &`)."""
    with open(tmp_path / "memdiff.log", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "memdiff", *args], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True,
                                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored
                                else None)


def _ended(memdiff: subprocess.Popen) -> None:
    """Kill what is left of memdiff's process group (nothing, when the test passed) and reap memdiff."""
    try:
        os.killpg(memdiff.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    memdiff.wait()


def _wait_for(found, process: subprocess.Popen) -> None:
    """Until `found()`; the test fails should memdiff end first (it must still be running to be stopped)."""
    deadline = time.monotonic() + 600
    while not found():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _left(memdiff: subprocess.Popen, pids) -> list:
    """Of `pids`, the processes still running now that memdiff has ended: its orphans."""
    assert memdiff.returncode is not None
    return [pid for pid in pids if _alive(pid)]


def _four_mib_allocated(path) -> bool:
    from memdiff.read.load import load

    snapshot = load(str(path))
    return any(e["action"] == "alloc" and e["size"] == 4 << 20 for trace in snapshot.device_traces for e in trace)


@pytest.mark.slow
def test_sigterm_to_memdiff_record_writes_the_snapshot_and_exits_143(torch, tmp_path):
    # A CI runner's cancel (and `timeout`) sends SIGTERM: it ended memdiff at once, the snapshot of the
    # run never written (exit -15). It stops the script as Ctrl-C does now.
    ready = tmp_path / "ready"
    memdiff = _memdiff(tmp_path, "record", "-o", "run.pickle", "--", sys.executable,
                       str(_script(tmp_path, ready=ready)))
    try:
        _wait_for(ready.exists, memdiff)
        memdiff.send_signal(signal.SIGTERM)
        assert memdiff.wait(timeout=600) == 128 + signal.SIGTERM, (tmp_path / "memdiff.log").read_text()
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "run.pickle")


def _recording_a_job(tmp_path) -> Tuple[subprocess.Popen, int]:
    """`memdiff record -o runs/` of a job (a script that sleeps once it holds 4 MiB), and the job's pid,
    once it is under way; ended if it never gets there."""
    ready = tmp_path / "ready"
    memdiff = _memdiff(tmp_path, "record", "-o", "runs/", "--", sys.executable, str(_script(tmp_path, ready=ready)))
    try:
        _wait_for(lambda: ready.exists() and ready.read_text(), memdiff)
    except BaseException:
        _ended(memdiff)
        raise
    return memdiff, int(ready.read_text())


@pytest.mark.slow
def test_sighup_to_memdiff_record_of_a_job_stops_the_job_and_writes_its_snapshot(torch, tmp_path):
    # -o DIR/ runs the job as a child: memdiff passed Ctrl-C and SIGTERM on but died of SIGHUP (a closed
    # terminal), the job running on, orphaned; and the job's own hook wrote nothing on SIGHUP either.
    memdiff, job = _recording_a_job(tmp_path)
    try:
        memdiff.send_signal(signal.SIGHUP)
        assert memdiff.wait(timeout=600) == 128 + signal.SIGHUP, (tmp_path / "memdiff.log").read_text()
        assert _left(memdiff, [job]) == []  # memdiff waited for its job: nothing left running
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "runs" / f"pid{job}.pickle")


@pytest.mark.slow
def test_sigterm_to_memdiff_record_repeat_stops_the_repeat_and_keeps_its_snapshot(torch, tmp_path):
    # --repeat runs each repeat as a `memdiff record` of its own: SIGTERM ended the outer one alone, the
    # repeat running on, orphaned (and subprocess.run killed it on Ctrl-C, its snapshot lost).
    ready = tmp_path / "ready"
    memdiff = _memdiff(tmp_path, "record", "--repeat", "2", "-o", "run.pickle", "--", sys.executable,
                       str(_script(tmp_path, ready=ready)))
    try:
        _wait_for(lambda: ready.exists() and ready.read_text(), memdiff)
        repeat = int(ready.read_text())  # the repeat's memdiff record runs the script in its own process
        memdiff.send_signal(signal.SIGTERM)
        assert memdiff.wait(timeout=600) == 128 + signal.SIGTERM, (tmp_path / "memdiff.log").read_text()
        assert _left(memdiff, [repeat]) == []
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "run-1.pickle") and not (tmp_path / "run-2.pickle").exists()


@pytest.mark.slow
@pytest.mark.parametrize("started", ["in the foreground", "in a shell script's background"])
def test_sigterm_to_memdiff_fit_stops_its_runs_and_keeps_their_snapshots(torch, tmp_path, started):
    # fit's runs are forked from its forkserver: SIGTERM ended fit alone, and its runs, the forkserver and
    # the resource tracker ran on, orphaned, with no snapshot. The emulated run writes only in its overlay:
    # its pid is read from its log, which is outside it. Started in a background (SIGINT ignored, handed
    # on to its runs), fit's SIGINT to its runs did nothing: each was killed, its snapshot unwritten.
    script = tmp_path / "sleeps.py"
    script.write_text("import argparse, os, time, torch\n"
                      "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int)\n"
                      "kept = torch.ones(p.parse_args().batch_size << 20, device='cuda')  # 4 MiB\n"
                      "print('ready', os.getpid(), flush=True)\n"
                      "time.sleep(3600)\n")
    log = tmp_path / "runs" / "h100-batch1.log"

    def said():
        return log.exists() and "ready" in log.read_text()
    memdiff = _memdiff(tmp_path, "fit", "--emulate", "h100", "--range", "batch=1:1", "--jobs", "1", "-o", "runs/",
                       "--", sys.executable, str(script), "--batch-size", "{batch}",
                       sigint_ignored=started != "in the foreground")
    try:
        _wait_for(said, memdiff)
        run = int(log.read_text().split("ready")[1].split()[0])
        memdiff.send_signal(signal.SIGTERM)
        assert memdiff.wait(timeout=600) == 128 + signal.SIGTERM, (tmp_path / "memdiff.log").read_text()
        assert _left(memdiff, [run]) == []
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "runs" / "h100-batch1.pickle")


def test_sigterm_and_sighup_stop_a_command_as_ctrl_c_does_unless_ignored():
    # In a process of its own: SIGTERM and SIGHUP raise as Ctrl-C does, with the shell's exit status; a
    # SIGHUP the process was started ignoring (`nohup`) stays ignored.
    code = ("import os, signal, sys, time\n"
            "from memdiff.recording.stopping import exit_status, terminating_as_interrupt\n"
            "signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == 'nohup' else signal.SIG_DFL)\n"
            "try:\n"
            "    with terminating_as_interrupt():\n"
            "        print('ready', flush=True)\n"
            "        time.sleep(3600)\n"
            "except KeyboardInterrupt as exc:\n"
            "    print(exit_status(exc), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)\n")
    for how, sent, said in (("", signal.SIGTERM, "143 True"), ("", signal.SIGHUP, "129 True"),
                            ("nohup", signal.SIGHUP, "143 True")):
        child = subprocess.Popen([sys.executable, "-c", code, how or "-"], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline() == "ready\n"
            child.send_signal(sent)
            if how == "nohup":  # ignored: it sleeps on, and SIGTERM stops it
                child.send_signal(signal.SIGTERM)
            assert child.communicate(timeout=600)[0].split() == said.split()
        finally:
            child.kill()


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: an orphan's new parent may be slow to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_job_outlives_no_memdiff_killed_with_sigkill_and_writes_its_snapshot(torch, tmp_path):
    # SIGKILL (a CI runner's last resort after its SIGTERM's grace) gives memdiff no say: the job it started
    # ran on, orphaned, to its end. The job now gets SIGTERM as memdiff dies, and its hook writes.
    memdiff, job = _recording_a_job(tmp_path)
    try:
        memdiff.kill()
        assert memdiff.wait(timeout=600) == -signal.SIGKILL
        deadline = time.monotonic() + 600
        while _running(job):  # nobody waits for it now: it ends of the SIGTERM, or the test fails
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "runs" / f"pid{job}.pickle")


# A script whose Lightning Trainer starts its own ranks (devices=2, DDP): it re-runs the script for rank 1 from
# rank 0. Each rank keeps 4 MiB, says it trains, and trains for an hour unless stopped.
LIGHTNING_SLEEPER = ("import os, time, torch\n"
                     "import lightning as L\n"
                     "from torch.utils.data import DataLoader, TensorDataset\n"
                     "class Tiny(L.LightningModule):\n"
                     "    def __init__(self):\n"
                     "        super().__init__()\n"
                     "        self.layer = torch.nn.Linear(32, 4)\n"
                     "    def training_step(self, batch, index):\n"
                     "        if self.global_step == 2:  # the third step (each rank has one batch an epoch)\n"
                     "            self.kept = torch.ones(1 << 20, device='cuda')  # 4 MiB\n"
                     "            os.write(1, f'training {self.global_rank} {os.getpid()}\\n'.encode())\n"
                     "        time.sleep(0.05)\n"
                     "        return self.layer(batch[0]).sum()\n"
                     "    def configure_optimizers(self):\n"
                     "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
                     "if __name__ == '__main__':\n"
                     "    data = DataLoader(TensorDataset(torch.randn(16, 32)), batch_size=8)\n"
                     "    L.Trainer(accelerator='gpu', devices=2, strategy='ddp', max_time='00:01:00:00',\n"
                     "              logger=False, enable_checkpointing=False, enable_progress_bar=False,\n"
                     "              enable_model_summary=False).fit(Tiny(), data)\n")

# The same with Fabric, whose launch() starts rank 1 as the Trainer does, and which has no Ctrl-C handling of its
# own: rank 0 ended of its KeyboardInterrupt, and rank 1, whom nobody told, trained on, orphaned.
FABRIC_SLEEPER = ("import os, time, torch\n"
                  "import lightning as L\n"
                  "fabric = L.Fabric(accelerator='gpu', devices=2, strategy='ddp')\n"
                  "fabric.launch()\n"
                  "model = fabric.setup(torch.nn.Linear(32, 4))  # DDP: its backward's all-reduce\n"
                  "for step in range(72000):\n"
                  "    fabric.backward(model(torch.randn(8, 32, device=fabric.device)).sum())\n"
                  "    if step == 2:\n"
                  "        kept = torch.ones(1 << 20, device='cuda')  # 4 MiB\n"
                  "        os.write(1, f'training {fabric.global_rank} {os.getpid()}\\n'.encode())\n"
                  "    time.sleep(0.05)\n")


@pytest.mark.slow
@pytest.mark.parametrize("script, to", [(LIGHTNING_SLEEPER, "memdiff"), (LIGHTNING_SLEEPER, "the process group"),
                                        (FABRIC_SLEEPER, "memdiff")], ids=["trainer", "trainer-group", "fabric"])
def test_ctrl_c_to_a_job_lightnings_own_launcher_started_writes_every_rank_and_exits_130(torch, tmp_path, script,
                                                                                         to):
    # Lightning's rank 0 ended a Ctrl-C by killing rank 1 with SIGKILL, and its observer thread, seeing rank 1
    # end so (or exit 1 of its own Ctrl-C, from a terminal), killed rank 0 with SIGKILL too: with CPU DDP,
    # neither snapshot was written; emulated, rank 1's never was. torchrun passes the Ctrl-C on, and waits.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(script)
    memdiff = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", sys.executable, "train.py")
    log = tmp_path / "memdiff.log"
    try:
        _wait_for(lambda: log.read_text().count("training ") == 2, memdiff)
        ranks = [int(line.split()[2]) for line in log.read_text().splitlines() if line.startswith("training ")]
        if to == "the process group":  # a terminal's Ctrl-C: every rank gets it, and memdiff passes it on
            os.killpg(memdiff.pid, signal.SIGINT)
        else:  # a CI runner's: memdiff alone, which passes it on to its child, rank 0
            memdiff.send_signal(signal.SIGINT)
        assert memdiff.wait(timeout=600) == 130, log.read_text()
        assert _left(memdiff, ranks) == []
    finally:
        _ended(memdiff)
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["exit_status"] == 130
    # each rank written, and none said to have died (Lightning ends a Ctrl-C with exit 1)
    assert [(r["rank"], r["state"], r.get("died")) for r in manifest["ranks"]] == \
        [(0, "written", None), (1, "written", None)], log.read_text()
    assert all(_four_mib_allocated(tmp_path / "runs" / f"rank{rank}.pickle") for rank in (0, 1))


def _descendants(pid: int) -> list:
    """Every process under `pid` now: its children, theirs, and so on."""
    children: dict = {}
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # no process, or one that ended meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and pidfds are Linux's")
def test_nothing_of_memdiff_fit_outlives_it_killed_with_sigkill_and_its_run_writes(torch, tmp_path):
    # fit's runs are forked from its forkserver, not from fit: SIGKILL (a CI runner's last resort) ended fit
    # alone, and its run trained on, orphaned, to its end, the forkserver and the resource tracker with it
    # (each run holds the pipe whose end tells the forkserver that fit is gone). Each run now watches fit,
    # and stops as on fit's Ctrl-C once it has ended, writing its snapshot.
    script = tmp_path / "sleeps.py"
    script.write_text("import argparse, os, time, torch\n"
                      "p = argparse.ArgumentParser(); p.add_argument('--batch-size', type=int)\n"
                      "kept = torch.ones(p.parse_args().batch_size << 20, device='cuda')  # 4 MiB\n"
                      "print('ready', os.getpid(), flush=True)\n"
                      "time.sleep(3600)\n")
    log = tmp_path / "runs" / "h100-batch1.log"
    memdiff = _memdiff(tmp_path, "fit", "--emulate", "h100", "--range", "batch=1:1", "--jobs", "1", "-o", "runs/",
                       "--", sys.executable, str(script), "--batch-size", "{batch}")
    try:
        _wait_for(lambda: log.exists() and "ready" in log.read_text(), memdiff)
        run = int(log.read_text().split("ready")[1].split()[0])
        fits = _descendants(memdiff.pid)  # the forkserver, the run, the resource tracker
        assert run in fits and len(fits) >= 3, fits
        memdiff.kill()
        assert memdiff.wait(timeout=600) == -signal.SIGKILL
        deadline = time.monotonic() + 600  # nobody waits for them now: they end by themselves, or the test fails
        while [pid for pid in fits if _running(pid)]:
            assert time.monotonic() < deadline, [pid for pid in fits if _running(pid)]
            time.sleep(0.05)
    finally:
        _ended(memdiff)
    assert _four_mib_allocated(tmp_path / "runs" / "h100-batch1.pickle")


@pytest.mark.slow
@pytest.mark.parametrize("script, status, taken", [(LIGHTNING_SLEEPER, 1, "Detected KeyboardInterrupt"),
                                                   (FABRIC_SLEEPER, 130, "[rank1]: KeyboardInterrupt")],
                         ids=["trainer", "fabric"])
def test_ctrl_c_to_a_lightning_script_recorded_into_one_file_lets_rank_1_write(torch, tmp_path, script, status,
                                                                              taken):
    # Into one file (-o FILE) the script's rank 0 runs in memdiff's own process, where the rank hook that
    # patches Lightning's launcher (lightning_stop.py) is not loaded: the Trainer ended the Ctrl-C by killing
    # rank 1 with SIGKILL, its snapshot (kept beside the run's in fit's runs) never written; under Fabric,
    # which has no Ctrl-C handling, rank 1 trained on and memdiff waited for it, for ever.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(script)
    memdiff = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "run.pickle", "--", sys.executable, "train.py")
    log = tmp_path / "memdiff.log"
    try:
        _wait_for(lambda: log.read_text().count("training ") == 2, memdiff)
        ranks = [int(line.split()[2]) for line in log.read_text().splitlines() if line.startswith("training ")]
        # A CI runner's Ctrl-C: memdiff alone, whose process is rank 0; once. One landing in a weak
        # dictionary's callback, where CPython ignores it, was dropped (1 run in 5): it is held to the next op.
        memdiff.send_signal(signal.SIGINT)
        # the Trainer ends a Ctrl-C with sys.exit(1), which is the script's status into one file; Fabric's
        # KeyboardInterrupt ends it as any script's
        assert memdiff.wait(timeout=600) == status, log.read_text()
        assert _left(memdiff, ranks) == []
    finally:
        _ended(memdiff)
    said = log.read_text()
    assert taken in said, said  # the script took the one Ctrl-C
    assert _four_mib_allocated(tmp_path / "run.pickle")  # rank 0's, this process's
    # rank 1 took the Ctrl-C passed on and wrote its snapshot (not kept, into one file: memdiff says so)
    assert "the script started 1 process that used the emulated GPU (rank1)" in said, said
