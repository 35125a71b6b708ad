"""peak: Summary -> the rows a person reads when chasing an OOM (top groups, the rest folded, total)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, List, Optional, Tuple

from memdiff.analyse.classify import PERSISTENT
from memdiff.analyse.guesses import GuessedPart, guessed_data, guessed_text, inference
from memdiff.analyse.lifetimes import BACKWARD, FORWARD, OPTIMIZER, OTHER
from memdiff.compare.findings import finding, in_order
from memdiff.compare.observe import (
    growing_data,
    growing_steps,
    kept_bytes,
    kept_data,
    oom_data,
    overflow_data,
    where_text,
)
from memdiff.errors import InputError
from memdiff.inert import scrubbed
from memdiff.model import WINDOW_KEY, DeviceSummary, Finding, Frame, Summary, largest_first
from memdiff.units import count_of, format_bytes

PHASE_COLUMNS = (FORWARD, BACKWARD, OPTIMIZER, OTHER)
# Steps shown in the per-phase table: all up to this many, else the first, the last and
# those around the peak's.
SHOWN_STEPS = 6


@dataclass
class PeakRow:
    """One table row: a group, the folded rest, or the total."""

    label: str
    count: int
    bytes: int
    share_pct: float
    site: str
    frames: List[Frame]
    category: str = ""
    signature: str = ""  # the group's; empty for the folded rest and the total

    @property
    def share_text(self) -> str:
        """The row's share of the peak as every table's cell says it: `12.3%`."""
        return f"{self.share_pct:.1f}%"

    @property
    def cells(self) -> List[str]:
        """The row's cells before its site, as every table shows them: `#`, count, bytes, share, category."""
        return [self.label, f"{self.count:,}", format_bytes(self.bytes), self.share_text, self.category]

    @property
    def title(self) -> str:
        """`adam.py:_multi_tensor_adam <- _foreach_sqrt (optimizer_temporary) 474.70 MiB`: the row named alone."""
        return f"{self.site} ({self.category}) {format_bytes(self.bytes)}"


@dataclass
class Share:
    """One name's bytes at the peak (a category, a scope, a compile context, a label) and its share of the peak."""

    name: str
    bytes: int
    pct: float

    @property
    def share_text(self) -> str:
        """The share as every table's cell says it: `12.3%`."""
        return f"{self.pct:.1f}%"

    @property
    def cells(self) -> List[str]:
        """The name, its bytes and its share, as every table shows them."""
        return [self.name, format_bytes(self.bytes), self.share_text]


@dataclass
class StepRow:
    """One step of the per-phase table: the highest memory of each phase (None: no such phase),
    how many runs of each phase the step has, and whether the device's peak is in it."""

    step: Optional[int]  # None: the row stands for steps left out
    peaks: Dict[str, Optional[int]]
    runs: Dict[str, int]
    holds_peak: bool = False

    @property
    def step_text(self) -> str:
        """`12 *`: the step, marked when it holds the device's peak; `…` for the steps left out."""
        return "…" if self.step is None else f"{self.step}{' *' if self.holds_peak else ''}"

    def phase_text(self, phase: str) -> str:
        """`1.25 GiB (3 runs)`: the phase's highest memory in the step, its runs when more than one; "" without it."""
        peak = self.peaks.get(phase)
        if peak is None or self.step is None:
            return ""
        runs = self.runs.get(phase, 0)
        return format_bytes(peak) + (f" ({runs} runs)" if runs > 1 else "")


@dataclass
class DevicePeak:
    """A device's summary with its table ready to show."""

    device: DeviceSummary
    reached_by: Optional[str]
    rows: List[PeakRow]
    total: PeakRow
    categories: List[Share]
    scopes: List[Share]
    compile_contexts: List[Share]
    labels: List[Share]  # the user's labels (user_metadata, annotations)
    steps: List[StepRow]
    findings: List[Finding]  # the catalogue's, about this device (findings.py)
    reserved: Optional[str] = None  # the caching allocator's reserved peak and fragmentation, in words
    window: bool = False  # a window of a longer trace (memdiff slice, --steps): its start is no trace start
    # `device 0: peak 4.76 GiB, in the backward of step 1; static 474.70 MiB`: the device in one line
    heading: str = ""
    # The device's facts as the text lays them out: (what, figure, words), `("static", "474.70 MiB", "live ...")`
    facts: List[Tuple[str, str, str]] = field(default_factory=list)


