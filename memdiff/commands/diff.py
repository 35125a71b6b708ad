"""`memdiff BASE HEAD` (or `memdiff diff BASE HEAD`): why does head use more memory than base?"""

from __future__ import annotations

import argparse
import sys
from typing import List, Tuple

from memdiff.analyse.classify import Rule
from memdiff.atomic import check_output, write_output
from memdiff.commands.args import (
    add_github_arguments,
    add_html_argument,
    add_job_arguments,
    add_report_arguments,
    add_reserved_argument,
    add_rules_arguments,
    add_threshold_arguments,
    add_whatif_argument,
    finding_choices,
    job_from,
    publisher_from,
    reserved_limit,
    rules_from,
)
from memdiff.compare.differ import MOMENTS
from memdiff.compare.limits import Limit, Thresholds, thresholds_over
from memdiff.compare.observe import PEAK
from memdiff.errors import EXIT_OK, EXIT_REGRESSION, InputError
from memdiff.read.inputs import read_summaries
from memdiff.read.job import is_job, summarize_ranks
from memdiff.read.window import add_window_arguments
from memdiff.render import render
from memdiff.report.build import Report, Run, Settings, compare

DESCRIPTION = ("Align two runs by stack signature and explain the peak difference. Either input "
               "may be a snapshot or a summary JSON. Exit 1 when a peak grew beyond the rule.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("base", help="the run to compare against (snapshot or summary), or a job: a folder or glob "
                                "of rank files, compared rank by rank with a job as head")
    p.add_argument("head", help="the new run (snapshot or summary), or a job")
    p.add_argument("--at", choices=MOMENTS, default=PEAK,
                   help="compare what is live at each run's peak (default), or at the peak of one phase in "
                        "both runs: like with like when the peaks fall in different phases")
    add_report_arguments(p)
    add_html_argument(p)
    add_threshold_arguments(p)
    add_reserved_argument(p)
    add_rules_arguments(p)
    add_github_arguments(p)
    add_job_arguments(p)
    add_window_arguments(p)
    add_whatif_argument(p)


def write_html(path: str, report: Report) -> None:
    """The HTML report of one comparison, written atomically to `path`."""
    write_output(path, render(report, "html"))


def _sides(args: argparse.Namespace, rules: List[Rule]) -> Tuple[List[Run], List[Run]]:
    """Both inputs as runs: a run each, or a job's runs by rank each."""
    history = bool(args.html)
    if not (is_job(args.base) or is_job(args.head)):
        base, head = read_summaries([args.base, args.head], rules, history=history, window=args.window)
        return [Run(base)], [Run(head)]
    if not (is_job(args.base) and is_job(args.head)):
        job, run_ = (args.base, args.head) if is_job(args.base) else (args.head, args.base)
        raise InputError(run_, f"is one run and {job} a job (a folder or glob of rank files): compare a job "
                               f"with a job, or one rank's file with a run")
    sides = []
    for arg in (args.base, args.head):
        files = job_from(args, arg).files
        summaries = summarize_ranks(files, rules, args.dask, history, args.window)
        sides.append([Run(s, f.rank) for f, s in zip(files, summaries)])
    return sides[0], sides[1]


def run(args: argparse.Namespace) -> int:
    """Read both inputs, align, judge, print; exit 1 on a regression."""
    rules = rules_from(args)
    if args.html is not None:
        check_output(args.html, inputs=[args.base, args.head])
    publisher = publisher_from(args)  # its --report checked before the runs are read
    base, head = _sides(args, rules)
    thresholds = Thresholds(peak=Limit.from_options(args.fail_over, args.fail_over_pct),
                            reserved=reserved_limit(args.reserved_fail_over),
                            findings=thresholds_over(None, None, None, {}, {}, choices=finding_choices(args)).findings)
    report = compare(base, head, Settings(thresholds=thresholds, at=args.at, top=args.top, min_delta=args.min_delta,
                                          whatif_run=args.head if args.whatif else None, rules=rules,
                                          window=args.window))
    sys.stdout.write(render(report, args.format))
    if args.html is not None:
        write_html(args.html, report)
    if publisher:
        publisher.add(report)
        publisher.finish()
    return EXIT_OK if report.passed else EXIT_REGRESSION
