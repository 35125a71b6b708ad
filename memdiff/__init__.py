"""memdiff: turn PyTorch GPU-memory snapshots into peak summaries, diffs and CI gates.

The Python API (`memdiff.api`) is re-exported here: `memdiff.summarize`, `memdiff.diff`,
`memdiff.judge`, `memdiff.load_baseline`, `memdiff.write_baseline`, `memdiff.record`. They are
imported on first use, so `import memdiff` stays cheap and never imports torch.
"""

from typing import Any

__version__ = "0.1.0"

API = ("summarize", "diff", "gate", "load_baseline", "write_baseline", "record", "thresholds")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        from memdiff import api

        return getattr(api, name)
    raise AttributeError(f"module 'memdiff' has no attribute {name!r}")
