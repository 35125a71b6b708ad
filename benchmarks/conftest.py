"""Grown snapshots for the benchmarks, made once per session from ../shared/snapshots."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GROW = Path(__file__).resolve().parent / "grow.py"

SOURCE = Path(__file__).resolve().parents[2] / "shared" / "snapshots" / "cs336-medium-ctx128-train.pickle"


@pytest.fixture(scope="session")
def grown(tmp_path_factory):
    """grown(n) -> path of the real training snapshot grown to n events (and grown(n, gz=True))."""
    if not SOURCE.is_file():
        pytest.skip(f"the real snapshot to grow is missing: {SOURCE}")
    folder = tmp_path_factory.mktemp("grown")
    made = {}

    def make(events: int, gz: bool = False, copy: str = "") -> str:
        key = (events, gz, copy)
        if key not in made:
            path = folder / f"grown-{events}{copy}.pickle"
            if not path.exists():
                # In a child process: growing a million events in this one would leave it large,
                # and children inherit the parent's peak RSS on some kernels.
                subprocess.run([sys.executable, str(GROW), str(SOURCE), str(events), str(path)], check=True)
            if gz:
                with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst)
                path = Path(f"{path}.gz")
            made[key] = str(path)
        return made[key]
    return make
