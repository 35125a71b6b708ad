"""`memdiff baseline SNAPSHOT -o baselines/NAME.json`: create or update a baseline; `--check DIR` validates."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Dict, List, Union

from memdiff.analyse.classify import Rule, check_categories
from memdiff.commands.args import (
    add_category_threshold_argument,
    add_job_arguments,
    add_noise_arguments,
    add_phase_threshold_argument,
    add_rules_arguments,
    add_threshold_arguments,
    job_from,
    rules_from,
    thresholds_from,
)
from memdiff.compare.baseline import read_baseline, update_baseline
from memdiff.compare.findings import finding, shown
from memdiff.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from memdiff.inert import text
from memdiff.model import Summary
from memdiff.predict.fit_gate import stored_fit
from memdiff.read.inputs import read_summary
from memdiff.read.job import is_job, summarize_ranks
from memdiff.read.window import add_window_arguments
from memdiff.units import count_of, format_bytes

DESCRIPTION = ("Write a baseline of SNAPSHOT to FILE, atomically. Updating an existing file keeps its name "
               "and thresholds unless flags replace them. With --check, validate baseline files instead.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", nargs="*", metavar="SNAPSHOT",
                   help="snapshot or summary to take the baseline from, or a job (a folder or glob of rank files): "
                        "one baseline holding every rank. Several runs are repeats of one workload: the baseline "
                        "stores the median run and the spread of all, which the default rule then allows")
    p.add_argument("-o", "--output", metavar="FILE", help="baseline file to create or update")
    p.add_argument("--name", help="baseline name (default: kept when updating, else the file's stem)")
    p.add_argument("--git-sha", metavar="SHA", help="commit the run was made from, stored for reviewers")
    p.add_argument("--fit", metavar="FIT.json",
                   help="a fit result (`memdiff fit ... --format json`): the baseline keeps its largest value per GPU, "
                        "and `memdiff gate --fit` fails when one drops (G011). Without it, an updated baseline keeps "
                        "the values it had")
    p.add_argument("--check", metavar="PATH", help="validate a baseline file, or every *.json in a folder")
    p.add_argument("--replace", action="store_true",
                   help="write over a baseline of the other kind at FILE: a job's with one run's, or one run's "
                        "with a job's (without it that is refused; a baseline of the same kind is updated)")
    add_threshold_arguments(p)
    add_category_threshold_argument(p)
    add_phase_threshold_argument(p)
    add_noise_arguments(p)
    add_rules_arguments(p)
    add_job_arguments(p)
    add_window_arguments(p)


def _check(path: str, rules: List[Rule]) -> int:
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    if not files:
        raise InputError(path, "no *.json baseline files here")
    broken = 0
    for f in files:
        try:
            b = read_baseline(f)
            check_categories(b.thresholds.categories, rules, f)  # what gate would refuse, said now
        except InputError as exc:
            broken += 1
            print(f"memdiff: {text(exc.path)}: {text(exc.message)}", file=sys.stderr)
        else:
            what = count_of(len(b.ranks), "rank") if b.ranks is not None else count_of(len(b.devices), "device")
            print(f"ok  {text(f)}  ({text(b.name)}, {what})")  # a baseline's name is data: one line
    return EXIT_BAD_INPUT if broken else EXIT_OK


def _summaries(args: argparse.Namespace, rules: List[Rule]) -> Union[Summary, Dict[int, Summary], List[Summary]]:
    """The run's summary, a job's summaries by rank, or the summaries of repeated runs."""
    if len(args.snapshot) > 1:
        if any(is_job(s) for s in args.snapshot):
            raise InputError(next(s for s in args.snapshot if is_job(s)),
                             "a baseline from repeats takes runs, not jobs: give one job, or several run files")
        seen: Dict[str, str] = {}
        for s in args.snapshot:
            # A file given twice is one run counted twice: its peak would weigh double in the spread.
            key = os.path.realpath(s)
            if key in seen:
                raise InputError(s, f"given twice (as {seen[key]} too): repeats are separate runs, each file once")
            seen[key] = s
        return [read_summary(s, rules, window=args.window) for s in args.snapshot]
    if not is_job(args.snapshot[0]):
        return read_summary(args.snapshot[0], rules, window=args.window)
    files = job_from(args, args.snapshot[0], finished=True).files
    return dict(zip([f.rank for f in files], summarize_ranks(files, rules, args.dask, window=args.window)))


def run(args: argparse.Namespace) -> int:
    """Create or update one baseline, or check baseline files."""
    if args.check:
        return _check(args.check, rules_from(args))
    if not args.snapshot or not args.output:
        raise InputError("baseline", "give SNAPSHOT -o FILE to write a baseline, or --check PATH")
    rules = rules_from(args)
    fit = stored_fit(args.fit) if args.fit is not None else None  # a broken fit result stops before anything
    baseline, done = update_baseline(args.output, lambda: _summaries(args, rules),
                                        lambda old: thresholds_from(args, rules, old, args.output), args.name,
                                        args.git_sha, fit, args.replace)
    name, thresholds = baseline.name, baseline.thresholds
    if baseline.ranks is not None:
        peaks = f"{count_of(len(baseline.ranks), 'rank')}, highest peak " + format_bytes(max(
            (d["peak_bytes"] for r in baseline.ranks for d in r["devices"]), default=0))
    else:
        peaks = ", ".join(f"device {d['device']} peak {format_bytes(d['peak_bytes'])}" for d in baseline.devices)
    spreads = baseline.spreads()
    if spreads:
        peaks += "; " + ", ".join(f"device {k} spread over {sp.runs} runs {format_bytes(sp.peak.min)} to "
                                  f"{format_bytes(sp.peak.max)}" for k, sp in spreads.items())
    if baseline.fit is not None:
        peaks += "; fit " + ", ".join(f"{g['gpu']} {baseline.fit['knob']} "
                                      f"{'nothing' if g['value'] is None else format(g['value'], ',')}"
                                      for g in baseline.fit["gpus"])
    noisy = next((sp.runs for sp in spreads.values() if sp.peak.max > sp.peak.min), None)
    print(f"memdiff: {done} {text(args.output)}: baseline {text(repr(name))}, {peaks}; "
          f"{thresholds.describe(noisy)}", file=sys.stderr)
    stored = [d for r in baseline.ranks for d in r["devices"]] if baseline.ranks is not None else baseline.devices
    for d in stored:
        if d.get("trace_events") == 0:  # every later gate of a traced run against it stops with exit 2
            print(f"memdiff: {shown(finding('T015', d['device']))}", file=sys.stderr)
    if getattr(args, "noise_margin", None) is not None and noisy is None:
        # The margin widens a spread; a run alone (or repeats with one peak) has none: said, not silently kept.
        print("memdiff: note: --noise-margin is kept in the thresholds but gates nothing here: it widens the "
              "spread of repeated runs whose peaks differ (`memdiff baseline RUN1 RUN2 RUN3`), and this baseline "
              "has none, so the rule above applies", file=sys.stderr)
    return 0
