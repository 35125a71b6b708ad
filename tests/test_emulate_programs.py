"""Programs an emulated script starts (`rm`, `cp`, a shell, `cat`) run where the watched folders are
kernel overlays (memdiff/recording/emulate/programs.py): the user's files keep every byte, the
script reads back what the programs wrote, they read what the script wrote, and memdiff lists their
writes as the run's. Where the kernel refuses, they run as before and memdiff says so once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces and overlayfs are Linux's")

REFUSED = "programs the run starts are not sandboxed"


def _emulate(tmp_path: Path, source: str, output: Path) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(output), "--",
                           "python", "train.py"], capture_output=True, text=True, cwd=tmp_path)
    if REFUSED in done.stderr:  # no user namespaces or overlayfs here: the fallback has its own test
        pytest.skip(done.stderr.split(REFUSED, 1)[1].splitlines()[0])
    return done


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_a_shell_s_rm_and_cp_change_only_the_overlay(tmp_path):
    # the report's case: the shell deleted the user's checkpoint folder, which memdiff could only name
    project = tmp_path / "proj"
    (project / "ckpt").mkdir(parents=True)
    (project / "ckpt" / "best.pt").write_bytes(b"the user's best weights")
    (tmp_path / "out").mkdir()
    done = _emulate(project, """
        import os, subprocess, torch
        x = torch.randn(4, 4, device="cuda")
        os.system("rm -rf ckpt && mkdir -p ckpt")
        subprocess.run(["cp", "train.py", "ckpt/copy.py"])
        print(os.listdir("ckpt"), open("ckpt/copy.py").read() == open("train.py").read())
    """, tmp_path / "out" / "r.pickle")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["['copy.py'] True"]
    assert (project / "ckpt" / "best.pt").read_bytes() == b"the user's best weights"
    assert sorted(p.name for p in (project / "ckpt").iterdir()) == ["best.pt"]
    assert "writer outside" not in done.stderr
    assert "the run's writes went to its overlay, the user's files are unchanged: 1 changed, 1 created" in done.stderr
    # the folder removed and made again (what the user had in it hidden), and the copy, as the run's
    assert "memdiff: emulation:   changed ckpt/\n" in done.stderr
    size = len((project / "train.py").read_bytes())
    assert f"memdiff: emulation:   created ckpt/copy.py ({size} B)" in done.stderr


@pytest.mark.slow
def test_a_program_reads_what_the_script_wrote_and_its_status_and_streams_pass(tmp_path):
    # -o in the project: memdiff's overlay lies inside the folder the program's overlay is made of
    (tmp_path / "data.txt").write_text("the user's data\n")
    before = _tree(tmp_path)
    done = _emulate(tmp_path, """
        import os, subprocess, sys, torch
        torch.save(torch.nn.Linear(4, 2).cuda().state_dict(), "model.pt")
        with open("notes.txt", "w") as f:
            f.write("written by the script\\n")
        head = subprocess.run(["head", "-c", "22", "model.pt"], capture_output=True).stdout
        print(head == open("model.pt", "rb").read(22), head[:8])
        print(subprocess.check_output(["cat", "notes.txt", "data.txt"], text=True), end="")
        print(subprocess.run(["cat"], input="through stdin", capture_output=True, text=True).stdout)
        print(subprocess.run(["sh", "-c", "exit 7"]).returncode, os.system("exit 3") >> 8,
              subprocess.run(["sh", "-c", "kill -TERM $$"]).returncode)
        os.system("echo appended >> notes.txt; mv data.txt moved.txt")
        print(open("notes.txt").read().split(), sorted(n for n in os.listdir(".") if n.endswith(".txt")))
    """, tmp_path / "run.pickle")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True b'MEMDIFF-'", "written by the script", "the user's data",
                                        "through stdin", "7 3 -15",
                                        "['written', 'by', 'the', 'script', 'appended'] ['moved.txt', 'notes.txt']"]
    assert _tree(tmp_path) == {**before, "run.pickle": (tmp_path / "run.pickle").read_bytes(),
                               "train.py": (tmp_path / "train.py").read_bytes()}
    for line in ("deleted data.txt", "created moved.txt (16 B)", "created notes.txt (31 B)"):
        assert f"memdiff: emulation:   {line}" in done.stderr, done.stderr


CHILD = """
import os, torch
print(torch.cuda.get_device_name(0), os.environ.get("MEMDIFF_SANDBOXED"))
with open("from_child.txt", "w") as f:
    f.write("the child's")
"""


@pytest.mark.slow
def test_a_python_child_inside_a_shell_is_emulated(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    before = _tree(tmp_path)
    done = _emulate(tmp_path, """
        import os, sys, torch
        torch.zeros(1, device="cuda")
        print(os.system(f"{sys.executable} child.py; echo shell > by_shell.txt"))
        print(open("from_child.txt").read(), open("by_shell.txt").read().strip())
    """, tmp_path / "run.pickle")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["NVIDIA H100 80GB HBM3 1", "0", "the child's shell"]
    assert _tree(tmp_path) == {**before, "run.pickle": (tmp_path / "run.pickle").read_bytes(),
                               "train.py": (tmp_path / "train.py").read_bytes()}
    assert "memdiff: emulation:   created by_shell.txt (6 B)" in done.stderr
    assert "memdiff: emulation:   created from_child.txt (11 B)" in done.stderr


def test_where_the_kernel_refuses_a_program_runs_as_before_and_memdiff_says_so_once(tmp_path, capfd, monkeypatch):
    """The sandbox refused (here: the only folder to watch is /, which is never mounted over): the
    program runs and writes as it did before this module, its status passes, one line says why, and
    the next program is started as it is."""
    from memdiff.recording.emulate import programs
    from memdiff.recording.emulate.overlay_calls import overlaid

    monkeypatch.setenv(programs.TREES, os.sep)
    monkeypatch.delenv(programs.INSIDE, raising=False)
    with overlaid() as overlay:
        first = subprocess.run(["sh", "-c", f"echo made > {tmp_path / 'by_sh.txt'}; exit 5"])
        second = subprocess.run(["sh", "-c", "exit 6"])
        state = Path(overlay.root, programs.STATE).read_text()
    assert (first.returncode, second.returncode) == (5, 6)
    assert (tmp_path / "by_sh.txt").read_text() == "made\n"  # not kept from the user's files: said so
    err = capfd.readouterr().err
    assert err.count(REFUSED) == 1 and "(no folder to watch but / (ENOENT))" in err
    assert state.startswith("refused: ")
