"""Argument types and flags shared by subcommands: sizes, percentages, counts, thresholds."""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

from memdiff.classify import Rule, load_rules
from memdiff.errors import InputError
from memdiff.gate import Limit, Thresholds
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


def add_category_threshold_argument(p: argparse.ArgumentParser) -> None:
    """--category-fail-over CAT=SIZE or CAT=P%, repeatable."""
    p.add_argument("--category-fail-over", action="append", default=[], metavar="CAT=LIMIT",
                   help="fail when a category's bytes at the peak grow by more than LIMIT (256MiB, or 10%%); "
                        "give a category twice for both")


def category_limits(values: List[str]) -> Dict[str, Limit]:
    """`["activation=256MiB", "activation=10%"]` -> {"activation": Limit(256 MiB, 10%)}."""
    out: Dict[str, Limit] = {}
    for value in values:
        name, sep, limit = value.partition("=")
        if not sep or not name:
            raise InputError("--category-fail-over", f"{value!r} is not CATEGORY=SIZE or CATEGORY=P%")
        old = out.get(name, Limit())
        try:
            if limit.endswith("%"):
                out[name] = Limit(old.fail_over_bytes, pct_arg(limit))
            else:
                out[name] = Limit(parse_size(limit), old.fail_over_pct)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise InputError("--category-fail-over", f"{name}: {exc}") from None
    return out


def thresholds_from(args: argparse.Namespace, stored: Optional[Thresholds] = None) -> Thresholds:
    """The command line's thresholds; over stored ones, each flag given replaces its part."""
    if stored is None:
        return Thresholds(Limit.from_options(args.fail_over, args.fail_over_pct),
                          category_limits(args.category_fail_over))
    categories = dict(stored.categories)
    categories.update(category_limits(args.category_fail_over))
    return Thresholds(stored.peak.overridden(args.fail_over, args.fail_over_pct), categories, list(stored.sites))
