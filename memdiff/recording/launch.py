"""Some ranks of a large job, each run alone: a torchrun command read for the job it describes.

Under emulation each rank already runs alone: its collectives complete at once and move nothing, so
rank 63 of a 512-GPU job needs neither the other 511 processes nor their GPUs. `memdiff record
--emulate GPU -o DIR/ --ranks 0,63 -- torchrun --nnodes 64 --nproc-per-node 8 train.py` reads the
job from torchrun's own options (its nodes, processes per node, the script or module and its
arguments) and starts only the named ranks, each in a process of its own with the environment
torchrun gives that rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ...). Time and
memory grow with the ranks run, not with the world size. The values collectives carry between
ranks (exchange.py) come only from the ranks that run: a rank that would hear from one that does
not keeps its own values, as a rank run alone does.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from memdiff.errors import InputError
from memdiff.numbers import DIGITS

# Told to every rank run this way: the ranks that run (exchange.py hears only from them).
RANKS = "MEMDIFF_RECORD_RANKS"
# Set beside RANKS where they are a job's first node, as a script's own Lightning launcher starts them here
# (launch_lightning.py), not ranks `--ranks` named: each rank's status says so (manifest.py).
FIRST_NODE = "MEMDIFF_RECORD_FIRST_NODE"
# The pid of the process that set a job's folder for the processes it starts while it is itself no
# process of the job: `memdiff record -o FILE` runs the script in its own process (exchange.py).
STARTED_BY = "MEMDIFF_RECORD_STARTED_BY"
MAX_WORLD = 1 << 20  # more ranks than any job has: a typo, not a job
PYTHON = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$")  # a Python interpreter's name

# torchrun's options that take a value (either spelling), and those that take none.
_VALUED = {f"--{name}" for name in (
    "nnodes", "nproc-per-node", "node-rank", "master-addr", "master-port", "rdzv-backend", "rdzv-endpoint",
    "rdzv-id", "rdzv-conf", "max-restarts", "monitor-interval", "start-method", "role", "log-dir", "redirects",
    "tee", "local-ranks-filter", "logs-specs", "local-addr", "event-log-handler", "numa-binding",
    "signals-to-handle", "virtual-local-rank", "duplicate-stdout-filters", "duplicate-stderr-filters")} | {"-r", "-t"}
_FLAGS = {"--standalone", "--no-python", "--module", "-m", "--run-path"}


# whose per-rank environment a job's ranks get
TORCHRUN, DEEPSPEED, LIGHTNING = "torchrun", "deepspeed", "lightning"


@dataclass(frozen=True)
class Launch:
    """The job a launcher's command describes: its size and what each rank runs."""

    nnodes: int
    nproc_per_node: int
    target: List[str]  # the command of one rank: python SCRIPT ARGS, python -m MODULE ARGS, or a program
    env: Dict[str, str] = field(default_factory=dict)  # what the launcher adds for every rank (accelerate's)
    # whose environment each rank gets: torchrun's (accelerate starts torchrun), DeepSpeed's launcher's, Lightning's
    launcher: str = TORCHRUN
    # DeepSpeed's launcher passes `--local_rank=N` to each rank after target[:local_rank_after]
    local_rank_after: Optional[int] = None
    # folders the launcher appends to every rank's PYTHONPATH (accelerate's DeepSpeed launch: its working folder)
    pythonpath: Tuple[str, ...] = ()

    def path(self, pythonpath: str) -> str:
        """A rank's PYTHONPATH: `pythonpath` (memdiff's hook first, then the user's), then the launcher's."""
        return os.pathsep.join(p for p in (pythonpath, *self.pythonpath) if p)

    @property
    def world_size(self) -> int:
        """How many ranks the job has."""
        return self.nnodes * self.nproc_per_node

    def command(self, rank: int) -> List[str]:
        """What `rank` runs: the target, with its local rank where the launcher passes it."""
        if self.local_rank_after is None:
            return list(self.target)
        at = self.local_rank_after
        return [*self.target[:at], f"--local_rank={rank % self.nproc_per_node}", *self.target[at:]]


def parse_ranks(text: str) -> List[int]:
    """`0,63` or `0-7,63` as the sorted ranks it names; InputError when it names none or is not ranks."""
    ranks: Set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not DIGITS.fullmatch(first) or (dash and not DIGITS.fullmatch(last)):
            raise InputError("--ranks", f"{text!r} is no list of ranks: give ranks and ranges, e.g. 0,63 or 0-7,63")
        low, high = int(first), int(last) if dash else int(first)
        if high < low or high >= MAX_WORLD:
            raise InputError("--ranks", f"{part.strip()!r} is no range of ranks (low-high, below {MAX_WORLD:,})")
        ranks.update(range(low, high + 1))
    return sorted(ranks)


