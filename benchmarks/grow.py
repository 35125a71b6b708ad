"""Grow a real snapshot to N trace events that still follow the peak rules.

The trace's matched alloc/free pairs are repeated with their addresses moved to a fresh range
and their times shifted past the end, so every copy opens and closes its own allocations.
Frames lists stay shared objects, as pickle memo references make them in real snapshots.

    python benchmarks/grow.py ../shared/snapshots/cs336-medium-ctx128-train.pickle 1000000 big.pickle
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Dict, List

from memdiff.read.load import load


def _matched_pairs(trace: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The alloc and free_requested/free_completed entries of allocations opened and closed in the trace."""
    opened: Dict[int, int] = {}
    keep = set()
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            opened[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in opened:
            j = opened.pop(e["addr"])
            keep.update((j, i))
    requested = {e["addr"] for i, e in enumerate(trace) if i in keep}
    return [e for i, e in enumerate(trace) if i in keep or (e["action"] == "free_requested" and e["addr"] in requested)]


def grow(snapshot: Dict[str, Any], events: int) -> Dict[str, Any]:
    """A copy of `snapshot` whose device-0 trace has exactly `events` entries."""
    trace = snapshot["device_traces"][0]
    pairs = _matched_pairs(trace)
    span = max(e["addr"] for e in trace) + 1
    times = [e["time_us"] for e in trace if "time_us" in e]
    period = (max(times) - min(times) + 1) if times else 0
    out = list(trace[:events])
    copy = 0
    while len(out) < events:
        copy += 1
        for e in pairs:
            if len(out) == events:
                break
            moved = dict(e)  # the frames list stays the same object
            moved["addr"] = e["addr"] + copy * span
            if "time_us" in e:
                moved["time_us"] = e["time_us"] + copy * period
            out.append(moved)
    grown = dict(snapshot)
    grown["device_traces"] = [out] + snapshot["device_traces"][1:]
    return grown


def write_grown(source: str, events: int, path: str) -> None:
    """Grow `source` to `events` events and pickle it (protocol 4, as torch writes them) to `path`."""
    snap = load(source)
    raw = {"segments": snap.segments, "device_traces": snap.device_traces,
           "allocator_settings": snap.source.allocator_settings,
           "external_annotations": snap.external_annotations}
    with open(path, "wb") as f:
        pickle.dump(grow(raw, events), f, protocol=4)


if __name__ == "__main__":
    write_grown(sys.argv[1], int(sys.argv[2]), sys.argv[3])
