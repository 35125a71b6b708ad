"""Every writer over the same hostile output paths: exit 0 or 2 with one line, never 3, never a hang,
no partial file left, and no device, pipe or link replaced by a regular file."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from contextlib import ExitStack, contextmanager

import pytest

import memdiff.atomic
from memdiff.cli import main

TARGETS = ["folder", "dangling-link", "link-loop", "dev-full", "under-a-file", "read-only-folder", "long-name",
           "fifo-without-reader", "device-node", "empty", "pseudo-file-system"]


@contextmanager
def mounted(folder, options):
    """A small tmpfs at `folder` (root only): a read-only folder or a full disk that bind root too."""
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def hostile(tmp_path):
    """hostile(name) -> the output path of that kind, made under tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir()
    mounts = ExitStack()

    def make(name):
        if name == "folder":
            (out / "dir").mkdir()
            return str(out / "dir")
        if name == "dangling-link":
            (out / "dangling").symlink_to(tmp_path / "elsewhere" / "x")
            return str(out / "dangling")
        if name == "link-loop":
            (out / "loop").symlink_to(out / "loop")
            return str(out / "loop")
        if name == "dev-full":
            return "/dev/full"
        if name == "under-a-file":
            (out / "report.txt").write_text("a file")
            return str(out / "report.txt" / "sub")
        if name == "read-only-folder":
            # Mode bits do not stop root; a read-only mount stops everyone.
            return str(mounts.enter_context(mounted(out / "ro", "ro,size=16k")) / "report")
        if name == "long-name":
            return str(out / ("x" * 256))
        if name == "fifo-without-reader":
            os.mkfifo(out / "fifo")
            return str(out / "fifo")
        if name == "device-node":
            try:
                os.mknod(out / "nulldev", stat.S_IFCHR | 0o666, os.makedev(1, 3))
            except PermissionError:
                pytest.skip("making a device node needs root")
            return str(out / "nulldev")
        if name == "pseudo-file-system":
            # access() lets root write into /proc (as into an NFS mount that squashes root); the
            # kernel refuses the file only when it is made. `record --emulate` crashed on it (exit 3).
            if not os.path.isdir("/proc/self"):
                pytest.skip("no /proc here")
            return "/proc/report"
        assert name == "empty"
        return ""
    with mounts:
        yield make


