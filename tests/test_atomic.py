"""Output files: atomic for regular files, in place for devices and pipes, through symlinks."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest

from memdiff.atomic import write_output, write_stream
from memdiff.errors import InputError


def test_a_pipe_stays_a_pipe(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_output(str(fifo), "summary\n")
    reader.join(5)
    assert got == ["summary\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_dev_null_stays_a_device():
    write_output("/dev/null", "discarded\n")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_symlink_is_followed_and_kept(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(str(link), "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


def test_a_new_file_gets_the_mode_open_gives_and_a_replaced_one_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        write_output(str(tmp_path / "new.md"), "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.md").st_mode) == 0o644
    kept = tmp_path / "kept.md"
    kept.write_text("old")
    kept.chmod(0o600)
    write_output(str(kept), "new")
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600 and kept.read_text() == "new"


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")])
def test_a_write_stopped_halfway_leaves_the_old_file_and_no_temporary(tmp_path, stop):
    target = tmp_path / "run.pickle"
    target.write_bytes(b"the previous run")

    def write(f):
        f.write(b"half of a snapshot")
        raise stop
    with pytest.raises(KeyboardInterrupt if stop is KeyboardInterrupt else InputError):
        write_stream(str(target), write, in_place=False)
    assert os.listdir(tmp_path) == ["run.pickle"] and target.read_bytes() == b"the previous run"


def test_a_name_of_255_bytes_is_written_through_a_shorter_temporary(tmp_path):
    target = tmp_path / ("é" * 127 + "x")  # 255 bytes in UTF-8
    write_output(str(target), "ok")
    assert os.listdir(tmp_path) == [target.name] and target.read_text() == "ok"


@pytest.mark.parametrize("path", ["/dev/null", "/dev/full", "/dev/stdout"])
def test_a_snapshot_never_replaces_a_device(path):
    with pytest.raises(InputError, match="not a regular file: memdiff never replaces one|is an open stream"):
        write_stream(path, lambda f: f.write(b"snapshot"), in_place=False)
    assert not stat.S_ISREG(os.stat("/dev/null").st_mode)
