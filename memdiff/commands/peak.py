"""`memdiff peak SNAPSHOT [--top N] [--device D]`: what is live at the peak, for chasing an OOM."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from memdiff.analyse.peak import peak_findings, peak_report, source_findings
from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_html_argument, add_rules_arguments, count_arg, index_arg, rules_from
from memdiff.read.inputs import read_summary
from memdiff.read.window import add_window_arguments
from memdiff.render.html import render_peak as render_peak_html
from memdiff.render.json import render_summary
from memdiff.render.text import render_peak

DESCRIPTION = ("Show per device the peak (as PyTorch's memory viewer counts it), static memory, "
               "where the peak happens and the top stack groups live at the peak.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", help="snapshot file (pickle or JSON, optionally gzip/bz2/xz)")
    p.add_argument("--top", type=count_arg, default=10, metavar="N", help="groups to list (default: 10)")
    p.add_argument("--device", type=index_arg, metavar="D", help="only this device index")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text (default), or json: the summary of the devices shown (the contract of "
                        "`memdiff summarize`)")
    add_html_argument(p)
    add_rules_arguments(p)
    add_window_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Load, normalize and print the peak report."""
    if args.html is not None:
        check_output(args.html, inputs=[args.snapshot])
    summary = read_summary(args.snapshot, rules_from(args), history=bool(args.html), window=args.window)
    peaks = peak_report(args.snapshot, summary, args.top, args.device)
    run_findings = source_findings(summary)  # about the run as a whole: every output shows them
    if args.html:
        write_output(args.html, render_peak_html(summary, peaks, run_findings))
    if args.format == "json":
        shown = {p.device.device for p in peaks}
        sys.stdout.write(render_summary(replace(summary, devices=[d for d in summary.devices if d.device in shown]),
                                        peak_findings(run_findings, peaks)))
    else:
        sys.stdout.write(render_peak(summary, peaks, run_findings))
    return 0
