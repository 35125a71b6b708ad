"""An existing Dask cluster, reached by its scheduler's address (`--dask tcp://host:8786`).

Two stages hand work to one: reading a job's ranks (read/job.py: each rank's summary) and recording
an emulated job's ranks (recording/dask_ranks.py: each rank's process). Both connect here, so that a
missing `distributed` or a scheduler that does not answer reads the same, in one line, wherever it
comes from.
"""

from __future__ import annotations

from typing import Any

from memdiff.errors import InputError

# How long `--dask` waits for the scheduler: Dask retries a refused connection until then.
DASK_CONNECT_TIMEOUT_S = 20


def connect(address: str) -> Any:
    """A distributed.Client of the scheduler at `address`; InputError when distributed is not
    installed or the scheduler cannot be reached."""
    try:
        from distributed import Client
    except ImportError:
        raise InputError("--dask", "needs dask.distributed: pip install 'memdiff[dask]'") from None
    try:
        return Client(address, timeout=f"{DASK_CONNECT_TIMEOUT_S}s")
    except (OSError, TimeoutError, ValueError) as exc:
        raise InputError(f"--dask {address}", f"cannot reach the scheduler: {exc}") from None


def failed(address: str, exc: Exception) -> InputError:
    """The one line for a cluster that failed while it ran our tasks (a lost connection, a timeout)."""
    return InputError(f"--dask {address}", f"the cluster failed: {exc}")
