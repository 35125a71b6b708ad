"""`memdiff record -o run.pickle -- python train.py ARGS`: run a script with memory recording on."""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import os
import runpy
import shutil
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any, Dict, Iterator, List, Optional, Tuple

import memdiff
from memdiff.atomic import check_folder, check_output, commit, temporary_name
from memdiff.commands.args import count_arg
from memdiff.compare.baseline import stem
from memdiff.errors import EXIT_BAD_INPUT, InputError
from memdiff.inert import shell, text
from memdiff.read.job import MAX_RANKS, ranges, rank_of, rank_patterns
from memdiff.read.load import decode
from memdiff.recording.capture import (
    STACKS,
    StepWindow,
    parse_steps,
    record,
    recorded_nothing,
    sigint_held,
    unreached_told,
)
from memdiff.recording.dask_ranks import cluster
from memdiff.recording.emulate.allocator import AllocatorConfig
from memdiff.recording.emulate.devices import GPUS
from memdiff.recording.emulate.escapes import escaped, failure_line
from memdiff.recording.emulate.gpus import gpu
from memdiff.recording.emulate.gpus import names as gpu_names
from memdiff.recording.emulate.overlay_calls import OWNED, ROOT, for_run
from memdiff.recording.emulate.swap import environment
from memdiff.recording.launch import PYTHON, STARTED_BY, Launch, parse_ranks
from memdiff.recording.launch_lightning import SCRIPTS, probe
from memdiff.recording.launchers import read_launch, runs_a_script
from memdiff.recording.lightning_stop import patched_here, stop_started_ranks
from memdiff.recording.manifest import (
    COLLECTIVES,
    MANIFEST,
    NOT_STARTED,
    JobManifest,
    ProcessRecord,
    RankRecording,
    claimed,
    clear_claims,
    clear_statuses,
    collect,
    collect_processes,
    job_folders,
    write_manifest,
)
from memdiff.recording.pick import Picked
from memdiff.recording.some_ranks import (
    Lost,
    SomeRanks,
    auto_ranks,
    dask_runner,
    exit_status,
    listed_ranks,
    local_runner,
)
from memdiff.recording.stopping import STOPPING, dying_with_us, wanted
from memdiff.recording.stopping import exit_status as stopped_status
from memdiff.units import format_bytes

# The most ranks --ranks runs at once on this machine, each a process holding torch and its emulated
# GPU's bookkeeping (about 0.3 GB each, docs/jobs.md): more is a job for --dask.
LOCAL_RANKS = 64


