"""Some ranks of an `accelerate launch` job: its command read for the job it describes (--ranks).

`accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --machine_rank 0 train.py` (or one
with `--use_fsdp`, or whose accelerate config says so) starts torchrun with an environment of its own
(ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP, FSDP_*, ...) that the script's Accelerator reads. That
environment is accelerate's to make, from its options, its config file and its defaults: so the command
is read with accelerate's own parser and checks, and each rank is given the environment accelerate's
own `prepare_multi_gpu_env` makes, under torchrun's per-rank one (launch.py). `--num_processes` counts
the processes of all machines, as accelerate's does.

`--use_deepspeed` (or a config of `distributed_type: DEEPSPEED`) is read the same way, through
accelerate's own `prepare_deepspeed_cmd_env` (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE,
ACCELERATE_DEEPSPEED_CONFIG_FILE, offload settings, ...; accelerate 1.15 is the reference). On one
machine, or with `--deepspeed_multinode_launcher standard`, accelerate starts torchrun; on several
with DeepSpeed's own multi-node launchers it starts a `deepspeed` command, read by that launcher's
reader (launch_deepspeed.py), each rank given the variables accelerate hands it through DeepSpeed's
`.deepspeed_env` file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import warnings
from typing import Any, Dict, Iterator, List, Tuple

from memdiff.errors import InputError
from memdiff.recording.emulate import swap
from memdiff.recording.emulate.asked import gpus_per_machine
from memdiff.recording.launch import Launch
from memdiff.recording.launch_deepspeed import read_deepspeed

_STANDARD = "standard"  # accelerate's multi-node DeepSpeed launcher that is torchrun


def is_accelerate(command: List[str]) -> bool:
    """Whether `command` is `accelerate launch ...` (or `python -m accelerate.commands.launch ...`)."""
    if len(command) >= 2 and os.path.basename(command[0]) == "accelerate" and command[1] == "launch":
        return True
    return len(command) >= 3 and command[1:3] == ["-m", "accelerate.commands.launch"]


def read_accelerate(command: List[str]) -> Launch:
    """The job of an `accelerate launch` command, with the environment accelerate gives its ranks;
    InputError where accelerate refuses the command or it starts one process only."""
    options = command[2:] if os.path.basename(command[0]) == "accelerate" else command[3:]
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_multi_gpu_env
    except ImportError as exc:
        raise InputError("--ranks", f"reads `accelerate launch` with accelerate's own parser, which does not "
                                    f"import here ({exc})") from None
    said = io.StringIO()
    try:
        # argparse's usage and message (shown as one line below), and the defaults accelerate filled in,
        # which it says as it reads the command: memdiff says what it runs
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            parsed = launch_command_parser().parse_args(options)
            with _a_node_of_its_gpus(parsed):
                args, defaults, precision_from_config = _validate_launch_command(parsed)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        raise InputError("--ranks", f"accelerate launch refuses the command: {lines[-1] if lines else options}") \
            from None
    except ValueError as exc:
        raise InputError("--ranks", f"accelerate launch refuses the command: {exc}") from None
    if int(args.num_machines) > 1 and args.machine_rank is None:  # accelerate itself stops on a TypeError
        raise InputError("--ranks", f"accelerate launch on {args.num_machines} machines needs --machine_rank N")
    try:
        if args.use_deepspeed and not args.cpu:
            return _read_deepspeed(args, defaults, precision_from_config)
        if args.cpu or not (args.multi_gpu or args.use_fsdp or args.use_megatron_lm):
            raise InputError("--ranks", f"this accelerate launch starts one process ({args.num_processes} "
                                        f"process(es) asked, no --multi_gpu or --use_fsdp): no ranks to pick from")
        with warnings.catch_warnings():  # a port in use on this machine: the ranks run alone use none
            warnings.simplefilter("ignore")
            env = prepare_multi_gpu_env(args)
    except (ValueError, RuntimeError, ConnectionError) as exc:
        raise InputError("--ranks", f"accelerate launch refuses the command: {exc}") from None
    ours, path = _added(env)
    return Launch(int(args.num_machines), int(args.nproc_per_node), _target(args), ours, pythonpath=path)


@contextlib.contextmanager
def _a_node_of_its_gpus(parsed: Any) -> Iterator[None]:
    """While accelerate reads the command: the node has the GPUs the command asks for on each machine, as
    the emulated node of the whole run does (emulate/asked.py). Without --multi_gpu or a config file,
    accelerate counts them to decide a multi-GPU launch; this machine has none."""
    per_machine = gpus_per_machine(parsed)
    if per_machine is None:
        yield
        return
    import torch

    with swap.replaced([(torch.cuda, "is_available", lambda: True), (torch.cuda, "device_count", lambda: per_machine)]):
        yield


def _read_deepspeed(args: Any, defaults: Any, precision_from_config: bool) -> Launch:
    """The job of `accelerate launch --use_deepspeed`: what accelerate's `launch_command` and
    `deepspeed_launcher` do with `args`, up to starting the job."""
    from accelerate.utils import is_deepspeed_available
    from accelerate.utils.environment import convert_dict_to_env_variables
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    if not is_deepspeed_available():  # accelerate's launcher refuses so, before it reads anything else
        raise InputError("--ranks", "accelerate launch with DeepSpeed needs DeepSpeed installed where it runs "
                                    "(accelerate's launcher stops without it): pip install deepspeed")
    if int(args.num_processes or 0) < 1:  # on a machine without GPUs accelerate counts none
        raise InputError("--ranks", "accelerate launch with DeepSpeed counts this machine's GPUs: give "
                                    "--num_processes N (all machines' processes) to say the job's size")
    # accelerate's default multi-node launcher is DeepSpeed's pdsh
    several = int(args.num_machines) > 1 and (args.deepspeed_multinode_launcher or "pdsh") != _STANDARD
    if several and args.deepspeed_hostfile is None:
        raise InputError("--ranks", f"accelerate launch with DeepSpeed on {args.num_machines} machines starts "
                                    f"DeepSpeed's runner, which finds the machines in a hostfile: give "
                                    f"--deepspeed_hostfile FILE, or --deepspeed_multinode_launcher standard")
    # what launch_command tells the ranks of the DeepSpeed fields the accelerate config file set
    fields = list(defaults.deepspeed_config) if defaults is not None else []
    args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * precision_from_config)
    with warnings.catch_warnings():  # a port in use on this machine: the ranks run alone use none
        warnings.simplefilter("ignore")
        cmd, env = prepare_deepspeed_cmd_env(args)
    # (accelerate also disables NCCL's P2P and InfiniBand on an RTX 4000: never an emulated GPU)
    if cmd is None:  # torchrun, on one machine or with the standard multi-node launcher
        ours, path = _added(env)
        return Launch(int(args.num_machines), int(args.nproc_per_node), _target(args), ours, pythonpath=path)
    # DeepSpeed's runner exports to every rank what accelerate writes to its `.deepspeed_env` file:
    # the variables accelerate's own check keeps (no empty value, no space or `;` in one)
    with contextlib.redirect_stderr(io.StringIO()):  # it warns of each variable it skips
        kept = dict(line.rstrip("\n").split("=", 1) for line in convert_dict_to_env_variables(env))
    ours, path = _added(kept)
    return dataclasses.replace(read_deepspeed(cmd), env=ours, pythonpath=path)


def _added(env: Dict[str, str]) -> Tuple[Dict[str, str], Tuple[str, ...]]:
    """What accelerate adds to this process's environment for its ranks: the variables it sets, and the
    folders it appends to PYTHONPATH (apart, for the ranks' own PYTHONPATH to keep memdiff's hook)."""
    ours = {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"}
    known = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    path = tuple(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in known)
    return ours, path


def _target(args: Any) -> List[str]:
    """What each rank runs, as accelerate's torchrun would run it."""
    rest = [args.training_script, *args.training_script_args]
    if args.no_python:
        return rest
    if args.module:
        return [sys.executable, "-m", *rest]
    return [sys.executable, "-u", *rest]
