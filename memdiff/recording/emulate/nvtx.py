"""The NVTX library torch.cuda.nvtx calls, as it answers on a GPU with no profiler attached.

torch.cuda.nvtx's Python functions (`range` as a context manager and as a decorator, `range_push`,
`range_pop`, `mark`, `range_start`, `range_end`) all call one native binding, `_nvtx`; a CPU build has
only a stub there that raises. Standing in for the binding, not for the functions, keeps every use
of the real functions working as it does on the GPU.
"""

from __future__ import annotations

from typing import Any

# What NVTX's push and pop return when no tool (Nsight) has injected itself: push/pop depth is not
# tracked (NVTX_NO_PUSH_POP_TRACKING), and a start/end range's id is 0
_NO_TRACKING = -2


class Markers:
    """torch._C._nvtx's functions, answering as NVTX does with no profiler attached."""

    def rangePushA(self, message: str) -> int:  # noqa: N802 (the binding's names)
        """Start a nested range: its depth is not tracked."""
        return _NO_TRACKING

    def rangePop(self) -> int:  # noqa: N802
        """End the innermost range: its depth is not tracked."""
        return _NO_TRACKING

    def rangeStartA(self, message: str) -> int:  # noqa: N802
        """Start a range that may end on another thread: id 0."""
        return 0

    def rangeEnd(self, range_id: int) -> None:  # noqa: N802
        """End a range started by rangeStartA."""

    def markA(self, message: str) -> None:  # noqa: N802
        """An instant event."""

    def deviceRangeStart(self, message: str, stream: int = 0) -> Any:  # noqa: N802
        """A range on a stream: no handle is made."""
        return None

    def deviceRangeEnd(self, handle: Any, stream: int = 0) -> None:  # noqa: N802
        """End a range started by deviceRangeStart."""
