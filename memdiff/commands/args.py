"""Argument types and flags shared by subcommands: sizes, percentages, counts, thresholds."""

from __future__ import annotations

import argparse
from typing import List

from memdiff.classify import Rule, load_rules
from memdiff.units import parse_size


def size_arg(text: str) -> int:
    """argparse type for sizes such as 512MiB, 0.5GiB, 64MB, 1e9."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pct_arg(text: str) -> float:
    """argparse type for a non-negative percentage (`1`, `2.5`, `3%`)."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage: it is negative")
    return value


def count_arg(text: str) -> int:
    """argparse type for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count")
    return value


def add_threshold_arguments(p: argparse.ArgumentParser) -> None:
    """--fail-over and --fail-over-pct, shared with the gate."""
    p.add_argument("--fail-over", type=size_arg, metavar="SIZE",
                   help="fail when a peak grows by more than SIZE (512MiB, 0.5GiB, 1e9 bytes)")
    p.add_argument("--fail-over-pct", type=pct_arg, metavar="P",
                   help="fail when a peak grows by more than P percent; with --fail-over both must be "
                        "exceeded (default without either: 1%% and 64MiB)")


def add_rules_arguments(p: argparse.ArgumentParser) -> None:
    """--rules and --custom-profile: user category rules, ranked above the built-in ones."""
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="category rules file (JSON or TOML; see README, Categories); may repeat")
    p.add_argument("--custom-profile", metavar="JSON",
                   help='categories by regex over frame names and files, e.g. \'{"kv_cache": "KVCache"}\'')


def rules_from(args: argparse.Namespace) -> List[Rule]:
    """The rules the command line asks for, built-in ones included."""
    return load_rules(args.rules, args.custom_profile)
