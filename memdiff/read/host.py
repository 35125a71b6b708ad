"""What a CPU capture says about the host it ran on (the snapshot's `memdiff_cpu_host`, written by
memdiff.recording.capture.cpu_host): whether its half-precision convolutions take oneDNN. The file is
untrusted: only the booleans of the keys known here are read, anything else is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

CPU_HOST = "memdiff_cpu_host"

PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class CpuHost:
    """The host of a CPU capture: per precision (bf16, fp16), whether its convolutions take oneDNN;
    a precision the capture could not ask about is absent."""

    onednn_convolutions: Dict[str, bool] = field(default_factory=dict)

    def slow_convolutions(self, precision: str) -> bool:
        """Whether convolutions in `precision` run ATen's `_slow_conv2d` on this host: the capture said
        oneDNN does not take them (without AVX-512, bf16; without AVX-512 FP16 or AMX, fp16)."""
        return self.onednn_convolutions.get(precision) is False


def read_cpu_host(raw: Any) -> Optional[CpuHost]:
    """The CpuHost a decoded snapshot carries, or None where it carries none (a GPU's snapshot, a
    capture older than the key, a file that holds something else there)."""
    marker = raw.get(CPU_HOST) if isinstance(raw, dict) else None
    if not isinstance(marker, dict):
        return None
    answers = {p: v for p in PRECISIONS for v in [marker.get(f"onednn_{p}_convolutions")] if isinstance(v, bool)}
    return CpuHost(answers)
