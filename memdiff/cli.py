"""The `memdiff` command: parse arguments, run one subcommand, map failures to exit codes.

Exit codes: 0 no regression, 1 regression, 2 bad input or usage, 3 internal error (a bug).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import List, Optional

from memdiff import __version__
from memdiff.commands import peak, summarize
from memdiff.errors import InputError

COMMANDS = (summarize, peak)
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser = argparse.ArgumentParser(
        prog="memdiff", parents=[common],
        description="Peak summaries, diffs and CI gates for PyTorch GPU-memory snapshots.")
    parser.add_argument("--version", action="version", version=f"memdiff {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.add_parser(sub, [common])
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run memdiff with `argv` (default: sys.argv[1:]) and return the exit code."""
    args = build_parser().parse_args(argv)
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
