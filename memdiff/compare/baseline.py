"""Baselines: a reviewed, few-KB JSON record of a run and the thresholds new runs are gated with.

A baseline keeps per device the peak, static and per-category bytes and the largest groups
(TOP_GROUPS). To diff a run against it, the bytes outside the stored groups become one
`rest` group per category on the baseline side; on the run's side, groups the baseline does
not store and that are smaller than every stored group join the same `rest` groups. Totals
(and so the TOTAL row and the category deltas) stay exact, and only a group large enough to
have been stored reads as NEW.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from memdiff import __version__
from memdiff.analyse.sameloop import loop_difference
from memdiff.atomic import check_output, make_folder, write_output
from memdiff.compare.figures import check_figures
from memdiff.compare.findings import ERROR, finding
from memdiff.compare.limits import Thresholds, thresholds_from_dict
from memdiff.compare.observe import PEAK, names_nodes, step_peaks
from memdiff.errors import InputError, clip, version_shown
from memdiff.inert import baseline_command
from memdiff.model import DeviceSummary, Finding, Group, PhasePeak, Range, Source, Spread, Summary
from memdiff.read.frames import signature_of
from memdiff.read.load import read_json, starts_as_a_snapshot
from memdiff.read.schema import validate
from memdiff.units import count_of, format_bytes

# Baselines keep their own version: summaries moved to 2 (lifetimes) without changing what a
# baseline stores. A baseline made from repeats is written as 2: a memdiff that cannot read its
# spread refuses it rather than gating it with a tighter rule than it was made for.
BASELINE_SCHEMA_VERSION = 1
SPREAD_SCHEMA_VERSION = 2
# A baseline holding fit values (`memdiff baseline ... --fit FIT.json`) is written as 3: a memdiff that
# reads only 1 or 2 would gate the snapshot and silently skip the fit check, so it refuses the file.
FIT_SCHEMA_VERSION = 3
# Repeats of a loop whose steps peak alike differ by the allocator's noise alone: beyond this
# share of the median peak they are not repeats.
NOISE_FLOOR = 0.05
READABLE_BASELINE_VERSIONS = (1, 2, 3)
TOP_GROUPS = 25
REST_SITE = "<groups not stored in the baseline: {category}>"


@dataclass
class Baseline:
    """The parsed baseline file."""

    name: str
    created: str
    tool: str
    source: Dict[str, Any]
    devices: List[Dict[str, Any]]
    thresholds: Thresholds
    # A job's baseline: per rank {"rank", "source", "devices"}; `source` and `devices` are then empty.
    ranks: Optional[List[Dict[str, Any]]] = None
    # The largest value per GPU of a fit (`memdiff baseline --fit`): {"knob", "max_memory", "gpus": [{"gpu",
    # "value"}]}; `memdiff gate --fit` fails when a GPU's value drops (G011).
    fit: Optional[Dict[str, Any]] = None
    # The file's measured figures differ from the digest memdiff wrote beside them (figures_sha256):
    # edited by hand, or a merge resolved by hand (G013). Never stored: read_baseline works it out.
    edited: bool = False


    def of_rank(self, rank: int) -> Optional["Baseline"]:
        """A job baseline's run of one rank, under the job's thresholds; None when it has no such rank."""
        found = next((r for r in self.ranks or [] if r["rank"] == rank), None)
        return None if found is None else replace(self, name=f"{self.name} rank {rank}", source=found["source"],
                                                  devices=found["devices"], ranks=None)

    def spreads(self) -> Dict[int, Spread]:
        """Per device, the spread over the repeated runs it was made from (none: one run)."""
        return {d["device"]: Spread.from_dict(d["spread"]) for d in self.devices if d.get("spread")}

    def label(self) -> str:
        """What names the baseline in a report: `baseline train @ 1a2b3c4d5e6f`."""
        sha = self.source.get("git_sha")
        return f"baseline {self.name}" + (f" @ {sha[:12]}" if sha else "")

    def schema_version(self) -> int:
        """The version this baseline is written with: 3 when it holds fit values, 2 when a spread, else 1."""
        if self.fit is not None:
            return FIT_SCHEMA_VERSION
        return SPREAD_SCHEMA_VERSION if any(d.get("spread") for d in self.devices) else BASELINE_SCHEMA_VERSION

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (what `to_json` writes, as a dict)."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        """The file's text: fixed key order and one group per line, so reviews read well; the digest of
        its measured figures (figures_digest) beside them."""
        text = self._text()
        lines = text.split("\n")
        after = next(i for i, line in enumerate(lines) if line.startswith('  "tool": ')) + 1
        lines.insert(after, f'  "figures_sha256": "{figures_digest(json.loads(text))}",')
        return "\n".join(lines)

    def _text(self) -> str:
        thresholds = json.dumps(self.thresholds.to_dict(), indent=2).replace("\n", "\n  ")
        head = ("{\n"
                f'  "schema_version": {self.schema_version()},\n'
                f'  "name": {json.dumps(self.name)},\n'
                f'  "created": {json.dumps(self.created)},\n'
                f'  "tool": {json.dumps(self.tool)},\n')
        if self.fit is not None:
            head += f'  "fit": {json.dumps(self.fit)},\n'
        if self.ranks is None:
            return (head + _source_json(self.source, "  ") + f'  "thresholds": {thresholds},\n'
                    + _devices_json(self.devices, "  ") + "\n}\n")
        ranks = [f'    {{\n      "rank": {r["rank"]},\n' + _source_json(r["source"], "      ")
                 + _devices_json(r["devices"], "      ") + "\n    }" for r in self.ranks]
        return head + f'  "thresholds": {thresholds},\n  "ranks": [\n' + ",\n".join(ranks) + "\n  ]\n}\n"


def figures_digest(doc: Dict[str, Any]) -> str:
    """The sha256 of what a baseline document holds measured (its source, devices or ranks, fit values),
    as its JSON reads back: written beside them as `figures_sha256`, so that a figure edited by hand
    shows (G013). Not the name, the dates or the thresholds, which a team sets by hand."""
    measured = {key: doc.get(key) for key in ("source", "devices", "ranks", "fit")}
    return hashlib.sha256(json.dumps(measured, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _source_json(source: Dict[str, Any], pad: str) -> str:
    items = ",\n".join(f"{pad}  {json.dumps(k)}: {json.dumps(v)}" for k, v in source.items())
    return f'{pad}"source": {{\n{items}\n{pad}}},\n'


def _devices_json(devices: List[Dict[str, Any]], pad: str) -> str:
    out = []
    for d in devices:
        groups = ",\n".join(f"{pad}      " + json.dumps(g) for g in d["groups"])
        fields = [f'"device": {d["device"]}', f'"peak_bytes": {d["peak_bytes"]}',
                  f'"static_bytes": {d["static_bytes"]}', f'"trace_events": {d["trace_events"]}',
                  f'"unmatched_free_count": {d["unmatched_free_count"]}',
                  *([f'"step_count": {d["step_count"]}'] if d.get("step_count") is not None else []),
                  *([f'"step_peaks": {json.dumps(d["step_peaks"])}'] if d.get("step_peaks") is not None else []),
                  *([f'"autograd_nodes": {json.dumps(d["autograd_nodes"])}'] if d.get("autograd_nodes") is not None
                    else []),
                  f'"categories": {json.dumps(d["categories"])}']
        fields += [f'"phases": {json.dumps(d["phases"])}'] if d.get("phases") else []
        fields += [f'"phase_categories": {json.dumps(d["phase_categories"])}'] if d.get("phase_categories") else []
        fields += ['"phase_groups": {' + ",".join(
            f'\n{pad}      {json.dumps(phase)}: [' + ",".join(f"\n{pad}        " + json.dumps(g) for g in gs)
            + f"\n{pad}      ]" for phase, gs in d["phase_groups"].items()) + f"\n{pad}    }}"] \
            if d.get("phase_groups") else []
        fields += [f'"at_peak": {json.dumps(d["at_peak"])}'] if d.get("at_peak") else []
        fields += [f'"earlier_rest": {json.dumps(d["earlier_rest"])}'] if d.get("earlier_rest") else []
        fields += [f'"rest_counts": {json.dumps(d["rest_counts"])}'] if d.get("rest_counts") else []
        fields += [f'"{k}": {d[k]}' for k in ("reserved_peak_bytes", "fragmentation_bytes") if d.get(k) is not None]
        fields += [f'"spread": {json.dumps(d["spread"])}'] if d.get("spread") else []
        fields.append(f'"groups": [\n{groups}\n{pad}    ]')
        out.append(f"{pad}  {{\n" + ",\n".join(f"{pad}    {f}" for f in fields) + f"\n{pad}  }}")
    return f'{pad}"devices": [\n' + ",\n".join(out) + f"\n{pad}]"


def _stored_groups(groups: List[Group]) -> List[Dict[str, Any]]:
    return [{"signature": g.signature, "site": g.site, "category": g.category or "other", "count": g.count,
             "bytes": g.bytes, **({"bytes_from_earlier_steps": g.bytes_from_earlier_steps}
                                  if g.bytes_from_earlier_steps else {}),
             **({"bytes_from_earlier_forwards": g.bytes_from_earlier_forwards, "earlier_forwards": g.earlier_forwards}
                if g.bytes_from_earlier_forwards else {})} for g in groups[:TOP_GROUPS]]


def _rest(groups: List[Group], value: Callable[[Group], int]) -> Dict[str, int]:
    """Per category, `value` summed over the groups not stored: their bytes from earlier steps
    (`earlier_rest`: the run's `kept from earlier steps` compares with them, however small the groups
    that hold them) or their allocations (`rest_counts`: the `rest` rows count them)."""
    rest: Dict[str, int] = {}
    for g in groups[TOP_GROUPS:]:
        if value(g):
            rest[g.category or "other"] = rest.get(g.category or "other", 0) + value(g)
    return rest


def _rest_by_moment(d: DeviceSummary, value: Callable[[Group], int]) -> Dict[str, Dict[str, int]]:
    """_rest at the peak and at each phase's peak whose groups are stored, where there is any."""
    moments = [(PEAK, d.groups)] + [(p.phase, p.groups) for p in d.phase_peaks if p.groups is not None]
    return {moment: rest for moment, rest in ((m, _rest(gs, value)) for m, gs in moments) if rest}


