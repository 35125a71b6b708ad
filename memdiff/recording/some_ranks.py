"""Some ranks of a launched job, each run alone (`memdiff record --emulate GPU -o DIR/ --ranks ...`): here, as
processes of this machine, or as tasks of a Dask cluster; the ranks a list names, or those `--ranks auto`
picks from the layout rank 0 built (pick.py).

Each rank starts as its launcher would have started it (launch.py), told which ranks run with it
(their collectives carry values: emulate/exchange.py). The command wires these runners (commands/record.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Protocol, Set, Tuple

from memdiff.recording.dask_ranks import RankTask, run_on_dask
from memdiff.recording.emulate.layout import LAYOUT
from memdiff.recording.launch import LIGHTNING, Launch, rank_env
from memdiff.recording.manifest import COLLECTIVES, clear_statuses
from memdiff.recording.pick import LAYOUT_FILE, Picked, pick, pipelines, read_layout
from memdiff.recording.stopping import dying_with_us
from memdiff.units import count_of


class Signals(Protocol):
    """The command's Ctrl-C and SIGTERM forwarding: what it received, and each child it must pass them on to."""

    received: List[int]

    def started(self, child: "subprocess.Popen[bytes]") -> None:
        """A child exists: signals are passed on to it from now."""


@dataclass(frozen=True)
class SomeRanks:
    """The ranks of a launched job that --ranks runs, each alone."""

    launch: Launch
    ranks: List[int]  # with --ranks auto: rank 0, run first; the others are picked once it has run
    auto: bool = False




@dataclass(frozen=True)
class RankStart:
    """Some ranks of the job started together, each alone (what a Runner is given)."""

    ranks: List[int]  # the ranks started, a process each
    running: List[int]  # the ranks that run with them: their collectives carry values (exchange.py)
    extra: Dict[int, Dict[str, str]] = field(default_factory=dict)  # added to a rank's environment
    # a rank whose output goes to PREFIX.stdout and PREFIX.stderr, not to the terminal (here, not on Dask)
    held: Dict[int, str] = field(default_factory=dict)
    # ranks that hear each other as they run (a pipeline's stages): on Dask one task, run side by side
    # (here every rank started runs beside the others anyway)
    teams: List[List[int]] = field(default_factory=list)


# What runs some ranks of the job, each alone: -> each rank's exit status, of the ranks it ran.
Runner = Callable[[RankStart], Dict[int, int]]


def rank_environment(env: Dict[str, str], some: SomeRanks, rank: int, running: List[int],
              extra: Dict[str, str]) -> Dict[str, str]:
    """The environment of `rank` started as its launcher would have started it (launch.py), told that
    the ranks `running` run (their collectives carry values), with `extra`."""
    launch = some.launch
    alone = {**env, **launch.env, **rank_env(launch, rank, running, port=29500), **extra}
    if launch.pythonpath:
        alone["PYTHONPATH"] = launch.path(env.get("PYTHONPATH", ""))
    # torchrun's own default for several ranks on a node; each of Lightning's ranks sets its own
    if launch.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ and launch.launcher != LIGHTNING:
        alone["OMP_NUM_THREADS"] = "1"
    return alone




def local_runner(forwarding: Signals, env: Dict[str, str], some: SomeRanks) -> Runner:
    """Ranks run here: each a process of this machine, all at once, then waited for."""
    def start(run: RankStart) -> Dict[int, int]:
        children = []
        for rank in run.ranks:
            environment = rank_environment(env, some, rank, run.running, run.extra.get(rank, {}))
            with contextlib.ExitStack() as files:  # the child keeps its own copies of them
                prefix = run.held.get(rank)
                out, err = (files.enter_context(open(prefix + suffix, "wb")) for suffix in (".stdout", ".stderr")) \
                    if prefix else (None, None)
                children.append(subprocess.Popen(some.launch.command(rank), env=environment, stdout=out, stderr=err,
                                                 preexec_fn=dying_with_us()))  # never orphaned: stopping.py
            forwarding.started(children[-1])
        return {rank: exit_status(child.wait()) for rank, child in zip(run.ranks, children)}
    return start


@dataclass
class Lost:
    """The ranks run on Dask whose end memdiff could not wait for (the scheduler, or their worker, was
    lost), each with why; the job's world size, for a manifest when none of them left a status."""

    world_size: int
    ranks: Dict[int, str] = field(default_factory=dict)