DESCRIPTION = ("Run a script (`-- python train.py ARGS` or `-- python -m pkg.module ARGS`) in this "
               "process with memory recording on: CUDA's allocator history when a GPU is present, "
               "else PyTorch's profiler. The snapshot is written even when the script fails. With "
               "-o DIR/, run any launcher (`-- torchrun --nproc-per-node 4 train.py`) and record every rank "
               "into DIR/rank{RANK}.pickle. Exits with the script's status, 3 included (memdiff's own internal "
               "errors say `memdiff: internal error`); Ctrl-C stops the script, writes the snapshot and exits 130 "
               "(SIGTERM 143, SIGHUP 129), stopping every process it started.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("-o", "--output", required=True, metavar="FILE|DIR/",
                   help="snapshot file to write; or a folder (ending in /, or existing): the command runs as a "
                        "child and every Python process it starts that imports torch writes DIR/rank{RANK}.pickle "
                        "(pid{PID}.pickle without RANK) at exit, so `-- torchrun ... train.py` records each rank")
    p.add_argument("--max-entries", type=count_arg, default=1_000_000, metavar="N",
                   help="CUDA ring buffer size in trace entries (default: 1000000)")
    p.add_argument("--stacks", choices=STACKS, default="all",
                   help="CUDA stacks: all (the default: C++ frames name autograd nodes) or python "
                        "(when the C++ unwinder crashes)")
    p.add_argument("--steps", type=steps_arg, metavar="START:STOP",
                   help="record only these optimizer steps, counted from 0 with STOP left out (3:5: the 4th and "
                        "5th optimizer.step() and the forward and backward before each): recording starts once "
                        "START steps have run and the file is written once STOP have, so a long job gives a small "
                        "file. Steps are counted by torch's global optimizer step hook, in every process with -o DIR/")
    p.add_argument("--repeat", type=count_arg, default=1, metavar="N",
                   help="run the script N times, each in a fresh process, writing FILE's stem -1, -2, ... "
                        "(runs/train.pickle: runs/train-1.pickle ...): repeats for `memdiff baseline RUN1 RUN2 ...`, "
                        "which gates with their measured spread")
    p.add_argument("--emulate", metavar="GPU", type=emulate_arg,
                   help="run the CUDA script with no GPU and write the snapshot GPU would record (one of "
                        f"{', '.join(gpu_names())}): its cuda tensors have shapes and no data, torch.cuda answers "
                        "as that GPU, kernels and the caching allocator as it allocates (docs/emulate.md)")
    p.add_argument("--gpus", type=count_arg, metavar="N",
                   help="with --emulate: the GPUs each process sees (torch.cuda.device_count()), for a script that "
                        "starts its own ranks (torch.multiprocessing.spawn) or runs nn.DataParallel; without it, the "
                        "devices CUDA_VISIBLE_DEVICES lists, else a launcher's processes per node (LOCAL_WORLD_SIZE, "
                        "spawn's nprocs), else as many as the script asks for (Lightning's devices=N), at least 1")
    p.add_argument("--keep-writes", metavar="DIR",
                   help="with --emulate: keep what the run wrote in DIR (a new or empty folder) to look at. An "
                        "emulated run never changes the user's files: all it writes, renames or deletes lands in an "
                        "overlay the run reads back (DIR/upper/<absolute path>), removed after the run without this "
                        "(docs/emulate.md, 'Your files')")
    p.add_argument("--ranks", metavar="LIST|all|auto",
                   help="with --emulate and -o DIR/ around a torchrun, `accelerate launch` or `deepspeed` command, "
                        "or `python train.py` whose Lightning Trainer or Fabric starts its own ranks (run once first, "
                        "up to its launcher, to read the job's size): run only these ranks of the job it describes "
                        "(0,63 or 0-7,63; all: every rank), each alone in its own process with the environment its "
                        "launcher gives it: any rank of a job of hundreds of GPUs from one CPU, at most "
                        f"{LOCAL_RANKS} at once without --dask. "
                        "auto: rank 0 first (the last rank beside it), then one rank per role of the layout its "
                        "script built (the last rank, "
                        "the last coordinate of each mesh dimension whose shards are uneven or not known to be even, "
                        "each pipeline stage's first rank; in a job of several nodes the first node's last rank "
                        "and the last node's first), each named with why (docs/jobs.md)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="with --emulate and --ranks: run each rank as a task on this existing Dask scheduler "
                        "(tcp://host:8786; needs memdiff[dask]), as many at once as its workers have threads; the "
                        "workers must see the script, the output folder and memdiff's Python at the same paths (a "
                        "shared filesystem). Rank 0 runs first; each rank hears only from the ranks that ended "
                        "before it, so none waits for another (docs/jobs.md)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python SCRIPT ARGS | -- python -m MODULE ARGS "
                        "| with -o DIR/, any launcher: -- torchrun ...")


def emulate_arg(text: str) -> str:
    """argparse type for --emulate: a GPU memdiff knows."""
    try:
        return gpu(text).key
    except InputError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def steps_arg(text: str) -> StepWindow:
    """argparse type for a window of optimizer steps."""
    try:
        return parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _target(command: List[str]) -> List[str]:
    """The script or module to run, checked before anything is recorded (a typo must not cost a
    training run, nor replace a snapshot with a recording of nothing)."""
    if command and command[0] == "--":
        command = command[1:]
    if command and PYTHON.match(os.path.basename(command[0])):
        command = command[1:]
        if command[:1] == ["-u"]:  # unbuffered, as launchers run their ranks
            command = command[1:]
    elif command and not command[0].endswith(".py") and command[0] != "-m":
        raise InputError("record", f"`{command[0]}` is not python: memdiff records a Python script in this "
                                   f"process (`-- python train.py ARGS` or `-- python -m MODULE ARGS`); to "
                                   f"record every process a launcher starts, give a folder: -o runs/")
    if not command or (command[0] == "-m" and len(command) < 2):
        raise InputError("record", "nothing to run: give `-- python SCRIPT ARGS` or `-- python -m MODULE ARGS`")
    if command[0] == "-c":
        raise InputError("record", "`python -c` is not supported: put the code in a file and give its path")
    if command[0] == "-m":
        sys.path.insert(0, os.getcwd())
        try:
            found = _module_found(command[1])
        finally:
            sys.path.pop(0)
        if not found:
            raise InputError(command[1], "no such module (run from the folder it is importable from)")
    elif os.path.isdir(command[0]):  # it was 'no such script', of a folder that is there
        raise InputError(command[0], "is a folder, not a script: give the script's path, or `-- python -m MODULE`")
    elif not os.path.isfile(command[0]):
        raise InputError(command[0], "no such script")
    return command


