"""source_line: the line of Python a frame names, read only where it is a source file on this machine
(the path comes from the snapshot, which may name any file)."""

from __future__ import annotations

import os

from memdiff.model import Frame
from memdiff.read.source import MAX_SOURCE_BYTES, source_line


def test_a_frames_line_is_read_from_its_file_by_absolute_or_library_path(tmp_path, monkeypatch):
    module = tmp_path / "lib" / "norm.py"
    module.parent.mkdir()
    module.write_text("def f(x):\n    return x.to(torch.float32).pow(2).mean(-1)\n")
    assert source_line(Frame(str(module), 2, "f")) == "return x.to(torch.float32).pow(2).mean(-1)"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert source_line(Frame("lib/norm.py", 2, "f")) == "return x.to(torch.float32).pow(2).mean(-1)"
    assert source_line(Frame("lib/norm.py", 99, "f")) is None  # past its end
    assert source_line(Frame("lib/missing.py", 1, "f")) is None


def test_a_path_that_names_no_source_file_is_never_read(tmp_path):
    """A FIFO would block the read forever and a huge file would be read whole: neither is opened."""
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    assert source_line(Frame(str(fifo), 1, "f")) is None
    big = tmp_path / "generated.py"
    with open(big, "wb") as f:
        f.truncate(MAX_SOURCE_BYTES + 1)
    assert source_line(Frame(str(big), 1, "f")) is None
    assert source_line(Frame("/dev/zero", 1, "f")) is None  # no .py: not source
    assert source_line(Frame(str(tmp_path / "a\x00b.py"), 1, "f")) is None