@pytest.fixture(autouse=True)
def no_hang(monkeypatch):
    """A pipe without a reader is given up in 0.2 s; anything slower than 300 s is a hang (a
    recording starts torch in a child process: on a loaded 2-core machine that alone took 30 s)."""
    monkeypatch.setattr(memdiff.atomic, "PIPE_READER_WAIT_S", 0.2)

    def hung(*_):
        raise TimeoutError("a writer hung")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def files(root):
    """Every path under `root`, links not followed, mount points not entered."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(folder, d))]
        found += [os.path.join(folder, n) for n in names + dirs]
    return sorted(found)


def pid(err):
    return err.split("(pid")[1].split(".pickle")[0]


def kinds(paths):
    return {p: stat.S_IFMT(os.lstat(p).st_mode) for p in paths}


@pytest.fixture
def inputs(shared, tmp_path):
    """(run, baseline, script) the writers read: a real snapshot, its baseline, a script to record."""
    run = str(shared / "linear-grad.pickle")
    baseline = tmp_path / "base.json"
    assert main(["baseline", run, "-o", str(baseline)]) == 0
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\nimport torch\nx = torch.ones(8)\n")
    return run, str(baseline), str(script)


WRITERS = {  # name: (argv for an output path, whether a pipe or device there is written in place)
    "diff --report": (lambda run, base, script, t: [run, run, "--report", t], True),
    "diff --html": (lambda run, base, script, t: [run, run, "--html", t], True),
    "summarize -o": (lambda run, base, script, t: ["summarize", run, "-o", t], True),
    "baseline -o": (lambda run, base, script, t: ["baseline", run, "-o", t], True),
    "peak --html": (lambda run, base, script, t: ["peak", run, "--html", t], True),
    "gate --html": (lambda run, base, script, t: ["gate", "--baseline", base, run, "--html", t], True),
    "record -o": (lambda run, base, script, t: ["record", "-o", t, "--", sys.executable, script], False),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_refuses_or_writes_every_hostile_path(torch, inputs, hostile, tmp_path, capsys, writer,
                                                           target):
    argv, in_place = WRITERS[writer]
    path = hostile(target)
    capsys.readouterr()
    before = kinds(files(tmp_path / "out"))
    code = main(argv(*inputs, path))
    err = capsys.readouterr().err
    if writer == "record -o" and target == "folder":  # a folder records every process started into it
        assert code == 0, err
        assert [os.path.basename(p) for p in files(tmp_path / "out")] == ["dir", f"pid{pid(err)}.pickle"]
        return
    expected = 0 if in_place and target == "device-node" else 2
    assert code == expected, err
    if code == 2:
        assert err.startswith("memdiff: ") and err.count("\n") == 1, err
        assert not (tmp_path / "ran").exists(), "record ran the script before refusing its output"
    # Nothing left behind, nothing replaced: the same paths of the same kinds as before.
    assert kinds(files(tmp_path / "out")) == before
    assert not (tmp_path / "elsewhere").exists()
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize("target", TARGETS)
def test_the_github_files_are_appended_or_refused(shared, hostile, tmp_path, capsys, monkeypatch, target):
    run = str(shared / "linear-grad.pickle")
    path = hostile(target)
    monkeypatch.setenv("RUNNER_TEMP", str(tmp_path))
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", path)
    before = kinds(files(tmp_path / "out"))
    code = main([run, run, "--github"])
    err = capsys.readouterr().err
    assert code == (0 if target in ("device-node", "empty") else 2), err
    if code == 2:
        assert err.startswith("memdiff: ") and err.count("\n") == 1, err
    assert kinds(files(tmp_path / "out")) == before


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "folder"])
@pytest.mark.parametrize("option", ["--memdiff-report", "--memdiff-html"])
def test_the_plugins_folders_are_checked_before_any_test_runs(pytester, hostile, tmp_path, option, target):
    path = hostile(target)
    pytester.makepyfile("def test_ran():\n    open('ran', 'w').close()\n")
    result = pytester.runpytest_inprocess(option, path)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert any(line.startswith(f"ERROR: {option}: ") for line in result.errlines), result.errlines
    assert not (pytester.path / "ran").exists()


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "folder"])
def test_the_baselines_folder_an_update_writes_is_checked_before_any_test_runs(pytester, hostile, target):
    # A file there made each test record its body, then fail on 'is a file, not a folder'.
    path = hostile(target)
    pytester.makepyfile("def test_ran():\n    open('ran', 'w').close()\n")
    result = pytester.runpytest_inprocess("--memdiff-update", "--memdiff-baselines", path)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    said = f"ERROR: --memdiff-baselines: {path or repr(path)}: "
    assert any(line.startswith(said) for line in result.errlines), result.errlines
    assert not (pytester.path / "ran").exists()


def test_a_file_named_as_the_baselines_folder_is_refused_before_any_test_runs(pytester):
    # The gate read 'no baseline at tests.py/NAME.json; create it with ... --memdiff-update', which failed.
    pytester.makepyfile("def test_ran():\n    open('ran', 'w').close()\n")
    result = pytester.runpytest_inprocess("--memdiff-baselines", "test_a_file_named_as_the_baselines_folder_is_"
                                                                 "refused_before_any_test_runs.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and not (pytester.path / "ran").exists()
    assert "is a file, not a folder" in "\n".join(result.errlines)
    # A folder only read (the gate's) need be neither there nor writable.
    pytester.runpytest_inprocess("--memdiff-baselines", "not-made-yet").assert_outcomes(passed=1)


def test_a_full_disk_leaves_no_partial_report(shared, tmp_path, capsys):
    run = str(shared / "linear-grad.pickle")
    with mounted(tmp_path / "small", "size=64k") as small:
        (small / "filler").write_bytes(b"x" * 64 * 1024)
        for argv in ([run, run, "--report", str(small / "r.md")], ["summarize", run, "-o", str(small / "s.json")]):
            assert main(argv) == 2
            assert capsys.readouterr().err.endswith("cannot write: No space left on device\n")
            assert os.listdir(small) == ["filler"]


def test_a_full_disk_leaves_no_partial_recording(torch, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.ones(100_000)\n")
    with mounted(tmp_path / "small", "size=64k") as small:
        (small / "filler").write_bytes(b"x" * 64 * 1024)
        assert main(["record", "-o", str(small / "run.pickle"), "--", "python", str(script)]) == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith("cannot write: No space left on device")
        assert os.listdir(small) == ["filler"]


def recorded(tmp_path, body, output="run.pickle"):
    """main(['record', ...]) of a script with `body` in this process: (exit code, files left in runs/)."""
    (tmp_path / "runs").mkdir(exist_ok=True)
    script = tmp_path / "train.py"
    script.write_text("import torch\nx = torch.ones(1000)\n" + body)
    code = main(["record", "-o", str(tmp_path / "runs" / output), "--", "python", str(script)])
    return code, sorted(os.listdir(tmp_path / "runs"))


def test_ctrl_c_in_the_script_still_writes_its_recording(torch, tmp_path, capsys):
    code, left = recorded(tmp_path, "raise KeyboardInterrupt\n")
    assert code == 130 and left == ["run.pickle"]
    assert "; interrupted)" in capsys.readouterr().err.splitlines()[-1]
    assert main(["peak", str(tmp_path / "runs" / "run.pickle")]) == 0


def test_ctrl_c_while_the_recording_is_written_leaves_no_partial_file(torch, tmp_path, monkeypatch):
    import memdiff.recording.snapshot_file

    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(memdiff.recording.snapshot_file.pickle, "dump", interrupted)
    assert recorded(tmp_path, "") == (130, [])


def test_a_scripts_exit_3_is_passed_on_and_said_to_be_the_scripts(torch, tmp_path, capsys):
    code, left = recorded(tmp_path, "import sys\nsys.exit(3)\n")
    assert code == 3 and left == ["run.pickle"]
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"memdiff: wrote {tmp_path / 'runs' / 'run.pickle'} (") and "the script exited 3" in last


@pytest.mark.slow  # records, in a child process
def test_os_exit_ends_the_recording_with_the_script_and_leaves_nothing(torch, tmp_path):
    """Documented: os._exit() ends memdiff's process too, before anything is written."""
    (tmp_path / "train.py").write_text("import os\nimport torch\nx = torch.ones(1000)\nos._exit(3)\n")
    (tmp_path / "runs").mkdir()
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", "runs/run.pickle", "--", "python",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 3 and "internal error" not in done.stderr
    assert os.listdir(tmp_path / "runs") == []


