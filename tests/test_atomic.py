"""Output files: atomic for regular files, in place for devices and pipes, through symlinks."""

from __future__ import annotations

import os
import stat
import threading

from memdiff.atomic import write_text_atomic


def test_a_pipe_stays_a_pipe(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_text_atomic(str(fifo), "summary\n")
    reader.join(5)
    assert got == ["summary\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_dev_null_stays_a_device():
    write_text_atomic("/dev/null", "discarded\n")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_symlink_is_followed_and_kept(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text_atomic(str(link), "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
