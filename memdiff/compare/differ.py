"""diff: two Summaries -> Diff, groups aligned per device so that the rows explain the peak delta.

Alignment, in order:
1. groups with the same signature;
2. left-over groups with the same allocation site: the frames up to and including the
   innermost Python frame (ops, autograd nodes, the allocating function), then the next
   Python callers, SITE_CALLERS of them first, then fewer, down to none (file name and
   function, no lines), and last the site label alone (innermost function, the op it called
   and the op doing the work, which tells autocast's `_to_copy` from the matmul it feeds).
   An edit to an outer caller then reads as GREW or SHRANK rather than GONE + NEW. Pairs are
   made largest first;
3. what is left is NEW (head only) or GONE (base only).
Before all of these, the buffers of one compiled graph (`compiled buffer N`, numbered by their place
in the graph: frames.py) are paired by their growth and order in the graph, not by their number:
the graph compiled for another shape may reuse a freed buffer where this one allocates, and every
number after that one shifts (_compiled_pairs).
Because each summary's groups add up to its peak, the rows' deltas add up to the peak delta.
"""

from __future__ import annotations

import math
import posixpath
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from memdiff.analyse.classify import PERSISTENT
from memdiff.analyse.lifetimes import BACKWARD, BEFORE_TRACE, FORWARD, OPTIMIZER
from memdiff.compare.observe import (
    AT_ADVICE,
    WARNING_STRINGS,
    _findings,
)
from memdiff.compare.rows import (
    PEAK,
    CategoryDelta,
    CategoryHigh,
    DeviceDiff,
    DiffRow,
    Kept,
    Member,
    PhaseDelta,
)
from memdiff.errors import InputError
from memdiff.model import DeviceSummary, Finding, Frame, Group, Moment, Source, Summary
from memdiff.read.frames import COMPILED_FILE, PROFILER_MODULE

SITE_CALLERS = 2

NEW, GONE, GREW, SHRANK, SAME = "NEW", "GONE", "GREW", "SHRANK", "SAME"
MOMENTS = (PEAK, FORWARD, BACKWARD, OPTIMIZER)  # what --at can compare

BY_SIGNATURE, BY_SITE = "signature", "site"
# A row of the backward's node temporaries, or of the gradients, whatever their sites (_alike_merged).
TEMPORARIES, GRADIENTS = "temporaries", "gradients"
GRADIENT = "gradient"
# A group made in one run's trace and one older than the other's, of one category, count and size.
BY_SIZE = "size"
# Groups of one category older than the trace and without a stack, whatever their labels say of
# how their category was found (a weight the update order told, a frozen weight guessed).
BY_OLDER = "older"
# Buffers of one compiled graph paired by their order in it where their numbers differ (_compiled_pairs).
BY_COMPILED = "compiled"
COMPILED_BUFFER = re.compile(r"^compiled buffer (\d+)$")
# The most candidate pairs of one graph's buffers weighed (_by_growth); past it they pair by number only.
MAX_COMPILED_CELLS = 200_000


