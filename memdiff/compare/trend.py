"""trend: each workload's peaks on the main branch, commit after commit, and where a run stands.

A history file is JSON Lines, one `TrendEntry` a line (schemas/history.schema.json), appended by
`memdiff history append` on every push to the main branch and kept wherever the user likes (a
branch, an artifact, a folder). The gate reads it with `--history` and its reports show the
workload's last peaks on main as a trend with this run's point after them: a reviewer sees
whether a +3% is new or the third in a row. Lines are kept in the order they were appended, the
order of the pushes; dates are shown, never sorted on (clocks of CI machines disagree).
(Not `history.py`: that module draws one run's memory over its trace.)
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence

from memdiff import __version__
from memdiff.atomic import check_output, make_folder, write_output
from memdiff.errors import InputError, clip
from memdiff.model import Summary, TrendDevice, TrendEntry
from memdiff.read.load import parse_json, read_small, starts_as_a_snapshot
from memdiff.read.schema import validate
from memdiff.units import change_or_unchanged, format_bytes

HISTORY_SCHEMA_VERSION = 1
DEFAULT_POINTS = 20  # main-branch peaks a trend shows
BLOCKS = "▁▂▃▄▅▆▇█"  # a sparkline's eight heights
TREND_HEADERS = ["commit", "date", "peak", "vs previous"]


def now() -> str:
    """UTC now, ISO 8601 to the second: `2026-11-24T18:02:11Z`."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def entry_of(summary: Summary, commit: str, workload: str, date: Optional[str] = None) -> TrendEntry:
    """A run's line of a history: per device its peak, its categories at the peak and, with
    allocator segments, its reserved peak. InputError for a run with no device memory."""
    if not summary.devices:
        raise InputError(summary.source.file, "the run records no device memory: nothing to keep in a history")
    return TrendEntry(commit=commit, date=date or now(), workload=workload, tool=f"memdiff {__version__}",
                      schema_version=HISTORY_SCHEMA_VERSION,
                      devices=[TrendDevice(d.device, d.peak_bytes, dict(sorted(d.categories.items())),
                                           d.reserved_peak_bytes) for d in summary.devices])


def read_history(path: str) -> List[TrendEntry]:
    """Every line of a history file, validated; InputError naming the line that is not one. An
    empty file is an empty history (`touch history.jsonl` before the first append)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        return []
    text = read_small(path, "a history file")
    _refuse_other(path, text)
    entries = []
    for n, line in enumerate(text.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}: line {n}"
        doc = parse_json(where, line, allow_nan=False)
        if isinstance(doc, dict) and doc.get("schema_version") != HISTORY_SCHEMA_VERSION and "schema_version" in doc:
            raise InputError(where, f"history schema_version {clip(repr(doc['schema_version']))} is not one this "
                                    f"memdiff reads ({HISTORY_SCHEMA_VERSION})")
        entries.append(TrendEntry.from_dict(validate(where, doc, "history")))
    return entries


def _refuse_other(path: str, data: bytes) -> None:
    """InputError saying what a file given as the history is, where it is a snapshot or a baseline (one JSON
    document over many lines): `line 1: invalid JSON: not UTF-8 text` said neither."""
    if starts_as_a_snapshot(data):
        raise InputError(path, "is a snapshot, not a history file (JSON Lines, one run a line, that `memdiff history "
                               "append RUN --to FILE --commit SHA` writes)")
    first = data.split(b"\n", 1)[0].strip()
    if first == b"{":  # a document written with an indent, as a baseline or a summary is
        raise InputError(path, "is one JSON document over many lines (a baseline or a summary?), not a history "
                               "file (JSON Lines, one run a line, that `memdiff history append` writes)")


def append_entry(path: str, entry: TrendEntry) -> int:
    """Add `entry` as the last line of the history at `path` (made when missing), atomically: the
    file is read and checked first (a file that is no history is never written to), then
    rewritten whole. Returns the number of lines the file now holds."""
    import json

    folder = os.path.dirname(path)
    if folder and not os.path.lexists(folder):
        make_folder(folder)
    check_output(path)
    old = b""
    count = 0
    if os.path.lexists(path):
        if not os.path.isfile(path):
            raise InputError(path, "is not a regular file: a history is a JSON Lines file")
        count = len(read_history(path))
        old = read_small(path, "a history file") if count else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
    line = json.dumps(entry.to_dict(), ensure_ascii=False, separators=(",", ":"))
    write_output(path, old.decode("utf-8") + line + "\n")
    return count + 1


@dataclass
class TrendPoint:
    """One main-branch run of the workload on one device."""

    commit: str
    date: str
    peak_bytes: int
    change_text: str = ""  # against the point before it (`+4.21 GiB (+23.4%)`, `unchanged`); "" for the oldest


@dataclass
class Trend:
    """A workload's last peaks on main for one device, and this run after them, ready to show."""

    workload: str
    device: int
    points: List[TrendPoint]  # oldest first
    head_bytes: int
    head_label: str  # what names this run's point: its commit, or `this run`
    sparkline: str  # one block per main-branch point
    head_block: str  # this run's block, on the same scale
    text: str  # the trend in words
    head_change_text: str = ""  # this run against the latest point: `+4.21 GiB (+23.4%)`, `unchanged`
    rows: List[List[str]] = field(default_factory=list)  # TREND_HEADERS, newest first, this run on top

    def to_dict(self) -> Dict[str, Any]:
        """The trend in the JSON document (diff.schema.json's `trends`): its figures and the table's words."""
        return {"workload": self.workload, "device": self.device, "head_bytes": self.head_bytes, "text": self.text,
                "head_change_text": self.head_change_text, "points": [asdict(p) for p in self.points]}

    @property
    def point_titles(self) -> List[str]:
        """`cccccccccccc 2026-01-03: 18.02 GiB`: each main-branch point named alone, oldest first (as `points`)."""
        return [f"{row[0]} {row[1]}: {row[2]}" for row in reversed(self.rows[1:])]

    @property
    def head_title(self) -> str:
        """`this run: 22.23 GiB, +4.21 GiB (+23.4%)`: this run's point named alone, against the latest."""
        head = self.rows[0]
        return f"{head[0]}: {head[2]}, {head[3]}"


