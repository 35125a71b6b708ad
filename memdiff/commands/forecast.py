"""`memdiff forecast RUN=VALUE RUN=VALUE ... [--at VALUE ...] [--budget SIZE]`: memory at a knob value not run."""

from __future__ import annotations

import argparse
import sys

from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_rules_arguments, budget_arg, count_arg, rules_from
from memdiff.compare.baseline import read_baseline
from memdiff.errors import EXIT_REGRESSION, InputError
from memdiff.lists import LISTS, ListOption
from memdiff.predict.forecast.course import parse_run
from memdiff.predict.forecast.engine import forecast, judge_headroom
from memdiff.read.window import add_window_arguments
from memdiff.render import forecast as render
from memdiff.units import format_bytes

DESCRIPTION = ("Forecast the peak at a batch size or length not run, from runs of one loop that differ in that "
               "one knob: each allocation's size is fitted as a constant, linear or quadratic function of the "
               "knob and the largest run's trace is replayed at the requested value, so the peak may move to "
               "another phase. Also: the largest value whose peak stays within --budget, and the "
               "leave-one-out error of the fit. With --baseline, a gate on the baseline's headroom limit (exit 1 "
               "when the largest value that fits falls below it).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("runs", nargs="+", metavar="RUN=VALUE",
                   help="a snapshot and its knob value (batch size, sequence length, ...): two or more runs")
    p.add_argument("--at", action=ListOption, item_type=count_arg, nargs="+", metavar="VALUE",
                   help="values to forecast (default: twice the largest run's); the first one is the JSON's "
                        f"predicted_peak_bytes{LISTS}")
    p.add_argument("--budget", type=budget_arg, metavar="SIZE",
                   help="also find the largest value whose predicted peak, times the most reserved over allocated "
                        "at a run's peak (the caching allocator's overhead), stays within SIZE (e.g. 80GiB)")
    p.add_argument("--baseline", metavar="FILE",
                   help="check the headroom limit stored in this baseline (thresholds.headroom: the largest value "
                        "within its budget must stay at least min-value); exit 1 when it fails")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="output format (default: text)")
    p.add_argument("--html", metavar="FILE", help="also write the forecast as a self-contained HTML page to FILE")
    add_window_arguments(p)
    add_rules_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Read the runs, forecast, print."""
    runs = [parse_run(r) for r in args.runs]
    if args.html is not None:
        check_output(args.html, inputs=[r.path for r in runs])
    headroom = None
    budget = args.budget
    if args.baseline is not None:
        headroom = read_baseline(args.baseline).thresholds.headroom
        if headroom is None:
            raise InputError(args.baseline, 'no headroom limit to check: add "headroom": {"budget": "80GiB", '
                                            '"min-value": 32} to its thresholds')
        if budget is not None and budget != headroom.budget_bytes:
            raise InputError("--budget", f"the baseline's headroom limit has its own budget "
                                         f"({format_bytes(headroom.budget_bytes)}): give one or the other")
        budget = headroom.budget_bytes
    result = forecast(runs, args.at, rules_from(args), budget, args.window)
    if headroom is not None:
        result = judge_headroom(result, args.baseline, headroom)
    if args.html:
        write_output(args.html, render.render_html(result))
    shown = {"json": render.render_json, "markdown": render.render_markdown}.get(args.format, render.render_text)
    sys.stdout.write(shown(result))
    return EXIT_REGRESSION if result.headroom is not None and not result.headroom.passed else 0
