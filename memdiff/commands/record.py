"""`memdiff record -o run.pickle -- python train.py ARGS`: run a script with memory recording on."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import traceback
from typing import List

from memdiff.capture import STACKS, record
from memdiff.commands.args import count_arg
from memdiff.errors import InputError
from memdiff.units import format_bytes

PYTHON = re.compile(r"^python(\d+(\.\d+)?)?(\.exe)?$")


DESCRIPTION = ("Run a script (`-- python train.py ARGS` or `-- python -m pkg.module ARGS`) in this "
               "process with memory recording on: CUDA's allocator history when a GPU is present, "
               "else PyTorch's profiler. The snapshot is written even when the script fails. Exits "
               "with the script's status.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="snapshot file to write")
    p.add_argument("--max-entries", type=count_arg, default=1_000_000, metavar="N",
                   help="CUDA ring buffer size in trace entries (default: 1000000)")
    p.add_argument("--stacks", choices=STACKS, default="all",
                   help="CUDA stacks: all (the default: C++ frames name autograd nodes) or python "
                        "(when the C++ unwinder crashes)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python SCRIPT ARGS | -- python -m MODULE ARGS")


def _target(command: List[str]) -> List[str]:
    if command and command[0] == "--":
        command = command[1:]
    if command and PYTHON.match(os.path.basename(command[0])):
        command = command[1:]
    if not command or (command[0] == "-m" and len(command) < 2):
        raise InputError("record", "nothing to run: give `-- python SCRIPT ARGS` or `-- python -m MODULE ARGS`")
    return command


def _run_target(target: List[str]) -> int:
    """Run the script or module as `python` would; its exit status."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            if not os.path.isfile(target[0]):
                raise InputError(target[0], "no such script")
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except InputError:
        raise
    except Exception:  # the user's program failed: show its traceback as python would
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run(args: argparse.Namespace) -> int:
    """Record the target and report where the snapshot went."""
    target = _target(args.command)
    with record(args.output, max_entries=args.max_entries, stacks=args.stacks):
        status = _run_target(target)
    size = os.path.getsize(args.output)
    print(f"memdiff: wrote {args.output} ({format_bytes(size)}); read it with `memdiff peak {args.output}`",
          file=sys.stderr)
    return status
