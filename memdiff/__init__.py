"""memdiff: turn PyTorch GPU-memory snapshots into peak summaries, diffs and CI gates."""

__version__ = "0.1.0"
