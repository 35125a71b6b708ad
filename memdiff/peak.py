"""peak: Summary -> the rows a person reads when chasing an OOM (top groups, the rest folded, total)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from memdiff.errors import InputError
from memdiff.model import DeviceSummary, Frame, Summary


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


@dataclass
class DevicePeak:
    """A device's summary with its table ready to show."""

    device: DeviceSummary
    reached_by: Optional[str]
    rows: List[PeakRow]
    total: PeakRow
    categories: List[Tuple[str, int, float]]
    scopes: List[Tuple[str, int, float]]
    compile_contexts: List[Tuple[str, int, float]]


def _share(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def _shares(totals: Dict[str, int], whole: int) -> List[Tuple[str, int, float]]:
    return [(name, n, _share(n, whole)) for name, n in totals.items()]


def device_peak(device: DeviceSummary, top: Optional[int]) -> DevicePeak:
    """The top `top` groups (all when None), the rest folded into one row, and a total row."""
    groups = device.groups
    shown = groups if top is None else groups[:top]
    rows = [PeakRow(str(i), g.count, g.bytes, _share(g.bytes, device.peak_bytes), g.site, g.frames, g.category or "")
            for i, g in enumerate(shown, 1)]
    rest = groups[len(shown):]
    if rest:
        rest_bytes = sum(g.bytes for g in rest)
        rows.append(PeakRow("…", sum(g.count for g in rest), rest_bytes,
                            _share(rest_bytes, device.peak_bytes), f"{len(rest)} other groups", []))
    total = PeakRow("total", sum(g.count for g in groups), sum(g.bytes for g in groups),
                    _share(sum(g.bytes for g in groups), device.peak_bytes),
                    f"{len(groups)} groups live at the peak", [])
    reached_by = next((g.site for g in groups if g.signature == device.peak_event_signature), None)
    return DevicePeak(device, reached_by, rows, total, _shares(device.categories, device.peak_bytes),
                      _shares(device.bytes_by_scope, device.peak_bytes),
                      _shares(device.bytes_by_compile_context, device.peak_bytes))


def peak_report(path: str, summary: Summary, top: Optional[int], device: Optional[int] = None) -> List[DevicePeak]:
    """One DevicePeak per device, or only `device`; InputError when the snapshot lacks it."""
    devices = summary.devices
    if device is not None:
        devices = [d for d in devices if d.device == device]
        if not devices:
            have = ", ".join(str(d.device) for d in summary.devices) or "none"
            raise InputError(path, f"no device {device} in this snapshot (devices: {have})")
    return [device_peak(d, top) for d in devices]
