"""The `memdiff` command: parse arguments, run one subcommand, map failures to exit codes.

Exit codes: 0 no regression, 1 regression, 2 bad input or usage, 3 internal error (a bug).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import List, Optional

from memdiff import __version__
from memdiff.commands import baseline, demo, diff, gate, peak, record, summarize
from memdiff.errors import InputError

COMMANDS = (diff, gate, baseline, summarize, peak, record, demo)
DEFAULT_COMMAND = "diff"
TOP_LEVEL_FLAGS = {"--debug", "--version", "-h", "--help"}
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    # SUPPRESS: a subcommand's default must not overwrite `memdiff --debug COMMAND`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    parser = argparse.ArgumentParser(
        prog="memdiff", usage="memdiff [--debug] {BASE HEAD | COMMAND ...}",
        description="Peak summaries, diffs and CI gates for PyTorch GPU-memory snapshots. "
                    "`memdiff BASE HEAD` is `memdiff diff BASE HEAD`.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"memdiff {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.add_parser(sub, [common])
    return parser


def with_default_command(argv: List[str], commands: List[str]) -> List[str]:
    """Insert `diff` where a command name is expected but something else stands (memdiff BASE HEAD)."""
    for i, arg in enumerate(argv):
        if arg in TOP_LEVEL_FLAGS:
            continue
        if arg not in commands:
            return argv[:i] + [DEFAULT_COMMAND] + argv[i:]
        break
    return argv


def main(argv: Optional[List[str]] = None) -> int:
    """Run memdiff with `argv` (default: sys.argv[1:]) and return the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = [name for action in parser._subparsers._group_actions for name in action.choices]
    args = parser.parse_args(with_default_command(argv, commands))
    try:
        return args.run(args)
    except InputError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"memdiff: {exc.path}: {exc.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; nothing left to say.
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug in memdiff: say so in one line unless --debug
        if args.debug:
            traceback.print_exc()
        print(f"memdiff: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback; "
              f"please report it)", file=sys.stderr)
        return EXIT_INTERNAL
