"""One emulated run of `memdiff fit`: the unmodified script in a process of its own on the emulated GPU,
as `memdiff record --emulate GPU -o FILE -- python SCRIPT ARGS` runs it, and what it left.

The process is forked from a server that has imported torch and nothing of the script's (Python's
forkserver), so each run starts as `memdiff record` does: torch imported, no module of the script,
a fresh allocator. Its stdout and stderr go to a log file beside the snapshot; what it sends back
is a small dict (`RunOutcome.to_dict`): how it ended, whether the emulated GPU ran out of memory
(the error PyTorch's words, even when the script caught it), and its peaks from the snapshot's summary.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

# How each run ended.
FITS, OOM, FAILED = "fits", "oom", "failed"
# How the ranks that ran of a job some of whose ranks did not were chosen: by `--ranks auto`, or as the
# ranks of its first node that a script's own Lightning launcher starts (its other nodes' never start here).
ONE_PER_ROLE, FIRST_NODE = "one per role", "first node"
LOG_TAIL_LINES = 12  # lines of a failed run's output its one-line error quotes
STOP_S = 60  # how long an interrupted run may take to write its snapshot


@dataclass
class RunOutcome:
    """What one emulated run left: its ending, its peaks, where it peaked, and its out-of-memory error."""

    status: str  # FITS (ran to its end, exit 0, no out-of-memory), OOM, FAILED (anything else)
    exit_status: int
    oom_message: Optional[str]
    refused: Optional[str]  # the emulator's one-line refusal of an op it cannot run
    peak_bytes: Optional[int]
    reserved_peak_bytes: Optional[int]
    phase: Optional[str]
    step: Optional[int]
    site: Optional[str]  # the allocation that reached the peak (memdiff peak's `reached by`)
    seconds: float
    cpu_seconds: float  # the process's own CPU time, user and system: the run's cost on a shared machine
    # `memdiff whatif --emulate`: what the change made (one sentence each), why it made nothing (None: it
    # did), and what the script used (its optimizer, as `--change optimizer=` names it)
    phase_peaks: Optional[Dict[str, int]] = None  # each phase's highest bytes live, over the steps
    categories: Optional[Dict[str, int]] = None  # bytes live at the peak, per category
    change_notes: Optional[List[str]] = None
    change_unmade: Optional[str] = None
    seen: Optional[Dict[str, Any]] = None
    steps: Optional[int] = None  # the training steps the snapshot holds (fit's note on a long run counts them)
    ranks_run: Optional[List[int]] = None  # a launched job run as its picked ranks: those (None: run whole)
    world_size: Optional[int] = None  # a launched job's ranks, run or not
    ranks_how: Optional[str] = None  # with ranks_run: how they were chosen (ONE_PER_ROLE, FIRST_NODE)
    # FAILED by the script's own exception: it in one line with the script's line (escapes.failure_line), which
    # the one-line error leads with; its traceback stays in the run's log
    failure: Optional[str] = None
    # where the job's ranks' snapshots went, where they are not beside `snapshot` (a job a script's Lightning
    # launcher starts, run as its picked ranks: fit_lightning.py)
    folder: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The outcome as sent back to the parent."""
        return asdict(self)


def _summary_facts(path: str, rules: Sequence[Any]) -> Dict[str, Any]:
    """The peaks, phase and site of the snapshot at `path`, as `memdiff peak` reads them (categories by
    `rules`, the category rules the command was given, loaded at its entry)."""
    from memdiff.read.inputs import read_summary

    summary = read_summary(path, rules)
    device = max(summary.devices, key=lambda d: d.peak_bytes, default=None)
    if device is None:
        return {}
    site = next((g.site for g in device.groups if g.signature == device.peak_event_signature), None)
    phases: Dict[str, int] = {}
    for p in device.phase_peaks:
        phases[p.phase] = max(phases.get(p.phase, 0), p.peak_bytes)
    return {"peak_bytes": device.peak_bytes, "reserved_peak_bytes": device.reserved_peak_bytes,
            "phase": device.phase_at_peak, "step": device.step_at_peak, "site": site,
            "phase_peaks": phases, "categories": dict(device.categories), "steps": len(device.steps)}


