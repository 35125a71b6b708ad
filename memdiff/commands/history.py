"""`memdiff history append RUN --to FILE --commit SHA`: keep a run's peaks in the main branch's history."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from memdiff.commands.args import add_rules_arguments, rules_from
from memdiff.compare.baseline import stem
from memdiff.compare.trend import append_entry, entry_of
from memdiff.errors import InputError
from memdiff.inert import text
from memdiff.read.inputs import read_summary
from memdiff.units import count_of, format_bytes

DESCRIPTION = ("Append a run's line to a history file (JSON Lines): the commit, the date, the workload, and per "
               "device the peak and each category's bytes at the peak. Run it on every push to the main branch; "
               "`memdiff gate --history FILE` then shows each workload's last peaks on main as a trend, with the "
               "pull request's point after them.")


def iso_date(value: str) -> str:
    """--date as given, when it is an ISO 8601 date or time (`2026-12-01`, `2026-12-01T06:28:06Z`, git's
    `%cI`); the trend shows it as the date of the line, so `yesterday` is refused, not stored."""
    try:
        datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value[:64]!r} is not an ISO 8601 date: give one such as 2026-12-01 or "
                                         "2026-12-01T06:28:06Z (`git log -1 --format=%cI`)") from None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("action", choices=("append",), help="append: add RUN's line to the history")
    p.add_argument("snapshot", metavar="RUN", help="snapshot or summary of the main-branch run")
    p.add_argument("--to", required=True, metavar="FILE", help="the history file (made when missing)")
    p.add_argument("--commit", required=True, metavar="SHA", help="the commit the run was made from")
    p.add_argument("--workload", metavar="NAME",
                   help="the workload's name (default: RUN's stem, as a baseline's; the gate matches the baseline's "
                        "name)")
    p.add_argument("--date", metavar="ISO", type=iso_date,
                   help="when the run was made, ISO 8601 (default: now, UTC)")
    add_rules_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Summarize the run and append its line atomically."""
    if not args.commit.strip():
        raise InputError("--commit", "empty: give the commit the run was made from")
    workload = args.workload or stem(args.snapshot)
    entry = entry_of(read_summary(args.snapshot, rules_from(args)), args.commit.strip(), workload, args.date)
    lines = append_entry(args.to, entry)
    peaks = ", ".join(f"device {d.device} peak {format_bytes(d.peak_bytes)}" for d in entry.devices)
    print(f"memdiff: {text(args.to)}: appended {text(repr(workload))} at {text(entry.commit[:12])} ({peaks}); "
          f"{count_of(lines, 'line')}", file=sys.stderr)
    return 0
