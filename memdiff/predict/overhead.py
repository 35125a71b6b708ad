"""The caching allocator's overhead a budget is compared with (forecast and whatif alike): what runs out
is reserved memory, and a replay predicts allocated bytes, so a predicted peak is scaled by reserved over
allocated at a measured peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from memdiff.model import DeviceSummary
from memdiff.units import format_bytes


@dataclass(frozen=True)
class Overhead:
    """Reserved over allocated at one run's peak: the ratio (at least 1) and the figures it came from."""

    ratio: float
    reserved_bytes: int
    allocated_bytes: int
    source: str  # where it was measured: "run.pickle device 0"


def device_overhead(device: DeviceSummary, source: str) -> Optional[Overhead]:
    """Reserved at the peak moment over allocated at it; None when the run does not know what was reserved
    then (a CPU capture has no caching allocator; a trace cut at both ends has no trusted reserved total).
    Not the reserved peak, which may fall at another moment (after the peak, its blocks freed and cached),
    nor reserved at the dump, measured when the run had freed most of its peak."""
    if device.fragmentation_bytes is None or device.peak_bytes <= 0:
        return None
    reserved = device.peak_bytes + device.fragmentation_bytes
    return Overhead(max(1.0, reserved / device.peak_bytes), reserved, device.peak_bytes, source)


def budget_note(measured: Sequence[Overhead], what: str) -> Tuple[float, str]:
    """The largest overhead measured (1 when none was) and the sentence that says what the budget is compared
    with: `what` (the peak, each predicted peak) times the figure, and where the figure was measured."""
    if not measured:
        return 1.0, (f"the budget is compared with {what} as allocated: no run records what was reserved at its "
                     f"peak (a CPU capture has no caching allocator)")
    most = max(measured, key=lambda o: o.ratio)
    several = f", the most of {len(measured)} measured" if len(measured) > 1 else ""
    return most.ratio, (f"the budget is compared with {what} times {most.ratio:.3f}, reserved over allocated at "
                        f"the peak of {most.source} ({format_bytes(most.reserved_bytes)} over "
                        f"{format_bytes(most.allocated_bytes)}{several}: the caching allocator's overhead, since "
                        f"what runs out is reserved memory)")
