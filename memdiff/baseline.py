"""The public path of a stored baseline (docs/api.md): `from memdiff.baseline import Baseline`.
The code lives in the comparing stage, `memdiff.compare.baseline`, an internal path."""

from memdiff.compare.baseline import Baseline

__all__ = ["Baseline"]
