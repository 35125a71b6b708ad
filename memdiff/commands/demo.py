"""`memdiff demo`: record the example GPT twice (plain, then with activation checkpointing) and diff them."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from memdiff.analyse.classify import load_rules
from memdiff.atomic import make_folder
from memdiff.commands.diff import write_html
from memdiff.errors import InputError
from memdiff.read.inputs import read_summary
from memdiff.recording.capture import record
from memdiff.render import render
from memdiff.report.build import Run, Settings, compare

RUNS = (("baseline", False), ("checkpointing", True))


DESCRIPTION = ("Train the example GPT (memdiff.examples.gpt) for two steps, once plainly and once with "
               "activation checkpointing, record both (CUDA when available, else CPU), and show the diff. "
               "Needs torch.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("--dir", metavar="DIR", help="where to keep the two snapshots (default: a new temporary folder)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="where to train (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    """Record both runs with progress on stderr, then print the diff."""
    from memdiff.recording.capture import torch_module

    if args.dir is not None:  # before the minutes of training, not after
        make_folder(args.dir)
    torch = torch_module()  # without torch: exit 2 saying how to install it
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda", f"no CUDA device here (torch {torch.__version__}, "
                                          f"CUDA available: no): run with --device cpu")
    from memdiff.examples.gpt import Config, train  # imports torch: only when the demo runs

    folder = args.dir if args.dir is not None else tempfile.mkdtemp(prefix="memdiff-demo-")
    paths = []
    for name, ckpt in RUNS:
        path = os.path.join(folder, f"gpt-{name}.pickle")
        # Whole lines: flushed at once, so the progress shows in a CI log as it happens.
        print(f"memdiff demo: recording the example GPT ({name}) ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with record(path):
            train(Config(activation_checkpointing=ckpt), steps=2, batch=8, seq=128, device=args.device)
        print(f"memdiff demo: recorded {name} in {time.perf_counter() - start:.1f} s -> {path}", file=sys.stderr,
              flush=True)
        paths.append(path)
    rules = load_rules()
    base, head = (read_summary(p, rules, history=True) for p in paths)
    report = compare([Run(base)], [Run(head)], Settings(top=10))
    sys.stdout.write(render(report, "text"))
    page = os.path.join(folder, "report.html")
    write_html(page, report)
    print(f"\nmemdiff demo: open {page} for both runs over time, or try `memdiff peak {paths[0]}`",
          file=sys.stderr)
    return 0 if report.passed else 1
