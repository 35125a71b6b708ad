"""memdiff: turn PyTorch GPU-memory snapshots into peak summaries, diffs and CI gates.

The Python API (`memdiff.api`) is re-exported here: `memdiff.summarize`, `memdiff.diff`,
`memdiff.gate`, `memdiff.thresholds`, `memdiff.load_baseline`,
`memdiff.write_baseline`, `memdiff.forecast`, `memdiff.whatif`, `memdiff.html_report` and
`memdiff.record`; `memdiff.api` itself is there too. They are imported on first use, so
`import memdiff` stays cheap and never imports torch.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

API = ("summarize", "diff", "gate", "load_baseline", "write_baseline", "html_report", "record",
       "thresholds", "forecast", "whatif")
__all__ = ["__version__", "api", *API]


def __getattr__(name: str) -> Any:
    if name in API or name == "api":
        # import_module, not `from memdiff import api`: that asks this very function for `api` first.
        api = importlib.import_module("memdiff.api")
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'memdiff' has no attribute {name!r}")