def from_summaries(summaries: Dict[int, Summary], name: str, thresholds: Thresholds, git_sha: Optional[str] = None,
                   created: Optional[str] = None) -> Baseline:
    """A job's baseline: each rank's run (by rank number), under one set of thresholds."""
    runs = {rank: from_summary(s, name, thresholds, git_sha, created) for rank, s in sorted(summaries.items())}
    first = next(iter(runs.values()))
    return replace(first, source={}, devices=[],
                   ranks=[{"rank": rank, "source": b.source, "devices": b.devices} for rank, b in runs.items()])


def from_summary(summary: Summary, name: str, thresholds: Thresholds, git_sha: Optional[str] = None,
                 created: Optional[str] = None) -> Baseline:
    """A baseline of a classified summary."""
    s = summary.source
    # The snapshot's keys: a gate says when the run's differ (T007), as a diff of the two runs does.
    source = {"file": s.file, "sha256": s.sha256, "generation": s.generation, "keys": sorted(s.keys),
              "allocator_settings": s.allocator_settings, "emulated": s.emulated, "git_sha": git_sha}
    devices = [{
        "device": d.device, "peak_bytes": d.peak_bytes, "static_bytes": d.static_bytes,
        "trace_events": d.trace_events, "unmatched_free_count": d.unmatched_free_count,
        # How many steps the run recorded: a gate compares it with the run's, as a diff does (T010).
        "step_count": len(d.steps),
        # The peaks of its steps after the first: a gate tells a run that grew step over step like
        # its baseline's from one that started to (K004), as a diff does.
        "step_peaks": step_peaks(d),
        # Whether its backward stacks name autograd nodes (the groups keep no frames): a gate warns of a
        # run recorded otherwise (T009), as a diff does. Absent when its stacks show no backward.
        **({} if names_nodes(d) is None else {"autograd_nodes": names_nodes(d)}),
        "categories": dict(sorted(d.categories.items())),
        "phases": {p.phase: p.peak_bytes for p in d.phase_peaks},
        # What each category held at each phase's peak: category limits compare like with like.
        "phase_categories": {p.phase: dict(sorted(p.categories.items())) for p in d.phase_peaks},
        # What was live at each phase's peak, largest first: site limits and the report's
        # like-for-like view compare the same moment of both runs.
        "phase_groups": {p.phase: _stored_groups(p.groups) for p in d.phase_peaks if p.groups is not None},
        "at_peak": {"phase": d.phase_at_peak, "step": d.step_at_peak, "scope": d.scope_at_peak},
        "earlier_rest": _rest_by_moment(d, lambda g: g.bytes_from_earlier_steps),
        "rest_counts": _rest_by_moment(d, lambda g: g.count),
        **{k: getattr(d, k) for k in ("reserved_peak_bytes", "fragmentation_bytes") if getattr(d, k) is not None},
        "groups": _stored_groups(d.groups),
    } for d in summary.devices]
    stamp = created or datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return Baseline(name=name, created=stamp, tool=f"memdiff {__version__}", source=source, devices=devices,
                    thresholds=thresholds)


