"""normalize: Snapshot -> Summary (engine.py), the peak counted as PyTorch's viewer counts it."""

from memdiff.analyse.normalize.engine import devices_of, summarize

__all__ = ["devices_of", "summarize"]