@dataclass
class Diff:
    """Both inputs, a DeviceDiff per device found in either, and why the pair may not compare."""

    base: Source
    head: Source
    devices: List[DeviceDiff]
    findings: List[Finding]  # the catalogue's (findings.py): why the pair may not compare, leaks, OOMs

    @property
    def warnings(self) -> List[str]:
        """The warnings' sentences, as the JSON's `warnings` has always listed them."""
        return [f.text for f in self.findings if f.code in WARNING_STRINGS]

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form of the comparison (the `devices`, `warnings`, `findings`, `base` and `head`
        of the diff contract; the verdict's keys come from `Verdict.to_dict`)."""
        return {"warnings": self.warnings, "findings": [f.to_dict() for f in self.findings],
                "base": self.base.to_dict(), "head": self.head.to_dict(), "devices": [asdict(d) for d in self.devices]}


def _site_key(callers: int):
    """Key function: the group's category and allocation point plus `callers` outer Python frames."""
    def key(g: Group) -> Tuple:
        # Positions are taken in the list the key is cut from: the profiler's `nn.Module` frames
        # sit between Python frames, and counting them would keep more callers than asked.
        kept = [f for f in g.frames if not PROFILER_MODULE.match(f.name)]
        frames = [(posixpath.basename(f.file), f.name) for f in kept]
        python = [i for i, f in enumerate(kept) if f.file.endswith(".py")]
        end = python[min(callers, len(python) - 1)] + 1 if python else len(frames)
        return (g.category, g.site, *frames[:end])
    return key


def _site_label(g: Group) -> Tuple:
    return (g.category, g.site)


SITE_KEYS = tuple(_site_key(n) for n in range(SITE_CALLERS, -1, -1)) + (_site_label,)

MODULE = re.compile(r"^nn\.Module: (\w+?)(?:_\d+)?$")
LIBRARY = re.compile(r"^(torch|stdlib)/")


# Building blocks that say little alone: `[Linear]` is the LM head and every MLP projection. Their
# parent module tells them apart (`Linear in GPT2MLP`, `Linear in GPT2LMHeadModel`).
GENERIC_MODULES = frozenset((
    "Linear", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "Embedding", "LayerNorm", "RMSNorm", "GroupNorm",
    "BatchNorm1d", "BatchNorm2d", "Dropout", "GELU", "ReLU", "SiLU", "Tanh", "Softmax", "Identity",
    "NewGELUActivation", "GELUActivation", "MultiheadAttention", "Sequential", "ModuleList"))


def context_of(frames: Sequence[Frame]) -> str:
    """The module an allocation happens in: the innermost `nn.Module` scope of profiler frames
    (`BertIntermediate`; a generic block with its parent, `Linear in GPT2MLP`), else the innermost
    model-code frame with its line (`modeling_bert.py:482`): a module's `forward` outside torch and
    the standard library, else any frame outside them."""
    modules = [m.group(1) for m in (MODULE.match(f.name) for f in frames) if m]
    if modules:
        inner = modules[0]
        parent = next((m for m in modules[1:] if m not in GENERIC_MODULES), None)
        return f"{inner} in {parent}" if inner in GENERIC_MODULES and parent else inner
    model_code = [f for f in frames if f.file.endswith(".py") and not LIBRARY.match(f.file)]
    for f in [f for f in model_code if f.name == "forward"] + model_code:
        # Line 0 is no line (a frame the profiler could not place): the file alone says as much.
        return f"{posixpath.basename(f.file)}:{f.line}" if f.line else posixpath.basename(f.file)
    return ""


def _older(g: Group) -> bool:
    """Whether a group's memory is older than its run's trace."""
    return (g.lifetime or {}).get("born") == BEFORE_TRACE


def _row(base: Sequence[Group], head: Sequence[Group], matched_by: Optional[str]) -> DiffRow:
    members = [Member("base", g.signature, g.count, g.bytes, g.bytes_from_earlier_steps, list(g.frames),
                      g.bytes_from_earlier_forwards, g.earlier_forwards) for g in base]
    members += [Member("head", g.signature, g.count, g.bytes, g.bytes_from_earlier_steps, list(g.frames),
                       g.bytes_from_earlier_forwards, g.earlier_forwards) for g in head]
    # Matched by size, the run whose trace made the memory shows it by the stack that made it.
    made = [g for g in (*base, *head) if not _older(g)] if matched_by == BY_SIZE else []
    shown = max(made or head or base, key=lambda g: (g.bytes, g.signature))
    b_bytes, h_bytes = sum(g.bytes for g in base), sum(g.bytes for g in head)
    delta = h_bytes - b_bytes
    if not base:
        status = NEW
    elif not head:
        status = GONE
    else:
        status = GREW if delta > 0 else SHRANK if delta < 0 else SAME
    return DiffRow(status=status, site=shown.site, signature=shown.signature, category=shown.category,
                   base_count=sum(g.count for g in base), head_count=sum(g.count for g in head),
                   base_bytes=b_bytes, head_bytes=h_bytes, delta_bytes=delta, frames=list(shown.frames),
                   matched_by=matched_by, context=context_of(shown.frames), label=shown.site,
                   base_earlier_bytes=sum(g.bytes_from_earlier_steps for g in base),
                   head_earlier_bytes=sum(g.bytes_from_earlier_steps for g in head),
                   members=members if len(members) > 2 or matched_by in (BY_SITE, BY_OLDER, BY_COMPILED) else [],
                   base_forward_bytes=sum(g.bytes_from_earlier_forwards for g in base),
                   head_forward_bytes=sum(g.bytes_from_earlier_forwards for g in head),
                   head_forwards=max((g.earlier_forwards for g in head), default=0))


def _merge(rows: Sequence[DiffRow], matched_by: str = BY_SITE) -> DiffRow:
    """One row of several that read alike and changed in opposite directions."""
    members = [m for r in rows for m in r.member_groups()]
    shown = max(rows, key=lambda r: (max(r.base_bytes, r.head_bytes), r.signature))
    b, h = sum(r.base_bytes for r in rows), sum(r.head_bytes for r in rows)
    status = NEW if not b else GONE if not h else GREW if h > b else SHRANK if h < b else SAME
    return DiffRow(status=status, site=shown.site, signature=shown.signature, category=shown.category,
                   base_count=sum(r.base_count for r in rows), head_count=sum(r.head_count for r in rows),
                   base_bytes=b, head_bytes=h, delta_bytes=h - b, frames=shown.frames,
                   matched_by=matched_by if b and h else None,
                   context=shown.context, label=shown.site, base_earlier_bytes=sum(r.base_earlier_bytes for r in rows),
                   head_earlier_bytes=sum(r.head_earlier_bytes for r in rows), members=members,
                   base_forward_bytes=sum(r.base_forward_bytes for r in rows),
                   head_forward_bytes=sum(r.head_forward_bytes for r in rows),
                   head_forwards=max((r.head_forwards for r in rows), default=0))


def _both_ways(rows: Sequence[DiffRow]) -> bool:
    return any(r.delta_bytes > 0 for r in rows) and any(r.delta_bytes < 0 for r in rows)


def _transient(g: Group) -> bool:
    """Memory the backward holds only while its node runs: at a peak, the working set of whichever
    node was running at that instant."""
    life = g.lifetime or {}
    return life.get("born") == BACKWARD and life.get("outlives") == "none"


def _alike_merged(rows: List[DiffRow], transient: Set[str]) -> List[DiffRow]:
    """One row per category and site where rows moved in opposite directions, else one row per
    category, site and module context; one row for the backward's node temporaries (groups whose
    signatures are in `transient`) where they moved in opposite directions; one row for the
    gradients where they moved in opposite directions and add up to (nearly) nothing.

    A NEW beside a SHRANK of one site is memory that moved between the site's call paths: two
    rows that cancel explain nothing. Rows of one site and module that moved the same way would
    read alike however they are labelled. Temporaries of different nodes that moved both ways
    say that the peak fell while another node ran, not what changed; gradients that moved both
    ways to the same total are the same weights' gradients made by other nodes (autocast's
    `ToCopyBackward0` where `AddmmBackward0` was). The member groups keep the detail either way.
    """
    def working(r: DiffRow) -> bool:
        return all(m.signature in transient for m in r.member_groups())

    def gradient(r: DiffRow) -> bool:
        return r.category == GRADIENT
    out: List[DiffRow] = []
    for matched_by, belongs, nets_out in ((TEMPORARIES, working, False), (GRADIENTS, gradient, True)):
        for category in sorted({r.category or "" for r in rows if r.delta_bytes and belongs(r)}):
            moved = [r for r in rows if r.delta_bytes and belongs(r) and (r.category or "") == category]
            churn = sum(abs(r.delta_bytes) for r in moved)
            if _both_ways(moved) and (not nets_out or abs(sum(r.delta_bytes for r in moved)) * 100 <= churn):
                out.append(_merge(moved, matched_by))
                merged = {id(r) for r in moved}
                rows = [r for r in rows if id(r) not in merged]
    buckets: Dict[Tuple, List[DiffRow]] = defaultdict(list)
    for r in rows:
        buckets[(r.category, r.site)].append(r)
    for same in buckets.values():
        moved = [r for r in same if r.delta_bytes]
        out.extend(r for r in same if not r.delta_bytes)
        if _both_ways(moved):
            out.append(_merge(moved))
            continue
        by_context: Dict[str, List[DiffRow]] = defaultdict(list)
        for r in moved:
            by_context[r.context].append(r)
        out.extend(alike[0] if len(alike) == 1 else _merge(alike) for alike in by_context.values())
    return out


def label_rows(rows: Sequence[DiffRow]) -> None:
    """Set each row's label: its site, with the context added where two of `rows` share a site,
    then the category where they still read alike."""
    by_site: Dict[str, List[DiffRow]] = defaultdict(list)
    for r in rows:
        by_site[r.site].append(r)
    for same in by_site.values():
        for r in same:
            r.label = r.site
        if len(same) < 2:
            continue
        for r in same:
            if r.context:
                r.label = f"{r.site} [{r.context}]"
        labels = defaultdict(list)
        for r in same:
            labels[r.label].append(r)
        for alike in labels.values():
            if len(alike) > 1 and len({r.category for r in alike}) > 1:
                for r in alike:
                    r.label = f"{r.label} ({r.category})"


def _older_than_one_trace(base: List[Group], head: List[Group]
                          ) -> Tuple[List[Tuple[List[Group], List[Group]]], List[Group], List[Group]]:
    """The groups of one category made in one run's trace and those older than the other's trace,
    where their counts and bytes are the same, and the groups left: the same memory (optimizer
    state) when one run started recording after a warm-up. It is known by its allocation in one
    run and by its update or its sizes in the other, so no stack matches."""
    def totals(groups: List[Group]) -> Tuple[int, int]:
        return sum(g.count for g in groups), sum(g.bytes for g in groups)
    paired: List[Tuple[List[Group], List[Group]]] = []
    taken: Set[int] = set()
    for category in sorted({g.category for g in base if g.category} & {g.category for g in head if g.category}):
        for base_older in (False, True):
            olds = [g for g in base if g.category == category and _older(g) == base_older]
            news = [g for g in head if g.category == category and _older(g) != base_older]
            if olds and news and totals(olds) == totals(news) and totals(olds)[1]:
                paired.append((olds, news))
                taken.update(id(g) for g in (*olds, *news))
    return (paired, [g for g in base if id(g) not in taken], [g for g in head if id(g) not in taken])


def _relabelled(base: Sequence[Group], head: Sequence[Group]) -> bool:
    """Whether groups of one category would read as different rows only by their labels: a
    signature only one run has, or signatures whose bytes moved in opposite directions."""
    moved: Dict[str, int] = defaultdict(int)
    for sign, groups in ((-1, base), (1, head)):
        for g in groups:
            moved[g.signature] += sign * g.bytes
    if {g.signature for g in base} != {g.signature for g in head}:
        return True
    return any(d > 0 for d in moved.values()) and any(d < 0 for d in moved.values())


def _compiled_place(g: Group) -> Optional[Tuple[Tuple, int]]:
    """(graph key, number) of a compiled buffer's group, else None. The key is the group's category
    and every frame but the buffer's number (file name and function, no lines, as signatures read
    them): the model code that ran the graph, forward or backward, and any op inside it."""
    for i, f in enumerate(g.frames):
        if f.file == COMPILED_FILE:
            m = COMPILED_BUFFER.match(f.name)
            if not m:
                return None
            rest = [(posixpath.basename(x.file), x.name) for k, x in enumerate(g.frames) if k != i]
            return (g.category, *rest), int(m.group(1))
    return None


def _per_allocation(g: Group) -> float:
    return g.bytes / max(g.count, 1)


def _growth(g: Group, k: Group) -> float:
    return math.log2((_per_allocation(k) or 1) / (_per_allocation(g) or 1))


def _by_growth(base: List[Group], head: List[Group], typical: float) -> List[Tuple[int, int]]:
    """(base index, head index) pairs of two lists of one graph's buffers, each in the order of the
    graph: first the pairs whose growth is nearest `typical` (a buffer for another sequence length
    grows as the others do; a weight's gradient not at all), then the nearest in order, then those
    of one number. Where the graph did not change, that is every buffer with itself."""
    if len(base) * len(head) > MAX_COMPILED_CELLS:
        numbers = {g.signature: j for j, g in enumerate(head)}
        return [(i, numbers[g.signature]) for i, g in enumerate(base) if g.signature in numbers]
    candidates = sorted((round(abs(_growth(g, k) - typical), 3), abs(i - j), g.signature != k.signature, i, j)
                        for i, g in enumerate(base) for j, k in enumerate(head))
    pairs: List[Tuple[int, int]] = []
    taken_b: Set[int] = set()
    taken_h: Set[int] = set()
    for *_, i, j in candidates:
        if i not in taken_b and j not in taken_h:
            pairs.append((i, j))
            taken_b.add(i)
            taken_h.add(j)
    return pairs


def _compiled_pairs(base: List[Group], head: List[Group]) -> Tuple[List[Tuple[Group, Group]], List[Group], List[Group]]:
    """Compiled buffers of one graph and category paired by their growth and order in the graph
    (_by_growth), and the groups left. One buffer of a graph compiled for two shapes is numbered
    alike in both only until the first buffer one of them reuses and the other allocates (or
    allocates in another order). The typical growth is that of the buffers of one number."""
    graphs: Dict[Tuple, List[List[Tuple[int, Group]]]] = defaultdict(lambda: [[], []])
    for side, groups in enumerate((base, head)):
        for g in groups:
            place = _compiled_place(g)
            if place is not None:
                graphs[place[0]][side].append((place[1], g))
    paired: List[Tuple[Group, Group]] = []
    taken: Set[int] = set()
    signed = {g.signature: g for olds, _ in graphs.values() for _, g in olds}
    growths = sorted(_growth(signed[k.signature], k) for _, news in graphs.values() for _, k in news
                     if k.signature in signed)
    typical = growths[len(growths) // 2] if growths else 0.0
    for olds, news in graphs.values():
        if not (olds and news):
            continue
        b = [g for _, g in sorted(olds, key=lambda x: (x[0], x[1].signature))]
        h = [g for _, g in sorted(news, key=lambda x: (x[0], x[1].signature))]
        for i, j in _by_growth(b, h, typical):
            paired.append((b[i], h[j]))
            taken.update((id(b[i]), id(h[j])))
    return paired, [g for g in base if id(g) not in taken], [g for g in head if id(g) not in taken]


def align(base: Sequence[Group], head: Sequence[Group]) -> List[DiffRow]:
    """Rows for two group lists, sorted by the size of the change (largest first)."""
    rows: List[DiffRow] = []
    # Memory older than the trace without a stack is one row per category, first: its label says
    # how its category was found (a weight the update order told, a frozen weight guessed), which
    # two runs may tell differently of the same weights (SGD and SGD with momentum, LoRA).
    by_category: Dict[Optional[str], List[List[Group]]] = defaultdict(lambda: [[], []])
    for side, groups in enumerate((base, head)):
        for g in groups:
            if _older(g) and not g.frames:
                by_category[g.category][side].append(g)
    # ...where labels alone would split it: labels only one run has, or labels that moved both ways.
    relabelled = [(olds, news) for olds, news in by_category.values() if olds and news and _relabelled(olds, news)]
    stackless = {id(g) for olds, news in relabelled for g in (*olds, *news)}
    rows.extend(_row(olds, news, BY_OLDER) for olds, news in relabelled)
    base = [g for g in base if id(g) not in stackless]
    head = [g for g in head if id(g) not in stackless]
    compiled, base_left, head_left = _compiled_pairs(base, head)
    rows.extend(_row([g], [k], BY_SIGNATURE if g.signature == k.signature else BY_COMPILED) for g, k in compiled)
    head_by_sig = {g.signature: g for g in head_left}
    base_left_: List[Group] = []
    for g in base_left:
        match = head_by_sig.pop(g.signature, None)
        if match is None:
            base_left_.append(g)
        else:
            rows.append(_row([g], [match], BY_SIGNATURE))
    base_left = base_left_
    head_left = [g for g in head_left if g.signature in head_by_sig]

    # Many to many: every left-over group of a site, in either run, is one row, so a site that
    # splits into two groups in one run cannot read as a NEW beside a SHRANK.
    for key in SITE_KEYS:
        by_site: Dict[Tuple, List[List[Group]]] = defaultdict(lambda: [[], []])
        for side, groups in enumerate((base_left, head_left)):
            for g in groups:
                by_site[key(g)][side].append(g)
        base_left, head_left = [], []
        for olds, news in by_site.values():
            if olds and news:
                rows.append(_row(olds, news, BY_SITE))
            else:
                base_left += olds
                head_left += news
    paired, base_left, head_left = _older_than_one_trace(base_left, head_left)
    rows.extend(_row(olds, news, BY_SIZE) for olds, news in paired)
    rows.extend(_row([g], [], None) for g in base_left)
    rows.extend(_row([], [g], None) for g in head_left)
    rows = _alike_merged(rows, {g.signature for g in (*base, *head) if _transient(g)})
    label_rows(rows)

    order = {NEW: 0, GREW: 1, GONE: 2, SHRANK: 3, SAME: 4}
    # Unchanged rows are sorted by their size too: a 30 MiB SAME row shows before a 4 B one.
    rows.sort(key=lambda r: (-abs(r.delta_bytes), order[r.status], -max(r.base_bytes, r.head_bytes), r.site,
                             r.signature))
    return rows


def _categories(base: Dict[str, int], head: Dict[str, int]) -> List[CategoryDelta]:
    # The classifier's per-device totals; empty for unclassified summaries.
    names = set(base) | set(head)
    out = [CategoryDelta(c, base.get(c, 0), head.get(c, 0), head.get(c, 0) - base.get(c, 0)) for c in names]
    out.sort(key=lambda c: (-abs(c.delta_bytes), c.category))
    return out


CHART_POINTS = 50


def _resample(d: DeviceSummary, points: int) -> List[Optional[int]]:
    """Allocated bytes over the trace's progress, `points` buckets, each the max it holds.

    A run without a timeline (a baseline, a dump with no trace) has no line: None.
    """
    if not d.timeline or not d.trace_events:
        return [None] * points
    out: List[Optional[int]] = [None] * points
    for index, value in d.timeline:
        b = min(points - 1, index * points // d.trace_events)
        held = out[b]
        out[b] = value if held is None else max(held, value)
    last = d.timeline[0][1]
    for i, v in enumerate(out):  # an empty bucket holds the level of the one before
        last = v if v is not None else last
        out[i] = last
    return out


def _chart(base: DeviceSummary, head: DeviceSummary) -> List[List[Optional[int]]]:
    """[percent of the trace, base bytes, head bytes] at CHART_POINTS points."""
    b, h = _resample(base, CHART_POINTS), _resample(head, CHART_POINTS)
    return [[round(100 * (i + 1) / CHART_POINTS), b[i], h[i]] for i in range(CHART_POINTS)]


def _phases(base: DeviceSummary, head: DeviceSummary) -> List[PhaseDelta]:
    b = {p.phase: p.peak_bytes for p in base.phase_peaks}
    h = {p.phase: p.peak_bytes for p in head.phase_peaks}
    return [PhaseDelta(phase, b.get(phase), h.get(phase), h.get(phase, 0) - b.get(phase, 0))
            for phase in (FORWARD, BACKWARD, OPTIMIZER) if phase in b or phase in h]


def _kept(rows: Sequence[DiffRow]) -> Optional[Kept]:
    """Memory kept from earlier steps outside the categories that live across steps."""
    leaky = [r for r in rows if r.category not in PERSISTENT and (r.base_earlier_bytes or r.head_earlier_bytes)]
    if not leaky:
        return None
    grew = sorted((r for r in leaky if r.head_earlier_bytes > r.base_earlier_bytes),
                  key=lambda r: r.base_earlier_bytes - r.head_earlier_bytes)
    return Kept(sum(r.base_earlier_bytes for r in leaky), sum(r.head_earlier_bytes for r in leaky), grew,
                sum(r.base_forward_bytes for r in leaky), sum(r.head_forward_bytes for r in leaky),
                max((r.head_forwards for r in leaky), default=0))


def _moment(d: DeviceSummary, at: str, role: str) -> Moment:
    found = d.at(at)
    if found is None:
        have = ", ".join(p.phase for p in d.phase_peaks) or "none (a summary or baseline without phases)"
        raise InputError(f"--at {at}", f"the {role} run has no {at} phase on device {d.device} (phases: {have})")
    return found


def _device_diff(b: DeviceSummary, h: DeviceSummary, at: str) -> DeviceDiff:
    b_at, h_at = _moment(b, at, "base"), _moment(h, at, "head")
    rows = align(b_at.groups, h_at.groups)
    return DeviceDiff(
        device=b.device, base_peak_bytes=b_at.peak_bytes, head_peak_bytes=h_at.peak_bytes,
        peak_delta_bytes=h_at.peak_bytes - b_at.peak_bytes, base_static_bytes=b.static_bytes,
        head_static_bytes=h.static_bytes, rows=rows, categories=_categories(b_at.categories, h_at.categories),
        chart=_chart(b, h), at=at,
        base_peak_phase=b.phase_at_peak, head_peak_phase=h.phase_at_peak, base_peak_step=b.step_at_peak,
        head_peak_step=h.step_at_peak, base_peak_scope=b.scope_at_peak, head_peak_scope=h.scope_at_peak,
        phases=_phases(b, h), kept=_kept(rows), category_highs=_category_highs(b, h),
        base_reserved_peak_bytes=b.reserved_peak_bytes, head_reserved_peak_bytes=h.reserved_peak_bytes,
        base_fragmentation_bytes=b.fragmentation_bytes, head_fragmentation_bytes=h.fragmentation_bytes)


def _highs(d: DeviceSummary) -> Dict[str, Tuple[int, str]]:
    """Each category's highest bytes over the peak and the phases' peaks, and where (the peak wins ties)."""
    out: Dict[str, Tuple[int, str]] = {}
    peak = d.phase_at_peak or PEAK  # the peak is its phase's peak: named so, it reads like for like
    for at, categories in [(peak, d.categories), *((p.phase, p.categories) for p in d.phase_peaks)]:
        for category, size in categories.items():
            if category not in out or size > out[category][0]:
                out[category] = (size, at)
    return out


def _category_highs(b: DeviceSummary, h: DeviceSummary) -> List[CategoryHigh]:
    base, head = _highs(b), _highs(h)
    return [CategoryHigh(c, base.get(c, (0, PEAK))[0], head.get(c, (0, PEAK))[0], base.get(c, (0, PEAK))[1],
                         head.get(c, (0, PEAK))[1]) for c in sorted(set(base) | set(head))]


def diff(base: Summary, head: Summary, at: str = PEAK, at_advice: Optional[str] = AT_ADVICE) -> Diff:
    """Align the two summaries device by device, at their peaks or at the peaks of phase `at`;
    `at_advice` words, in the warnings, how the caller's command diffs at one phase."""
    b_devs = {d.device: d for d in base.devices}
    h_devs = {d.device: d for d in head.devices}
    devices = []
    for dev in sorted(set(b_devs) | set(h_devs)):
        b, h = b_devs.get(dev), h_devs.get(dev)
        # A side that lacks the device compares as empty at whatever moment the other is taken.
        devices.append(_device_diff(b or DeviceSummary.blank(dev), h or DeviceSummary.blank(dev),
                                    at if b and h else PEAK))
    return Diff(base=base.source, head=head.source, devices=devices, findings=_findings(base, head, devices, at_advice))