def dask_runner(client: Any, address: str, forwarding: Signals, env: Dict[str, str], some: SomeRanks,
                folder: str, lost: Lost) -> Runner:
    """Ranks run as tasks on a Dask cluster (dask_ranks.py). The cluster may run fewer tasks at once
    than there are ranks, so a rank that waited for another (exchange.py) could wait for one that
    starts only once it ends: each rank is told that only itself, the ranks of this run that already
    ended (exit 0) and the ranks of its team (run in its task) run with it. It hears what those sent,
    and waits only for its team. The ranks whose end was not waited for are put in `lost`."""
    ended_well: Set[int] = set()

    def start(run: RankStart) -> Dict[int, int]:
        ranks = run.ranks
        heard = set(run.running) & ended_well
        team_of = {rank: team for team in run.teams for rank in team}
        tasks = {rank: RankTask(rank, some.launch.command(rank),
                                rank_environment(env, some, rank, sorted(heard | {rank, *team_of.get(rank, ())}),
                                                 run.extra.get(rank, {})),
                                os.getcwd(), folder)
                 for rank in ranks}
        ended = run_on_dask(client, address, tasks, lambda: forwarding.received, run.teams)
        codes: Dict[int, int] = {}
        for rank in ranks:
            if rank not in ended:  # cancelled at a second Ctrl-C: run if its hook said it started
                if os.path.exists(os.path.join(folder, f".rank{rank}.status")):
                    codes[rank] = 128 + forwarding.received[0]
            else:
                status = ended[rank].status
                if status is not None:  # None: stopped before it started
                    codes[rank] = status
                why = ended[rank].lost
                if why:
                    lost.ranks[rank] = why
        failed = [(rank, ended[rank].failed) for rank in ranks if rank in ended and ended[rank].failed]
        if failed:
            more = f" (and {count_of(len(failed) - 1, 'more rank')} likewise)" if len(failed) > 1 else ""
            print(f"memdiff: --dask: rank {failed[0][0]} did not run: {failed[0][1]}{more}", file=sys.stderr)
        ended_well.update(rank for rank, code in codes.items() if code == 0)
        return codes
    return start


def exit_status(code: int) -> int:
    """A child's exit status as a shell says it: 128 + N when signal N killed it."""
    return code if code >= 0 else 128 - code


@dataclass(frozen=True)
class Held:
    """What a rank run beside rank 0's first run printed, held in the job's folder until that run ends."""

    rank: int
    prefix: str  # PREFIX.stdout, PREFIX.stderr

    def show(self) -> None:
        """Print what it printed, on the streams it printed it on, and remove the files."""
        if not any(os.path.getsize(self.prefix + suffix) for suffix in (".stdout", ".stderr")):
            self.drop()
            return
        print(f"memdiff: --ranks auto: the last rank, {self.rank}, ran beside rank 0 (every job's picks hold it); "
              f"what it printed:", file=sys.stderr)
        for suffix, stream in ((".stdout", sys.stdout), (".stderr", sys.stderr)):
            stream.flush()
            with open(self.prefix + suffix, "rb") as f:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    shutil.copyfileobj(f, buffer)
                else:
                    stream.write(f.read().decode(errors="replace"))
            stream.flush()
        self.drop()

    def drop(self) -> None:
        """Remove the files (its run does not stand: it runs again)."""
        for suffix in (".stdout", ".stderr"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.prefix + suffix)


