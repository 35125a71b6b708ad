"""A baseline's figures checked against each other: what one run's memory can be.

The schema bounds each figure alone; a hand edit (or a hostile pull request) can still store
figures no run has, and each one gates as a limit: a spread whose highest run is 8 EiB lets
every run pass, a spread whose lowest is above its highest gates nothing sensible. What
`memdiff baseline` writes always holds: byte figures within what a device can hold; each
spread's min <= median <= max, holding the stored run's figure; static memory at most the
peak; the reserved peak at least the allocated peak plus the fragmentation at it; at the peak
and at each phase's peak, the categories adding up to at most that peak, and each category's
stored groups to at most the category.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Tuple

from memdiff.errors import InputError, clip, number
from memdiff.units import format_bytes

# 1 PiB. The largest GPU memory today is under 2**39 bytes (288 GB); a figure past 2**50 is no
# run's, and as a spread's highest run it would let every run pass.
MAX_DEVICE_BYTES = 2**50
# The fields that count things (or say where), not bytes: a device's, a stored group's, a spread's.
DEVICE_COUNTS = frozenset(("device", "trace_events", "unmatched_free_count", "step_count", "rest_counts", "at_peak"))
GROUP_COUNTS = frozenset(("count", "earlier_forwards"))
SPREAD_COUNTS = frozenset(("runs",))
REMAKE = "remake the baseline with `memdiff baseline` rather than editing its figures"


def check_figures(path: str, doc: Dict[str, Any]) -> None:
    """InputError naming the JSON path of the first figure of a (schema-checked) baseline document
    that contradicts the others or exceeds MAX_DEVICE_BYTES."""
    ranks = doc.get("ranks")
    runs = [("", doc)] if ranks is None else [(f"ranks.{k}.", r) for k, r in enumerate(ranks)]
    for prefix, run in runs:
        for i, device in enumerate(run["devices"]):
            why = _contradiction(f"{prefix}devices.{i}", device)
            if why is not None:
                raise InputError(path, f"{why}: {REMAKE}")


def _contradiction(where: str, d: Dict[str, Any]) -> Optional[str]:
    """What is wrong with one stored device's figures, starting with the JSON path; None when nothing."""
    for key, value in _byte_figures(where, d):
        if value > MAX_DEVICE_BYTES:
            return f"{key}: {number(value)} bytes is more than any device holds (at most 1 PiB, 2**50 bytes)"
    peak = d["peak_bytes"]
    if d["static_bytes"] > peak:
        # Static memory is live before the trace and until its end, so at the peak too.
        return (f"{where}.static_bytes: {format_bytes(d['static_bytes'])} is above the device's peak "
                f"({where}.peak_bytes, {format_bytes(peak)}), which holds the memory live all through the run")
    reserved, fragmentation = d.get("reserved_peak_bytes"), d.get("fragmentation_bytes")
    if reserved is not None and fragmentation is not None and peak + fragmentation > reserved:
        # The allocator reserved the peak's tensors and its cached free blocks at that moment.
        return (f"{where}.reserved_peak_bytes: {format_bytes(reserved)} is below what was reserved at the peak, "
                f"{format_bytes(peak + fragmentation)} ({where}.peak_bytes {format_bytes(peak)} plus "
                f"{where}.fragmentation_bytes {format_bytes(fragmentation)})")
    phases = d.get("phases", {})
    for phase, size in phases.items():
        if size > d["peak_bytes"]:
            return (f"{where}.phases.{phase}: {format_bytes(size)} is above the device's peak "
                    f"({where}.peak_bytes, {format_bytes(d['peak_bytes'])}), the highest of every phase")
    moments = [("peak", f"{where}.peak_bytes", d["peak_bytes"], f"{where}.categories", d["categories"],
                f"{where}.groups", d["groups"])]
    by_phase, phase_groups = d.get("phase_categories", {}), d.get("phase_groups") or {}
    moments += [(f"the {p} peak", f"{where}.phases.{p}", phases.get(p, 0), f"{where}.phase_categories.{p}",
                 by_phase.get(p, {}), f"{where}.phase_groups.{p}", phase_groups.get(p, []))
                for p in dict.fromkeys([*by_phase, *phase_groups])]
    for moment, size_key, size, categories_key, categories, groups_key, groups in moments:
        why = _moment(moment, size_key, size, categories_key, categories, groups_key, groups)
        if why is not None:
            return why
    return _spread(where, d) if d.get("spread") else None


def _moment(moment: str, size_key: str, size: int, categories_key: str, categories: Dict[str, int],
            groups_key: str, groups: List[Dict[str, Any]]) -> Optional[str]:
    """The categories at one moment add up to at most its bytes, each category's stored groups to at most it."""
    total = sum(categories.values())
    if total > size:
        return (f"{categories_key}: the categories add up to {format_bytes(total)}, more than the {moment} "
                f"({size_key}, {format_bytes(size)})")
    held: Dict[str, int] = {}
    for j, g in enumerate(groups):
        held[g["category"]] = held.get(g["category"], 0) + g["bytes"]
        if held[g["category"]] > categories.get(g["category"], 0):
            return (f"{groups_key}.{j}.bytes: the stored groups of category {clip(g['category'])!r} hold "
                    f"{format_bytes(held[g['category']])} by this one, more than the category's "
                    f"{format_bytes(categories.get(g['category'], 0))} at the {moment}")
    return None


def _spread(where: str, d: Dict[str, Any]) -> Optional[str]:
    """Each range of the spread is ordered and holds the stored run's figure (the stored run is one of the runs)."""
    spread = d["spread"]
    ranges = [(f"{where}.spread.peak", spread["peak"], d["peak_bytes"])]
    ranges += [(f"{where}.spread.phases.{p}", r, d.get("phases", {}).get(p))
               for p, r in spread.get("phases", {}).items()]
    ranges += [(f"{where}.spread.categories.{clip(c)}", r, d["categories"].get(c, 0))
               for c, r in spread.get("categories", {}).items()]
    for key, r, stored in ranges:
        if not r["min"] <= r["median"] <= r["max"]:
            # In bytes: two figures a few bytes apart read alike in GiB.
            return (f"{key}: min {number(r['min'])} B, median {number(r['median'])} B and max {number(r['max'])} B "
                    f"are out of order (min <= median <= max)")
        if stored is not None and not r["min"] <= stored <= r["max"]:
            return (f"{key}: the stored run's {number(stored)} B is outside the spread's {number(r['min'])} B to "
                    f"{number(r['max'])} B, and the stored run is one of the runs")
    return None


def _byte_figures(where: str, value: Any, counts: FrozenSet[str] = DEVICE_COUNTS) -> Iterator[Tuple[str, int]]:
    """Every integer under a stored device that is a size in bytes, with its JSON path; `counts`: the
    keys of `value` that are not (a category may be named `count`: only a group's count is one)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        if key in counts:
            continue
        here = f"{where}.{clip(str(key))}"
        if isinstance(v, int) and not isinstance(v, bool):
            yield here, v
        else:
            inner = GROUP_COUNTS if isinstance(value, list) else SPREAD_COUNTS if key == "spread" else frozenset()
            yield from _byte_figures(here, v, inner)
