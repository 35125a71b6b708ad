"""Some ranks of a job DeepSpeed's launcher starts: a `deepspeed` command read for the job it describes
(--ranks).

`deepspeed --num_nodes 2 --num_gpus 8 train.py --deepspeed_config ds.json` runs its runner, which
reads the job's nodes from a hostfile (`-H`, by default /job/hostfile when it exists: lines `host
slots=N`) or takes this machine alone, keeps the first `--num_nodes` hosts and `--num_gpus` GPUs on
each, and starts `deepspeed.launcher.launch` on every node (over pdsh, or this node's with
`--no_ssh`; its MPI and Slurm runners start the ranks otherwise, and are refused). That launcher gives each rank an
environment of its own (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE,
MASTER_ADDR, MASTER_PORT, CUDA_VISIBLE_DEVICES: no torchrun variables) and passes `--local_rank=N`
to the script, after it and before its arguments, unless `--no_local_rank`. memdiff reads the same
options with a parser of its own (DeepSpeed need not import here; deepspeed/launcher/runner.py and
launch.py of DeepSpeed 0.18 are the reference) and starts only the ranks asked for, each as that
launcher would. A job with no hostfile is the nodes `--num_nodes` says, each of `--num_gpus` GPUs
(DeepSpeed itself asks for a hostfile past one node: the emulated job needs no hosts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from typing import Dict, List, Optional

from memdiff.errors import InputError
from memdiff.read.load import read_small
from memdiff.recording.launch import DEEPSPEED, Launch

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default (DLTS_HOSTFILE), read only when it exists
_HOST = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own hostfile line


_RUNNER = ("deepspeed", "ds")  # the scripts DeepSpeed installs for its runner


def _options_at(command: List[str]) -> Optional[int]:
    """Where the runner's options start in `command`: after `deepspeed`, after `python PATH/deepspeed`
    (the script run by a Python of one's choosing), after `python -m deepspeed.launcher.runner`;
    None for any other command."""
    if command and os.path.basename(command[0]) in _RUNNER:
        return 1
    if len(command) >= 2 and os.path.basename(command[0]).startswith("python"):
        if os.path.basename(command[1]) in _RUNNER:
            return 2
        if command[1:3] == ["-m", "deepspeed.launcher.runner"]:
            return 3
    return None


def is_deepspeed(command: List[str]) -> bool:
    """Whether `command` runs DeepSpeed's launcher (_options_at)."""
    return _options_at(command) is not None


def _parser() -> argparse.ArgumentParser:
    """DeepSpeed's runner's options, as it spells and defaults them."""
    p = argparse.ArgumentParser(prog="deepspeed")
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE)
    p.add_argument("-i", "--include", default="")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="pdsh")
    p.add_argument("--launcher_args", default="")
    for flag in ("--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi",
                 "--save_pid", "--elastic_training", "--bind_cores_to_rank"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="", choices=["tune", "run"])
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", default=None)
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def _hosts(path: str) -> Optional[Dict[str, int]]:
    """The hosts and slots of a DeepSpeed hostfile, None when there is none; InputError where DeepSpeed
    would refuse it."""
    if not os.path.isfile(path):
        if path != DEFAULT_HOSTFILE:
            raise InputError(path, "no such hostfile (deepspeed -H)")
        return None
    hosts: Dict[str, int] = {}
    for line in read_small(path, "a DeepSpeed hostfile").decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST.search(line)
        if not match:
            raise InputError(path, f"a hostfile line is no `host slots=N`: {line[:80]!r}")
        if match.group(1) in hosts:
            raise InputError(path, f"the hostfile names {match.group(1)} twice")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise InputError(path, "the hostfile names no host")
    return hosts


def read_deepspeed(command: List[str]) -> Launch:
    """The job of a `deepspeed` command: its nodes and GPUs, and what each rank runs; InputError where
    DeepSpeed would refuse the command or its size is not fixed by what it says."""
    options = command[_options_at(command) or len(command):]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = _parser().parse_args(options)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        raise InputError("--ranks", f"deepspeed refuses the command: {lines[-1] if lines else options}") from None
    if args.include or args.exclude:
        raise InputError("--ranks", "deepspeed's --include/--exclude are not read: give the job's size with "
                                    "--num_nodes and --num_gpus (or a hostfile)")
    if args.elastic_training or args.autotuning:
        raise InputError("--ranks", "deepspeed's elastic training and autotuning change the job's size as it "
                                    "runs: give a fixed --num_nodes and --num_gpus")
    if args.no_python and args.module:
        raise InputError("--ranks", "deepspeed refuses --no_python with --module")
    hosts = _hosts(args.hostfile)
    if hosts is None:
        if args.num_gpus <= 0:
            raise InputError("--ranks", "deepspeed without a hostfile counts this machine's GPUs: give "
                                        "--num_gpus N (and --num_nodes N) to say the job's size")
        nodes, per_node = max(args.num_nodes, 1), args.num_gpus
    else:
        kept = list(hosts.values())[:args.num_nodes] if args.num_nodes > 0 else list(hosts.values())
        slots = {args.num_gpus} if args.num_gpus > 0 else set(kept)
        if len(slots) > 1:
            raise InputError(args.hostfile, f"its hosts have different slots ({', '.join(map(str, kept))}): memdiff "
                                            f"reads jobs whose nodes have the same GPUs; give --num_gpus N")
        nodes, per_node = len(kept), slots.pop()
    if (args.force_multi or nodes > 1) and not args.no_ssh and args.launcher.lower() != "pdsh":
        # DeepSpeed's MPI and Slurm runners start the ranks through mpirun or srun, not its launch.py
        raise InputError("--ranks", f"deepspeed's --launcher {args.launcher} starts the ranks with that launcher's "
                                    f"environment, which memdiff does not give: it reads pdsh's (the default) "
                                    f"and --no_ssh's")
    if args.no_python:
        head = [args.user_script]
    elif args.module:
        head = [sys.executable, "-u", "-m", args.user_script]
    else:
        head = [sys.executable, "-u", args.user_script]
    return Launch(nodes, per_node, head + list(args.user_args), launcher=DEEPSPEED,
                  local_rank_after=None if args.no_local_rank else len(head))
