"""`memdiff record -o run.pickle -- python train.py ARGS`: run a script with memory recording on."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import sys
import traceback
from typing import List

from memdiff.capture import STACKS, record
from memdiff.commands.args import count_arg
from memdiff.errors import InputError
from memdiff.load import load
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
    """The script or module to run, checked before anything is recorded (a typo must not cost a
    training run, nor replace a snapshot with a recording of nothing)."""
    if command and command[0] == "--":
        command = command[1:]
    if command and PYTHON.match(os.path.basename(command[0])):
        command = command[1:]
    elif command and not command[0].endswith(".py") and command[0] != "-m":
        raise InputError("record", f"`{command[0]}` is not python: memdiff records a Python script in this "
                                   f"process (`-- python train.py ARGS` or `-- python -m MODULE ARGS`)")
    if not command or (command[0] == "-m" and len(command) < 2):
        raise InputError("record", "nothing to run: give `-- python SCRIPT ARGS` or `-- python -m MODULE ARGS`")
    if command[0] == "-c":
        raise InputError("record", "`python -c` is not supported: put the code in a file and give its path")
    if command[0] == "-m":
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(command[1]) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise InputError(command[1], "no such module (run from the folder it is importable from)")
    elif not os.path.isfile(command[0]):
        raise InputError(command[0], "no such script")
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
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except Exception:  # the user's program failed: show its traceback as python would
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _recorded_nothing(path: str) -> bool:
    """Whether a fresh snapshot holds no allocation at all (no trace event, no live block)."""
    snapshot = load(path)
    return not any(snapshot.device_traces) and not any(
        b.get("state") == "active_allocated" for s in snapshot.segments for b in s.get("blocks", []))


def run(args: argparse.Namespace) -> int:
    """Record the target and report where the snapshot went."""
    target = _target(args.command)
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)  # a run's snapshot is never lost to a missing folder
    partial = os.path.join(folder, f".{os.path.basename(args.output)}.recording")
    with record(partial, max_entries=args.max_entries, stacks=args.stacks):
        status = _run_target(target)
    if os.path.exists(args.output) and _recorded_nothing(partial):
        os.unlink(partial)
        print(f"memdiff: the run recorded no allocation; kept the existing {args.output}", file=sys.stderr)
        return status
    os.replace(partial, args.output)
    size = os.path.getsize(args.output)
    print(f"memdiff: wrote {args.output} ({format_bytes(size)}); read it with `memdiff peak {args.output}`",
          file=sys.stderr)
    return status
