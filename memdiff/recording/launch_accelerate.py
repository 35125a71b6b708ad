"""Some ranks of an `accelerate launch` job: its command read for the job it describes (--ranks).

`accelerate launch --multi_gpu --num_processes 16 --num_machines 2 --machine_rank 0 train.py` (or one
with `--use_fsdp`, or whose accelerate config says so) starts torchrun with an environment of its own
(ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP, FSDP_*, ...) that the script's Accelerator reads. That
environment is accelerate's to make, from its options, its config file and its defaults: so the command
is read with accelerate's own parser and checks, and each rank is given the environment accelerate's
own `prepare_multi_gpu_env` makes, under torchrun's per-rank one (launch.py). `--num_processes` counts
the processes of all machines, as accelerate's does.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from typing import Any, List

from memdiff.errors import InputError
from memdiff.recording.launch import Launch


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
            args = _validate_launch_command(launch_command_parser().parse_args(options))[0]
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        raise InputError("--ranks", f"accelerate launch refuses the command: {lines[-1] if lines else options}") \
            from None
    except ValueError as exc:
        raise InputError("--ranks", f"accelerate launch refuses the command: {exc}") from None
    try:
        if args.use_deepspeed and not args.cpu:
            raise InputError("--ranks", "accelerate launch with DeepSpeed starts DeepSpeed's launcher, which "
                                        "memdiff does not read yet: run the whole job, or give torchrun's command")
        if args.cpu or not (args.multi_gpu or args.use_fsdp or args.use_megatron_lm):
            raise InputError("--ranks", f"this accelerate launch starts one process ({args.num_processes} "
                                        f"process(es) asked, no --multi_gpu or --use_fsdp): no ranks to pick from")
        with warnings.catch_warnings():  # a port in use on this machine: the ranks run alone use none
            warnings.simplefilter("ignore")
            env = prepare_multi_gpu_env(args)
    except (ValueError, RuntimeError, ConnectionError) as exc:
        raise InputError("--ranks", f"accelerate launch refuses the command: {exc}") from None
    ours = {k: v for k, v in env.items() if os.environ.get(k) != v}  # what accelerate adds for its ranks
    return Launch(int(args.num_machines), int(args.nproc_per_node), _target(args), ours)


def _target(args: Any) -> List[str]:
    """What each rank runs, as accelerate's torchrun would run it."""
    rest = [args.training_script, *args.training_script_args]
    if args.no_python:
        return rest
    if args.module:
        return [sys.executable, "-m", *rest]
    return [sys.executable, "-u", *rest]