def test_a_link_to_a_snapshot_is_kept_and_what_it_leads_to_replaced(torch, tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "real.pickle").write_bytes(b"an earlier run")
    (tmp_path / "runs" / "latest.pickle").symlink_to("real.pickle")
    code, left = recorded(tmp_path, "", output="latest.pickle")
    assert code == 0 and left == ["latest.pickle", "real.pickle"]
    assert (tmp_path / "runs" / "latest.pickle").is_symlink()
    assert (tmp_path / "runs" / "real.pickle").read_bytes() != b"an earlier run"


FOLDER_WRITERS = {  # name: argv for an output folder
    "record -o DIR/": lambda run, base, script, t: ["record", "-o", t + "/", "--", sys.executable, script],
    "gate --html DIR (several runs)": lambda run, base, script, t: [
        "gate", "--baselines", os.path.join(os.path.dirname(base), "baselines"), run, run, "--html", t],
    "demo --dir": lambda run, base, script, t: ["demo", "--dir", t],
}


@pytest.mark.parametrize("target", [t for t in TARGETS if t not in ("folder", "empty")])
@pytest.mark.parametrize("writer", FOLDER_WRITERS)
def test_every_folder_writer_refuses_a_hostile_folder_before_the_work(torch, inputs, hostile, tmp_path, capsys,
                                                                        writer, target):
    path = hostile(target)
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "linear-grad.json").write_bytes((tmp_path / "base.json").read_bytes())
    before = kinds(files(tmp_path / "out"))
    code = main(FOLDER_WRITERS[writer](*inputs, path))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("memdiff: ") and err.count("\n") == 1, err
    assert not (tmp_path / "ran").exists()
    assert kinds(files(tmp_path / "out")) == before


ONTO_INPUT = {  # name: argv that reads `run` (and `other`, a second run or its baseline) and writes `out`
    "slice -o": lambda run, other, out: ["slice", run, "--events", "0:10", "-o", out],
    "summarize -o": lambda run, other, out: ["summarize", run, "-o", out],
    "peak --html": lambda run, other, out: ["peak", run, "--html", out],
    "diff --html": lambda run, other, out: [other, run, "--html", out],
    "gate --html": lambda run, other, out: ["gate", "--baseline", other, run, "--html", out],
    "whatif --html": lambda run, other, out: ["whatif", run, "--html", out],
    "forecast --html": lambda run, other, out: ["forecast", f"{other}=1", f"{run}=2", "--html", out],
}


@pytest.mark.parametrize("writer", ONTO_INPUT)
@pytest.mark.parametrize("how", ["same-path", "hard-link"])
def test_no_writer_replaces_the_snapshot_it_reads(shared, tmp_path, capsys, writer, how):
    """A run's snapshot is never lost: an output named as (or hard-linked to) the input is refused."""
    run = tmp_path / "run.pickle"
    run.write_bytes((shared / "linear-grad.pickle").read_bytes())
    other = tmp_path / "other.pickle"
    other.write_bytes((shared / "linear-nograd.pickle").read_bytes())
    if writer.startswith("gate"):
        other = tmp_path / "base.json"
        assert main(["baseline", str(run), "-o", str(other)]) == 0
    target = run
    if how == "hard-link":
        target = tmp_path / "alias.pickle"
        os.link(run, target)
    before = run.read_bytes()
    capsys.readouterr()
    assert main(ONTO_INPUT[writer](str(run), str(other), str(target))) == 2
    err = capsys.readouterr().err
    assert err.startswith("memdiff: ") and err.count("\n") == 1 and "is the input" in err, err
    assert run.read_bytes() == before
