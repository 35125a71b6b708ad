"""Some ranks of a job Lightning's own launcher starts: `python train.py` run once to read its job (--ranks).

A script whose `Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy="ddp")` (or Fabric) is run
as `python train.py` starts its other local ranks itself: its strategy's `_SubprocessScriptLauncher`
runs `_call_children_scripts`, which sets MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and
WORLD_SIZE in its own environment and re-runs the script once per other local rank with LOCAL_RANK
changed (lightning/fabric/strategies/launchers/subprocess_script.py; the pytorch package's is the
same). A process that finds LOCAL_RANK in its environment is one created externally, and starts none
(LightningEnvironment.creates_processes_externally); its global rank is NODE_RANK x devices +
LOCAL_RANK. The job's size is in the script, not in the command, so the script is run once first, as
a probe: emulated, recorded nowhere, with MEMDIFF_RECORD_LIGHTNING naming a folder; at the moment
Lightning's launcher would start the children, the probe writes the launcher's devices per node and
nodes there and ends. Each rank asked for then runs alone with what Lightning would have given it
(launch.rank_env), so it spawns nothing. A probe that steps an optimizer first, or ends, started no
ranks: a plain script, or a Lightning one of one device, has no job to pick ranks from. One whose
strategy starts its ranks with torch.multiprocessing (ddp_spawn) is stopped there too: those ranks are
functions of the launching process, not scripts that can be started alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from memdiff.errors import InputError
from memdiff.recording.emulate.on_import import patched_on_import
from memdiff.recording.launch import FIRST_NODE, LIGHTNING, RANKS, Launch
from memdiff.recording.stopping import dying_with_us

# The folder the probe writes what it found in (set for the probe's process only).
PROBE = "MEMDIFF_RECORD_LIGHTNING"
FOUND = "launch.json"
# What a run of the script already read of its job, as the probe writes it (`{"devices": 2, "num_nodes": 2}`):
# set by `memdiff fit`, whose own run of the script stopped where the launcher would start the ranks
# (recording/fit_lightning.py), so the script is not run once more to read the same. Never passed on to a rank.
KNOWN = "MEMDIFF_RECORD_LIGHTNING_JOB"
# Lightning's launchers, in each of its packages' names (lightning, and the standalone ones): the one that
# re-runs the script per rank, and the one that starts its ranks with torch.multiprocessing (ddp_spawn).
_PACKAGES = ("lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning")
SCRIPTS = tuple(f"{package}.strategies.launchers.subprocess_script" for package in _PACKAGES)
SPAWNS = tuple(f"{package}.strategies.launchers.multiprocessing" for package in _PACKAGES)
# The real file functions, taken before the emulator's guards of the user's files replace them: the
# probe's folder is memdiff's own, in its output folder (as layout.py's file).
_open, _replace = open, os.replace


def _found(folder: str, facts: Dict[str, Any]) -> None:
    """Write what the probe found, then end its process: nothing of the script runs past this point
    (its output so far flushed; its exit handlers, its recording among them, do not run: the probe's
    folder is thrown away)."""
    partial = os.path.join(folder, f"{FOUND}.{os.getpid()}.tmp")
    with _open(partial, "w", encoding="utf-8") as f:
        json.dump(facts, f)
    _replace(partial, os.path.join(folder, FOUND))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _at_launch(folder: str) -> Any:
    def _call_children_scripts(self: Any) -> None:
        _found(folder, {"devices": int(self.num_processes), "num_nodes": int(self.num_nodes)})
    return _call_children_scripts


def _at_spawn(folder: str) -> Any:
    def launch(self: Any, *args: Any, **kwargs: Any) -> None:
        _found(folder, {"spawns": True})
    return launch


@contextlib.contextmanager
def probed() -> Iterator[None]:
    """For the block, when MEMDIFF_RECORD_LIGHTNING names a folder (this process is the probe): the
    process ends where Lightning's launcher would start the other ranks, saying the job's size, or at
    the first optimizer step, saying it started none (or where it would start them with
    torch.multiprocessing, saying so)."""
    # Taken out of the environment: a process the probe starts is no probe.
    folder = os.environ.pop(PROBE, None)
    if not folder:
        yield
        return

    def stop(name: str, module: Any) -> Tuple[Any, str, Any]:
        if name in SCRIPTS:
            return module._SubprocessScriptLauncher, "_call_children_scripts", _at_launch(folder)
        return module._MultiProcessingLauncher, "launch", _at_spawn(folder)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    stepping = register_optimizer_step_pre_hook(lambda *_: _found(folder, {"stepped": True}))
    try:
        with patched_on_import(SCRIPTS + SPAWNS, stop):
            yield
    finally:
        stepping.remove()


@contextlib.contextmanager
def children_waited() -> Iterator[None]:
    """For the block (an emulated process): the other local ranks a Lightning launcher of this process
    started are waited for at its end. On GPUs the ranks end together, held by their last collectives;
    emulated collectives wait for no one, so the launching rank could end first, and the run end (its
    overlay removed, `memdiff record` and `fit` returned) while the others still train: they would
    lose their emulated GPU and their snapshots, or outlive the run."""
    launchers: List[Any] = []

    def remembered(name: str, module: Any) -> Tuple[Any, str, Any]:
        owner = module._SubprocessScriptLauncher
        real = owner.__dict__["_call_children_scripts"]

        def _call_children_scripts(self: Any) -> Any:
            launchers.append(self)
            node = _this_node(self)
            if node is not None:  # this process, the node's rank 0, and the ranks it starts
                os.environ[RANKS], os.environ[FIRST_NODE] = node, "1"
            return real(self)
        return owner, "_call_children_scripts", _call_children_scripts
    try:
        with patched_on_import(SCRIPTS, remembered):
            yield
    finally:
        for launcher in launchers:
            for child in getattr(launcher, "procs", []):
                child.wait()


def _this_node(launcher: Any) -> Optional[str]:
    """The ranks that run of the job `launcher` starts, as RANKS (launch.py) says them, where it is a job
    of several nodes run as `python train.py` here: its first node's ranks only (NODE_RANK says which
    node this is; the other nodes' ranks are never started), which hear only from each other, where they
    waited for the other nodes' collectives for as long as the group's timeout. None for one node, or
    where memdiff record says which ranks run (--ranks)."""
    nodes, devices = int(launcher.num_nodes), int(launcher.num_processes)
    if nodes <= 1 or os.environ.get(RANKS):
        return None
    node = int(os.environ.get("NODE_RANK") or 0)
    return ",".join(str(node * devices + local) for local in range(devices))


def probe(command: List[str], env: Dict[str, str], folder: str, started: Callable[[Any], None],
          interrupted: Callable[[], bool]) -> Tuple[Optional[Launch], int]:
    """The job `command` starts from inside itself: the script run once in the environment `env` of a
    rank (memdiff's hook, the emulated GPU, the run's overlay), recorded nowhere (a hidden folder in the
    job's `folder`, removed after), up to where Lightning's launcher would start the other ranks; its
    output kept back (the ranks print the same). `started` is told of its process (to pass Ctrl-C on).
    None and its exit status when it failed or was `interrupted` before that, its output shown; InputError
    where it started no ranks. Where `env` holds KNOWN (taken out of it, so no rank sees it), the job it
    says, without running the script."""
    known = env.pop(KNOWN, None)
    if known:
        try:
            facts = json.loads(known)
        except ValueError:
            facts = None
        return _launch(facts if isinstance(facts, dict) else {}, command), 0
    place = os.path.join(folder, ".lightning-probe")
    shutil.rmtree(place, ignore_errors=True)
    os.makedirs(place)
    try:
        log = os.path.join(place, "output.log")
        with open(log, "wb") as out:
            child = subprocess.Popen(command, env={**env, PROBE: place, "MEMDIFF_RECORD_DIR": place}, stdout=out,
                                     stderr=subprocess.STDOUT, preexec_fn=dying_with_us())
            started(child)
            code = child.wait()
        if interrupted() or code:
            with open(log, "rb") as said:
                sys.stderr.buffer.write(said.read())
            sys.stderr.flush()
            print(f"memdiff: --ranks: `{' '.join(command)}` {'was interrupted' if interrupted() else 'failed'} "
                  f"before a Lightning launcher started its ranks: no rank was run", file=sys.stderr)
            return None, code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
        return _read(place, command), 0
    finally:
        shutil.rmtree(place, ignore_errors=True)


def _read(folder: str, command: List[str]) -> Launch:
    """The job the probe found: Lightning's launcher's nodes of `devices` ranks, each running the
    command itself; InputError where the script started no ranks before it stepped an optimizer or ended."""
    try:
        with open(os.path.join(folder, FOUND), encoding="utf-8") as f:
            facts = json.load(f)
    except (OSError, ValueError):
        facts = None
    # the probe ended without a word: no launcher, no optimizer step
    return _launch(facts if isinstance(facts, dict) else {}, command)


def _launch(facts: Dict[str, Any], command: List[str]) -> Launch:
    """The job `facts` (what the probe found) says; InputError where it says the script started no ranks."""
    devices, nodes = facts.get("devices"), facts.get("num_nodes")
    if facts.get("spawns"):
        raise InputError("--ranks", f"`{' '.join(command)}` starts its ranks with torch.multiprocessing (Lightning's "
                                    f"strategy ddp_spawn or ddp_notebook), whose ranks --ranks does not start alone: "
                                    f"use strategy=\"ddp\", or record the whole job without --ranks")
    if not (isinstance(devices, int) and isinstance(nodes, int) and devices > 0 and nodes > 0):
        until = "stepped an optimizer" if facts.get("stepped") else "ended"
        raise InputError("--ranks", f"`{' '.join(command)}` {until} before a Lightning launcher started its ranks "
                                    f"(a Trainer or Fabric of devices= or num_nodes= over 1, strategy ddp or "
                                    f"fsdp): no job to pick ranks from; record it without --ranks, or give the "
                                    f"torchrun, accelerate or DeepSpeed command that starts its job")
    return Launch(nodes, devices, list(command), launcher=LIGHTNING)
