"""source_line and enclosing_class: the line of Python a frame names and the class it is in, read only
where it is a source file on this machine (the path comes from the snapshot, which may name any file)."""

from __future__ import annotations

import os

from memdiff.model import Frame
from memdiff.read.source import MAX_SOURCE_BYTES, enclosing_class, source_line


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


def test_the_class_of_a_frames_line_is_the_innermost_class_that_holds_it(tmp_path, monkeypatch):
    """A trace names the function only (`__init__`); the class is read from the file: a method's line
    and a comprehension's inside it are in their class, a function's outside any class in none."""
    (tmp_path / "train.py").write_text(
        "import torch\n"                                              # 1
        "class EMA:\n"                                                # 2
        "    def __init__(self, model):\n"                            # 3
        "        self.shadow = {k: p.clone()\n"                       # 4
        "                       for k, p in model.named_parameters()}\n"  # 5
        "    class Inner:\n"                                          # 6
        "        def __init__(self):\n"                               # 7
        "            self.x = torch.zeros(1)\n"                       # 8
        "    def to(self, device):\n"                                 # 9
        "        pass\n"                                              # 10
        "def main():\n"                                               # 11
        "    ema = EMA(None)\n")                                      # 12
    monkeypatch.chdir(tmp_path)  # the relative path a script run as `python train.py` leaves in its frames
    assert [enclosing_class(Frame("train.py", line, "f")) for line in (4, 5, 8, 10, 12)] == [
        "EMA", "EMA", "Inner", "EMA", None]
    assert enclosing_class(Frame(str(tmp_path / "train.py"), 3, "__init__")) == "EMA"
    (tmp_path / "broken.py").write_text("class A:\n    def f(:\n")
    assert enclosing_class(Frame("broken.py", 2, "f")) is None  # no parse, no class
    monkeypatch.chdir(tmp_path.parent)
    assert enclosing_class(Frame("train.py", 4, "__init__")) is None  # not here: no class known