def auto_ranks(run: Runner, forwarding: Signals, some: SomeRanks, folder: str,
               beside: bool) -> Tuple[List[Picked], Dict[int, int]]:
    """--ranks auto: rank 0 first, writing the layout its script builds (emulate/layout.py); then
    the ranks of the other roles that layout has (pick.py), all at once, each said with why; with
    each rank's exit status. Only rank 0 when it failed or was interrupted: its failure is the job's,
    and it is what the user sees. Except where rank 0 stopped because its pipeline stage hears its
    shapes from a rank that did not run (p2p.objects_from_sender): it runs again, with the others,
    its pipeline's among them.

    Where `beside` (ranks run here, not on Dask), the last rank, which every job's picks hold, runs
    beside rank 0's first run, as `--ranks 0,LAST` would run them: a machine of two cores then takes
    the time of one rank, not two, when the layout adds no other (an FSDP job). What it prints is
    shown once rank 0's run ended well; it runs again with rank 0 where rank 0 does."""
    path = os.path.join(folder, LAYOUT_FILE)
    last = some.launch.world_size - 1
    held = Held(last, os.path.join(folder, f".rank{last}")) if beside and last > 0 else None
    first = [0] + ([last] if held else [])
    try:
        codes = run(RankStart(first, first, extra={0: {LAYOUT: path}}, held={last: held.prefix} if held else {}))
        failed = codes.get(0) != 0
        layout = {} if forwarding.received or (failed and not os.path.exists(path)) else read_layout(path)
        waits = layout.get("refused_from") if failed and layout.get("stages") else None
        if forwarding.received or (failed and waits is None):
            print("memdiff: --ranks auto: rank 0 did not finish, so no other rank was picked", file=sys.stderr)
            if held:  # rank 0's failure is what the user sees; the last rank's output is kept
                print(f"memdiff: --ranks auto: the last rank, {last}, ran beside it and exited {codes.get(last)}: "
                      f"what it printed is in {held.prefix}.stdout and .stderr", file=sys.stderr)
            beside_picks = [Picked(last, "the last rank, run beside rank 0")] if held else []
            return [Picked(0, "rank 0, run first to read the job's layout")] + beside_picks, codes
        picked, notes = pick(layout, some.launch.world_size, some.launch.nproc_per_node)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if held and waits is None:
        held.show()
    elif held:  # it heard from rank 0, which stopped early: it runs again with it
        held.drop()
        codes.pop(last, None)
    for chosen in picked:
        print(f"memdiff: --ranks auto: rank {chosen.rank}: {chosen.why}", file=sys.stderr)
    for note in notes:
        print(f"memdiff: --ranks auto: {note}", file=sys.stderr)
    if waits is not None:
        print(f"memdiff: --ranks auto: running rank 0 again, with the ranks picked: its pipeline stage hears its "
              f"shapes from rank {waits}, which did not run with it the first time", file=sys.stderr)
    ranks = [p.rank for p in picked]
    codes.update(_after_rank_0(run, forwarding, folder, ranks, first, waits is not None, local=beside,
                               layout=layout))
    return picked, codes


def _after_rank_0(run: Runner, forwarding: Signals, folder: str, ranks: List[int], ran: List[int], again: bool,
                  local: bool, layout: Dict[str, Any]) -> Dict[int, int]:
    """The ranks of `ranks` that rank 0's first run did not run (`ran`), each pipeline's (in the layout)
    in one task on Dask; their exit statuses. Where `again`, rank 0's pipeline stage stopped where it
    would hear a rank that did not run, and rank 0 runs again first: here with every rank of `ranks`
    (all at once, as they hear each other), on Dask with the ranks of its pipeline, in one task (a rank
    there hears only the ranks that ended, and the others then hear this pipeline's, ended)."""
    teams = pipelines(layout, ranks)
    codes: Dict[int, int] = {}
    if again:
        # Its first run's end, claims (the rank hook's, a Dask task's) and what it sent are not this run's:
        # its peers wait for the new one, which writes its snapshot in place of the first.
        clear_statuses(folder)
        shutil.rmtree(os.path.join(folder, COLLECTIVES), ignore_errors=True)
        team = ranks if local else next((t for t in teams if 0 in t), [0])
        codes.update(run(RankStart(team, ranks, teams=[team])))
        if forwarding.received:
            return codes
        ran = team
    rest = [r for r in ranks if r not in ran]
    if rest:
        codes.update(run(RankStart(rest, ranks, teams=[t for t in teams if not set(t) & set(ran)])))
    return codes


def listed_ranks(run: Runner, forwarding: Signals, ranks: List[int], staged: bool, folder: str) -> Dict[int, int]:
    """The ranks --ranks names, each alone; their exit statuses. All at once; or `staged` (on Dask, where
    a rank hears only from ranks that ended before it), rank 0 first, so that every other rank hears
    what it sends (a broadcast's object, its sizes), and no other rank when it failed or was stopped.
    Staged, the ranks of one pipeline hear each other as they run: rank 0 writes the job's layout
    (emulate/layout.py), and each pipeline's ranks named run in one task; where rank 0's own stage
    stopped to hear a rank of its pipeline, it runs again with them first, in one task."""
    if not staged or 0 not in ranks or len(ranks) == 1:
        return run(RankStart(ranks, ranks))
    path = os.path.join(folder, LAYOUT_FILE)
    try:
        codes = run(RankStart([0], ranks, extra={0: {LAYOUT: path}}))
        layout = read_layout(path) if os.path.exists(path) else {}
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    waits = layout.get("refused_from") if codes.get(0) != 0 and layout.get("stages") else None
    if forwarding.received or (codes.get(0) != 0 and waits is None):
        print("memdiff: --dask: rank 0, run first, did not finish, so no other rank was run", file=sys.stderr)
        return codes
    if waits is not None:
        print(f"memdiff: --dask: rank 0 runs again, with the ranks of its pipeline named, in one task: its stage "
              f"hears its shapes from rank {waits}, which had not run", file=sys.stderr)
    codes.update(_after_rank_0(run, forwarding, folder, ranks, [0], waits is not None, local=False, layout=layout))
    return codes