def _share(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def _shares(totals: Dict[str, int], whole: int) -> List[Share]:
    return [Share(name, n, _share(n, whole)) for name, n in totals.items()]


def device_peak(device: DeviceSummary, top: Optional[int], window: bool = False) -> DevicePeak:
    """The top `top` groups (all when None), the rest folded into one row, and a total row; `window`:
    the summary is of a window of a longer trace."""
    groups = device.groups
    shown = groups if top is None else groups[:top]
    rows = [PeakRow(str(i), g.count, g.bytes, _share(g.bytes, device.peak_bytes), g.site, g.frames, g.category or "",
                    g.signature) for i, g in enumerate(shown, 1)]
    rest = groups[len(shown):]
    if rest:
        rest_bytes = sum(g.bytes for g in rest)
        rows.append(PeakRow("…", sum(g.count for g in rest), rest_bytes,
                            _share(rest_bytes, device.peak_bytes), f"{count_of(len(rest), 'other group')}", []))
    total = PeakRow("total", sum(g.count for g in groups), sum(g.bytes for g in groups),
                    _share(sum(g.bytes for g in groups), device.peak_bytes),
                    f"{count_of(len(groups), 'group')} live at the peak", [])
    reached_by = next((g.site for g in groups if g.signature == device.peak_event_signature), None)
    reserved = None if window else reserved_text(device)
    return DevicePeak(device=device, reached_by=reached_by, rows=rows, total=total,
                      categories=_shares(device.categories, device.peak_bytes),
                      scopes=_shares(device.bytes_by_scope, device.peak_bytes),
                      compile_contexts=_shares(device.bytes_by_compile_context, device.peak_bytes),
                      labels=_shares(device.bytes_by_label, device.peak_bytes),
                      steps=step_rows(device), findings=device_findings(device, window),
                      # a window's segments are the blocks it carried in, not the allocator's: no reserved figure
                      reserved=reserved, window=window,
                      heading=heading_text(device),
                      facts=peak_facts(device, reached_by, reserved, window))


def peak_facts(device: DeviceSummary, reached_by: Optional[str], reserved: Optional[str],
               window: bool) -> List[Tuple[str, str, str]]:
    """The device's facts, each (what, figure, words): the peak and when, what reached it, its phase
    and scope, static memory, what the dump held, reserved memory and the trace's length."""
    d = device
    facts = [("peak", format_bytes(d.peak_bytes), f"{d.peak_bytes:,} B, {when_text(d)}")]
    if reached_by:
        facts.append(("reached by", "", reached_by))
    if d.phase_at_peak:
        facts.append(("peak in", "", where_text(d.phase_at_peak, d.step_at_peak)))
    if d.scope_at_peak:
        facts.append(("scope", "", f"{d.scope_at_peak} (record_function scope open at the peak)"))
    facts.append(("static", format_bytes(d.static_bytes), "live when the window began, counted from its start"
                   if window else "live before the trace began, counted from its start"))
    if not window:  # a window's end is no dump: its blocks are only what it carried in
        facts.append(("at dump", format_bytes(d.allocated_bytes_at_dump),
                      "allocated" + (f", {format_bytes(d.reserved_bytes_at_dump)} reserved by the caching allocator"
                                     if d.reserved_bytes_at_dump is not None
                                     else " (no caching allocator: CPU capture)")))
    if reserved:
        facts.append(("reserved", "", reserved))
    facts.append(("trace", f"{d.trace_events:,}", "events"))
    return facts


def heading_text(device: DeviceSummary) -> str:
    """`device 0: peak 4.76 GiB, in the backward of step 1; static 474.70 MiB`."""
    where = f", in {where_text(device.phase_at_peak, device.step_at_peak)}" if device.phase_at_peak else ""
    return (f"device {device.device}: peak {format_bytes(device.peak_bytes)}{where}; "
            f"static {format_bytes(device.static_bytes)}")


def when_text(device: DeviceSummary) -> str:
    """When the peak is: `at event 1,234 of 5,678 (+1.234 s into the trace, 2026-01-02 03:04:05.678 UTC)`,
    the times when the trace has them; `before the first event (...)` when nothing rose above static memory."""
    if device.peak_event_index is None:
        return "before the first event (nothing in the trace rose above static memory)"
    us, start_us = device.peak_time_us, device.trace_start_time_us
    stamp = ""
    if us is not None:
        utc = datetime.fromtimestamp(us / 1e6, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        into = f"+{(us - start_us) / 1e6:.3f} s into the trace, " if start_us is not None else ""
        stamp = f" ({into}{utc} UTC)"
    return f"at event {device.peak_event_index:,} of {device.trace_events:,}{stamp}"


def page_title(summary: Summary) -> str:
    """`memdiff peak: run.pickle`: the peak page's title."""
    return f"memdiff peak: {summary.source.file}"


def reserved_text(device: DeviceSummary) -> Optional[str]:
    """`5.05 GiB at its highest; 293.95 MiB of it held no tensor at the peak (fragmentation)`;
    None without segments (CPU captures)."""
    if device.reserved_peak_bytes is None:
        return None
    frag = device.fragmentation_bytes
    return (f"{format_bytes(device.reserved_peak_bytes)} at its highest (the caching allocator's segments)"
            + (f"; {format_bytes(frag)} of it held no tensor at the peak (fragmentation)" if frag is not None else ""))


def device_findings(device: DeviceSummary, window: bool = False) -> List[Finding]:
    """What the catalogue says of one run's device: a trace that starts mid-run (or a window's
    carried memory), out-of-memory events, memory kept from earlier steps and whether it grows
    step over step, categories guessed for memory older than the trace; in the one order every
    report shows findings in (findings.in_order)."""
    out = []
    if not device.trace_events:
        out.append(finding("T015", device.device))
    if device.unmatched_free_count:
        out.append(finding("T004" if window else "T002", device.device, frees=device.unmatched_free_count,
                           freed_bytes=device.unmatched_free_bytes, freed=format_bytes(device.unmatched_free_bytes)))
    out += [finding("A002", device.device, **oom_data(o)) for o in device.oom_events]
    groups = sorted((g for g in device.groups if g.bytes_from_earlier_steps and g.category not in PERSISTENT),
                    key=lambda g: -g.bytes_from_earlier_steps)
    if groups:
        kept, forward_bytes, forwards = kept_bytes(device)
        out.append(finding("K001", device.device, **kept_data(
            f"{format_bytes(kept)} live at the peak",
            [f"{g.category}: {g.site} {format_bytes(g.bytes_from_earlier_steps)}" for g in groups],
            kept, forward_bytes, forwards)))
    if growing_steps(device):
        out.append(finding("K004", device.device, **growing_data(device)))
    guessed: Dict[Tuple[str, str], int] = {}
    for g in device.groups:
        how = inference(g.site, g.category or "")
        if how is not None:
            guessed[(g.category or "", how)] = guessed.get((g.category or "", how), 0) + g.bytes
    if guessed:
        parts = [GuessedPart(c, how, n) for (c, how), n in guessed.items()]
        by_category: Dict[str, int] = {}
        for p in parts:
            by_category[p.category] = by_category.get(p.category, 0) + p.bytes
        amount = sum(guessed.values())
        out.append(finding("C001", device.device, amount=format_bytes(amount), amount_bytes=amount,
                           by_category=largest_first(by_category), categories=guessed_text(parts),
                           by_inference=guessed_data(parts)))
    return in_order(out)


def source_findings(summary: Summary) -> List[Finding]:
    """What the catalogue says of a run as a whole: a trace whose ring buffer wrapped, a run the
    emulator wrote and what it could only approximate; in the one order (findings.in_order)."""
    out = []
    if summary.source.trace_overflowed() is not None:
        out.append(finding("T001", **overflow_data(summary.source)))
    emulated = summary.source.emulated
    if emulated:
        out.append(finding("T013", gpu=emulated["gpu"]))
        out.extend(finding("T014", role="", note=note) for note in emulated.get("notes", []))
    return in_order(out)


def peak_findings(run_findings: List[Finding], peaks: List[DevicePeak]) -> List[Finding]:
    """Every finding of a peak report as one list (its JSON's `findings`): the run's and each shown
    device's, in the one order (findings.in_order); the text and the page show the same findings,
    the run's first, then each device's under its heading, each part in that order."""
    return in_order([*run_findings, *(f for p in peaks for f in p.findings)])


def step_rows(device: DeviceSummary) -> List[StepRow]:
    """The per-phase table: per step, the peak of each phase; long runs of steps are cut to the
    first, the last and those around the peak's step, a row with step None standing for a gap."""
    rows = []
    for s in device.steps:
        peaks: Dict[str, Optional[int]] = {phase: None for phase in PHASE_COLUMNS}
        runs = {phase: 0 for phase in PHASE_COLUMNS}
        holds = False
        for span in s.phases:
            seen = peaks[span.phase]
            peaks[span.phase] = span.peak_bytes if seen is None else max(seen, span.peak_bytes)
            runs[span.phase] += 1
            holds = holds or (device.peak_event_index is not None
                              and span.start_event <= device.peak_event_index <= span.end_event)
        rows.append(StepRow(s.step, peaks, runs, holds))
    if len(rows) <= SHOWN_STEPS:
        return rows
    at = next((k for k, r in enumerate(rows) if r.holds_peak), 0)
    keep = sorted({0, len(rows) - 1, at - 1, at, at + 1} & set(range(len(rows))))
    out: List[StepRow] = []
    last = -1
    for k in keep:
        if out and k > last + 1:
            out.append(StepRow(None, {}, {}))
        out.append(rows[k])
        last = k
    return out


def peak_report(path: str, summary: Summary, top: Optional[int], device: Optional[int] = None) -> List[DevicePeak]:
    """One DevicePeak per device, or only `device`; InputError when the snapshot lacks it."""
    devices = summary.devices
    if device is not None:
        devices = [d for d in devices if d.device == device]
        if not devices:
            have = ", ".join(str(d.device) for d in summary.devices) or "none"
            raise InputError(path, f"no device {device} in this snapshot (devices: {have})")
    window = WINDOW_KEY in summary.source.keys
    # Names from the snapshot are made one line each here, once for every output.
    return [scrubbed(device_peak(d, top, window), skip=("device",)) for d in devices]
