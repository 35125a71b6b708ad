"""`memdiff BASE HEAD` (or `memdiff diff BASE HEAD`): why does head use more memory than base?"""

from __future__ import annotations

import argparse
import sys

from memdiff.commands.args import (add_github_arguments, add_rules_arguments, add_threshold_arguments, count_arg,
                                   publisher_from, rules_from, size_arg)
from memdiff.diff import Diff, diff, fold
from memdiff.gate import Limit, Thresholds, Verdict, judge
from memdiff.inputs import read_summaries
from memdiff.render import json as render_json
from memdiff.render import markdown as render_markdown
from memdiff.render import text as render_text

EXIT_REGRESSION = 1


DESCRIPTION = ("Align two runs by stack signature and explain the peak difference. Either input "
               "may be a snapshot or a summary JSON. Exit 1 when a peak grew beyond the rule.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("base", help="the run to compare against (snapshot or summary)")
    p.add_argument("head", help="the new run (snapshot or summary)")
    p.add_argument("--top", type=count_arg, default=20, metavar="N", help="rows to show per device (default: 20)")
    p.add_argument("--min-delta", type=size_arg, default=0, metavar="SIZE",
                   help="hide rows that changed by less than SIZE (they still count in TOTAL)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="report format (default: text); json rows are never folded")
    add_threshold_arguments(p)
    add_rules_arguments(p)
    add_github_arguments(p)


def render_report(result: Diff, verdict: Verdict, fmt: str, top: int, min_delta: int) -> str:
    """The report in `fmt`; text and markdown fold rows past `top` or under `min_delta`, JSON never does."""
    if fmt == "json":
        return render_json.render_diff(result, verdict)
    folded = {d.device: fold(d, top, min_delta) for d in result.devices}
    renderer = render_markdown if fmt == "markdown" else render_text
    return renderer.render_diff(result, verdict, folded)


def run(args: argparse.Namespace) -> int:
    """Read both inputs, align, judge, print; exit 1 on a regression."""
    rules = rules_from(args)
    base, head = read_summaries([args.base, args.head], rules)
    result = diff(base, head)
    verdict = judge(result, Thresholds(peak=Limit.from_options(args.fail_over, args.fail_over_pct)))
    sys.stdout.write(render_report(result, verdict, args.format, args.top, args.min_delta))
    publisher = publisher_from(args)
    if publisher:
        publisher.add(result, verdict, args.top, args.min_delta)
        publisher.finish()
    return 0 if verdict.passed else EXIT_REGRESSION
