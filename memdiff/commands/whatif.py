"""`memdiff whatif RUN [--change CHANGE ...] [--budget SIZE]`: the peak after a change nobody has made yet."""

from __future__ import annotations

import argparse
import sys

from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_rules_arguments, rules_from, size_arg
from memdiff.lists import LISTS, ListOption
from memdiff.predict.whatif import whatif
from memdiff.render import whatif as render

DESCRIPTION = ("Predict the peak of a run after a change nobody has made yet, from that one run: its trace is "
               "replayed with each allocation the change touches dropped, scaled, moved or added (the forecast's "
               "replay). Changes: checkpoint, checkpoint=F (a fraction of the repeated blocks), weights=bf16|fp16, "
               "autocast=bf16|fp16, optimizer=sgd|sgd-momentum|adam|adamw|adamw-amsgrad|adagrad|rmsprop|adafactor, "
               "zero-grad=none|zeros, accumulate=K; several joined by + apply together. Without --change, every "
               "applicable change, sorted by saving. Accuracy on captured pairs: docs/whatif.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", metavar="RUN", help="a snapshot (the profiler route's or a CUDA one)")
    p.add_argument("--change", action=ListOption, metavar="CHANGE",
                   help="a change to predict (checkpoint=0.5, weights=bf16, optimizer=sgd, accumulate=4, "
                        f"checkpoint+weights=bf16){LISTS}; default: every applicable one")
    p.add_argument("--budget", type=size_arg, metavar="SIZE",
                   help="say whether each predicted peak fits within SIZE (e.g. 80GiB)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="output format (default: text)")
    p.add_argument("--html", metavar="FILE", help="also write the what-if as a self-contained HTML page to FILE")
    add_rules_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Read the run, replay each change, print."""
    if args.html is not None:
        check_output(args.html, inputs=[args.snapshot])
    result = whatif(args.snapshot, args.change, rules_from(args), args.budget)
    if args.html:
        write_output(args.html, render.render_html(result))
    shown = {"json": render.render_json, "markdown": render.render_markdown}.get(args.format, render.render_text)
    sys.stdout.write(shown(result))
    return 0
