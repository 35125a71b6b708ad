"""The overlay an emulated run writes to (memdiff/recording/emulate/overlay.py): random sequences of
file operations run under it leave the user's tree byte-identical, and the run reads back what it
would have read without it: each call's result (or error) is the one the same call gives on a real
copy of the tree, and the tree the run sees at the end is the copy's. Links, the user's and the
run's, relative and absolute, are followed as the kernel follows them in the tree the run sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from memdiff.recording.emulate.overlay_calls import overlaid

NAMES = ["a", "b", "d", "d/c", "d/e", "d/e/f", "n", "d/n", "x/y", "d/to_a", "d/to_e/f"]
OPS = ["write", "read", "rename", "replace", "link", "symlink", "abslink", "unlink", "rmdir", "mkdir", "makedirs",
       "truncate", "listdir", "scandir", "stat", "lstat", "readlink", "rmtree", "copy", "copy2", "copytree", "move",
       "chmod", "walk"]
MODES = ["w", "a", "x", "r+", "wb", "ab"]

operation = st.tuples(st.sampled_from(OPS), st.sampled_from(NAMES), st.sampled_from(NAMES), st.sampled_from(MODES),
                      st.binary(max_size=8), st.integers(0, 6))


def _local(target: str, root: str) -> str:
    """A link's target with the tree's own folder named `<root>`: the copy's absolute links read as the user's."""
    return "<root>" + target[len(root):] if target.startswith(root + os.sep) else target


def _tree(root: str) -> dict:
    """Every path below `root`: a folder's None, a link's target, a file's bytes and mode, read with
    whatever os and open are now (the overlay's, inside it)."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                seen[rel] = ("link", _local(os.readlink(path), root))
            elif os.path.isdir(path):
                seen[rel] = None
            else:
                with open(path, "rb") as f:
                    seen[rel] = (f.read(), os.stat(path).st_mode & 0o777)
    return seen


def _apply(root: str, op: tuple) -> object:
    """One file call on the tree at `root`: what it returned, or the kind of error it raised."""
    kind, one, two, mode, data, n = op
    p, q = os.path.join(root, one), os.path.join(root, two)
    try:
        if kind == "write":
            with open(p, mode) as f:
                f.write(data if "b" in mode else data.decode("latin-1"))
            return None
        if kind == "read":
            with open(p, "rb") as f:
                return f.read()
        if kind in ("rename", "replace", "link"):
            return getattr(os, kind)(p, q)
        if kind == "symlink":
            return os.symlink(one, q)  # a relative target, as the tree has it
        if kind == "abslink":
            return os.symlink(p, q)
        if kind == "lstat":
            info = os.lstat(p)
            return (oct(info.st_mode), info.st_size if not os.path.islink(p) else None)
        if kind == "readlink":
            return _local(os.readlink(p), root)
        if kind in ("unlink", "rmdir", "mkdir"):
            return getattr(os, kind)(p)
        if kind == "makedirs":
            return os.makedirs(p, exist_ok=bool(n % 2))
        if kind == "truncate":
            return os.truncate(p, n)
        if kind == "listdir":
            return sorted(os.listdir(p))
        if kind == "scandir":
            with os.scandir(p) as entries:
                return sorted((e.name, e.is_dir(), e.is_file()) for e in entries)
        if kind == "stat":
            info = os.stat(p)
            return (info.st_size, oct(info.st_mode))
        if kind == "rmtree":
            if os.path.islink(p):  # refused either way; shutil's descriptor walk may say FileNotFoundError,
                return "a link"  # its path walk (the overlay's) says OSError
            return shutil.rmtree(p)
        if kind == "copy":
            shutil.copyfile(p, q)
            return None
        if kind == "copy2":  # the bytes, then the mode, times and extended attributes
            shutil.copy2(p, q)
            return None
        if kind == "copytree":
            if (os.path.realpath(q) + os.sep).startswith(os.path.realpath(p) + os.sep):
                # into itself: it ends at Python's recursion limit or the longest path, whichever comes
                # first, and the overlay's calls take frames of their own
                return "into itself"
            shutil.copytree(p, q, symlinks=bool(n % 2))
            return None
        if kind == "move":
            shutil.move(p, q)
            return None
        if kind == "chmod":
            return os.chmod(p, 0o600 + n)
        if kind == "walk":
            return sorted((os.path.relpath(f, root), sorted(d), sorted(fs)) for f, d, fs in os.walk(p))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return type(exc).__name__
    raise AssertionError(kind)


def _make(root: str) -> None:
    for folder in ("d/e",):
        os.makedirs(os.path.join(root, folder))
    for name, data in (("a", b"alpha"), ("b", b"beta"), ("d/c", b"charlie"), ("d/e/f", b"foxtrot")):
        Path(root, name).write_bytes(data)
    os.symlink("../a", os.path.join(root, "d", "to_a"))
    os.symlink(os.path.join(root, "d", "e"), os.path.join(root, "d", "to_e"))


# no explain phase: tracing every line of the file calls makes a failure take minutes to report
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(st.lists(operation, min_size=1, max_size=12))
def test_random_file_calls_under_the_overlay_change_nothing_and_read_back_as_without_it(ops):
    base = tempfile.mkdtemp()
    try:
        # each tree one folder down in its own: a link that leads out of one ("../a" moved up) never reaches the other
        user, copy = os.path.join(base, "user", "tree"), os.path.join(base, "copy", "tree")
        _make(user)
        _make(copy)
        before = _tree(user)
        expected = [_apply(copy, op) for op in ops]
        with overlaid():
            got = [_apply(user, op) for op in ops]
            seen = _tree(user)
        assert got == expected
        assert seen == _tree(copy)
        assert _tree(user) == before
    finally:
        shutil.rmtree(base)


def test_a_run_overlaid_deep_in_a_tree_hands_worker_batches_over_a_unix_socket(tmp_path, monkeypatch):
    """multiprocessing hands a DataLoader worker's batch to the main process over a Unix socket bound
    in the temporary folder, whose path holds at most 107 bytes. An overlay kept deep in the user's
    tree (here 150 bytes) must still give the run a temporary folder where that socket binds, or
    the worker's batch is lost and the run hangs."""
    from multiprocessing.connection import Listener

    root = tmp_path / ("deep-" * 30)
    root.mkdir()
    monkeypatch.setenv("MEMDIFF_OVERLAY", str(root))
    assert len(str(root)) > 150
    with overlaid() as overlay:
        folder = tempfile.mkdtemp(prefix="pymp-")
        with Listener(os.path.join(folder, "listener-abcdefgh"), family="AF_UNIX") as listener:
            assert listener.address.startswith(overlay.scratch)
        # the temporary folder is the run's, not the user's: it passes through to the disk
        Path(folder, "scratch.txt").write_text("a run's temporary file")
        assert Path(folder, "scratch.txt").is_file()
    overlay.discard()
    assert not os.path.exists(overlay.scratch)


def test_an_extension_torch_builds_as_the_run_goes_builds_where_its_native_tools_can_enter(tmp_path, monkeypatch):
    """torch.utils.cpp_extension makes its build folder under TORCH_EXTENSIONS_DIR (~/.cache by default)
    and runs ninja there with `cwd=`: ninja is no Python, so a folder made in the overlay was missing to
    it, and DeepSpeed's CPU Adam failed to build under emulation. The run's extensions build in its
    scratch folder, a real one, and nothing lands in the user's cache."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "users-cache"))
    monkeypatch.chdir(tmp_path)
    with overlaid() as overlay:
        build = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "py311_cu130", "cpu_adam")
        os.makedirs(build)
        assert build.startswith(overlay.scratch)
        assert subprocess.run(["ls"], cwd=build, capture_output=True).returncode == 0
    overlay.discard()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "users-cache")
    assert not (tmp_path / "users-cache").exists()


def test_a_tar_archive_extracted_by_the_run_lands_in_the_overlay_and_reads_back(tmp_path):
    """tarfile writes through `open` it bound at import (`bltn_open`), around builtins' routed one: a
    dataset archive the script unpacks over files the user has (pytorch/examples' gcn unpacks Cora)."""
    import io
    import tarfile

    archive = tmp_path / "cora.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("cora/cora.cites", b"35 1033\n"), ("cora/cora.content", b"31336 0 1\n")):
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    (tmp_path / "cora").mkdir()
    (tmp_path / "cora" / "cora.cites").write_bytes(b"the user's own")
    before = _tree(str(tmp_path))
    with overlaid():
        with tarfile.open(archive) as tar:
            tar.extractall(tmp_path, filter="data")
        seen = (Path(tmp_path, "cora", "cora.cites").read_bytes(), Path(tmp_path, "cora", "cora.content").read_bytes())
    assert seen == (b"35 1033\n", b"31336 0 1\n")
    assert _tree(str(tmp_path)) == before


def test_a_write_through_a_link_lands_in_the_run_s_copy_and_never_in_the_user_s_file(tmp_path):
    """A run that points `latest.pt` at the user's `best.pt` by an absolute link and saves to
    `latest.pt` (checkpoint rotation) changes the file as the run sees it, both names read the new
    bytes back, and the user's `best.pt` keeps its own. A user's link to a file the run rewrote
    (the Hub cache's snapshots/ -> blobs/) reads the run's copy."""
    best, latest = tmp_path / "best.pt", tmp_path / "latest.pt"
    best.write_bytes(b"the user's weights")
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "0a1b").write_text('{"hidden_size": 64}')
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "config.json").symlink_to("../blobs/0a1b")
    before = _tree(str(tmp_path))
    with overlaid() as overlay:
        os.symlink(best, latest)
        with open(latest, "wb") as f:
            f.write(b"the run's weights")
        assert best.read_bytes() == latest.read_bytes() == b"the run's weights"
        assert os.readlink(latest) == str(best)
        Path(tmp_path, "blobs", "0a1b").write_text('{"hidden_size": 128}')
        assert Path(tmp_path, "snapshots", "config.json").read_text() == '{"hidden_size": 128}'
        assert [c.path for c in overlay.changes()] == [str(best), str(tmp_path / "blobs" / "0a1b"), str(latest)]
    assert _tree(str(tmp_path)) == before
    overlay.discard()


