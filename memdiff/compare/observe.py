"""What a diff observes about the two runs beside its rows: where a peak is, the trace's bookkeeping,
memory kept from earlier steps, steps that grow, out-of-memory events, and the findings (T0xx, P001)
they raise; `memdiff.compare.differ.diff` puts them on its Diff."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from memdiff.analyse.classify import PERSISTENT
from memdiff.analyse.lifetimes import BACKWARD, OPTIMIZER, frame_phase
from memdiff.compare.findings import finding
from memdiff.compare.rows import PEAK, DeviceDiff
from memdiff.model import DeviceSummary, Finding, OomEvent, Source, Summary
from memdiff.read.frames import names_autograd_node
from memdiff.units import count_of, format_bytes

EVENT_RATIO_WARNING = 2.0



def _setting(settings: Dict[str, Any], key: str) -> str:
    """One allocator setting as T008 shows it: its value, or `not recorded` where the run's torch
    wrote no such key (it read `None`, a value nobody set)."""
    return repr(settings[key]) if key in settings else "not recorded"

def where_text(phase: Optional[str], step: Optional[int]) -> str:
    """`the optimizer step of step 0`, `the forward of step 2`: where a peak happens; `step 2`
    without a phase, "" when neither is known (a snapshot without a trace)."""
    if phase is None:
        return "" if step is None else f"step {step}"
    named = {OPTIMIZER: "the optimizer step"}.get(phase, f"the {phase}")
    return named + (f" of step {step}" if step is not None else "")


# The trace's bookkeeping, not the allocator's behaviour: told apart from settings that differ.
TRACE_BOOKKEEPING = ("trace_alloc_overflowed", "trace_alloc_max_entries")


def overflow_data(source: Source) -> Dict[str, Any]:
    """T001's figures: the size of the ring buffer that wrapped (0 when torch does not say)."""
    size = source.trace_overflowed() or 0
    return {"max_entries": size, "ring": f"its ring buffer of {size:,} entries" if size else "its ring buffer"}


def names_nodes(d: DeviceSummary) -> Optional[bool]:
    """Whether the stacks of a device's backward memory name autograd nodes; None when none of its
    groups was made by the autograd engine, as far as the stacks say."""
    groups = [*d.groups, *(g for p in d.phase_peaks for g in p.groups or [])]
    backward = [g for g in groups if any(frame_phase(f.name, f.file) == BACKWARD for f in g.frames)]
    if not backward:
        return None
    return any(names_autograd_node(f.name) for g in backward for f in g.frames)


def _keys(source: Source) -> Set[str]:
    """A snapshot's top-level keys that say which torch wrote it (the emulator's marker says how instead)."""
    return set(source.keys) - {"emulated"}


def _step_count(s: Summary, d: DeviceSummary) -> Optional[int]:
    """How many steps a device's run recorded: a run's steps, a baseline's stored count; None for a
    baseline made before baselines kept it."""
    return d.steps_recorded(baseline=s.source.container == "baseline")


# The codes whose sentences the JSON's `warnings` lists: why the two runs may not compare.
WARNING_STRINGS = ("T001", "T003", "T005", "T006", "T007", "T008", "T009", "T010", "T012", "T014", "T015", "P001",
                   "P002")
KEPT_SITES = 3  # sites the kept line names


# How the diff command picks a phase; a caller without --at names its own way (`at_advice`).
AT_ADVICE = "--at {phase}"