def sparkline(values: Sequence[int]) -> str:
    """One of eight block heights per value, the lowest value at the bottom, the highest at the top
    (all the middle height when they are equal)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return BLOCKS[3] * len(values)
    return "".join(BLOCKS[round((v - lo) * (len(BLOCKS) - 1) / (hi - lo))] for v in values)


def trend_of(entries: Sequence[TrendEntry], workload: str, device: int, head_bytes: int,
             head_label: Optional[str] = None, points: int = DEFAULT_POINTS) -> Optional[Trend]:
    """The workload's last `points` main-branch peaks on `device` and this run's; None when the
    history has none."""
    found = [TrendPoint(e.commit, e.date, d.peak_bytes) for e in entries if e.workload == workload
             for d in e.devices if d.device == device][-points:]
    if not found:
        return None
    for before, p in zip(found, found[1:]):
        p.change_text = change_or_unchanged(before.peak_bytes, p.peak_bytes)
    blocks = sparkline([p.peak_bytes for p in found] + [head_bytes])
    latest = found[-1]
    lo, hi = min(p.peak_bytes for p in found), max(p.peak_bytes for p in found)
    label = head_label or "this run"
    change = change_or_unchanged(latest.peak_bytes, head_bytes)
    if len(found) == 1:
        text = (f"{workload}, device {device}: one peak on main so far, {format_bytes(latest.peak_bytes)} at "
                f"{latest.commit[:12]}; {label} {format_bytes(head_bytes)}, {change}"
                + ("" if change == "unchanged" else " against it"))
    else:
        if head_bytes > hi:
            standing = f"above all {len(found)}"
        elif head_bytes < lo:
            standing = f"below all {len(found)}"
        else:
            standing = "within their range"
        moves = sum(1 for a, b in zip(found, found[1:]) if a.peak_bytes != b.peak_bytes)
        text = (f"{workload}, device {device}: the last {len(found)} peaks on main "
                + (f"were all {format_bytes(lo)}" if lo == hi else f"ran from {format_bytes(lo)} to {format_bytes(hi)}")
                + f" (it moved at {moves} of {len(found) - 1} commits); latest {format_bytes(latest.peak_bytes)} at "
                  f"{latest.commit[:12]}; {label} {format_bytes(head_bytes)}, {change} against the latest, {standing}")
    rows = [[label, "", format_bytes(head_bytes), change]]
    rows += [[p.commit[:12], p.date, format_bytes(p.peak_bytes), p.change_text] for p in reversed(found)]
    return Trend(workload, device, found, head_bytes, label, blocks[:-1], blocks[-1], text, change, rows)


def workloads(entries: Sequence[TrendEntry]) -> List[str]:
    """The workloads a history holds, in the order they first appear."""
    return list(dict.fromkeys(e.workload for e in entries))
