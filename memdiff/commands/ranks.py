"""`memdiff ranks JOB`: every rank of a distributed job side by side, and why the heaviest is heaviest."""

from __future__ import annotations

import argparse
import sys

from memdiff.commands.args import (
    add_job_arguments,
    add_rules_arguments,
    count_arg,
    job_from,
    pct_arg,
    rules_from,
    size_arg,
)
from memdiff.compare.judge import imbalance_check
from memdiff.compare.ranks import compare_ranks
from memdiff.errors import EXIT_OK, EXIT_REGRESSION
from memdiff.read.job import summarize_ranks
from memdiff.read.window import add_window_arguments
from memdiff.render import ranks as render_ranks
from memdiff.report.ranks import shown_ranks

DESCRIPTION = ("Read a job (a folder or glob of per-rank snapshots or summaries; the rank comes from each "
               "file name) and show per rank the peak, where it is, static and category bytes; the spread "
               "across ranks; ranks grouped by shape; and the heaviest rank diffed against the median one. "
               "Exit 1 when --fail-imbalance is exceeded.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("job", help="a folder of rank files, or a glob ('runs/rank*.pickle'; quote it)")
    p.add_argument("--fail-imbalance", type=pct_arg, metavar="P",
                   help="exit 1 when the heaviest rank's peak exceeds the median rank's by more than P percent")
    p.add_argument("--top", type=count_arg, default=10, metavar="N",
                   help="rows of the heaviest-vs-median diff to show (default: 10)")
    p.add_argument("--min-delta", type=size_arg, default=0, metavar="SIZE",
                   help="hide diff rows that changed by less than SIZE")
    p.add_argument("--format", choices=("text", "json"), default="text", help="report format (default: text)")
    add_job_arguments(p)
    add_rules_arguments(p)
    add_window_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Summarize every rank, compare them, print; exit 1 over the imbalance limit."""
    rules = rules_from(args)
    job = job_from(args, args.job)
    summaries = summarize_ranks(job.files, rules, args.dask, window=args.window)
    report = compare_ranks(job.files, summaries, job.missing)
    check = (imbalance_check(report.median_bytes, report.max_bytes, args.fail_imbalance)
             if args.fail_imbalance is not None else None)
    if args.format == "json":
        sys.stdout.write(render_ranks.render_json(report, check))
    else:
        sys.stdout.write(render_ranks.render_text(shown_ranks(report, args.top, args.min_delta, check)))
    return EXIT_OK if check is None or check.passed else EXIT_REGRESSION
