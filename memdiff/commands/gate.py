"""`memdiff gate SNAPSHOT --baseline FILE` or `--baselines DIR SNAPSHOT...`: fail the build on a regression."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

from memdiff.analyse.classify import Rule
from memdiff.atomic import check_output, make_folder
from memdiff.commands.args import (
    add_category_threshold_argument,
    add_github_arguments,
    add_html_argument,
    add_job_arguments,
    add_noise_arguments,
    add_phase_threshold_argument,
    add_report_arguments,
    add_rules_arguments,
    add_threshold_arguments,
    add_whatif_argument,
    count_arg,
    job_from,
    publisher_from,
    rules_from,
    thresholds_from,
)
from memdiff.commands.diff import write_html
from memdiff.compare.baseline import Baseline, baseline_path_for, comparable_pair, no_baseline, read_baseline, stem
from memdiff.compare.findings import finding, shown
from memdiff.compare.trend import DEFAULT_POINTS, read_history
from memdiff.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REGRESSION, InputError, clip
from memdiff.inert import baseline_command, md_code, text
from memdiff.model import Summary, TrendEntry
from memdiff.predict.fit_gate import check_fit, fit_file, gate_file
from memdiff.read.inputs import read_summary
from memdiff.read.job import is_job, ranges, summarize_ranks
from memdiff.read.window import add_window_arguments
from memdiff.render import render
from memdiff.render.json import dumps
from memdiff.report.build import Report, Run, Settings, compare
from memdiff.report.fitcheck import with_fit

DESCRIPTION = ("Compare each run with its baseline under the baseline's thresholds (flags override them) "
               "and print the report and one line per threshold. Exit 0 pass, 1 regression, 2 bad input.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshots", nargs="+", metavar="SNAPSHOT",
                   help="runs to gate (snapshots or summaries), or jobs (a folder or glob of rank files, gated rank "
                        "by rank against a job baseline; with --baselines, DIR/<folder name>.json)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline", metavar="FILE", help="the baseline of the one SNAPSHOT")
    which.add_argument("--baselines", metavar="DIR", help="folder of baselines named after each run's stem")
    p.add_argument("--mixed-routes", action="store_true",
                   help="gate an emulated run (`memdiff record --emulate`) against a baseline recorded on a GPU, or "
                        "the other way round; refused without it, as the two routes need not agree (docs/emulate.md)")
    p.add_argument("--require-baseline", action="store_true",
                   help="a run without a baseline is an error (verdict no-baseline): exit 2, or 1 when another run "
                        "regressed (the regression is said first)")
    add_report_arguments(p)
    add_html_argument(p, several=True)
    add_threshold_arguments(p)
    add_category_threshold_argument(p)
    add_phase_threshold_argument(p)
    add_noise_arguments(p)
    add_rules_arguments(p)
    add_github_arguments(p)
    p.add_argument("--history", metavar="FILE",
                   help="the main branch's history (`memdiff history append`): the reports show each workload's "
                        "last peaks on main (the baseline's name) as a trend, with this run's point after them; a "
                        "file not there yet is warning G010 and no trend")
    p.add_argument("--history-points", type=count_arg, default=DEFAULT_POINTS, metavar="N",
                   help=f"main-branch peaks a trend shows (default: {DEFAULT_POINTS})")
    add_job_arguments(p)
    add_window_arguments(p)
    add_whatif_argument(p)
    p.add_argument("--fit", metavar="FIT.json",
                   help="this change's fit result (`memdiff fit ... --format json`), gated against the fit values "
                        "the --baseline holds (`memdiff baseline ... --fit`): a GPU whose largest value dropped fails "
                        "(G011). Required when the baseline holds fit values")


def _pairs(args: argparse.Namespace) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]]]:
    """(run, baseline) pairs to gate, and runs whose baseline is missing."""
    # A run that does not exist is bad input, whatever the flags: a typo or a crashed recording
    # must not read as "not gated" and pass.
    for snap in args.snapshots:
        if not os.path.exists(snap) and not is_job(snap):
            raise InputError(snap, "no such file (a glob that matches nothing is passed on as it is)")
    if args.baseline is not None:
        if not args.baseline:
            raise InputError("--baseline", "empty path: give the baseline file, e.g. --baseline baselines/train.json")
        if len(args.snapshots) != 1:
            raise InputError("gate", "--baseline takes one SNAPSHOT; use --baselines DIR for several")
        return [(args.snapshots[0], args.baseline)], []
    if os.path.exists(args.baselines) and not os.path.isdir(args.baselines):
        raise InputError(args.baselines, "is not a folder of baselines")
    # A missing folder is every run without its baseline: the first run of a new repository.
    pairs: List[Tuple[str, str]] = []
    missing: List[Tuple[str, str]] = []
    for snap in args.snapshots:
        path = baseline_path_for(args.baselines, os.path.normpath(snap) if os.path.isdir(snap) else snap)
        (pairs if os.path.exists(path) else missing).append((snap, path))
    return pairs, missing


def _html_paths(path: str, runs: List[str], given: int) -> Dict[str, str]:
    """Where each gated run's HTML report goes: `path` itself when one run was given, else a page
    per run in the folder `path` (made when missing), named after the run. Decided by the runs
    given, not those with a baseline: the action makes the folder for several heads, and a second
    workload added without its baseline yet made it a file's name (`is a folder`, exit 2, no G008)."""
    if given <= 1:
        check_output(path, inputs=runs)
        return {run: path for run in runs}
    if os.path.isfile(path):
        raise InputError(path, "with several runs --html names a folder (one page per run), and this is a file")
    make_folder(path)
    return {run: os.path.join(path, f"{stem(run)}.html") for run in runs}


