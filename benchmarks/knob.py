"""A grown snapshot as if run at another batch size: every even allocation size times VALUE.

Sizes are scaled by a rule of the size alone, so an allocation and its free stay equal and the
peak rules still hold; half the allocations grow linearly with the knob, half stay constant.

    python benchmarks/knob.py big.pickle 4 big-b4.pickle
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    source, value, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(source, "rb") as f:
        snapshot = pickle.load(f)
    for trace in snapshot["device_traces"]:
        for e in trace:
            size = e.get("size")
            if e["action"] in ("alloc", "free_requested", "free_completed") and isinstance(size, int) and size % 2 == 0:
                e["size"] = size * value
    with open(out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)


if __name__ == "__main__":
    main()