def _module_found(name: str) -> bool:
    """Whether module `name` is there to run, found without running any of it. importlib's find_spec
    of `pkg.mod` imports `pkg` first, in memdiff's process and with memdiff's sys.argv: a package that
    reads sys.argv at import (torchtitan's) would exit on memdiff's options, and one whose dependency is
    missing would read as missing itself. Each package's folders are searched instead; what the
    package's own code fails on is seen when it runs, as python shows it."""
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: no package of it is imported
    except (ImportError, ValueError):
        return False
    for depth in range(1, len(parts)):
        folders = spec.submodule_search_locations if spec is not None else None
        if not folders:  # not a package: it has no submodules
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth + 1]), list(folders))
    return spec is not None


def _run_target(target: List[str], emulated: bool = False, failed: Optional[List[str]] = None) -> int:
    """Run the script or module as `python` would; its exit status. Under emulation, an exception
    that came from a call around the emulator to CUDA itself is the emulator's refusal (one line,
    exit 2), not the script's failure. An exception of the script's own is put in `failed` too, in one
    line (escapes.failure_line), for a caller that reports it (fit's and whatif's runs)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        return 0
    except InputError:  # the emulator refusing an op: one line, exit 2, not the script's traceback
        raise
    except KeyboardInterrupt:
        # past a Lightning launcher's own handling of it (Fabric has none): the ranks it started from this
        # process stop too, each writing its snapshot, rather than train on while this process waits for them
        stop_started_ranks()
        raise
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except Exception as exc:  # the user's program failed: show its traceback as python would
        refusal = escaped(exc) if emulated else None
        if refusal is not None:
            raise refusal from None
        traceback.print_exc()
        if failed is not None:
            failed.append(failure_line(exc))
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _say(line: str) -> None:
    print(f"memdiff: emulation: {line}", file=sys.stderr)


def _overlay(args: argparse.Namespace, owned: List[str], near: str, script: Optional[str]) -> Any:
    """Under --emulate, the run's overlay (overlay_calls.for_run) over the user's working folder and the
    script's; else nothing."""
    if not args.emulate:
        return contextlib.nullcontext()
    folders = [os.getcwd()] + ([os.path.dirname(os.path.abspath(script))] if script else [])
    return for_run(owned, args.keep_writes, near, folders, _say)


def _script(command: List[str]) -> Optional[str]:
    """The script a command runs (`python train.py`, `torchrun ... train.py`), if it names one."""
    return next((c for c in command if c.endswith(".py") and os.path.isfile(c)), None)


def is_folder(output: str) -> bool:
    """Whether `-o` names a folder (one snapshot per process) rather than one snapshot file."""
    return output.endswith(("/", os.sep)) or os.path.isdir(output)


