"""Every thread of the script on the emulated GPU, not only the main one.

torch's modes, through which the emulator runs a script's CUDA calls, are per thread: a thread the
script starts (a ThreadPoolExecutor's workers, which transformers 5 loads weights in for
`from_pretrained(..., device_map="cuda")`, a loader thread, a callback's) would start without them
and reach CUDA itself ("Found no NVIDIA driver"). Each thread started while the emulator runs enters
the same modes before it runs anything; the emulator takes one op at a time (Emulator.lock).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def every_thread(*modes: Any) -> Iterator[None]:
    """Threads started in the block run under `modes` (entered in that order) for their whole life."""
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]  # runs run() in the new thread

    def inner(thread: threading.Thread) -> None:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            bootstrap(thread)

    setattr(threading.Thread, "_bootstrap_inner", inner)  # noqa: B010
    try:
        yield
    finally:
        setattr(threading.Thread, "_bootstrap_inner", bootstrap)  # noqa: B010