def _findings(base: Summary, head: Summary, devices: Sequence[DeviceDiff] = (),
              at_advice: Optional[str] = AT_ADVICE) -> List[Finding]:
    """What the catalogue says of the pair: reasons the two runs may not be comparable (the diff is
    still computed), kept memory and leaks, OOMs of the head run. `at_advice` words how the caller
    diffs at one phase ("{phase}" stands for it), None when it cannot."""
    out = [finding("T001", run=role, **overflow_data(s.source)) for role, s in (("base", base), ("head", head))
           if s.source.trace_overflowed() is not None]
    out += [finding("G013", baseline=s.source.file) for s in (base, head) if s.source.edited]
    out += [finding("T015", d.device, run=role) for role, s in (("base", base), ("head", head))
            for d in s.devices if not d.trace_events]
    b_set, h_set = base.source.allocator_settings, head.source.allocator_settings
    if b_set is not None and h_set is not None and b_set != h_set:
        keys = sorted(k for k in set(b_set) | set(h_set)
                      if b_set.get(k) != h_set.get(k) and k not in TRACE_BOOKKEEPING)
        if keys:
            # A setting one run's torch does not write is not the value None: say it was not recorded.
            out.append(finding("T008", keys=keys, detail=", ".join(
                f"{k}: {_setting(b_set, k)} -> {_setting(h_set, k)}" for k in keys)))
    if base.source.route() != head.source.route():
        out.append(finding("T012", base_route=base.source.route(), head_route=head.source.route()))
    for role, run in (("base", base), ("head", head)):
        out.extend(finding("T014", role=f"{role} ", note=note) for note in (run.source.emulated or {}).get("notes", []))
    b_devs, h_devs = [d.device for d in base.devices], [d.device for d in head.devices]
    if b_devs != h_devs:
        out.append(finding("T005", base_devices=b_devs or "none", head_devices=h_devs or "none"))
    if base.source.generation != head.source.generation:
        out.append(finding("T006", base_format=base.source.generation, head_format=head.source.generation))
    elif base.source.keys and head.source.keys and _keys(base.source) != _keys(head.source):
        only_b = sorted(_keys(base.source) - _keys(head.source))
        only_h = sorted(_keys(head.source) - _keys(base.source))
        out.append(finding("T007", only_base=only_b, only_head=only_h, detail="; ".join(
            part for part in (f"only base has {', '.join(only_b)}" if only_b else "",
                              f"only head has {', '.join(only_h)}" if only_h else "") if part)))
    heads = {d.device: d for d in head.devices}
    for b in base.devices:
        h = heads.get(b.device)
        if h is None:
            continue
        # A baseline's groups keep no frames: it stores what its run's stacks said (None before it did).
        named = {role: d.autograd_nodes if s.source.container == "baseline" else names_nodes(d)
                 for role, s, d in (("base", base, b), ("head", head, h))}
        if None not in named.values() and named["base"] != named["head"]:
            which, other = ("base", "head") if named["base"] else ("head", "base")
            out.append(finding("T009", b.device, which=which, other=other))
        if (b.unmatched_free_count > 0) != (h.unmatched_free_count > 0):
            out.append(finding("T003", b.device, which="base" if b.unmatched_free_count else "head"))
        lo, hi = sorted((b.trace_events, h.trace_events))
        # Runs that record the same number of steps record the same work, however many events
        # a bigger batch or gradient accumulation makes; only then is the count no evidence.
        # A baseline keeps its run's count, so a gate says what a diff of the two runs says; one
        # made before it did has no count, never zero, and the sentence says so.
        b_steps, h_steps = _step_count(base, b), _step_count(head, h)
        same_steps = bool(b_steps) and b_steps == h_steps
        if lo and hi / lo > EVENT_RATIO_WARNING and not same_steps:
            if b_steps is None or h_steps is None:
                steps = (", steps unknown: the baseline was made by an earlier memdiff, which kept no step count; "
                         "`memdiff baseline` again stores it")
            else:
                steps = f", {b_steps} -> {h_steps} steps" if b_steps or h_steps else ""
            out.append(finding("T010", b.device, ratio=hi / lo, base_events=b.trace_events,
                               head_events=h.trace_events, base_steps=b_steps, head_steps=h_steps, steps=steps))
    base_devices = {b.device: b for b in base.devices}
    for d in devices:
        if d.at == PEAK and d.base_peak_phase and d.head_peak_phase and d.base_peak_phase != d.head_peak_phase:
            # The gate has no --at: against a baseline the report's like-for-like view (when the
            # baseline keeps the phase's groups) and the phase table compare like with like.
            at_phase = base_devices[d.device].at(d.head_peak_phase) if d.device in base_devices else None
            if base.source.container == "baseline":
                advice = ("the phase peaks below" + (", the like-for-like view of the markdown and HTML reports"
                                                     if at_phase is not None and at_phase.groups else "")
                          + ", or the gate's --phase-fail-over")
            elif at_phase is not None and at_phase.groups and at_advice is not None:
                advice = at_advice.format(phase=d.head_peak_phase)
            else:
                advice = "the phase peaks below"
            out.append(finding("P001", d.device, base_phase=d.base_peak_phase, head_phase=d.head_peak_phase,
                               base_where=where_text(d.base_peak_phase, d.base_peak_step),
                               head_where=where_text(d.head_peak_phase, d.head_peak_step), advice=advice))
        # Only a peak that fell: one that grew fails on its own (a run out of memory in its forward).
        lost = d.phases_lost() if d.peak_delta_bytes < 0 else []
        if lost:
            out.append(finding("P002", d.device, phases=lost,
                               missing=" or ".join("optimizer step" if p == OPTIMIZER else p for p in lost)))
        k = d.kept
        if k is not None and k.head_bytes > k.base_bytes:
            out.append(finding("K002", d.device, **kept_data(
                f"{format_bytes(k.base_bytes)} -> {format_bytes(k.head_bytes)}",
                [f"{r.category}: {r.label or r.site} "
                 f"{format_bytes(r.head_earlier_bytes - r.base_earlier_bytes, signed=True)}" for r in k.rows],
                k.head_bytes, k.head_forward_bytes, k.head_forwards),
                base_bytes=k.base_bytes, head_bytes=k.head_bytes))
        h_dev, b_dev = heads.get(d.device), base_devices.get(d.device)
        if (h_dev is not None and b_dev is not None and k is not None and k.head_bytes > k.base_bytes
                and growing_steps(h_dev) and not growing_steps(b_dev)):
            said = growing_data(h_dev)
            if base.source.container == "baseline" and b_dev.step_peaks is None:
                # Whether the baseline's run grew too is unknown: say so, as the finding may fail the gate.
                said["unknown"] = ("; whether the baseline's run grew too is unknown: it was made by an earlier "
                                   "memdiff, which kept no step peaks (`memdiff baseline` again stores them)")
            out.append(finding("K004", d.device, **said))
        if k is not None and k.head_forward_bytes and not k.base_forward_bytes:
            out.append(finding("K003", d.device, kept=format_bytes(k.head_forward_bytes),
                               kept_bytes=k.head_forward_bytes,
                               forwards=count_of(k.head_forwards, "earlier forward"), forward_count=k.head_forwards))
    for h in head.devices:
        b_ooms = len(base_devices[h.device].oom_events) if h.device in base_devices else 0
        if len(h.oom_events) > b_ooms:
            out += [finding("A002", h.device, run="head", **oom_data(o)) for o in h.oom_events]
    return out