def _launched(command: List[str], run: bool = True) -> List[str]:
    """The command to run in a child process, checked before anything runs; with `run` False, a
    launcher's command that is read, not run (--ranks), which need not be installed here."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InputError("record", "nothing to run: give `-- torchrun ... train.py` or `-- python train.py ARGS`")
    if PYTHON.match(os.path.basename(command[0])):
        _target(command)  # the script or module must be there
        return command
    if run and shutil.which(command[0]) is None:
        raise InputError(command[0], "no such command (not on PATH)")
    return command


class _Forwarding:
    """Ctrl-C, SIGTERM and SIGHUP passed on to the job (a CI runner cancelling it signals memdiff, not the
    launcher; a closed terminal hangs memdiff up), from before the job starts until it has ended. A
    signal memdiff was started ignoring (SIGHUP under `nohup`) is not handled: the job inherits it ignored.

    The handler is in place before the child is started: a signal that comes while it starts is
    passed on once it exists, never lost. And the child starts with both signals at their defaults
    (exec resets a handled signal, where an ignored one would stay ignored: memdiff started in the
    background by a shell script inherits SIGINT ignored, and a job that ignored the Ctrl-C memdiff
    passes on would run to its end)."""

    def __init__(self) -> None:
        self.received: List[int] = []
        self.children: "List[subprocess.Popen[bytes]]" = []  # the launcher, or each rank run alone (--ranks)
        self._pending: List[int] = []
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "_Forwarding":
        for s in STOPPING:
            if wanted(s):
                self._previous[s] = signal.signal(s, self._forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _forward(self, signum: int, _frame: Any) -> None:
        self.received.append(signum)
        self._pending.append(signum)  # for a child still being started: passed on once it exists
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def started(self, child: "subprocess.Popen[bytes]") -> None:
        """A child exists: pass on what came while it started, then each signal as it comes.
        (A handler runs between two of this thread's bytecodes, so each signal goes once.)"""
        self.children.append(child)
        for signum in self._pending:
            if child.poll() is None:
                child.send_signal(signum)


@dataclass(frozen=True)
class _JobOutcome:
    """What a recorded launch left in its folder."""

    written: List[str]  # snapshot files this run wrote
    lost: List[str]  # one line per rank that left no snapshot, saying why
    refused: List[int]  # under --emulate: the ranks the emulator stopped at an op it cannot run
    died: List[str]  # one line per rank or other process that failed (an exception, a failing exit), with its error
    processes: List[ProcessRecord]  # what each process that is no rank said of itself


def _report_jobs(args: argparse.Namespace, folder: str, before: Dict[str, Dict[str, int]],
                 status: int, emulated: Optional[List[int]], picked: Optional[List[Picked]],
                 lost: Optional[Lost] = None) -> _JobOutcome:
    """_report_job for the job of `folder` and each later job the command ran with the same ranks (a
    script that trains, then evaluates, each under torchrun: DIR/job2/, ...), their outcomes together.
    `lost`: ranks run on Dask whose end was not waited for, marked in the job's manifest."""
    jobs = [here for here in job_folders(folder) if here == folder or claimed(here)]
    shown = [args.output] + [os.path.join(args.output, os.path.basename(here), "") for here in jobs[1:]]
    if len(jobs) > 1:
        print(f"memdiff: the command ran {len(jobs)} jobs with the same ranks; each job's snapshots are in a "
              f"folder of its own: {', '.join(shown)}", file=sys.stderr)
    outcomes = []
    for here, name in zip(jobs, shown):
        outcomes.append(_report_job(here, before.get(here, {}), status, name, emulated, picked,
                                    lost if here == folder else None))
        clear_claims(here)
    return _JobOutcome(*(sum((getattr(o, f.name) for o in outcomes), []) for f in fields(_JobOutcome)))


def _report_job(folder: str, before: Dict[str, int], status: int, shown: str,
                emulated: Optional[List[int]], picked: Optional[List[Picked]],
                unwaited: Optional[Lost] = None) -> _JobOutcome:
    """Gather the ranks' statuses into the job's manifest (with how the command ended) and say what
    the run wrote; `shown`: the folder as the user named it; `emulated`: the ranks run, when only some
    were (--ranks); `picked`: why each, when --ranks auto picked them; `unwaited`: the ranks whose end was
    not waited for, `not finished` unless they wrote their snapshot (a manifest even when none of them
    had started: they are never silently absent)."""
    manifest = collect(folder)
    if manifest is None and unwaited and unwaited.ranks:
        manifest = JobManifest(unwaited.world_size, [RankRecording(r, NOT_STARTED)
                                                     for r in range(unwaited.world_size)])
    if manifest is not None:
        why = [(p.rank, p.why) for p in picked] if picked is not None else None
        manifest = replace(manifest if emulated is None else manifest.only(emulated, why), exit_status=status)
        if unwaited and unwaited.ranks:
            manifest = manifest.unfinished(unwaited.ranks, folder)
        write_manifest(folder, manifest)
    names = [n for n in os.listdir(folder)
             if n.endswith(".pickle") and not n.startswith(".") and os.path.isfile(os.path.join(folder, n))]
    written = sorted((n for n in names if os.stat(os.path.join(folder, n)).st_mtime_ns != before.get(n)),
                     key=_by_rank)
    stale = sorted((n for n in names if n in before and n not in written), key=_by_rank)
    if written:
        sizes = ", ".join(f"{n} {format_bytes(os.path.getsize(os.path.join(folder, n)))}" for n in written)
        job = f" of a job of {manifest.world_size:,} rank{'s' if manifest.world_size != 1 else ''}" if manifest else ""
        if manifest is not None and manifest.emulated is not None:
            how = "its first node's, as its Lightning launcher starts them" if manifest.first_node else "each run alone"
            job += f" (rank{'s' if len(manifest.emulated) != 1 else ''} {ranges(manifest.emulated)}, {how})"
        # A job is read with `ranks`; files of processes without RANK are read one by one.
        read = (f"memdiff ranks {shell(shown)}" if manifest
                else f"memdiff peak {shell(os.path.join(shown, written[0]))}")
        print(f"memdiff: wrote {len(written)} snapshot{'s' if len(written) != 1 else ''}{job} to {shown} "
              f"({sizes}); read {'them' if manifest else 'one'} with `{read}`", file=sys.stderr)
    if stale:
        print(f"memdiff: {shown}: {', '.join(stale)} not from this run"
              + (f": not read as this job's ({MANIFEST} says {manifest.world_size} rank"
                 f"{'s' if manifest.world_size != 1 else ''})" if manifest else ""), file=sys.stderr)
    lost = ([f"rank {r.rank} of {manifest.world_size} has no snapshot: {r.why_missing()}"
             for r in manifest.missing(folder)] if manifest is not None else [])
    refused = [r.rank for r in manifest.ranks if r.refused] if manifest is not None else []
    died = ([f"rank {r.rank} of {manifest.world_size} died: {r.died}" for r in manifest.ranks
             if r.died and not r.refused] if manifest is not None else [])
    processes = collect_processes(folder)
    # A process that is no rank (a Hogwild worker, a spawned helper) and died is as much the job's
    # failure: the script may not look at its workers' exit codes, memdiff does.
    died += [f"process {p.pid} (`{p.command}`) died: {p.died}" for p in processes if p.died]
    return _JobOutcome(written, lost, refused, died, processes)


def _why_nothing(outcome: _JobOutcome) -> str:
    """Why no process wrote a snapshot, from what each one said of itself (never a guess)."""
    if not outcome.processes:
        return ("no Python process ran memdiff's hook (the command started none, or started it without "
                "memdiff's sitecustomize: an environment without its PYTHONPATH, python -I, -E or -S)")
    said = [f"process {p.pid} (`{p.command}`) {p.why_nothing()}" for p in outcome.processes[:3]]
    if len(outcome.processes) > 3:
        said.append(f"{len(outcome.processes) - 3} more processes likewise")
    said += [f"process {p.pid} started {child}" for p in outcome.processes for child in p.started_without_hook]
    return "; ".join(said)


def _by_rank(name: str) -> Tuple[int, str]:
    """Rank files in rank order (rank10 after rank9), by the names jobs are read by; others last."""
    rank = rank_of(name, RANK_NAMES)
    return (rank if rank is not None else MAX_RANKS, name)


RANK_NAMES = rank_patterns(None)


def _hook_env(args: argparse.Namespace, folder: str) -> Dict[str, Optional[str]]:
    """The environment every Python process started from here needs to run memdiff's rank hook and
    record into `folder` (None: a name removed from it)."""
    hook = str(resources.files("memdiff.recording").joinpath("rank_hook"))
    return {"MEMDIFF_RECORD_DIR": folder, "MEMDIFF_RECORD_MAX_ENTRIES": str(args.max_entries),
            "MEMDIFF_RECORD_STACKS": args.stacks, "MEMDIFF_RECORD_STEPS": str(args.steps or ""),
            "MEMDIFF_PACKAGE_PARENT": os.path.dirname(os.path.dirname(os.path.abspath(memdiff.__file__))),
            "PYTHONPATH": os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH")) if p),
            # every process that imports torch runs on the emulated GPU (docs/emulate.md)
            "MEMDIFF_RECORD_EMULATE": args.emulate or None,
            # each process sees this many emulated GPUs, whatever its launcher says
            GPUS: str(args.gpus) if args.gpus is not None else None,
            "MEMDIFF_RECORD_RANK_PID": None}  # set by each rank for its own children, never inherited from us


@contextlib.contextmanager
def _children_emulated(args: argparse.Namespace, folder: Optional[str]) -> Iterator[Optional[str]]:
    """Under --emulate with -o FILE: every Python process the script starts (torch.multiprocessing's
    spawned ranks, a subprocess) runs on the emulated GPU inside the run's overlay too, recorded into
    `<overlay>/processes`, the folder yielded; never on the machine's own torch, free to write the
    user's files. Else nothing (None)."""
    if not args.emulate or folder is None:
        yield None
        return
    processes = os.path.join(folder, "processes")
    os.makedirs(processes, exist_ok=True)
    # this process runs the script and is no process of a job (exchange.py): only what it starts is; it is
    # rank 0 of a Lightning launcher's job, which the hook that stops the other ranks writing is not loaded into
    with environment({**_hook_env(args, processes), STARTED_BY: str(os.getpid())}), patched_here(SCRIPTS):
        yield processes


def _children_said(processes: Optional[str], output: str) -> Optional[str]:
    """The line that says which processes the script started used the emulated GPU, whose memory the
    snapshot of this process does not hold; None when none did."""
    if processes is None:
        return None
    names = sorted((stem(n) for n in os.listdir(processes) if n.endswith(".pickle") and not n.startswith(".")),
                   key=_by_rank)
    if not names:
        return None
    return (f"the script started {len(names)} process{'es' if len(names) != 1 else ''} that used the emulated GPU "
            f"({', '.join(names)}); {output} holds the script's own process only: record with -o DIR/ for a "
            f"snapshot of each")


@dataclass(frozen=True)
class _ScriptRanks:
    """What --ranks asks of a script that starts its own ranks (Lightning's launcher), whose job is known
    once it has run up to its launcher (_script_launch)."""

    asked: str


def _some_ranks(args: argparse.Namespace, command: List[str]) -> "SomeRanks | _ScriptRanks | None":
    """What --ranks asks to run, checked before anything runs; None without it."""
    if args.ranks is None:
        return None
    if not args.emulate:
        raise InputError("--ranks", "runs ranks of a job each alone, which only an emulated rank can (its "
                                    "collectives wait for no one): give it with --emulate GPU")
    asked = args.ranks.strip()
    if asked not in ("auto", "all"):
        parse_ranks(asked)  # a bad list is one line now, before the script runs
    if runs_a_script(command):  # _launched checked that the script is there
        return _ScriptRanks(asked)
    launch = read_launch(command)
    if PYTHON.match(os.path.basename(launch.target[0])):
        _target(launch.target)  # what each rank runs must be there: no launcher of ours starts and finds out
    return _sized(args, launch, asked)


def _sized(args: argparse.Namespace, launch: Launch, asked: str) -> SomeRanks:
    """The ranks `asked` (auto, all, or a list) of the job `launch`; InputError where one is not the job's,
    or they are more than this machine runs at once without --dask."""
    auto = asked == "auto"
    ranks = [0] if auto else [] if asked == "all" else parse_ranks(asked)
    beyond = [r for r in ranks if r >= launch.world_size]
    if beyond:
        raise InputError("--ranks", f"the job has {launch.world_size:,} ranks ({launch.nnodes} node(s) of "
                                    f"{launch.nproc_per_node}): no rank {beyond[0]}")
    if asked == "all":
        ranks = list(range(launch.world_size))
    if len(ranks) > LOCAL_RANKS and not args.dask:
        raise InputError("--ranks", f"{len(ranks):,} ranks are more than this machine runs at once (at most "
                                    f"{LOCAL_RANKS}, each a process of its own): give --dask ADDRESS to run them "
                                    f"as tasks on a Dask cluster, or fewer ranks")
    return SomeRanks(launch, ranks, auto)


def _script_launch(args: argparse.Namespace, forwarding: _Forwarding, env: Dict[str, str], command: List[str],
                   folder: str, asked: str) -> Tuple[Optional[SomeRanks], int]:
    """The ranks `asked` of the job a script starts from inside itself (Lightning's launcher), read by
    running it once up to its launcher (launch_lightning.py); None and its exit status when that run
    failed or was interrupted."""
    launch, status = probe(command, env, folder, forwarding.started, lambda: bool(forwarding.received))
    if launch is None:
        return None, 130 if forwarding.received else status
    some = _sized(args, launch, asked)
    print(f"memdiff: --ranks: its Lightning launcher starts a job of {launch.world_size:,} ranks "
          f"({launch.nnodes} node(s) of {launch.nproc_per_node} devices)", file=sys.stderr)
    return some, 0


def _run_launcher(args: argparse.Namespace) -> int:
    """Run a launcher (or any command) with every Python process it starts recorded into the folder.

    Exit status: the command's; but a job with a rank that died is never a success (1 when the command
    itself succeeded), nor one whose ranks did not all leave a snapshot (2), and a run ended by Ctrl-C
    is 130."""
    check_folder(args.output)
    command = _launched(args.command, run=args.ranks is None)
    if args.emulate:  # each rank's emulator reads it: a bad setting is one line here, before any rank starts
        try:
            AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        except ValueError as exc:
            raise InputError("PYTORCH_CUDA_ALLOC_CONF", str(exc)) from None
    ranks = _some_ranks(args, command)
    client = cluster(args.dask) if args.dask else None  # reached before anything runs
    folder = os.path.abspath(args.output)
    os.makedirs(folder, exist_ok=True)
    clear_statuses(folder)
    collectives = os.path.join(folder, COLLECTIVES)  # what the ranks' collectives carried (exchange.py)
    shutil.rmtree(collectives, ignore_errors=True)
    before = {here: {n: os.stat(os.path.join(here, n)).st_mtime_ns for n in os.listdir(here)}
              for here in job_folders(folder)}
    env = {k: v for k, v in {**os.environ, **_hook_env(args, folder)}.items() if v is not None}
    picked: Optional[List[Picked]] = None
    codes: Dict[int, int] = {}
    lost: Optional[Lost] = None
    with contextlib.ExitStack() as holding:
        if client is not None:
            holding.enter_context(client)
        holding.enter_context(_overlay(args, [folder], folder, _script(command)))
        forwarding = holding.enter_context(_Forwarding())
        env.update((k, os.environ[k]) for k in (ROOT, OWNED) if k in os.environ)
        if ranks is None:
            # dying_with_us: a memdiff killed (SIGKILL) leaves no launcher running on, orphaned
            forwarding.started(subprocess.Popen(command, env=env, preexec_fn=dying_with_us()))
            codes = {-1: exit_status(forwarding.children[0].wait())}  # the launcher's, which is no rank
        else:
            if isinstance(ranks, _ScriptRanks):  # a script that starts its ranks itself: run it once to read its job
                sized, failed = _script_launch(args, forwarding, env, command, folder, ranks.asked)
                if sized is None:
                    return failed
                ranks = sized
            if client is not None:
                lost = Lost(ranks.launch.world_size)
                run = dask_runner(client, args.dask, forwarding, env, ranks, folder, lost)
            else:
                run = local_runner(forwarding, env, ranks)
            if ranks.auto:
                picked, codes = auto_ranks(run, forwarding, ranks, folder, beside=client is None)
            else:  # each named rank alone
                codes = listed_ranks(run, forwarding, ranks.ranks, staged=client is not None, folder=folder)
    shutil.rmtree(collectives, ignore_errors=True)
    interrupted = forwarding.received[0] if forwarding.received else None
    if interrupted is not None:  # Ctrl-C: 130, as a shell says; SIGTERM: 143
        status = 130 if interrupted == signal.SIGINT else 128 + interrupted
    else:  # the command's; of ranks run alone, the first rank's that failed
        status = next((code for code in codes.values() if code), 0)
    outcome = _report_jobs(args, folder, before, status, sorted(codes) if ranks is not None else None, picked, lost)
    for line in outcome.died + outcome.lost:
        print(f"memdiff: {line}", file=sys.stderr)
    if not outcome.written and not outcome.lost:
        print(f"memdiff: no process of `{' '.join(command)}` recorded an allocation: {_why_nothing(outcome)}; "
              f"nothing written to {args.output}", file=sys.stderr)
        return status or EXIT_BAD_INPUT
    if outcome.refused:  # each such rank said which op, in one line: the run is bad input, not a crash
        return EXIT_BAD_INPUT
    if outcome.died:  # the job failed, whatever its launcher said (Lightning's does not wait for its ranks)
        return status or 1
    return status or (EXIT_BAD_INPUT if outcome.lost else 0)


def repeat_paths(output: str, n: int) -> List[str]:
    """Where each of `n` repeats goes: `runs/train.pickle` -> `runs/train-1.pickle`, ... (the
    suffixes kept, as `stem` reads them)."""
    folder, name = os.path.split(output)
    base = stem(name)
    rest = name[len(base):]
    return [os.path.join(folder, f"{base}-{k}{rest}") for k in range(1, n + 1)]


def _run_repeats(args: argparse.Namespace) -> int:
    """Record the script `args.repeat` times, each in a process of its own (a second run in the
    same process would find modules imported and the allocator's pool warm: no repeat at all)."""
    if is_folder(args.output):
        raise InputError(args.output, "--repeat records one script to a file: give -o FILE (a job's ranks are "
                                      "repeats enough in themselves)")
    _target(args.command)  # checked before the first run
    paths = repeat_paths(args.output, args.repeat)
    for path in paths:
        check_output(path, in_place=False, make_folder=True)
    command = args.command[1:] if args.command and args.command[0] == "--" else args.command
    for k, path in enumerate(paths, 1):
        window = ["--steps", str(args.steps)] if args.steps else []
        emulate = ["--emulate", args.emulate] if args.emulate else []
        emulate += ["--gpus", str(args.gpus)] if args.gpus is not None else []
        # Ctrl-C, SIGTERM and SIGHUP passed on to the repeat's own `memdiff record`, which writes its snapshot
        # and stops: subprocess.run killed it on Ctrl-C (its snapshot lost), and SIGTERM ended this process
        # alone, the repeat running on, orphaned.
        with _Forwarding() as forwarding:
            forwarding.started(subprocess.Popen([sys.executable, "-m", "memdiff", "record", "-o", path,
                                                 "--max-entries", str(args.max_entries), "--stacks", args.stacks,
                                                 *window, *emulate, "--", *command],
                                                preexec_fn=dying_with_us()))
            returncode = exit_status(forwarding.children[0].wait())
        if returncode:
            print(f"memdiff: run {k} of {args.repeat} exited {returncode}: the repeats stop there",
                  file=sys.stderr)
            return returncode
    print(f"memdiff: recorded {args.repeat} repeats; make their baseline with `memdiff baseline "
          f"{' '.join(shell(p) for p in paths)} -o {shell(f'baselines/{stem(args.output)}.json')}`", file=sys.stderr)
    return 0


def _dask_asked(args: argparse.Namespace) -> None:
    """--dask runs an emulated job's ranks into a folder: InputError for anything else it is given with."""
    if not args.emulate:
        raise InputError("--dask", "runs the ranks of an emulated job as tasks on a Dask cluster: give it with "
                                   "--emulate GPU and --ranks all (or a list)")
    if args.ranks is None:
        raise InputError("--dask", "runs the ranks --ranks names as tasks on a Dask cluster: give --ranks all "
                                   "(or a list, or auto) with it")
    if args.repeat > 1 or not is_folder(args.output):
        raise InputError("--dask", "records each rank of a job into a folder: give -o DIR/ (and no --repeat)")


def run(args: argparse.Namespace) -> int:
    """Record the target and report where the snapshot went."""
    if args.gpus is not None and not args.emulate:
        raise InputError("--gpus", "sets how many GPUs the emulated job has: give it with --emulate GPU (a real "
                                   "run sees the GPUs the machine has)")
    if args.keep_writes is not None and not args.emulate:
        raise InputError("--keep-writes", "keeps what an emulated run wrote: give it with --emulate GPU (a real run "
                                          "writes the files themselves)")
    if args.dask is not None:
        _dask_asked(args)
    if args.ranks is not None and (not is_folder(args.output) or args.repeat > 1):
        # Into one file, or repeated, the script ran whole and --ranks went unread.
        raise InputError("--ranks", "runs some ranks of an emulated job, each into the job's folder: give it with "
                                    "--emulate GPU and -o DIR/ (and no --repeat)")
    if args.repeat > 1:
        return _run_repeats(args)
    if is_folder(args.output):
        return _run_launcher(args)
    target = _target(args.command)
    # Checked (and its folder made) before the script runs: a bad path must not cost the run.
    check_output(args.output, in_place=False, make_folder=True)
    partial = temporary_name(args.output)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started with Ctrl-C ignored (in the background of a shell script): it stops the script all
        # the same, as it stops a launched job (-o DIR/), and as the docs say.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupted = False
        refused: Optional[InputError] = None
        with contextlib.ExitStack() as holding:
            root = holding.enter_context(_overlay(args, [args.output, partial],
                                                  os.path.dirname(os.path.abspath(partial)),
                                                  target[0] if target[0] != "-m" else None))
            processes = holding.enter_context(_children_emulated(args, root))
            unreached = holding.enter_context(unreached_told())
            try:
                with record(partial, max_entries=args.max_entries, stacks=args.stacks, steps=args.steps,
                            emulate=args.emulate, gpus=args.gpus):
                    try:
                        status = _run_target(target, emulated=bool(args.emulate))
                    except KeyboardInterrupt as exc:  # Ctrl-C (SIGTERM, SIGHUP: stopping.py) ends the script,
                        interrupted, status = True, stopped_status(exc)  # not the recording: what it did is kept
                    except InputError as exc:  # the emulator refused an op: what ran until then is kept
                        refused, status = exc, EXIT_BAD_INPUT
                    finally:
                        # The script has ended: a Ctrl-C (or SIGTERM, SIGHUP) from here until the snapshot is in
                        # place (a second one, or the first after a natural end) must not lose it.
                        holding.enter_context(sigint_held([s for s in STOPPING if wanted(s)]))
            except KeyboardInterrupt as exc:
                # While recording started (nothing recorded yet), or in the instant between the script's
                # end and the hold above (the block's exit wrote the snapshot all the same).
                interrupted, status = True, stopped_status(exc)
            if not os.path.exists(partial):  # a window of steps the script never reached, or failed (it said so)
                # One line, the file first: an exit 2 reads as `memdiff: FILE: what is wrong`.
                print(f"memdiff: {args.output}: nothing written: {unreached[0]}" if unreached else
                      f"memdiff: nothing written to {args.output}", file=sys.stderr)
                return status or EXIT_BAD_INPUT
            if os.path.exists(args.output) and recorded_nothing(decode(partial)[0]):
                print(f"memdiff: the run recorded no allocation; kept the existing {args.output}", file=sys.stderr)
                return status
            commit(partial, args.output)
            children = _children_said(processes, args.output)
            if children is not None:
                _say(children)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    notes = [format_bytes(os.path.getsize(args.output))] + ([f"optimizer steps {args.steps}"] if args.steps else [])
    if refused is not None:
        notes.append("up to where the emulator stopped")
    elif status:  # so that a script's own exit 3 does not read as a memdiff bug
        notes.append("interrupted" if interrupted else f"the script exited {status}")
    print(f"memdiff: wrote {text(args.output)} ({'; '.join(notes)}); read it with `memdiff peak {shell(args.output)}`",
          file=sys.stderr)
    if refused is not None:
        raise refused
    return status
