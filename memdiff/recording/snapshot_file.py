"""Writing a snapshot file: below both the capture (capture.py) and the emulator, which writes
the file a script's own `torch.cuda.memory._dump_snapshot` asks for."""

from __future__ import annotations

import pickle
from typing import Any

from memdiff.atomic import write_stream

# Protocol 4 keeps the file readable by pytorch.org/memory_viz and by Python 3.4+.
PICKLE_PROTOCOL = 4


def dump(snapshot: Any, path: str) -> None:
    """Write `snapshot` to `path` atomically (memdiff.atomic); a pipe or device there is refused, never replaced."""
    write_stream(path, lambda f: pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL), in_place=False)