def _trend_label(args: argparse.Namespace) -> Optional[str]:
    """What names this run's point in a trend: --head-label, else with --github the pull request's head commit."""
    if args.head_label or not args.github:
        return args.head_label
    from memdiff.github import event_labels

    head = event_labels(os.environ)[1]
    return f"this PR ({head})" if head else None


def _gate(args: argparse.Namespace, snap: str, path: str, baseline: Baseline, rules: List[Rule],
          with_history: bool, history: Optional[List[TrendEntry]] = None) -> Report:
    """One run, or each rank of a job, against its baseline under the baseline's thresholds.

    A rank the baseline has and the run lacks fails the gate (a crashed rank must not pass); a
    rank the baseline lacks is not gated, as a run without a baseline is."""
    thresholds = thresholds_from(args, rules, baseline.thresholds, path)
    settings = Settings(thresholds=thresholds, top=args.top, min_delta=args.min_delta,
                        update_hint=baseline_command(snap, path), base_label=baseline.label(),
                        run=snap, baseline=path, missing_ranks_fail=not args.allow_missing_ranks,
                        unbaselined_ranks_fail=args.require_baseline, spreads=baseline.spreads(),
                        history=history, workload=baseline.name, trend_points=args.history_points,
                        trend_label=_trend_label(args), whatif_run=snap if args.whatif else None, rules=rules,
                        window=args.window)
    if not is_job(snap):
        base, head = comparable_pair(path, baseline, read_summary(snap, rules, history=with_history,
                                                                  window=args.window), args.mixed_routes)
        return compare([Run(base)], [Run(head)], settings)
    if baseline.ranks is None:
        # `memdiff baseline` refuses to write a job's baseline over one run's unless --replace.
        raise InputError(path, f"is the baseline of one run and {snap} is a job: make a job baseline with "
                               f"`{baseline_command(snap, path, replace=True)}`")
    files = job_from(args, snap, finished=True).files
    base_runs, head_runs = [], []
    for f, summary in zip(files, summarize_ranks(files, rules, args.dask, with_history, args.window)):
        stored = baseline.of_rank(f.rank)
        if stored is None:
            head_runs.append(Run(summary, f.rank))
            continue
        base, head = comparable_pair(path, stored, summary, args.mixed_routes)
        base_runs.append(Run(base, f.rank))
        head_runs.append(Run(head, f.rank))
    present = {f.rank for f in files}
    if not base_runs:
        raise InputError(snap, f"no rank of the job is in the baseline {path} (it has ranks "
                               f"{clip(ranges([r['rank'] for r in baseline.ranks]))})")
    # A rank only the baseline has is compared with nothing: the report says it is missing.
    base_runs += [Run(Summary(source=base_runs[0].summary.source, devices=[]), r["rank"])
                  for r in baseline.ranks if r["rank"] not in present]
    return compare(base_runs, head_runs, settings)


