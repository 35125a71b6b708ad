"""`memdiff fit` of a job Lightning's own launcher starts (`-- python train.py`), run as `memdiff record
--ranks auto` runs it where one machine cannot start it whole.

Fit runs such a script in a process of its own (fitrun.run_emulated), where its Lightning launcher starts
the other local ranks of one node only: a job of several nodes was its first node's ranks, and a rank of a
later node that holds more (the last rank, which holds the last shard of what is sharded over all ranks)
never ran. Where fit runs a job as its picked ranks (`splits`: several nodes, more than WHOLE_JOB_RANKS
ranks, or `{nodes}` searched, as for torchrun's jobs), that process is the first run `--ranks auto` makes
of a script: it ends where the launcher would start the ranks (SplitJob, raised through the script, after
the launcher's devices per node and nodes are read), and the job then runs as `memdiff record --emulate
GPU --ranks auto -o DIR/` runs it (fitrun._run_split: rank 0 and the last rank, then the other ranks the
layout rank 0 built picks and, of several nodes, the first node's last rank and the last node's first, whose
LOCAL_RANK 0 runs Lightning's prepare_data, each alone), told that size (`known`, launch_lightning.KNOWN)
rather than running the script again to read it.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, Optional, Tuple

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


def known(job: SplitJob) -> Dict[str, str]:
    """What `memdiff record --ranks auto` is told of `job` in its environment, so that it does not run the
    script again to read the job's size (launch_lightning.KNOWN)."""
    return {KNOWN: json.dumps({"devices": job.devices, "num_nodes": job.nodes})}
