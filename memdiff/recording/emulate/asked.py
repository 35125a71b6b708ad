"""The GPUs a framework asks for, given to the emulated node before it checks that they are there.

Lightning's `Trainer(devices=2)` (`--trainer.devices 2`) is parsed by its device parser into GPU
indices [0, 1], then checked against `torch.cuda.device_count()`: a node that has no other rule for its
count (devices.py: no --gpus, CUDA_VISIBLE_DEVICES or launcher) would answer 1 and Lightning would
refuse ("You requested gpu: [0, 1] But your machine only has: [0]"). Here the parser's answer is told
to the node first (Placement.ask), so the job sees the GPUs it asked for, and Lightning's own launcher
starts one process per GPU (each told its count by the WORLD_SIZE and LOCAL_RANK Lightning sets).

accelerate's launcher reads `accelerate launch --num_processes N` (no --multi_gpu, no config file) as a
multi-GPU job when the node has more than one GPU (`_validate_launch_command`): the node is told the
processes per machine it asks for first, so it starts N ranks through torchrun, as on a node of N GPUs,
not the script once.

`torch.multiprocessing.spawn(fn, nprocs=N)` is a launcher too: each process it starts sees N GPUs,
as torchrun's see their LOCAL_WORLD_SIZE (a script that spawns a rank per GPU calls
`torch.cuda.set_device(rank)` in each).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Callable, Iterator, Optional

from memdiff.recording.emulate import swap
from memdiff.recording.emulate.devices import GPUS, SPAWNED
from memdiff.recording.emulate.on_import import Setting, patched_on_import

# The modules of Lightning's device parser (both of its package names), and the function every
# request for GPUs passes through there: an int N, a list of indices, or -1 (all there are).
PARSERS = ("lightning.fabric.utilities.device_parser", "lightning_fabric.utilities.device_parser")
TO_LIST = "_normalize_parse_gpu_input_to_list"
# accelerate's launcher, and the function that reads its options (and counts the node's GPUs).
ACCELERATE_LAUNCH = "accelerate.commands.launch"
VALIDATE = "_validate_launch_command"


def _asking(placement: Any, real: Callable[..., Any]) -> Callable[..., Any]:
    def normalized(gpus: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = _wanted(gpus)
        if wanted:
            placement.ask(wanted)
        return real(gpus, *args, **kwargs)
    normalized.__wrapped__ = real  # type: ignore[attr-defined]
    return normalized


def gpus_per_machine(args: Any) -> Optional[int]:
    """The GPUs each machine needs for `accelerate launch` options `args` (its processes over its
    machines); None for a launch of one process, which asks for no more than one."""
    processes, machines = getattr(args, "num_processes", None), getattr(args, "num_machines", None)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 2:
        return None
    return max(processes // machines if isinstance(machines, int) and machines > 1 else processes, 1)


def _launching(placement: Any, real: Callable[..., Any]) -> Callable[..., Any]:
    def validate(args: Any, *rest: Any, **kwargs: Any) -> Any:
        wanted = gpus_per_machine(args)
        if wanted is not None:
            placement.ask(wanted)
        return real(args, *rest, **kwargs)
    validate.__wrapped__ = real  # type: ignore[attr-defined]
    return validate


def _wanted(gpus: Any) -> int:
    """How many GPUs a request names: N for the int N, one past the highest index of a list; 0 for none
    or all (-1: as many as there are)."""
    if isinstance(gpus, bool):
        return 0
    if isinstance(gpus, int):
        return gpus if gpus > 0 else 0
    if isinstance(gpus, (list, tuple)) and gpus and all(isinstance(g, int) and g >= 0 for g in gpus):
        return max(gpus) + 1
    return 0


def _spawning(real: Callable[..., Any]) -> Callable[..., Any]:
    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
        told = GPUS in os.environ or SPAWNED in os.environ or not isinstance(nprocs, int) or nprocs < 1
        if told:
            return real(fn, args, nprocs, *rest, **kwargs)
        os.environ[SPAWNED] = str(nprocs)  # for the processes started now, which copy the environment
        try:
            return real(fn, args, nprocs, *rest, **kwargs)
        finally:
            os.environ.pop(SPAWNED, None)
    start_processes.__wrapped__ = real  # type: ignore[attr-defined]
    return start_processes


@contextlib.contextmanager
def devices_asked(emulator: Any) -> Iterator[None]:
    """For the block: the GPUs Lightning's device parser asks for are the emulated node's, so are the
    processes per machine accelerate's launcher is asked for, and each process torch.multiprocessing.spawn
    starts sees as many GPUs as it starts processes."""
    def patch(name: str, module: Any) -> Optional[Setting]:
        attribute, wrap = (VALIDATE, _launching) if name == ACCELERATE_LAUNCH else (TO_LIST, _asking)
        real: Optional[Callable[..., Any]] = getattr(module, attribute, None)
        if real is None or hasattr(real, "__wrapped__"):
            return None
        return module, attribute, wrap(emulator.placement, real)
    # the module: torch.multiprocessing's attribute `spawn` is the function of that name
    spawn: Any = importlib.import_module("torch.multiprocessing.spawn")
    with swap.replaced([(spawn, "start_processes", _spawning(spawn.start_processes))]), \
            patched_on_import((*PARSERS, ACCELERATE_LAUNCH), patch):
        yield