def _spelled(option: str) -> str:
    """--nproc_per_node and --nproc-per-node are one option to torchrun."""
    return option.replace("_", "-") if option.startswith("--") else option


def _count(option: str, value: Optional[str]) -> int:
    """A count torchrun was given; elastic MIN:MAX only where MIN is MAX (a size must be known)."""
    low, _, high = (value or "").partition(":")
    if DIGITS.fullmatch(low) and (not high or high == low) and int(low) > 0:
        return int(low)
    raise InputError("--ranks", f"torchrun's {option} {value} is no fixed count: give {option} N to say the job's size")


def _torchrun_options(command: List[str]) -> Optional[List[str]]:
    """torchrun's options and what follows them in `torchrun ...` or `python -m torch.distributed.run
    ...`; None for any other command."""
    if command[:1] == ["torchrun"] or (command and command[0].endswith("/torchrun")):
        return command[1:]
    if len(command) >= 3 and command[1:3] == ["-m", "torch.distributed.run"]:
        return command[3:]
    return None


def is_torchrun(command: List[str]) -> bool:
    """Whether `command` runs torchrun (_torchrun_options)."""
    return _torchrun_options(command) is not None


def read_torchrun(command: List[str]) -> Launch:
    """The job of `torchrun ...` or `python -m torch.distributed.run ...`; InputError for any other
    command (--ranks reads torchrun's options only) or a size it does not fix."""
    options = _torchrun_options(command)
    if options is None:
        raise InputError("--ranks", "runs some ranks of a torchrun, accelerate, DeepSpeed or Lightning job: give "
                                    "`-- torchrun [options] train.py ...` (or python -m torch.distributed.run), "
                                    "`-- accelerate launch [options] train.py ...`, `-- deepspeed [options] train.py "
                                    "...` or `-- python train.py ...` whose Lightning Trainer or Fabric starts its "
                                    f"own ranks; other launchers (`{os.path.basename(command[0])}`) are not read yet")
    given: Dict[str, Optional[str]] = {}
    i = 0
    while i < len(options) and options[i].startswith("-"):
        if options[i] == "--":  # the end of torchrun's options, which its parser drops
            i += 1
            break
        option, eq, value = options[i].partition("=")
        option = _spelled(option)
        if option in _FLAGS:
            given[option] = None
            i += 1
        elif option in _VALUED:
            if not eq:
                i += 1
                value = options[i] if i < len(options) else ""
            given[option] = value
            i += 1
        else:
            raise InputError("--ranks", f"torchrun's option {option} is not one memdiff reads: give the job's "
                                        f"size with --nnodes and --nproc-per-node")
    rest = options[i:]
    if not rest:
        raise InputError("--ranks", "the torchrun command names no script to run")
    if rest[1:2] == ["--"]:
        # torchrun's parser drops one `--` right after the script or module (nanochat's speedrun.sh:
        # `torchrun ... -m scripts.base_train -- --depth=24`): the rank's arguments start after it
        rest = [rest[0], *rest[2:]]
    nproc = _count("--nproc-per-node", given.get("--nproc-per-node", "1"))
    nnodes = _count("--nnodes", given.get("--nnodes", "1"))
    if "--no-python" in given:
        target = rest
    elif "--module" in given or "-m" in given:
        target = [sys.executable, "-m", *rest]
    else:
        target = [sys.executable, "-u", *rest]  # torchrun runs each rank's Python unbuffered
    return Launch(nnodes, nproc, target)


def rank_env(launch: Launch, rank: int, ranks: List[int], port: int) -> Dict[str, str]:
    """The environment the job's launcher gives `rank` (one node's agent per `nproc_per_node` ranks),
    with the ranks that run, for the collectives: torchrun's, DeepSpeed's launcher's (its
    deepspeed/launcher/launch.py: no torchrun variables, the node's GPUs made visible), or Lightning's
    (launch_lightning.py: a rank whose LOCAL_RANK is set starts no others)."""
    local, node = rank % launch.nproc_per_node, rank // launch.nproc_per_node
    if launch.launcher == LIGHTNING:  # what Lightning's _call_children_scripts gives a rank: no RANK
        return {"LOCAL_RANK": str(local), "NODE_RANK": str(node), "WORLD_SIZE": str(launch.world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), RANKS: ",".join(map(str, ranks))}
    if launch.launcher == DEEPSPEED:
        return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(launch.world_size),
                "LOCAL_SIZE": str(launch.nproc_per_node), "CROSS_RANK": str(node), "CROSS_SIZE": str(launch.nnodes),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), RANKS: ",".join(map(str, ranks)),
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(launch.nproc_per_node)))}
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(launch.world_size),
            "LOCAL_WORLD_SIZE": str(launch.nproc_per_node), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE":
            str(launch.nnodes), "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE":
            str(launch.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "False", RANKS: ",".join(map(str, ranks))}
