"""`memdiff summarize SNAPSHOT [-o FILE] [--format json|text]`: the versioned summary of one snapshot."""

from __future__ import annotations

import argparse
import sys

from memdiff.analyse.peak import peak_report, source_findings
from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_rules_arguments, rules_from
from memdiff.read.inputs import read_summary
from memdiff.read.window import add_window_arguments
from memdiff.render.json import render_summary
from memdiff.render.text import render_peak

DESCRIPTION = ("Reduce a snapshot to a small, versioned summary: peak, static memory and every "
               "byte live at the peak grouped by stack signature.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", help="snapshot file (pickle or JSON, optionally gzip/bz2/xz)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--format", choices=("json", "text"), default="json", help="output format (default: json)")
    add_rules_arguments(p)
    add_window_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Load, normalize, render; write to stdout or atomically to the output file."""
    if args.output is not None:
        check_output(args.output, inputs=[args.snapshot])
    summary = read_summary(args.snapshot, rules_from(args), window=args.window)
    if args.format == "json":
        text = render_summary(summary)
    else:
        text = render_peak(summary, peak_report(args.snapshot, summary, top=None), source_findings(summary))
    if args.output is not None:
        write_output(args.output, text)
    else:
        sys.stdout.write(text)
    return 0
