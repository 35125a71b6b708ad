"""Patterns of public training scripts met in the eighth pass over them (docs/emulate.md, "An eighth
pass"), each as a small scenario of our own under `memdiff record --emulate h100`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def _record(tmp_path, script, *extra):
    (tmp_path / "train.py").write_text(script)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", *extra,
                           "--", sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _facts(stdout):
    return json.loads(next(s for s in stdout.splitlines() if s.startswith("facts "))[len("facts "):])


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_a_file_class_derived_from_fileio_writes_into_the_overlay(tmp_path):
    """A library's own file class deriving from `io.FileIO` (blobfile's local files, through which
    OpenAI's improved-diffusion saves its checkpoints) opens its path itself, around the routed open():
    the audit hook stopped its first save with PermissionError, where a GPU's run writes. It writes into
    the run's copy now and reads back, and the user's file keeps its bytes. Every file object is still an
    `io.FileIO`, and the library's class only its own."""
    import io

    from memdiff.recording.emulate.overlay_calls import overlaid

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "model000003.pt").write_bytes(b"the user's own checkpoint")
    before = _tree(tmp_path)
    with overlaid():
        class ProxyFile(io.FileIO):  # defined as the script imports its library: while the run goes
            def __init__(self, path, mode):
                super().__init__(path, mode=mode)

        for name, data in (("model000003.pt", b"step 3's weights"), ("model000000.pt", b"step 0's weights")):
            with ProxyFile(str(tmp_path / "logs" / name), "wb") as f:
                f.write(data)
        with ProxyFile(str(tmp_path / "logs" / "model000003.pt"), "rb") as f:
            seen = (f.read(), f.name)
        with open(tmp_path / "logs" / "model000000.pt", "rb") as f:
            plain = (f.read(), isinstance(f.raw, io.FileIO), isinstance(f.raw, ProxyFile))
    assert seen == (b"step 3's weights", str(tmp_path / "logs" / "model000003.pt"))
    assert plain == (b"step 0's weights", True, False)
    assert _tree(tmp_path) == before
    assert io.FileIO is sys.modules["_io"].FileIO  # the real class again after the run
