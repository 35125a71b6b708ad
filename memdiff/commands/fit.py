"""`memdiff fit --emulate h100,l4 -o runs/ -- python train.py --batch-size {batch}`: the largest value that trains."""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

from memdiff.atomic import check_output, write_output
from memdiff.commands.args import add_rules_arguments, count_arg, rules_from, share_arg
from memdiff.commands.record import emulate_arg
from memdiff.errors import EXIT_OK, EXIT_REGRESSION, InputError
from memdiff.lists import LISTS, ListOption
from memdiff.predict.fit import (
    DEFAULT_RANGE,
    FEWEST_KNOBS,
    FEWEST_RANGE,
    NPROC,
    WHOLE_JOB_RANKS,
    Grid,
    fixed,
    knob_of,
    parse_range,
    parse_set,
    run_fit,
)
from memdiff.predict.fit_gate import gated, read_fit
from memdiff.recording.emulate.gpus import gpu
from memdiff.recording.emulate.gpus import names as gpu_names
from memdiff.render import fit as render
from memdiff.render.fit_html import render_fit_html

DESCRIPTION = ("Find, for each emulated GPU, the largest value of the command's placeholder ({batch}, or any "
               "{name}) whose run of the unmodified script trains without running out of memory: a forecast from "
               "the two smallest values, then the runs that confirm the boundary (the largest value that fits and "
               "the next that does not), never more per GPU than bisection over the values would make plus four (18 "
               "on 1:4096). Each run is `memdiff record --emulate GPU` in a fresh process; its "
               "snapshot and output are kept in -o DIR/. Exit 0 when every GPU fits a value, 1 when one fits not "
               "even the smallest or --baseline's value dropped, 2 when the script fails for another reason than "
               "memory.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--emulate", required=True, action=ListOption, item_type=emulate_arg, metavar="GPU",
                   help=f"the GPUs to fit on (of {', '.join(gpu_names())}){LISTS}")
    p.add_argument("-o", "--output", required=True, metavar="DIR/",
                   help="folder for every run's snapshot and output: GPU-NAMEVALUE.pickle and .log (l4-batch8.pickle)")
    p.add_argument("--range", action=ListOption, metavar="NAME=LOW:HIGH",
                   help=f"the values the placeholder may take (default: {DEFAULT_RANGE[0]}:{DEFAULT_RANGE[1]}){LISTS}")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--multiple", type=count_arg, default=1, metavar="N",
                      help="only multiples of N (8: batch sizes a tensor core likes)")
    step.add_argument("--pow2", action="store_true", help="only powers of two")
    p.add_argument("--max-memory", type=share_arg, default=1.0, metavar="F",
                   help="a value fits only when its reserved peak (what the caching allocator holds, what runs "
                        "out) stays within F of the GPU's capacity (0.9 leaves 10%% headroom; default 1: it runs "
                        "without running out of memory)")
    p.add_argument("--nproc", type=count_arg, metavar="N",
                   help="a launched job's process count, put where the command says {nproc} (`torchrun "
                        "--nproc-per-node {nproc} train.py --batch-size {batch}`), for a search of another knob; "
                        "with {nproc} as the knob, fit finds the fewest processes on which every rank fits "
                        f"(default range {FEWEST_RANGE[0]}:{FEWEST_RANGE[1]})")
    p.add_argument("--set", action=ListOption, metavar="NAME=VALUE",
                   help="fix a placeholder fit does not search (`--set tp=8 --set pp=2` with {dp} searched); "
                        "{nodes}, {tp}, {pp} and {dp} as the knob are searched as {nproc} is, for the fewest "
                        f"that fits (default range {FEWEST_RANGE[0]}:{FEWEST_RANGE[1]}); a job of several nodes or "
                        f"over {WHOLE_JOB_RANKS} ranks (torchrun's, or a script's Lightning launcher's), and any "
                        f"whose {{nodes}} is searched, runs only the ranks `memdiff record --ranks auto` picks{LISTS}")
    p.add_argument("--jobs", type=count_arg, default=2, metavar="N", help="emulated runs at a time (default: 2)")
    p.add_argument("--baseline", metavar="FILE",
                   help="a fit result (`memdiff fit ... --format json`): exit 1 when a GPU's largest value is "
                        "below it (finding G011)")
    p.add_argument("--html", metavar="FILE",
                   help="also write a self-contained page plotting each run's allocated and reserved peak against "
                        "the knob per GPU, with the GPU's capacity as a line")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="output format (default: text)")
    add_rules_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python SCRIPT ARGS with a placeholder: --batch-size {batch}")


def run(args: argparse.Namespace) -> int:
    """Fit, print, and exit by what was found."""
    keys: List[str] = []
    keys += [k for k in args.emulate if k not in keys]
    if not keys:
        raise InputError("--emulate", "name at least one GPU")
    ranges: Dict[str, Tuple[int, int]] = dict(parse_range(r) for r in args.range)
    command = args.command[1:] if args.command and args.command[0] == "--" else args.command
    if not command:
        raise InputError("fit", "nothing to run: give `-- python train.py --batch-size {batch}`")
    if args.nproc is not None:
        if not any("{" + NPROC + "}" in arg for arg in command):
            raise InputError("--nproc", "the command has no {nproc} to put it in: `-- torchrun --nproc-per-node "
                                        "{nproc} train.py --batch-size {batch}`")
        command = fixed(command, {NPROC: args.nproc})
    command = fixed(command, dict(parse_set(s) for s in args.set))
    knob = knob_of(command, ranges)
    low, high = ranges.get(knob, FEWEST_RANGE if knob in FEWEST_KNOBS else DEFAULT_RANGE)
    grid = Grid(knob, low, high, 1 if args.pow2 else args.multiple, args.pow2)
    baseline = read_fit(args.baseline) if args.baseline is not None else None  # read before any run
    if args.html is not None:
        check_output(args.html)
    result = run_fit(command, [gpu(k) for k in keys], args.output, grid, args.max_memory, rules_from(args),
                     args.jobs, say=lambda line: print(f"memdiff: {line}", file=sys.stderr, flush=True))
    if baseline is not None:
        result = gated(result, baseline, args.baseline)
    if args.html is not None:
        write_output(args.html, render_fit_html(result))
    shown = {"json": render.render_json, "markdown": render.render_markdown}.get(args.format, render.render_text)
    sys.stdout.write(shown(result))
    if result.passed is False or any(g.value is None for g in result.gpus):
        return EXIT_REGRESSION
    return EXIT_OK
