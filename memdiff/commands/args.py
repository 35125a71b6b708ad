"""Argument types and flags shared by subcommands: sizes, percentages, counts, thresholds."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from memdiff.analyse.classify import Rule, check_categories, findings_chosen, load_rules, read_rule_files
from memdiff.analyse.lifetimes import BACKWARD, FORWARD, OPTIMIZER
from memdiff.compare.findings import DEFAULT_FAIL_ON
from memdiff.compare.limits import DEFAULT_PEAK, Limit, Thresholds, parse_limit, parse_pct, thresholds_over
from memdiff.errors import InputError
from memdiff.lists import LISTS, ListOption, chosen_codes, joined_limit, named_limits
from memdiff.numbers import decimal, whole_number
from memdiff.read.job import Job, discover
from memdiff.units import parse_size

if TYPE_CHECKING:
    from memdiff.github import Publisher


def size_arg(text: str) -> int:
    """argparse type for sizes such as 512MiB, 0.5GiB, 64MB, 1e9B; a number without a unit is bytes and
    deprecated, said in one warning line (a flag's value is a promise: refused only in a later release)."""
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", DeprecationWarning)
            size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    for w in said:
        print(f"memdiff: warning: {w.message}", file=sys.stderr)
    return size


def peak_size_arg(text: str) -> int:
    """--fail-over's type: a size; a percent (`5%`, which the category and phase limits take) is
    pointed to --fail-over-pct, where it read only as not a size."""
    if text.strip().endswith("%"):
        raise argparse.ArgumentTypeError(f"{text!r} is a percent, not a size: give it as --fail-over-pct "
                                         f"{text.strip()[:-1].strip()} (or a size: 512MiB)")
    return size_arg(text)


def budget_arg(text: str) -> int:
    """--budget's type: a size above 0 (`80GiB`); a budget of 0 B fits nothing, so every answer would be
    'no' or 'over budget' for a typo's sake (`0B`, `0.GiB`)."""
    size = size_arg(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is 0 B: a budget is the memory a run may use (e.g. 80GiB)")
    return size


def pct_arg(text: str) -> float:
    """argparse type for a percentage a limit can use (`1`, `2.5`, `3%`)."""
    try:
        return parse_pct(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole_at_least(text: str, low: int, below: str) -> int:
    """The whole number in `text`, at least `low`; argparse's error (`below` saying why) otherwise."""
    try:
        value = whole_number(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text} {below}")
    return value


def count_arg(text: str) -> int:
    """argparse type for a count of at least 1."""
    return _whole_at_least(text, 1, "is not a positive count")


def index_arg(text: str) -> int:
    """argparse type for an index from 0 (a device's)."""
    return _whole_at_least(text, 0, "is not an index: it is negative")


def share_arg(text: str) -> float:
    """argparse type for a plain number (a share such as 0.9); the command checks its range."""
    try:
        return decimal(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_threshold_arguments(p: argparse.ArgumentParser) -> None:
    """--fail-over and --fail-over-pct, shared with the gate."""
    p.add_argument("--fail-over", type=peak_size_arg, metavar="SIZE",
                   help="fail when a peak grows by more than SIZE (512MiB, 0.5GiB, 1e9B)")
    p.add_argument("--fail-over-pct", type=pct_arg, metavar="P",
                   help="fail when a peak grows by more than P percent; with --fail-over both must be "
                        "exceeded (without either: a baseline's own limit, else the default rule, "
                        f"{DEFAULT_PEAK.describe()})".replace("%", "%%"))
    p.add_argument("--fail-on", action=ListOption, nargs="+", metavar="CODE",
                   help="also fail on these findings (codes from `memdiff rule --all`, or a family letter: K); "
                        f"by default {', '.join(DEFAULT_FAIL_ON)} fail (docs/findings.md){LISTS}")
    p.add_argument("--ignore", action=ListOption, nargs="+", metavar="CODE",
                   help="neither show nor fail on these findings (codes, or a family letter; a code named alone "
                        f"wins over its family given to --fail-on, and a code given to both is an error){LISTS}")


def limit_arg(text: str) -> Limit:
    """argparse type for one part of a limit: a percent (`1%`) or a size (`32MiB`)."""
    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_noise_arguments(p: argparse.ArgumentParser) -> None:
    """--noise-margin and --reserved-fail-over, shared by baseline and gate."""
    p.add_argument("--noise-margin", type=limit_arg, metavar="LIMIT",
                   help="over a baseline made from repeated runs whose peaks differ, the default rule fails a peak "
                        "past the runs' highest by more than LIMIT (a percent of the baseline's peak, or a size; "
                        "default: 1%%); a run inside the measured spread always passes")
    add_reserved_argument(p)


def add_reserved_argument(p: argparse.ArgumentParser) -> None:
    """--reserved-fail-over: a limit on the caching allocator's reserved peak."""
    p.add_argument("--reserved-fail-over", action=ListOption, item_type=limit_arg, metavar="LIMIT",
                   help="also fail when the caching allocator's reserved peak grows by more than LIMIT (a size or "
                        "a percent, or both: 64MiB,5%%); by default the gate judges allocated memory only")


def add_rules_arguments(p: argparse.ArgumentParser) -> None:
    """--rules and --custom-profile: user category rules, ranked above the built-in ones."""
    p.add_argument("--rules", action=ListOption, keep_whole=os.path.isfile, metavar="FILE",
                   help=f"category rules file (JSON or TOML; see docs/categories.md){LISTS}")
    p.add_argument("--custom-profile", metavar="JSON",
                   help='categories by regex over frame names and files, e.g. \'{"kv_cache": "KVCache"}\'')


def _rule_files(args: argparse.Namespace) -> List[Tuple[str, Any]]:
    """The --rules files, each read once per command: its categories and its choice of findings
    come from the one reading."""
    if getattr(args, "rule_documents", None) is None:
        args.rule_documents = read_rule_files(getattr(args, "rules", None) or [])
    return args.rule_documents


def rules_from(args: argparse.Namespace) -> List[Rule]:
    """The rules the command line asks for, built-in ones included."""
    return load_rules(_rule_files(args), args.custom_profile)


def add_category_threshold_argument(p: argparse.ArgumentParser) -> None:
    """--category-fail-over CAT=SIZE or CAT=P%, repeatable."""
    p.add_argument("--category-fail-over", action=ListOption, metavar="CAT=LIMIT",
                   help="fail when a category's bytes grow by more than LIMIT (256MiB, or 10%%), each run taken "
                        "where the category is highest (the peak or a phase's peak); give a category twice for "
                        f"both a size and a percent{LISTS}")


GATED_PHASES = (FORWARD, BACKWARD, OPTIMIZER)


def add_phase_threshold_argument(p: argparse.ArgumentParser) -> None:
    """--phase-fail-over PHASE=SIZE or PHASE=P%, repeatable."""
    p.add_argument("--phase-fail-over", action=ListOption, metavar="PHASE=LIMIT",
                   help="fail when the highest memory of a phase (forward, backward, optimizer) over all steps "
                        f"grows by more than LIMIT (512MiB, or 5%%); give a phase twice for both{LISTS}")


def category_limits(values: List[str]) -> Dict[str, Limit]:
    """--category-fail-over values as limits per category."""
    return named_limits(values, "--category-fail-over")


def phase_limits(values: List[str]) -> Dict[str, Limit]:
    """--phase-fail-over values as limits per phase: `["forward=512MiB"]` -> {"forward": Limit(512 MiB)}."""
    return named_limits(values, "--phase-fail-over", GATED_PHASES)


def thresholds_from(args: argparse.Namespace, rules: Sequence[Rule], stored: Optional[Thresholds] = None,
                    stored_from: str = "the baseline") -> Thresholds:
    """The command line's thresholds; over stored ones (read from `stored_from`), each limit given
    replaces its stored one whole (the peak's flags together, a category's or phase's by name).
    A category limit that no rule's category matches is bad input."""
    categories = category_limits(args.category_fail_over)
    check_categories(categories, rules, "--category-fail-over")
    if stored is not None:
        check_categories(stored.categories, rules, stored_from)
    return thresholds_over(stored, args.fail_over, args.fail_over_pct, categories, phase_limits(args.phase_fail_over),
                           getattr(args, "noise_margin", None), reserved_limit(getattr(args, "reserved_fail_over", [])),
                           finding_choices(args))


def finding_choices(args: argparse.Namespace) -> List[Tuple[str, str, List[str], List[str]]]:
    """The choices of findings to fail on or ignore, in the order they apply: each rules file's
    (`findings` in it), then --fail-on and --ignore."""
    files = [(path, path, fail_on, ignore) for path, fail_on, ignore in findings_chosen(_rule_files(args))]
    return files + [("--fail-on", "--ignore", *chosen_codes(args.fail_on, args.ignore, "--fail-on", "--ignore"))]


def reserved_limit(parts: Sequence[Limit]) -> Optional[Limit]:
    """--reserved-fail-over's parts as one limit (a size and a percent: both must be exceeded); None when not given."""
    reserved = None
    for part in parts:
        reserved = joined_limit(reserved or Limit(), part, "--reserved-fail-over")
    return reserved


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """--top, --min-delta and --format, for the commands that print a diff report."""
    p.add_argument("--top", type=count_arg, default=20, metavar="N", help="rows to show per device (default: 20)")
    p.add_argument("--min-delta", type=size_arg, default=0, metavar="SIZE",
                   help="hide rows that changed by less than SIZE (they still count in TOTAL)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="report format (default: text); json rows are never folded")


def add_whatif_argument(p: argparse.ArgumentParser) -> None:
    """--whatif: on a regression, the changes that buy it back (`memdiff whatif` on the head run)."""
    p.add_argument("--whatif", action="store_true",
                   help="on a regression, replay the head run (a snapshot, not a summary) with each change "
                        "`memdiff whatif` knows and add to the report the changes that bring its peak back to "
                        "the base's (or within the rule), smallest saving first, or the one that saves most "
                        "when none is enough")


def add_html_argument(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--html: the self-contained HTML report (both runs over time, the tables, the stacks)."""
    where = (" (with several runs, a folder: one page per run, named after it)" if several else "")
    p.add_argument("--html", metavar="FILE" if not several else "PATH",
                   help="also write a self-contained HTML report (memory over time by category, what is live "
                        f"at the peak, the tables with their stacks; opens offline) to FILE{where}")


def add_github_arguments(p: argparse.ArgumentParser) -> None:
    """--github, --report and the labels that name base and head in the markdown report."""
    p.add_argument("--github", action="store_true",
                   help="in GitHub Actions: job summary, step outputs (verdict, peak-delta-bytes, report) and "
                        "annotations")
    p.add_argument("--report", metavar="FILE", help="also write the markdown report to FILE")
    p.add_argument("--base-label", metavar="TEXT", help="name of the base run in the markdown report "
                                                         "(default with --github: the PR's base commit)")
    p.add_argument("--head-label", metavar="TEXT", help="name of the head run (default with --github: its commit)")


def publisher_from(args: argparse.Namespace, expected: int = 1) -> Optional["Publisher"]:
    """The GitHub publisher the flags ask for, if any."""
    from memdiff.atomic import check_output
    from memdiff.github import Publisher

    if not args.github and args.report is None:
        return None
    if args.report is not None:
        if args.report.lower().endswith((".html", ".htm")):
            # The markdown report under an HTML name opens as a page of raw markdown.
            raise InputError(args.report, "--report writes the markdown report; the HTML report is --html FILE")
        check_output(args.report)
    return Publisher(environ=os.environ if args.github else {}, report_path=args.report,
                     base_label=args.base_label, head_label=args.head_label, expected=expected,
                     annotate=args.github, annotate_on_stderr=getattr(args, "format", None) == "json")


def job_from(args: argparse.Namespace, arg: str, finished: bool = False) -> Job:
    """The job `arg` names, read with the job options; what it leaves out is said on stderr.
    `finished`: a job whose recorded command failed is bad input (a gate or a baseline of a
    crashed job would hold memory up to the crash for the run's)."""
    job = discover(arg, args.rank_pattern, args.allow_missing_ranks)
    unfinished = job.unfinished()
    if finished and unfinished:
        raise InputError(arg, f"{unfinished}, so it is no run to gate or keep as a baseline; record a job "
                              f"that finishes")
    note = job.note()
    if note:
        print(f"memdiff: {arg}: {note}", file=sys.stderr)
    return job


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """How a job (a folder or glob of per-rank files) is read: rank numbers, missing ranks, Dask."""
    p.add_argument("--rank-pattern", metavar="REGEX",
                   help="read each file's rank with this regex (its first group: the digits) instead of the "
                        "documented names (rank3, rank-3, rank3_..., name_3.pickle)")
    p.add_argument("--allow-missing-ranks", action="store_true",
                   help="read a job whose rank numbers have gaps (by default a missing rank is exit 2)")
    p.add_argument("--dask", metavar="ADDRESS",
                   help="summarize the ranks on this Dask scheduler (tcp://host:8786; needs memdiff[dask]); "
                        "its workers read the files from the same paths")