def _output_to(log: str) -> None:
    """Send this process's stdout and stderr (the file descriptors, so the script's and torch's too) to
    `log`, made afresh: the first thing a forked run does, so that nothing it says, even as the parent
    stops it with SIGINT in the middle of an import, reaches the user's terminal."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_emulated(gpu: str, target: List[str], snapshot: str, log: str, max_entries: int, rules: Sequence[Any],
                 change: Optional[Sequence[Tuple[str, Optional[str]]]] = None,
                 knob: Optional[str] = None) -> RunOutcome:
    """Run `target` (`[SCRIPT, ARGS...]` or `[-m, MODULE, ARGS...]`) on emulated `gpu`, writing its snapshot
    to `snapshot` and its output to `log`; with `change` (`memdiff whatif --change`'s parts, maybe none),
    those changes made inside the emulator (emulate/changes) and what they did reported. With `knob` (fit's),
    a job the script's Lightning launcher starts that fit runs as its picked ranks raises SplitJob where the
    launcher would start them (fit_lightning.py)."""
    import argparse
    import contextlib
    import time

    from memdiff.commands.record import _children_emulated, _run_target
    from memdiff.errors import EXIT_BAD_INPUT, InputError
    from memdiff.recording.capture import record, sigint_held, torch_module
    from memdiff.recording.emulate.changes import applying
    from memdiff.recording.emulate.gpus import gpu as gpu_named
    from memdiff.recording.emulate.overlay_calls import for_run
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating
    from memdiff.recording.fit_lightning import split_at_launch
    from memdiff.recording.stopping import STOPPING
    from memdiff.recording.stopping import exit_status as stopped_status

    torch_module()
    started = time.monotonic()
    refused: Optional[str] = None
    failed: List[str] = []
    emulator = Emulator(gpu_named(gpu))
    hook = argparse.Namespace(max_entries=max_entries, stacks="all", steps=None, emulate=gpu, gpus=None)
    with contextlib.ExitStack() as run:
        # The run's overlay, and in it the folder that the processes the script starts record into (its
        # Lightning launcher's other ranks, torch.multiprocessing's workers): each on the emulated GPU, as
        # `memdiff record -o FILE` runs them. Without it they met the machine's own torch and died ("No
        # supported gpu backend found!"), and the run was judged by the script's own process alone.
        root = run.enter_context(for_run([snapshot], None, os.path.dirname(os.path.abspath(snapshot)), [],
                                         lambda _: None))
        processes = run.enter_context(_children_emulated(hook, root))
        assert processes is not None  # emulated, with the overlay's folder: _children_emulated made it
        with emulating(emulator), contextlib.ExitStack() as changes:
            session = changes.enter_context(applying(change)) if change is not None else None
            if knob is not None:  # after the emulator's own patch of Lightning's launcher: this one runs first
                changes.enter_context(split_at_launch(knob))
            with record(snapshot, max_entries=max_entries):
                try:
                    status = _run_target(target, emulated=True, failed=failed)
                except InputError as exc:  # the emulator refused an op: the script cannot be fitted as it is
                    refused, status = f"{exc.path}: {exc.message}", EXIT_BAD_INPUT
                except KeyboardInterrupt as exc:  # fit's stop, or SIGTERM to fit's process group (stopping.py)
                    status = stopped_status(exc)
                finally:
                    # The script has ended: a signal from here until the snapshot is written (fit's Ctrl-C
                    # after a SIGTERM to its process group, both stopping the run) must not cut the write short.
                    changes.enter_context(sigint_held(STOPPING))
        sys.stdout.flush()
        sys.stderr.flush()
        children = started_processes(processes, snapshot)
    oom = emulator.out_of_memory[0] if emulator.out_of_memory else children.out_of_memory
    refused = refused or children.refused
    if status == 0 and children.failed is not None:  # a rank that died fails the job, as on GPUs
        print(f"memdiff: {children.failed}", file=sys.stderr)
        status = 1
        failed.append(children.failed)
    # The script's own process is rank 0 of the job its launcher starts: where the job's other nodes never
    # started (a job of several nodes run as `python train.py`), the answer says which ranks ran.
    ran = sorted({0, *children.ranks})
    some = children.world_size is not None and children.world_size > len(ran)
    facts = _summary_facts(snapshot, rules) if os.path.exists(snapshot) else {}
    for name, path in children.files:
        theirs = _summary_facts(path, rules)
        if theirs and (theirs["reserved_peak_bytes"] or 0) > (facts.get("reserved_peak_bytes") or -1):
            facts = {**theirs, "site": f"{name}: {theirs['site']}"}
    seconds = time.monotonic() - started
    used = resource.getrusage(resource.RUSAGE_SELF)  # a forked process's count starts at its fork
    ended = OOM if oom is not None else FITS if status == 0 else FAILED
    return RunOutcome(status=ended, exit_status=status, oom_message=oom, refused=refused,
                      peak_bytes=facts.get("peak_bytes"), reserved_peak_bytes=facts.get("reserved_peak_bytes"),
                      phase=facts.get("phase"), step=facts.get("step"), site=facts.get("site"), seconds=seconds,
                      phase_peaks=facts.get("phase_peaks"), categories=facts.get("categories"),
                      cpu_seconds=used.ru_utime + used.ru_stime,
                      change_notes=None if session is None else session.notes,
                      change_unmade=None if session is None else session.unmade(),
                      seen=None if session is None else session.seen, steps=facts.get("steps"),
                      ranks_run=ran if some else None, world_size=children.world_size if some else None,
                      ranks_how=FIRST_NODE if some else None, failure=failed[0] if failed else None)


@dataclass(frozen=True)
class Started:
    """What the processes a script started on the emulated GPU left (its Lightning launcher's other ranks,
    torch.multiprocessing's ranks): their snapshots, copied beside the run's, and how they ended."""

    files: List[Tuple[str, str]]  # (what it was: "rank 1", "process 123"; its snapshot's copy), ranks first
    out_of_memory: Optional[str]  # the first one's error, "rank 1: CUDA out of memory. ..."
    refused: Optional[str]  # the first op refused in one of them
    failed: Optional[str]  # the first that died or left no snapshot, and why
    ranks: List[int]  # the job's ranks among them
    world_size: Optional[int]  # the job's size, as they said it (None: no rank among them)


def started_processes(processes: str, snapshot: str) -> Started:
    """Read the statuses and snapshots the processes the run's script started left in `processes` (the
    folder `record -o FILE` gives them), copying each snapshot beside `snapshot` (`STEM.rank1.pickle`,
    `STEM.pid123.pickle`)."""
    import shutil

    from memdiff.recording.manifest import NOT_EMULATED, NOT_STARTED, collect

    manifest = collect(processes, keep=True)
    ranks = [r for r in manifest.ranks if r.state not in (NOT_STARTED, NOT_EMULATED)] if manifest is not None else []
    missing = set(manifest.missing(processes)) if manifest is not None else set()
    stem = snapshot[:-len(".pickle")] if snapshot.endswith(".pickle") else snapshot
    files: List[Tuple[str, str]] = []
    written = [(f"rank {r.rank}", r.file) for r in ranks if r not in missing and r.file] + \
        [(f"process {n[3:-len('.pickle')]}", n) for n in sorted(os.listdir(processes))
         if n.startswith("pid") and n.endswith(".pickle")]
    for name, file in written:
        copy = f"{stem}.{file}"
        shutil.copyfile(os.path.join(processes, file), copy)
        files.append((name, copy))
    return Started(
        files=files, ranks=[r.rank for r in ranks], world_size=manifest.world_size if manifest is not None else None,
        out_of_memory=next((f"rank {r.rank}: {r.out_of_memory}" for r in ranks if r.out_of_memory), None),
        refused=next((f"rank {r.rank}: {r.refused}" for r in ranks if r.refused), None),
        failed=next((f"rank {r.rank} the script started died: {r.died}" if r.died else
                     f"rank {r.rank} the script started left no snapshot: {r.why_missing()}"
                     for r in ranks if r.died or r in missing), None))


def _ends_with_fit() -> None:
    """A run stops, as on fit's Ctrl-C, once the process that started it (fit, whatif) has ended, SIGKILL
    included (stopping.ending_with): its parent is the forkserver, which outlived a killed fit, and the run,
    the script's processes and the forkserver ran on, orphaned, to the script's end."""
    import multiprocessing

    from memdiff.recording.stopping import ending_with

    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        ending_with(parent.pid)


def child(conn: Any, gpu: str, target: List[str], snapshot: str, log: str, max_entries: int, rules: Sequence[Any],
          change: Optional[Sequence[Tuple[str, Optional[str]]]] = None, knob: Optional[str] = None) -> None:
    """The forked process's entry: run, its output in `log`, send the outcome's dict back, close. With `knob`
    (fit's), a job the script's Lightning launcher starts that fit runs as its picked ranks runs so."""
    import multiprocessing
    import time

    from memdiff.recording.fit_lightning import SplitJob
    from memdiff.recording.stopping import a_run_fit_stops

    try:
        _output_to(log)
        # A SIGTERM to fit's whole process group (a CI runner's cancel, `timeout`) stops the run as fit's
        # Ctrl-C does, writing what it recorded: the forkserver left it SIGTERM's default, death unwritten.
        a_run_fit_stops()
        _ends_with_fit()
        # The forkserver made this process its children's default start method: a script's DataLoader
        # workers would then start afresh, without the emulator, and re-run the script from its top. A fresh
        # `python train.py` has the platform's default (fork on Linux), which forks them from the run.
        multiprocessing.set_start_method(None, force=True)
        started = time.monotonic()
        try:
            outcome = run_emulated(gpu, target, snapshot, log, max_entries, rules, change, knob)
        except SplitJob as job:
            outcome = _run_split(job, gpu, target, snapshot, log, max_entries, rules, started)
        conn.send(outcome.to_dict())
    except KeyboardInterrupt:
        # The parent stops a run it no longer needs with SIGINT (fit's boundary found, a what-if failed): one
        # that lands before the script starts is no failure of memdiff's to report.
        pass
    except BaseException as exc:  # memdiff's own failure in the child: said to the parent, never lost
        import traceback

        traceback.print_exc()
        conn.send({"internal_error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _run_split(job: Any, gpu: str, target: List[str], snapshot: str, log: str, max_entries: int,
               rules: Sequence[Any], started: float) -> RunOutcome:
    """The job `job` (fit_lightning.SplitJob: what fit's run of `target`, begun at `started`, read where its
    Lightning launcher would start the ranks; that run's snapshot `snapshot` is no rank's and is removed)
    run as `memdiff record --emulate GPU --ranks auto` runs it, into the folder beside it (`runs/l4-nodes2/`,
    as a torchrun job's); its time and CPU seconds count the first run's."""
    import time
    from dataclasses import replace

    from memdiff.recording.fit_lightning import known

    if os.path.exists(snapshot):
        os.unlink(snapshot)
    first = resource.getrusage(resource.RUSAGE_SELF)
    folder = snapshot[:-len(".pickle")] if snapshot.endswith(".pickle") else snapshot + ".ranks"
    print(f"memdiff: fit: {job}, as `memdiff record --ranks auto` runs it", file=sys.stderr, flush=True)
    outcome = run_launched(gpu, [sys.executable, *target], folder, log, max_entries, rules, picked=True,
                           env=known(job))
    return replace(outcome, folder=folder, seconds=time.monotonic() - started,
                   cpu_seconds=outcome.cpu_seconds + first.ru_utime + first.ru_stime)


def run_launched(gpu: str, command: List[str], folder: str, log: str, max_entries: int,
                 rules: Sequence[Any], picked: bool = False, env: Optional[Dict[str, str]] = None) -> RunOutcome:
    """Run a launched job (`torchrun --nproc-per-node 4 train.py`) as `memdiff record --emulate GPU -o
    folder/ -- COMMAND` runs it, every rank on its own emulated `gpu` (with `picked`, only the ranks
    `--ranks auto` picks, each alone), and judge it by the ranks that ran: out of memory when any rank's
    emulator raised the error (the rank's status says so, even when the script caught it), refused when
    any rank's op was; its peaks are the rank's with the largest reserved peak. `env` is added to the
    environment `memdiff record` runs in."""
    import json
    import subprocess
    import time

    from memdiff.recording.manifest import MANIFEST, NOT_EMULATED
    from memdiff.recording.stopping import dying_with_us

    started = time.monotonic()
    with open(log, "a", encoding="utf-8") as out:  # launched_child made it
        process = subprocess.Popen([sys.executable, "-m", "memdiff", "record", "--emulate", gpu, "--max-entries",
                                    str(max_entries), *(["--ranks", "auto"] if picked else []), "-o",
                                    folder.rstrip(os.sep) + os.sep, "--", *command],
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **env} if env else None,
                                   preexec_fn=dying_with_us())  # a run killed after STOP_S stops it too
        returncode = _wait_passing_interrupt(process)
    seconds = time.monotonic() - started
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the job's processes, this forked child's only
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {}
    ranks = [r for r in manifest.get("ranks", []) if r.get("state") != NOT_EMULATED]
    oom = next((r["out_of_memory"] for r in ranks if r.get("out_of_memory")), None)
    refused = next((f"rank {r['rank']}: {r['refused']}" for r in ranks if r.get("refused")), None)
    facts: Dict[str, Any] = {}
    for r in ranks:
        path = os.path.join(folder, r.get("file") or "")
        if r.get("file") and os.path.isfile(path):
            rank_facts = _summary_facts(path, rules)
            if rank_facts and (rank_facts["reserved_peak_bytes"] or 0) >= facts.get("reserved_peak_bytes", -1):
                facts = {**rank_facts, "site": f"rank {r['rank']}: {rank_facts['site']}"}
    status = returncode
    ended = OOM if oom is not None else FITS if status == 0 and ranks else FAILED
    return RunOutcome(status=ended, exit_status=status, oom_message=oom, refused=refused,
                      peak_bytes=facts.get("peak_bytes"), reserved_peak_bytes=facts.get("reserved_peak_bytes"),
                      phase=facts.get("phase"), step=facts.get("step"), site=facts.get("site"), seconds=seconds,
                      cpu_seconds=used.ru_utime + used.ru_stime, ranks_run=manifest.get("emulated_ranks"),
                      world_size=manifest.get("world_size") if picked else None,
                      ranks_how=ONE_PER_ROLE if picked else None)


def launched_child(conn: Any, gpu: str, command: List[str], folder: str, log: str, max_entries: int,
                   rules: Sequence[Any], picked: bool = False) -> None:
    """The forked process's entry for a launched job: run it, its output in `log`, send the outcome's dict
    back, close."""
    from memdiff.recording.stopping import a_run_fit_stops

    try:
        _output_to(log)
        a_run_fit_stops()  # as `child`: its record is stopped as on fit's Ctrl-C
        _ends_with_fit()
        conn.send(run_launched(gpu, command, folder, log, max_entries, rules, picked).to_dict())
    except KeyboardInterrupt:  # the parent stops a job it no longer needs, as `child`
        pass
    except BaseException as exc:  # memdiff's own failure in the child: said to the parent, never lost
        conn.send({"internal_error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def log_tail(log: str) -> str:
    """The last lines of a run's output (`log`), joined on one line."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return " | ".join(lines[-LOG_TAIL_LINES:]) or "(no output)"


def checked(command: str, where: str, sent: Optional[Dict[str, Any]], exitcode: Optional[int],
            log: str, hint: str = "") -> Dict[str, Any]:
    """What a run sent (`child`), or why it is no answer: one line (InputError, `command`'s) when the run
    ended without a report, the emulator refused an op or the script failed for another reason than memory
    (`hint`, a clause the caller knows, said before the output's tail); RuntimeError for memdiff's own
    failure in the run."""
    from memdiff.errors import InputError, clip

    if sent is None:
        raise InputError(command, f"the run {where} ended without a report (exit {exitcode}); its output "
                                  f"({log}): {clip(log_tail(log), 1500)}")
    if "internal_error" in sent:
        raise RuntimeError(f"memdiff {command}'s run {where}: {sent['internal_error']}")
    if sent["refused"]:
        raise InputError(command, f"the emulator cannot run the script ({where}): {sent['refused']}")
    if sent["status"] == FAILED and sent.get("failure"):
        # The error and the script's line first, as the emulator's refusals read; the traceback is in the log.
        raise InputError(command, f"the script failed {where}: {clip(sent['failure'], 500)} (exit "
                                  f"{sent['exit_status']}, not out of memory); {hint}its output: {log}")
    if sent["status"] == FAILED:
        raise InputError(command, f"the script failed {where} (exit {sent['exit_status']}), not out of memory; "
                                  f"{hint}its output ({log}): {clip(log_tail(log), 1500)}")
    return sent


class _Started(Protocol):
    """A run started in a process of its own, which reports on `conn` (fit's and whatif's)."""

    process: Any
    conn: Any


R = TypeVar("R", bound=_Started)


def finished(running: Sequence[R]) -> List[Tuple[R, Optional[Dict[str, Any]]]]:
    """Wait until one or more of `running` (each with its `process` and the `conn` it reports on) ends;
    each that did, joined, with what it sent (None: nothing, it died first)."""
    from multiprocessing.connection import wait

    ready = wait([r.process.sentinel for r in running] + [r.conn for r in running])
    out: List[Tuple[R, Optional[Dict[str, Any]]]] = []
    for r in running:
        process, conn = r.process, r.conn
        if process.sentinel in ready or conn in ready:
            sent: Optional[Dict[str, Any]] = None
            try:
                sent = conn.recv()
            except EOFError:
                pass
            process.join()
            out.append((r, sent))
    return out


def _wait_passing_interrupt(process: Any) -> int:
    """Wait for `memdiff record`'s process and give its exit status. Interrupted (fit's `stop`: a value
    it no longer needs), pass the Ctrl-C on, as a terminal would, so that record stops the job's
    launcher and ranks and writes what they recorded; only one that does not end within half of STOP_S
    (the rest is this process's own) is killed. subprocess.run killed it at once, and the launcher and
    its ranks, whose parent it was, ran on, orphaned, to their end."""
    import signal
    import subprocess

    try:
        return int(process.wait())
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_S / 2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise


def stop(processes: Sequence[Any]) -> None:
    """Interrupt the runs still going as Ctrl-C interrupts `memdiff record`, which writes what each
    recorded; only one that does not end within STOP_S is killed."""
    import signal

    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGINT)
    for process in processes:
        process.join(STOP_S)
        if process.is_alive():
            process.kill()
            process.join()
