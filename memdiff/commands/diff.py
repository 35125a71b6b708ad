"""`memdiff BASE HEAD` (or `memdiff diff BASE HEAD`): why does head use more memory than base?"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, List, Optional

from memdiff.atomic import check_output, write_output
from memdiff.classify import Rule
from memdiff.commands.args import (
    add_github_arguments,
    add_html_argument,
    add_job_arguments,
    add_report_arguments,
    add_rules_arguments,
    add_threshold_arguments,
    job_from,
    publisher_from,
    rules_from,
)
from memdiff.differ import MOMENTS, PEAK, Diff, diff, fold
from memdiff.errors import EXIT_OK, EXIT_REGRESSION, InputError
from memdiff.inputs import read_summaries
from memdiff.job import is_job, summarize_ranks
from memdiff.jobdiff import diff_jobs
from memdiff.judge import Limit, Thresholds, Verdict, judge, judge_ranks
from memdiff.model import Summary
from memdiff.render import html as render_html
from memdiff.render import json as render_json
from memdiff.render import markdown as render_markdown
from memdiff.render import ranks as render_ranks
from memdiff.render import text as render_text

if TYPE_CHECKING:  # the publisher is imported only when --github or --report asks for it
    from memdiff.github import Publisher


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
    add_rules_arguments(p)
    add_github_arguments(p)
    add_job_arguments(p)


def render_report(result: Diff, verdict: Verdict, fmt: str, top: int, min_delta: int) -> str:
    """The report in `fmt`; text and markdown fold rows past `top` or under `min_delta`, JSON never does."""
    if fmt == "json":
        return render_json.render_diff(result, verdict)
    folded = {d.device: fold(d, top, min_delta) for d in result.devices}
    renderer = render_markdown if fmt == "markdown" else render_text
    return renderer.render_diff(result, verdict, folded)


def write_html(path: str, result: Diff, verdict: Verdict, base: Summary, head: Summary, top: int, min_delta: int,
               base_label: Optional[str] = None) -> None:
    """The HTML report of one comparison, written atomically to `path`."""
    folded = {d.device: fold(d, top, min_delta) for d in result.devices}
    write_output(path, render_html.render_diff(result, verdict, folded, base, head, base_label))


def _run_jobs(args: argparse.Namespace, rules: List[Rule], publisher: Optional[Publisher]) -> int:
    """Job against job: every rank diffed and judged, the worst shown in full."""
    if not (is_job(args.base) and is_job(args.head)):
        job, run_ = (args.base, args.head) if is_job(args.base) else (args.head, args.base)
        raise InputError(run_, f"is one run and {job} a job (a folder or glob of rank files): compare a job "
                               f"with a job, or one rank's file with a run")
    base_files = job_from(args, args.base).files
    head_files = job_from(args, args.head).files
    base = summarize_ranks(base_files, rules, args.dask, history=bool(args.html))
    head = summarize_ranks(head_files, rules, args.dask, history=bool(args.html))
    job = diff_jobs(base_files, base, head_files, head, at=args.at)
    thresholds = Thresholds(peak=Limit.from_options(args.fail_over, args.fail_over_pct))
    per_rank = {r.rank: judge(r.diff, thresholds) for r in job.ranks}
    verdict = judge_ranks(per_rank, thresholds.describe())
    worst = job.worst
    if args.format == "json":
        sys.stdout.write(json.dumps(render_ranks.job_diff_document(job, verdict, per_rank), indent=2,
                                    ensure_ascii=False) + "\n")
    else:
        report = render_report(worst.diff, per_rank[worst.rank], args.format, args.top, args.min_delta)
        sys.stdout.write(render_ranks.render_job_diff(job, verdict, per_rank, report, args.format == "markdown"))
    if args.html is not None:  # the page shows the worst rank
        b = dict(zip([f.rank for f in base_files], base))[worst.rank]
        h = dict(zip([f.rank for f in head_files], head))[worst.rank]
        write_html(args.html, worst.diff, per_rank[worst.rank], b, h, args.top, args.min_delta)
    if publisher:  # the comment shows the worst rank in full, under the job's verdict
        publisher.add(worst.diff, verdict, args.top, args.min_delta)
        publisher.finish()
    return EXIT_OK if verdict.passed else EXIT_REGRESSION


def run(args: argparse.Namespace) -> int:
    """Read both inputs, align, judge, print; exit 1 on a regression."""
    rules = rules_from(args)
    if args.html is not None:
        check_output(args.html)
    publisher = publisher_from(args)  # its --report checked before the runs are read
    if is_job(args.base) or is_job(args.head):
        return _run_jobs(args, rules, publisher)
    base, head = read_summaries([args.base, args.head], rules, history=bool(args.html))
    result = diff(base, head, at=args.at)
    verdict = judge(result, Thresholds(peak=Limit.from_options(args.fail_over, args.fail_over_pct)))
    sys.stdout.write(render_report(result, verdict, args.format, args.top, args.min_delta))
    if args.html is not None:
        write_html(args.html, result, verdict, base, head, args.top, args.min_delta)
    if publisher:
        publisher.add(result, verdict, args.top, args.min_delta)
        publisher.finish()
    return EXIT_OK if verdict.passed else EXIT_REGRESSION