def test_extended_attributes_copied_with_a_file_are_the_run_s_and_never_reach_the_user_s_file(tmp_path):
    """shutil.copy2 copies a file's extended attributes after its bytes: onto a user's file under
    the overlay they land on the run's copy (read back there), and the user's file keeps its own."""
    source, target = tmp_path / "tokens.bin", tmp_path / "cache.bin"
    source.write_bytes(b"new")
    target.write_bytes(b"old")
    try:
        os.setxattr(source, "user.origin", b"the dataset")
        os.setxattr(target, "user.origin", b"the user's")
    except (AttributeError, OSError) as exc:  # no xattrs on this system or file system
        pytest.skip(f"extended attributes unsupported here: {exc}")
    with overlaid() as overlay:
        shutil.copy2(source, target)
        assert target.read_bytes() == b"new" and os.getxattr(target, "user.origin") == b"the dataset"
    assert target.read_bytes() == b"old" and os.getxattr(target, "user.origin") == b"the user's"
    overlay.discard()


def test_the_system_s_links_and_memdiff_s_own_paths_pass_as_named(tmp_path):
    """A run that logs to /dev/stdout (a link to /proc/self/fd/1, which names a pipe the kernel alone
    can open) writes to its output; a snapshot memdiff owns in a folder reached through a link is
    written where memdiff named it, not into the overlay."""
    script = ("import os, sys\n"
              "from memdiff.recording.emulate.overlay_calls import overlaid\n"
              "with overlaid() as overlay:\n"
              "    with open('/dev/stdout', 'w') as f:\n"
              "        f.write('step 1: loss 2.31\\n')\n"
              "    overlay.own(sys.argv[1])\n"
              "    with open(sys.argv[1], 'w') as f:\n"
              "        f.write('snapshot')\n"
              "overlay.discard()\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "latest").symlink_to(tmp_path / "runs")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "latest" / "run.pickle")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "step 1: loss 2.31\n"
    assert (tmp_path / "runs" / "run.pickle").read_text() == "snapshot"


def test_a_named_temporary_file_in_a_users_folder_is_written_to_the_overlay_and_reads_back(tmp_path, monkeypatch):
    """tempfile.NamedTemporaryFile(dir=...) opens through open() with an opener that makes the file, and
    open() is handed the folder, which the overlay took for a file to write (IsADirectoryError):
    datasets' map() writes its cache files that way (accelerate's nlp_example stopped there)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.chdir(tmp_path)

    def opener(path, flags):
        return os.open(path, flags, 0o644)
    with overlaid():
        with tempfile.NamedTemporaryFile("wb", dir=cache, delete=False) as made:
            made.write(b"rows")
        with open("own.txt", "w", opener=opener) as own:
            own.write("text")
        with open(made.name, "rb") as f, open("own.txt") as g:
            read = (f.read(), g.read())
        listed = os.listdir(cache)
    assert read == (b"rows", "text")
    assert own.name == "own.txt" and listed == [os.path.basename(made.name)]
    assert list(cache.iterdir()) == [] and not (tmp_path / "own.txt").exists()  # the user's tree as it was


def test_modules_the_run_writes_import_as_the_run_sees_them(tmp_path, monkeypatch):
    """evaluate.load and datasets copy a metric's or loader's script into a modules cache, put the cache
    on sys.path and import it; transformers does the same for remote code. The import system reads the
    disk around Python's file calls, so a cache the run made in the overlay was missing to it
    (`No module named 'evaluate_modules'`, accelerate's FSDP example on a fresh HF_HOME). A module the
    run writes imports, beside the user's own; one the run rewrote imports as rewritten; the user's
    tree stays as it was."""
    import importlib
    import pkgutil

    users = tmp_path / "users_lib"
    (users / "ulib_pkg").mkdir(parents=True)
    (users / "ulib_pkg" / "__init__.py").write_text("WHO = 'the user'\n")
    (users / "ulib_old.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(users))
    before = _tree(str(tmp_path))
    with overlaid():
        cache = tmp_path / "hf_home" / "modules"
        (cache / "runs_modules" / "metrics").mkdir(parents=True)  # a namespace package's folder
        (cache / "runs_modules" / "__init__.py").write_text("")
        (cache / "runs_modules" / "metrics" / "bleu.py").write_text("def score():\n    return 42\n")
        sys.path.append(str(cache))
        (users / "ulib_pkg" / "added.py").write_text("from . import WHO\nSEEN = WHO\n")
        (users / "ulib_old.py").write_text("VALUE = 2\n")
        importlib.invalidate_caches()
        bleu = importlib.import_module("runs_modules.metrics.bleu")
        added = importlib.import_module("ulib_pkg.added")
        old = importlib.import_module("ulib_old")
        seen = (bleu.score(), bleu.__file__, added.SEEN, old.VALUE)
        # plugin discovery lists a folder's modules through its finder (pkgutil.iter_modules)
        listed = ([name for _, name, _ in pkgutil.iter_modules([str(cache / "runs_modules" / "metrics")])],
                  sorted(name for _, name, _ in pkgutil.iter_modules([str(users)])))
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("runs_modules.metrics.missing")
    for name in ("runs_modules", "runs_modules.metrics", "runs_modules.metrics.bleu", "ulib_pkg", "ulib_pkg.added",
                 "ulib_old"):
        sys.modules.pop(name, None)
    sys.path.remove(str(cache))
    assert seen == (42, str(cache / "runs_modules" / "metrics" / "bleu.py"), "the user", 2)
    assert listed == (["bleu"], ["ulib_old", "ulib_pkg"])
    assert _tree(str(tmp_path)) == before