def _check_fit_args(args: argparse.Namespace, baselines: Dict[str, Baseline]) -> None:
    """--fit and the baselines' fit values go together: a check the baseline holds is never skipped, and a
    fit result is never taken without a baseline value to gate it against (both: exit 2, nothing compared)."""
    holding = [path for path, b in baselines.items() if b.fit is not None]
    if args.fit is None and holding:
        raise InputError(holding[0], "holds fit values (`memdiff baseline --fit`) and no fit result was given: "
                                     "gate this change's with --fit FIT.json (`memdiff fit ... --format json`)")
    if args.fit is not None:
        if args.baseline is None:
            raise InputError("--fit", "gates one run's fit: give --baseline FILE and its SNAPSHOT")
        if not holding:
            raise InputError(args.baseline, "holds no fit values to gate --fit against: store them with "
                                            f"`memdiff baseline SNAPSHOT -o {args.baseline} --fit FIT.json`")


def run(args: argparse.Namespace) -> int:
    """Gate every run; exit 1 when any check fails (or a required baseline is missing)."""
    if args.baseline is not None and len(args.snapshots) == 1 and fit_file(args.snapshots[0]):
        from memdiff.render.fit import render_gate

        if args.fit is not None:
            raise InputError("--fit", "gates a snapshot's fit next to it; here the fit result is the run itself")
        if args.github:
            raise InputError("--github", "a fit result is gated on its own: print it with --format markdown and post "
                                         "it with `memdiff comment --report FILE`")
        checked = gate_file(args.snapshots[0], args.baseline)  # a fit result (`memdiff fit --format json`)
        sys.stdout.write(render_gate(checked, args.format))
        return EXIT_OK if checked.passed else EXIT_REGRESSION
    rules = rules_from(args)
    pairs, missing = _pairs(args)
    html_paths = {} if args.html is None else _html_paths(args.html, [snap for snap, _ in pairs], len(args.snapshots))
    status = EXIT_OK
    documents = []
    publisher = publisher_from(args, expected=len(pairs))
    history = None
    if args.history is not None and not os.path.exists(args.history):
        # The first push to main has not appended yet: said, and the gate goes on without a trend.
        missing_history = finding("G010", path=args.history)
        print(f"memdiff: {text(shown(missing_history))}", file=sys.stderr)
        if publisher:
            publisher.annotation(missing_history, "warning")
    elif args.history is not None:
        history = read_history(args.history)
    baselines = {path: read_baseline(path) for _, path in pairs}  # every file read before any is gated
    _check_fit_args(args, baselines)
    for snap, path in pairs:
        baseline = baselines[path]
        report = _gate(args, snap, path, baseline, rules, snap in html_paths, history)
        if baseline.fit is not None:
            report = with_fit(report, *check_fit(baseline.fit, path, args.fit))
        status = status or (EXIT_OK if report.passed else EXIT_REGRESSION)
        if snap in html_paths:
            write_html(html_paths[snap], report)
        if publisher:
            publisher.add(report)
        if args.format == "json":
            documents.append(report.to_dict())
            continue
        if len(args.snapshots) > 1:
            sys.stdout.write(f"## {md_code(snap)} against {md_code(path)}\n\n" if args.format == "markdown"
                             else f"== {text(snap)} against {text(path)}\n\n")
        sys.stdout.write(render(report, args.format) + ("\n" if len(pairs) > 1 else ""))
    if args.format == "json":
        # One shape whatever the number of runs: a list, one document per run, those without a
        # baseline included, so that a step reading the JSON cannot miss that they were not gated.
        documents += [{"run": snap, "baseline": path, "verdict": "no-baseline", "required": args.require_baseline,
                       "command": baseline_command(snap, path)} for snap, path in missing]
        sys.stdout.write(dumps(documents))
    for snap, path in missing:
        if publisher:
            publisher.add_missing(snap, path, args.require_baseline, compared=bool(pairs))
        print(f"memdiff: {text(shown(no_baseline(snap, path, args.require_baseline, compared=bool(pairs))))}",
              file=sys.stderr)
    if publisher:
        publisher.finish()
    if missing and (args.require_baseline or not pairs):
        # Nothing compared for a run that needed it: bad input, never the regression code and never
        # green; a regression found among the other runs still says so first.
        return status or EXIT_BAD_INPUT
    return status