def _range(values: List[int]) -> Range:
    ordered = sorted(values)
    return Range(ordered[0], ordered[-1], ordered[(len(ordered) - 1) // 2])


def from_repeats(summaries: List[Summary], name: str, thresholds: Thresholds, git_sha: Optional[str] = None,
                 created: Optional[str] = None) -> Baseline:
    """A baseline of repeated runs of one workload: the run whose peak is the median (the lower
    middle of an even count) is stored, and each device keeps the spread of the runs' peaks, phase
    peaks and categories at the peak (none when the peaks are equal: the one-run form). InputError
    when the runs are not repeats of one loop (sameloop.loop_difference, _check_noise)."""
    devices = [[d.device for d in s.devices] for s in summaries]
    if any(ds != devices[0] for ds in devices):
        raise InputError(summaries[0].source.file, f"repeats of one workload have the same devices, and these have "
                                                   f"{clip(', '.join(str(ds) for ds in devices))}")
    for s in summaries[1:]:
        why = loop_difference(s, summaries[0], os.path.basename(summaries[0].source.file), stacks=True)
        if why is not None:
            raise InputError(s.source.file, f"not a repeat of {os.path.basename(summaries[0].source.file)}: {why}")
    _check_noise(summaries)
    order = sorted(range(len(summaries)), key=lambda k: (sum(d.peak_bytes for d in summaries[k].devices), k))
    stored = from_summary(summaries[order[(len(order) - 1) // 2]], name, thresholds, git_sha, created)
    for k, d in enumerate(stored.devices):
        runs = [s.devices[k] for s in summaries]
        phases = set.intersection(*({p.phase for p in r.phase_peaks} for r in runs))
        categories = sorted({c for r in runs for c in r.categories})
        spread = Spread(len(runs), _range([r.peak_bytes for r in runs]),
                        {p: _range([next(x.peak_bytes for x in r.phase_peaks if x.phase == p) for r in runs])
                         for p in sorted(phases)},
                        {c: _range([r.categories.get(c, 0) for r in runs]) for c in categories})
        # Runs that peak alike have no spread: the baseline is the one-run form (version 1).
        if spread.peak.max > spread.peak.min:
            d["spread"] = spread.to_dict()
    return stored


def _step_variation(d: DeviceSummary) -> float:
    """How much the peaks of a device's steps after the first differ, as a share of the highest:
    the evidence that its memory depends on the data (the first step is left out: it builds the
    optimizer's state, so even a fixed loop peaks otherwise there)."""
    peaks = [max((p.peak_bytes for p in s.phases), default=0) for s in d.steps[1:]]
    return (max(peaks) - min(peaks)) / max(peaks) if len(peaks) >= 2 and max(peaks) else 0.0


def _check_noise(summaries: List[Summary]) -> None:
    """InputError when the runs' peaks spread more than NOISE_FLOOR while no run's steps vary
    that much: a loop whose memory does not change from step to step does not change from run to
    run either, so such a spread is two workloads (context 128 and 256), not noise. Runs in which
    no step is found (no loop) give no such evidence and are taken as given."""
    for k, d in enumerate(summaries[0].devices):
        runs = [s.devices[k] for s in summaries]
        if not all(r.steps for r in runs):
            continue
        peaks = sorted(r.peak_bytes for r in runs)
        median = peaks[(len(peaks) - 1) // 2]
        spread = (peaks[-1] - peaks[0]) / median if median else 0.0
        varies = max(_step_variation(r) for r in runs)
        if spread > NOISE_FLOOR and varies < NOISE_FLOOR:
            raise InputError(summaries[0].source.file,
                             f"not repeats of one workload: device {d.device} peaks from {format_bytes(peaks[0])} to "
                             f"{format_bytes(peaks[-1])} ({100 * spread:.1f}% of the median run's), but no run's steps "
                             f"vary by {100 * NOISE_FLOOR:.0f}%, so the spread is not the workload's noise (a "
                             "different size or code?); runs whose memory depends on the data show it over at "
                             "least 3 steps each")


def update_baseline(path: str, summary_of: Callable[[], Union[Summary, Dict[int, Summary], List[Summary]]],
                    thresholds_for: Callable[[Optional[Thresholds]], Thresholds], name: Optional[str] = None,
                    git_sha: Optional[str] = None, fit: Optional[Dict[str, Any]] = None,
                    replace_kind: bool = False) -> Tuple[Baseline, str]:
    """Create or update the baseline at `path` atomically: (the baseline, what was done, as the
    CLI says it: `wrote`, `updated`, or `replaced the baseline of a job (2 ranks) in`).

    `summary_of` gives the run's summary, a job's summaries by rank, or repeated runs' summaries
    (a list: the baseline keeps their spread). An existing baseline is
    read first, so a broken one stops everything before the run is summarized or anything is
    written; it keeps its name unless `name` is given, and `thresholds_for` gets its thresholds
    to build on. `fit` (fit values, `predict.fit_gate.stored_fit`) replaces the old baseline's; without it an
    updated baseline keeps them, as it keeps its thresholds. A job's baseline is never replaced by one
    run's, nor the other way round, unless `replace_kind` (`--replace`): InputError saying what is there.
    """
    folder = os.path.dirname(path)
    if folder and not os.path.lexists(folder):
        make_folder(folder)  # the first baseline of a repository: `-o baselines/train.json`
    check_output(path)
    # Only a regular file holds a baseline to update: reading a pipe given as the output would wait forever.
    try:
        old = read_baseline(path) if os.path.isfile(path) else None
    except InputError as exc:
        # Never overwritten unread: the path may name a file that is no baseline at all.
        raise InputError(exc.path, f"{exc.message} (delete or fix the file to write a new baseline there)") from None
    limits = thresholds_for(old.thresholds if old else None)
    summary = summary_of()
    runs = list(summary.values()) if isinstance(summary, dict) else summary if isinstance(summary, list) else [summary]
    if not any(s.devices for s in runs):
        raise InputError(path, "the run records no device memory: a baseline of nothing would pass every gate")
    other_kind = old is not None and (old.ranks is not None) != isinstance(summary, dict)
    if old is not None and other_kind and not replace_kind:
        _refuse_other_kind(path, old, summary)
    label = name or (old.name if old else stem(path))
    if isinstance(summary, dict):
        baseline = from_summaries(summary, label, limits, git_sha)
    elif isinstance(summary, list):
        baseline = from_repeats(summary, label, limits, git_sha)
    else:
        baseline = from_summary(summary, label, limits, git_sha)
    baseline = replace(baseline, fit=fit if fit is not None else old.fit if old else None)
    # What the run gave is checked as a read checks it: never a file that the next read refuses.
    check_figures(path, baseline.to_dict())
    write_output(path, baseline.to_json())
    # A kind replaced is said as such: `updated` read as if the job's ranks were still gated.
    done = "wrote" if old is None else f"replaced {_kind_of(old)} in" if other_kind else "updated"
    return baseline, done


def _kind_of(old: Baseline) -> str:
    """`the baseline of a job (2 ranks)` or `the baseline of one run`."""
    return (f"the baseline of a job ({count_of(len(old.ranks), 'rank')})" if old.ranks is not None
            else "the baseline of one run")


def _refuse_other_kind(path: str, old: Baseline, summary: Union[Summary, Dict[int, Summary], List[Summary]]) -> None:
    """InputError: writing would replace a job's baseline with one run's, or one run's with a job's.
    A job's gates every rank; overwritten by rank 0's, the job's other ranks were no longer gated,
    and all the command said was `updated`."""
    there = _kind_of(old)
    given = (f"a job ({count_of(len(summary), 'rank')})" if isinstance(summary, dict)
             else "repeated runs" if isinstance(summary, list) else "one run")
    raise InputError(path, f"holds {there}, and this is {given}: writing it would replace one kind of baseline "
                           f"with the other; give another -o, or pass --replace to write over it")


def _not_a_baseline(path: str, doc: Any) -> Optional[str]:
    """What a run's file given as a baseline is, in words, and what to do; None when it may be one."""
    make = f"make the run's baseline with `{baseline_command(path, 'baselines/' + stem(path) + '.json')}`"
    if doc is None:
        return f"is a snapshot, not a baseline: {make}, then gate against that file"
    if isinstance(doc, dict) and "schema_version" in doc and "devices" in doc and "thresholds" not in doc:
        return f"is a summary (`memdiff summarize`), not a baseline: {make}, then gate against that file"
    if isinstance(doc, dict) and doc.get("kind") == "fit":
        return ("is a fit result (`memdiff fit --format json`), not a baseline: give it to "
                "`memdiff gate RUN --baseline FILE --fit`")
    return None


def read_baseline(path: str) -> Baseline:
    """Parse and validate a baseline file; InputError with file, line and column or the JSON path."""
    start = b""  # read_json says what is wrong with a path that is no regular file (a pipe would block here)
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                start = f.read(8)
        except OSError:
            pass
    if starts_as_a_snapshot(start):
        raise InputError(path, str(_not_a_baseline(path, None)))
    doc = read_json(path, "a baseline")
    said = _not_a_baseline(path, doc)
    if said:
        raise InputError(path, said)
    if isinstance(doc, dict) and doc.get("schema_version") not in READABLE_BASELINE_VERSIONS \
            and "schema_version" in doc:
        raise InputError(path, f"baseline schema_version {version_shown(doc['schema_version'])} is not one this "
                               f"memdiff reads ({', '.join(map(str, READABLE_BASELINE_VERSIONS))})")
    validate(path, doc, "baseline")
    seen: set = set()
    for r in doc.get("ranks") or []:
        if r["rank"] in seen:
            # Gating would take one of the two runs stored for the rank and never say which.
            raise InputError(path, f"rank {r['rank']} is stored twice in the baseline's ranks: keep one")
        seen.add(r["rank"])
    check_figures(path, doc)
    baseline = Baseline(name=doc["name"], created=doc["created"], tool=doc.get("tool", ""),
                        source=doc.get("source", {}), devices=doc.get("devices", []),
                        thresholds=thresholds_from_dict(path, doc["thresholds"]), ranks=doc.get("ranks"),
                        fit=doc.get("fit"))
    # A baseline written before the digest has none: nothing to tell of its figures.
    stored = doc.get("figures_sha256")
    return replace(baseline, edited=stored is not None and stored != figures_digest(doc))


SUFFIXES = (".gz", ".bz2", ".xz", ".pickle", ".pkl", ".json")


def stem(path: str) -> str:
    """`runs/train.pickle.gz` -> `train`: the name a run's baseline is stored under."""
    name = os.path.basename(path)
    while True:
        for suffix in SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                break
        else:
            return name


def baseline_path_for(folder: str, snapshot: str) -> str:
    """The baseline of `snapshot` in `folder`: same stem, `.json`."""
    return os.path.join(folder, stem(snapshot) + ".json")


def _rest_group(category: str, count: int, size: int, earlier: int = 0) -> Group:
    site = REST_SITE.format(category=category)
    return Group(signature=signature_of([site]), site=site, frames=[], count=max(count, 1), bytes=size,
                 category=category, bytes_from_earlier_steps=earlier)


def _groups_of(stored: List[Dict[str, Any]], categories: Dict[str, int], earlier: Dict[str, int],
               counts: Dict[str, int]) -> List[Group]:
    """The stored groups, and a `rest` group per category for its bytes outside them: they add up
    to the moment's total exactly, and so do their bytes from earlier steps and their allocations
    (baselines written before they were stored: none, and one allocation a rest)."""
    groups = [Group(signature=g["signature"], site=g["site"], frames=[], count=g["count"], bytes=g["bytes"],
                    category=g["category"], bytes_from_earlier_steps=g.get("bytes_from_earlier_steps", 0),
                    bytes_from_earlier_forwards=g.get("bytes_from_earlier_forwards", 0),
                    earlier_forwards=g.get("earlier_forwards", 0))
              for g in stored]
    held: Dict[str, int] = {}
    for g in stored:
        held[g["category"]] = held.get(g["category"], 0) + g["bytes"]
    return groups + [_rest_group(c, counts.get(c, 0), total - held.get(c, 0), earlier.get(c, 0))
                     for c, total in categories.items() if total > held.get(c, 0)]


def _stored_summary(b: Baseline) -> Summary:
    devices = []
    for d in b.devices:
        earlier, counts = d.get("earlier_rest", {}), d.get("rest_counts", {})
        groups = _groups_of(d["groups"], d["categories"], earlier.get(PEAK, {}), counts.get(PEAK, {}))
        at_peak = d.get("at_peak") or {}  # where the peak was (baselines written before it: unknown)
        # The phases' peak bytes (for phase thresholds), each category's bytes then (category
        # thresholds) and, in baselines that carry them, the groups live then (site thresholds,
        # --at). A phase whose peak is the device's shares its groups; baselines written before
        # phase groups have none.
        by_phase, phase_groups = d.get("phase_categories", {}), d.get("phase_groups")
        phases = [PhasePeak(phase, None, size, 0, categories=by_phase.get(phase, {}),
                            groups=[] if phase_groups is None else
                            _groups_of(phase_groups[phase], by_phase.get(phase, {}), earlier.get(phase, {}),
                                       counts.get(phase, {}))
                            if phase in phase_groups
                            else None if phase == at_peak.get("phase") else [])
                  for phase, size in d.get("phases", {}).items()]
        devices.append(DeviceSummary.blank(
            d["device"], trace_events=d["trace_events"], static_bytes=d["static_bytes"], peak_bytes=d["peak_bytes"],
            unmatched_free_count=d["unmatched_free_count"], step_count=d.get("step_count"),
            step_peaks=d.get("step_peaks"), autograd_nodes=d.get("autograd_nodes"),
            groups=groups, categories=d["categories"],
            phase_peaks=phases, phase_at_peak=at_peak.get("phase"), step_at_peak=at_peak.get("step"),
            scope_at_peak=at_peak.get("scope"),
            reserved_peak_bytes=d.get("reserved_peak_bytes"), fragmentation_bytes=d.get("fragmentation_bytes")))
    s = b.source
    source = Source(file=f"baseline {b.name} ({s['file']})", sha256=s["sha256"], size_bytes=0, container="baseline",
                    generation=s["generation"], keys=list(s.get("keys", [])),
                    allocator_settings=s.get("allocator_settings"), emulated=s.get("emulated"), edited=b.edited)
    return Summary(source=source, devices=devices, tool=b.tool)


def _pooled(head: DeviceSummary, stored: Dict[str, Any]) -> DeviceSummary:
    """The run's device with its groups, at the peak and at each phase's peak the baseline stores,
    pooled as the baseline's are."""
    phase_groups = stored.get("phase_groups") or {}
    phases = [replace(p, groups=_pooled_groups(p.groups, phase_groups[p.phase]))
              if p.groups is not None and p.phase in phase_groups else p for p in head.phase_peaks]
    return replace(head, groups=_pooled_groups(head.groups, stored["groups"]), phase_peaks=phases)


def _pooled_groups(groups: List[Group], stored: List[Dict[str, Any]]) -> List[Group]:
    signatures = {g["signature"] for g in stored}
    smallest = min((g["bytes"] for g in stored), default=0)
    kept: List[Group] = []
    rest: Dict[str, List[Group]] = {}
    for g in groups:
        if g.signature in signatures or g.bytes >= smallest:
            kept.append(g)
        else:
            rest.setdefault(g.category or "other", []).append(g)
    pooled = kept + [_rest_group(c, sum(g.count for g in gs), sum(g.bytes for g in gs),
                                 sum(g.bytes_from_earlier_steps for g in gs)) for c, gs in rest.items()]
    return sorted(pooled, key=lambda g: (-g.bytes, g.signature))


def no_baseline(run: str, path: str, required: bool, compared: bool = True) -> Finding:
    """Finding G008: `run` has no baseline at `path`, with the command that makes it, and whether
    that fails the gate: `required` (--require-baseline), or no run `compared` at all."""
    folder = os.path.dirname(path)
    absent = f" (the folder {folder} does not exist yet; that command makes it)" if folder and \
        not os.path.isdir(folder) else ""
    # The line is all a user reads of a gate that exits 2: it says that this fails it, and why.
    gated = (" (no run had its baseline: nothing was compared, so the gate fails)" if not compared
             else " (the gate fails: --require-baseline)" if required
             else " (not gated; --require-baseline makes this fail)")
    found = finding("G008", snapshot=run, path=path, command=baseline_command(run, path), absent=absent, gated=gated)
    # A missing baseline that fails the gate (exit 2) is an error where it is said, as its annotation is, not a
    # warning beside it.
    return replace(found, severity=ERROR) if no_baseline_level(required, compared) == "error" else found


def no_baseline_level(required: bool, compared: bool = True) -> str:
    """The workflow annotation's level of a run without its baseline (G008): `error` when that fails
    the gate (`required`, or no run `compared`), as no_baseline's sentence says; else `warning`."""
    return "error" if required or not compared else "warning"


def comparable_pair(path: str, baseline: Baseline, head: Summary, mixed_routes: bool = False
                    ) -> Tuple[Summary, Summary]:
    """(base, head) summaries the differ can align; InputError when the devices differ, when one
    was emulated and the other recorded (or emulated as another GPU) unless `mixed_routes`, and
    when the baseline is a job's."""
    if baseline.ranks is not None:
        # A job's baseline keeps its runs per rank: one run is gated against a rank of it through
        # the job (its folder), which also fails on the ranks it lacks.
        raise InputError(path, f"is the baseline of a job ({count_of(len(baseline.ranks), 'rank')}) and "
                               f"{clip(head.source.file)} is one run: gate the job's folder against it, or make a "
                               f"baseline of the run alone")
    base = _stored_summary(baseline)
    base_route = base.source.route()
    if base_route != head.source.route() and not mixed_routes:
        raise InputError(path, f"the baseline was {base_route} and the run was {head.source.route()}: an emulated "
                               f"run is gated against an emulated baseline (make one with `memdiff baseline` of an "
                               f"emulated run), or pass --mixed-routes to compare them all the same")
    want = [d["device"] for d in baseline.devices]
    have = [d.device for d in head.devices]
    if want != have:
        raise InputError(path, f"the baseline has devices {clip(str(want))} and the run has {clip(str(have))}: "
                               f"they cannot be gated against each other; re-create the baseline with "
                               f"`memdiff baseline`")
    stored = {d["device"]: d for d in baseline.devices}
    pooled = replace(head, devices=[_pooled(d, stored[d.device]) for d in head.devices])
    return base, pooled
