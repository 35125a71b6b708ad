"""`memdiff gate SNAPSHOT --baseline FILE` or `--baselines DIR SNAPSHOT...`: fail the build on a regression."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

from memdiff.atomic import check_output, make_folder
from memdiff.baseline import Baseline, baseline_path_for, comparable_pair, read_baseline, stem
from memdiff.classify import Rule
from memdiff.commands.args import (
    add_category_threshold_argument,
    add_github_arguments,
    add_html_argument,
    add_job_arguments,
    add_phase_threshold_argument,
    add_report_arguments,
    add_rules_arguments,
    add_threshold_arguments,
    job_from,
    publisher_from,
    rules_from,
    thresholds_from,
)
from memdiff.commands.diff import render_report, write_html
from memdiff.differ import diff
from memdiff.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REGRESSION, InputError, clip
from memdiff.inputs import read_summary
from memdiff.job import is_job, ranges, ranks_text, summarize_ranks
from memdiff.jobdiff import JobDiff, RankDiff
from memdiff.judge import Verdict, judge, judge_ranks
from memdiff.model import Summary
from memdiff.render import json as render_json
from memdiff.render import ranks as render_ranks

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
    p.add_argument("--require-baseline", action="store_true", help="a run without a baseline fails the gate")
    add_report_arguments(p)
    add_html_argument(p, several=True)
    add_threshold_arguments(p)
    add_category_threshold_argument(p)
    add_phase_threshold_argument(p)
    add_rules_arguments(p)
    add_github_arguments(p)
    add_job_arguments(p)


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


def _html_paths(path: str, runs: List[str]) -> Dict[str, str]:
    """Where each run's HTML report goes: `path` itself for one run, else a page per run in the
    folder `path` (made when missing), named after the run."""
    if len(runs) <= 1:
        check_output(path)
        return {run: path for run in runs}
    if os.path.isfile(path):
        raise InputError(path, "with several runs --html names a folder (one page per run), and this is a file")
    make_folder(path)
    return {run: os.path.join(path, f"{stem(run)}.html") for run in runs}


@dataclass
class _GatedJob:
    """A job gated against its baseline."""

    job: JobDiff
    verdict: Verdict
    per_rank: Dict[int, Verdict]
    failures: List[str]  # why the job fails beyond its ranks' checks
    pairs: Dict[int, Tuple[Summary, Summary]]  # each rank's (baseline side, run side), for the HTML page


def _gate_job(args: argparse.Namespace, job_arg: str, path: str, baseline: Baseline, rules: List[Rule],
              history: bool) -> _GatedJob:
    """Each rank of the job against the same rank of the job's baseline, under its thresholds.

    A rank the baseline has and the run lacks fails the gate (a crashed rank must not pass); a
    rank the baseline lacks is not gated, as a run without a baseline is."""
    if baseline.ranks is None:
        raise InputError(path, f"is the baseline of one run and {job_arg} is a job: make a job baseline with "
                               f"`memdiff baseline {job_arg} -o {path}`")
    files = job_from(args, job_arg, finished=True).files
    thresholds = thresholds_from(args, rules, baseline.thresholds, path)
    per_rank: Dict[int, Verdict] = {}
    pairs: Dict[int, Tuple[Summary, Summary]] = {}
    ranks, only_head = [], []
    for f, summary in zip(files, summarize_ranks(files, rules, args.dask, history)):
        stored = baseline.of_rank(f.rank)
        if stored is None:
            only_head.append(f.rank)
            continue
        base, head = pairs[f.rank] = comparable_pair(path, stored, summary)
        result = diff(base, head)
        per_rank[f.rank] = judge(result, thresholds, update_hint=f"memdiff baseline {job_arg} -o {path}")
        ranks.append(RankDiff(f.rank, result))
    present = {f.rank for f in files}
    only_base = [r["rank"] for r in baseline.ranks if r["rank"] not in present]
    if not ranks:
        raise InputError(job_arg, f"no rank of the job is in the baseline {path} (it has ranks "
                                  f"{clip(ranges([r['rank'] for r in baseline.ranks]))})")
    failures = []
    if only_base and not args.allow_missing_ranks:
        failures.append(f"{ranks_text(only_base)}: in the baseline but not in the run (a rank that crashed?); "
                        f"--allow-missing-ranks gates the others only")
    if only_head and args.require_baseline:
        failures.append(f"{ranks_text(only_head)}: no baseline (--require-baseline)")
    verdict = judge_ranks(per_rank, thresholds.describe())
    verdict = replace(verdict, passed=verdict.passed and not failures, notes=failures + verdict.notes)
    return _GatedJob(JobDiff(ranks=ranks, only_base=only_base, only_head=only_head), verdict, per_rank, failures,
                     pairs)


def run(args: argparse.Namespace) -> int:
    """Gate every run; exit 1 when any check fails (or a required baseline is missing)."""
    rules = rules_from(args)
    pairs, missing = _pairs(args)
    html_paths = _html_paths(args.html, [snap for snap, _ in pairs]) if args.html is not None else {}
    status = EXIT_OK
    documents = []
    publisher = publisher_from(args, expected=len(pairs))
    for snap, path in pairs:
        baseline = read_baseline(path)
        if is_job(snap):
            gated = _gate_job(args, snap, path, baseline, rules, history=snap in html_paths)
            job, verdict, per_rank = gated.job, gated.verdict, gated.per_rank
            status = status or (EXIT_OK if verdict.passed else EXIT_REGRESSION)
            worst = job.worst
            if snap in html_paths:  # the page shows the worst rank
                write_html(html_paths[snap], worst.diff, per_rank[worst.rank], *gated.pairs[worst.rank], args.top,
                           args.min_delta, base_label=f"baseline {baseline.name} rank {worst.rank}")
            if publisher:
                publisher.add(worst.diff, verdict, args.top, args.min_delta,
                              base_label=f"baseline {baseline.name} rank {worst.rank}")
            if args.format == "json":
                documents.append({"run": snap, "baseline": path,
                                  **render_ranks.job_diff_document(job, verdict, per_rank)})
                continue
            if len(args.snapshots) > 1:
                sys.stdout.write(f"{'## ' if args.format == 'markdown' else '== '}{snap} against {path}\n\n")
            report = render_report(worst.diff, per_rank[worst.rank], args.format, args.top, args.min_delta)
            sys.stdout.write(render_ranks.render_job_diff(job, verdict, per_rank, report, args.format == "markdown",
                                                          gated.failures) + ("\n" if len(pairs) > 1 else ""))
            continue
        base, head = comparable_pair(path, baseline, read_summary(snap, rules, history=bool(html_paths)))
        result = diff(base, head)
        verdict = judge(result, thresholds_from(args, rules, baseline.thresholds, path),
                        update_hint=f"memdiff baseline {snap} -o {path}")
        status = status or (EXIT_OK if verdict.passed else EXIT_REGRESSION)
        if snap in html_paths:
            write_html(html_paths[snap], result, verdict, base, head, args.top, args.min_delta,
                       base_label=f"baseline {baseline.name}")
        if publisher:
            sha = baseline.source.get("git_sha")
            publisher.add(result, verdict, args.top, args.min_delta,
                          base_label=f"baseline {baseline.name}" + (f" @ {sha[:12]}" if sha else ""))
        if args.format == "json":
            documents.append({"run": snap, "baseline": path, **render_json.diff_document(result, verdict)})
            continue
        if len(args.snapshots) > 1:
            sys.stdout.write(f"{'## ' if args.format == 'markdown' else '== '}{snap} against {path}\n\n")
        sys.stdout.write(render_report(result, verdict, args.format, args.top, args.min_delta)
                         + ("\n" if len(pairs) > 1 else ""))
    if args.format == "json":
        # One shape whatever the number of runs: a list, one diff document per gated run.
        sys.stdout.write(json.dumps(documents, indent=2, ensure_ascii=False) + "\n")
    for snap, path in missing:
        if publisher:
            publisher.add_missing(snap, path, args.require_baseline)
        print(f"memdiff: {snap}: no baseline at {path}: make it with `memdiff baseline {snap} -o {path}`"
              + ("" if args.require_baseline or not pairs else " (not gated; --require-baseline makes this fail)"),
              file=sys.stderr)
    if publisher:
        publisher.finish()
    if missing and (args.require_baseline or not pairs):
        # Nothing compared for a run that needed it: bad input, never the regression code and never
        # green; a regression found among the other runs still says so first.
        return status or EXIT_BAD_INPUT
    return status
