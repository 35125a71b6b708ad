"""The counts of a sweep for docs/emulate.md: `python counts.py EMULATED.jsonl [META.jsonl]`.

EMULATED.jsonl is sweep.py's output under `memdiff record --emulate h100`; META.jsonl, the same
zoo's failed models run again with `--device meta` (torch alone, no emulator). A model that fails
there with the same exception type (or whose config does not shrink) fails in PyTorch or the
model's code at the sweep's small config, not in the emulator; one out of memory is the emulated
GPU's answer; the others are the emulator's, listed one by one.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any, Dict, List


def _read(path: str) -> Dict[str, Dict[str, Any]]:
    with open(path) as f:
        return {r["name"]: r for r in (json.loads(line) for line in f if line.startswith("{"))}


def _kind(error: str) -> str:
    return error.split(":", 1)[0]


def report(emulated: Dict[str, Dict[str, Any]], meta: Dict[str, Dict[str, Any]]) -> List[str]:
    """The lines of the counts: ok, refused (by op), failed as without emulation, failed by the emulator."""
    status = Counter(r["status"] for r in emulated.values())
    lines = [f"models: {len(emulated)}; ok {status['ok']}, refused {status['refused']}, failed {status['failed']}, "
             f"skipped {status['skipped']} (no small config)"]
    broken = [n for n, r in emulated.items() if r.get("problems")]
    lines.append(f"fact checks broken: {len(broken)} {' '.join(broken)}".rstrip())
    for name, record in emulated.items():
        if record["status"] == "refused":
            lines.append(f"refused {name}: {record['error']}")
    same, ours, full = [], [], []
    for name, record in emulated.items():
        if record["status"] != "failed":
            continue
        there = meta.get(name)
        alike = there is not None and (there["status"] == "skipped" or there["status"] == "failed"
                                       and _kind(there["error"]) == _kind(record["error"]))
        # the emulated GPU's answer, not a failure of the emulator: the default widths do not fit
        (full if _kind(record["error"]) == "OutOfMemoryError" else same if alike else ours).append(name)
    lines.append(f"out of memory on the emulated GPU at the default widths: {len(full)} {' '.join(full)}".rstrip())
    lines.append(f"failed as without emulation (torch on meta): {len(same)}")
    for name in same:
        lines.append(f"  {name}: {emulated[name]['error'][:160]} ({emulated[name]['where']})")
    lines.append(f"failed under emulation only: {len(ours)}")
    for name in ours:
        lines.append(f"  {name}: {emulated[name]['error'][:160]} ({emulated[name]['where']})")
    return lines


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: counts.py EMULATED.jsonl [META.jsonl]")
    print("\n".join(report(_read(sys.argv[1]), _read(sys.argv[2]) if len(sys.argv) == 3 else {})))
