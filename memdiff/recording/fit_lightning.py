"""`memdiff fit` of a job Lightning's own launcher starts (`-- python train.py`), run as `memdiff record
--ranks auto` runs it where one machine cannot start it whole.

Fit runs such a script in a process of its own (fitrun.run_emulated), where its Lightning launcher starts
the other local ranks of one node only: a job of several nodes was its first node's ranks, and a rank of a
later node that holds more (the last rank, which holds the last shard of what is sharded over all ranks)
never ran. Where fit runs a job as its picked ranks (`splits`: several nodes, more than WHOLE_JOB_RANKS
ranks, or `{nodes}` searched, as for torchrun's jobs), that process is the first run `--ranks auto` makes
of a script: it ends where the launcher would start the ranks (SplitJob, raised through the script, after
the launcher's devices per node and nodes are read), and the job then runs as `memdiff record --emulate
GPU --ranks auto -o DIR/` runs it (rank 0 and the last rank, then the other ranks the layout rank 0 built
picks, each alone), told that size (launch_lightning.KNOWN) rather than running the script again to read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from dataclasses import replace
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from memdiff.recording.emulate.on_import import patched_on_import
from memdiff.recording.launch import RANKS
from memdiff.recording.launch_lightning import KNOWN, SCRIPTS

# A launched job runs whole (every rank a process) up to this many ranks on one node; a larger one, one of
# several nodes, or any job whose `{nodes}` is searched runs only the ranks `memdiff record --ranks auto` picks.
WHOLE_JOB_RANKS = 8
NODES = "nodes"


def splits(knob: Optional[str], nodes: int, world_size: int) -> bool:
    """Whether fit, searching `knob`, runs a job of `nodes` nodes and `world_size` ranks as the ranks
    `--ranks auto` picks rather than whole: always while `{nodes}` is searched (every value then runs alike),
    and for a job of several nodes (which one machine cannot start whole) or of more than WHOLE_JOB_RANKS."""
    return knob == NODES or nodes > 1 or world_size > WHOLE_JOB_RANKS


class SplitJob(BaseException):
    """Raised where a script's Lightning launcher would start the ranks of a job fit runs as its picked ranks:
    a BaseException, so that the script's own `except Exception` does not take it for its failure (Lightning's
    Trainer tears down and raises it again)."""

    def __init__(self, devices: int, nodes: int) -> None:
        super().__init__(f"a Lightning job of {nodes} node(s) of {devices} devices, run as its picked ranks")
        self.devices, self.nodes = devices, nodes


@contextlib.contextmanager
def split_at_launch(knob: Optional[str]) -> Iterator[None]:
    """For the block (fit's run of a script, under the emulator): where a Lightning launcher would start the
    ranks of a job that `splits`, SplitJob; any other job starts as its launcher starts it. A process that is
    itself a rank memdiff started (RANKS set) is left alone."""
    def stop(name: str, module: Any) -> Tuple[Any, str, Any]:
        owner = module._SubprocessScriptLauncher
        real = owner.__dict__["_call_children_scripts"]

        def _call_children_scripts(self: Any) -> Any:
            devices, nodes = int(self.num_processes), int(self.num_nodes)
            if not os.environ.get(RANKS) and splits(knob, nodes, devices * nodes):
                raise SplitJob(devices, nodes)
            return real(self)
        return owner, "_call_children_scripts", _call_children_scripts
    with patched_on_import(SCRIPTS, stop):
        yield


def run_split(job: SplitJob, gpu: str, target: List[str], snapshot: str, log: str, max_entries: int,
              rules: Sequence[Any], started: float) -> Any:
    """The job `job` (read by fit's run of `target`, begun at `started`, whose own snapshot `snapshot` is
    no run of the job and is removed) run as `memdiff record --emulate GPU --ranks auto` runs it, into the
    folder beside it (`runs/l4-nodes2/`, as a torchrun job's): its RunOutcome, its time and CPU seconds
    counting the first run's."""
    from memdiff.recording.fitrun import run_launched

    with contextlib.suppress(FileNotFoundError):
        os.unlink(snapshot)
    first = resource.getrusage(resource.RUSAGE_SELF)
    folder = snapshot[:-len(".pickle")] if snapshot.endswith(".pickle") else snapshot + ".ranks"
    print(f"memdiff: fit: {job}, as `memdiff record --ranks auto` runs it", file=sys.stderr, flush=True)
    known = json.dumps({"devices": job.devices, "num_nodes": job.nodes})
    outcome = run_launched(gpu, [sys.executable, *target], folder, log, max_entries, rules, picked=True,
                           env={KNOWN: known})
    return replace(outcome, folder=folder, seconds=time.monotonic() - started,
                   cpu_seconds=outcome.cpu_seconds + first.ru_utime + first.ru_stime)
