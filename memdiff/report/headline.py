"""The headline: the one sentence a reviewer reads first, worded from a report's devices.

What grew (or shrank), at which moment and in which phase, the category and the sites that carry the
change (weights before what follows them), what offset it, how the other phases moved and what was kept
from earlier steps. report/build.py calls `headline_of` once the devices are worded; every output opens with it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from memdiff.compare.differ import NEW, CategoryDelta, DeviceDiff
from memdiff.compare.observe import PEAK, kept_from, where_text
from memdiff.report.types import SITES_NAMED, DeviceReport, moment_name
from memdiff.units import change_text, format_bytes

# Memory that follows the weights: an optimizer's state and the gradients are sized by them.
FOLLOWS_WEIGHTS = ("gradient", "optimizer_state")
# Weights lead when they moved at least 1/WEIGHTS_LEAD of the largest move (AdamW's state is 2x).
WEIGHTS_LEAD = 4


# A site moving against its category's change is named when it moved at least 1/OFFSET_NAMED of it.
OFFSET_NAMED = 4


def _cause(d: DeviceDiff, sign: int) -> Optional[str]:
    """The category that moved most in the direction of `sign`, and the sites that carry it.
    Weights lead when they moved that way: gradients and optimizer state follow them (AdamW's
    state is twice the weights, so it moves most, but a wider model is the cause)."""
    moved: List[CategoryDelta] = [c for c in d.categories if c.delta_bytes * sign > 0]
    if not moved:
        return None
    largest = max(moved, key=lambda c: (abs(c.delta_bytes), c.category))
    weights = next((c for c in moved if c.category == "parameter"
                    and abs(c.delta_bytes) * WEIGHTS_LEAD >= abs(largest.delta_bytes)), None)
    c = weights or largest
    rows = [r for r in d.rows if r.category == c.category and r.delta_bytes * sign > 0][:SITES_NAMED]
    # A category that moved both ways (an optimizer swapped, autocast's casts) names what came
    # against the move too: its net change alone reads as if the other side never happened.
    against = [r for r in d.rows if r.category == c.category and r.delta_bytes * sign < 0
               and abs(r.delta_bytes) * OFFSET_NAMED >= abs(c.delta_bytes)][:1]
    sites = ", ".join(f"{r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}"
                      + (" new" if r.status == NEW else "") for r in rows)
    if sites and against:
        r = against[0]
        sites += (f"; offset by {r.label or r.site} {format_bytes(r.delta_bytes, signed=True)}"
                  + (" new" if r.status == NEW else ""))
    text = f"{c.category} {change_text(c.base_bytes, c.head_bytes)}" + (f" ({sites})" if sites else "")
    if weights is not None:
        following = [f"{f.category} {format_bytes(f.delta_bytes, signed=True)}" for f in moved
                     if f.category in FOLLOWS_WEIGHTS]
        text += f", and with the weights {' and '.join(following)}" if following else ""
    return text


def _phase_tail(d: DeviceDiff, skip: Sequence[Optional[str]]) -> str:
    """The other phases' peaks: `the forward and the optimizer step are unchanged`, `the backward
    (+16.00 KiB) is within 1%`, `the backward +1.06 MiB (+10.4%)`; the phases in `skip` (where the
    peak is, the one explained) are not repeated."""
    same, close, moved = [], [], []
    for p in d.phases:
        if p.phase in skip or p.base_peak_bytes is None or p.head_peak_bytes is None:
            continue
        if p.delta_bytes == 0:
            same.append(where_text(p.phase, None))
        elif abs(p.delta_bytes) * 100 < p.base_peak_bytes:
            close.append(f"{where_text(p.phase, None)} ({format_bytes(p.delta_bytes, signed=True)})")
        else:
            moved.append(f"{where_text(p.phase, None)} {change_text(p.base_peak_bytes, p.head_peak_bytes)}")
    parts = [f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} {what}"
             for names, what in ((same, "unchanged"), (close, "within 1%")) if names]
    return "".join(f"; {part}" for part in moved + parts)


def _device_headline(r: DeviceReport) -> str:
    d = r.diff
    moment = moment_name(d.at)
    if d.peak_delta_bytes == 0:
        text = f"{moment} unchanged at {format_bytes(d.head_peak_bytes)}"
    else:
        text = f"{moment} {change_text(d.base_peak_bytes, d.head_peak_bytes)}"
        text += f" ({r.noise_within})" if r.noise_within else ""
    moved = d.at == PEAK and d.base_peak_phase and d.head_peak_phase and d.base_peak_phase != d.head_peak_phase
    if moved:
        text += (f", now in {where_text(d.head_peak_phase, None)} "
                 f"(it was in {where_text(d.base_peak_phase, None)})")
    elif d.at == PEAK and d.head_peak_phase:
        text += f", in {where_text(d.head_peak_phase, None)}"
    sign = 1 if d.peak_delta_bytes >= 0 else -1
    like = r.like_for_like.diff if r.like_for_like is not None else None
    if moved and like is not None:
        # Rows at two different moments explain nothing: name the cause at one phase's peak in both (_moved_phase).
        cause = _cause(like, sign)
        if cause:
            text += f": at the {like.at} peak of both, {cause}"
    else:
        cause = _cause(d, sign) if d.peak_delta_bytes else None
        if cause:
            text += f": {cause}"
    if not cause and not d.peak_delta_bytes and not any(x.delta_bytes for x in d.rows):
        text += "; no group changed"
    if like is not None and not moved:
        # The peak held, another phase moved: that is the change to explain.
        phase_cause = _cause(like, 1 if like.peak_delta_bytes >= 0 else -1)
        text += (f"; {where_text(like.at, None)} {change_text(like.base_peak_bytes, like.head_peak_bytes)}"
                 + (f": {phase_cause}" if phase_cause else ""))
    text += _phase_tail(d, [d.head_peak_phase if d.at == PEAK else d.at, like.at if like is not None else None])
    k = d.kept
    if k is not None and k.head_bytes > k.base_bytes:
        text += f"; kept from {kept_from(k.head_bytes, k.head_forward_bytes)} {change_text(k.base_bytes, k.head_bytes)}"
    return text


def headline_of(devices: Sequence[DeviceReport]) -> str:
    """One sentence a reviewer reads first: what grew, in which phase, and the sites that carry it."""
    if not devices:
        return "no device memory in either run"
    worst = max(devices, key=lambda r: (r.diff.peak_delta_bytes, abs(r.diff.peak_delta_bytes), -r.device))
    text = _device_headline(worst)
    return f"device {worst.device}: {text}" if len(devices) > 1 else text