# Kept memory grows step over step when each step after the first peaks higher than the one
# before by at least this share of it (the first step makes the optimizer's state and is left out).
STEP_GROWTH_PCT = 1.0
STEPS_GROWING = 2  # steps after the first that must each grow over the one before


def step_peaks(d: DeviceSummary) -> List[int]:
    """The peaks of the steps after the first that run the phases the second one runs: a step cut
    short (the trace ends in its forward, a last evaluation) is no step to compare. A baseline's
    are the ones it stored (none when made before baselines kept them)."""
    if d.step_peaks is not None:
        return list(d.step_peaks)
    steps = d.steps[1:]
    kinds = {p.phase for p in steps[0].phases} if steps else set()
    return [max((p.peak_bytes for p in s.phases), default=0) for s in steps if {p.phase for p in s.phases} == kinds]


def kept_bytes(d: DeviceSummary) -> Tuple[int, int, int]:
    """A device's memory kept at the peak from earlier steps outside the categories that live across
    steps: (bytes, of those from earlier forwards, how many earlier forwards at most)."""
    groups = [g for g in d.groups if g.bytes_from_earlier_steps and g.category not in PERSISTENT]
    return (sum(g.bytes_from_earlier_steps for g in groups), sum(g.bytes_from_earlier_forwards for g in groups),
            max((g.earlier_forwards for g in groups), default=0))


def growing_steps(d: DeviceSummary) -> bool:
    """Whether the device keeps memory from earlier steps and each step after the first peaks at
    least STEP_GROWTH_PCT higher than the one before (over STEPS_GROWING steps at least)."""
    peaks = step_peaks(d)
    if len(peaks) < STEPS_GROWING or not kept_bytes(d)[0]:
        return False
    return all(after * 100 > before * (100 + STEP_GROWTH_PCT) for before, after in zip(peaks, peaks[1:]))


def growing_data(d: DeviceSummary) -> Dict[str, Any]:
    """K004's figures: the step peaks after the first, and the bytes kept at the peak."""
    peaks = step_peaks(d)
    kept = kept_bytes(d)[0]
    return {"step_peaks_bytes": peaks, "steps": ", ".join(format_bytes(p) for p in peaks),
            "kept_bytes": kept, "kept": format_bytes(kept), "unknown": ""}


def oom_data(o: OomEvent) -> Dict[str, Any]:
    """A002's figures for one `oom` trace entry."""
    return {"event": o.event_index, "requested_bytes": o.requested_bytes, "requested": format_bytes(o.requested_bytes),
            "device_free_bytes": o.device_free_bytes,
            "free": format_bytes(o.device_free_bytes) if o.device_free_bytes is not None else "unknown"}


def kept_data(amount: str, sites: Sequence[str], kept_bytes: int = 0, forward_bytes: int = 0,
              forwards: int = 0) -> Dict[str, Any]:
    """The one wording of kept memory (K001 in a run's peak report, K002 in a diff), as the
    catalogue's figures: what it was kept from, AMOUNT, the forwards that made it, the sites;
    of the bytes kept from earlier forwards (`forward_bytes` of `kept_bytes`), it says how many
    forwards made them."""
    more = f" and {len(sites) - KEPT_SITES:,} more" if len(sites) > KEPT_SITES else ""
    passes = ""
    if forward_bytes and forwards:
        share = "" if forward_bytes >= kept_bytes else f" {format_bytes(forward_bytes)} of it"
        passes = f",{share} made by {count_of(forwards, 'earlier forward')} that a forward of the same code followed"
    return {"source": kept_from(kept_bytes, forward_bytes), "amount": amount, "passes": passes,
            "sites": f"{', '.join(sites[:KEPT_SITES])}{more}", "kept_bytes": kept_bytes,
            "forward_bytes": forward_bytes, "forwards": forwards}


def kept_from(kept_bytes: int, forward_bytes: int) -> str:
    """What kept memory was kept from: `earlier steps`, `earlier forwards` (a forward of the same
    code ran after the one that made it, in the same step: a validation loop without
    torch.no_grad()), or both."""
    if not forward_bytes:
        return "earlier steps"
    return "earlier forwards" if forward_bytes >= kept_bytes else "earlier steps and forwards"
