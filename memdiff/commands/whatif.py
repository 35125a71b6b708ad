"""`memdiff whatif RUN [--change CHANGE ...] [--budget SIZE]`: the peak after a change nobody has made yet;
`memdiff whatif --emulate GPU -o DIR/ -- python train.py ARGS`: the script re-run with each change."""

from __future__ import annotations

import argparse
import sys

from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_rules_arguments, budget_arg, count_arg, rules_from
from memdiff.commands.record import emulate_arg
from memdiff.errors import InputError
from memdiff.lists import LISTS, ListOption
from memdiff.predict.whatif import whatif
from memdiff.render import whatif as render

DESCRIPTION = ("Predict the peak of a run after a change nobody has made yet, from that one run: its trace is "
               "replayed with each allocation the change touches dropped, scaled, moved or added (the forecast's "
               "replay). Changes: checkpoint, checkpoint=F (a fraction of the repeated blocks), weights=bf16|fp16, "
               "autocast=bf16|fp16, optimizer=sgd|sgd-momentum|adam|adamw|adamw-amsgrad|adagrad|rmsprop|adafactor, "
               "step=single|foreach|fused (the update's form), zero-grad=none|zeros, "
               "accumulate=K; several joined by + apply together. Without --change, every "
               "applicable change, sorted by saving. Accuracy on captured pairs: docs/whatif.md. With --emulate GPU "
               "-o DIR/ -- python train.py ARGS, each change is made inside the emulator to the unmodified script "
               "and the script re-run (a run, not a prediction), against its run unchanged; accumulate=K needs "
               "the script's own flag, given as {accumulate} in the command.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", metavar="RUN", nargs="?",
                   help="a snapshot (the profiler route's or a CUDA one); with --emulate, none: give the command")
    p.add_argument("--change", action=ListOption, metavar="CHANGE",
                   help="a change to predict (checkpoint=0.5, weights=bf16, optimizer=sgd, accumulate=4, "
                        f"checkpoint+weights=bf16){LISTS}; default: every applicable one")
    p.add_argument("--budget", type=budget_arg, metavar="SIZE",
                   help="say whether each change fits within SIZE (e.g. 80GiB): its predicted peak times the "
                        "run's reserved over allocated, what the caching allocator holds (a re-run: its reserved peak)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="output format (default: text)")
    p.add_argument("--html", metavar="FILE", help="also write the what-if as a self-contained HTML page to FILE")
    p.add_argument("--emulate", type=emulate_arg, metavar="GPU",
                   help="re-run the command after -- on this emulated GPU with each change made inside the "
                        "emulator, instead of predicting from a recorded run")
    p.add_argument("-o", "--output", metavar="DIR/",
                   help="with --emulate: folder for every run's snapshot and output (baseline.pickle, "
                        "checkpoint-0.5.pickle and .log)")
    p.add_argument("--jobs", type=count_arg, metavar="N",  # None: 2, and told apart from a replay's misuse
                   help="with --emulate: emulated runs at a time (default: 2)")
    add_rules_arguments(p)
    # "*", not REMAINDER: options after RUN stay options; the command follows `--`.
    p.add_argument("command", nargs="*",
                   help="with --emulate: -- python SCRIPT ARGS ({accumulate} where the script takes accumulate=K)")

# `whatif RUN --emulate GPU -o DIR/ -- python train.py`: RUN takes the positional the script's first word
# would, and argparse leaves the script over as unrecognized.
LEFT_AFTER_DASHES = ("give one recorded run (`memdiff whatif run.pickle`) or a script to re-run "
                     "(`memdiff whatif --emulate GPU -o DIR/ -- python train.py`), not both")


def run(args: argparse.Namespace) -> int:
    """Read the run (or re-run the command with each change), replay each change, print."""
    if args.emulate is not None:
        from memdiff.predict.whatif.rerun import rerun

        if args.output is None:
            raise InputError("whatif", "--emulate runs the script: give -o DIR/ for its snapshots and output")
        # argparse gives the command's first word to RUN (the optional positional before it).
        command = ([args.snapshot] if args.snapshot else []) + (args.command[1:] if args.command[:1] == ["--"]
                                                                else args.command)
        if args.html is not None:
            check_output(args.html)
        result = rerun(command, args.emulate, args.output, args.change, rules_from(args), args.budget,
                       args.jobs or 2)
    else:
        if args.snapshot is None or args.command or args.output is not None:
            raise InputError("whatif", "give one recorded run (`memdiff whatif run.pickle`), or --emulate GPU -o "
                                       "DIR/ -- python train.py to re-run a script with each change")
        if args.jobs is not None:
            raise InputError("--jobs", "sets how many emulated runs go at a time: give it with --emulate GPU -o DIR/ "
                                       "-- python train.py (a recorded run is replayed in this process)")
        if args.html is not None:
            check_output(args.html, inputs=[args.snapshot])
        result = whatif(args.snapshot, args.change, rules_from(args), args.budget)
    if args.html:
        write_output(args.html, render.render_html(result))
    shown = {"json": render.render_json, "markdown": render.render_markdown}.get(args.format, render.render_text)
    sys.stdout.write(shown(result))
    return 0
