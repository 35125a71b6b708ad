"""The command line as a user runs it: entry points, output files, formats, exit codes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import alloc, py_frames

from memdiff.cli import main
from memdiff.read.schema import validate

SNAP = {"segments": [], "device_traces": [[alloc(1, 3 * 2**20, py_frames("model.py:3:forward")),
                                           alloc(2, 2**20, py_frames("model.py:9:loss"))]]}


@pytest.fixture
def snap(tmp_path):
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(SNAP, 4))
    return path


def test_summarize_writes_a_valid_summary_file(snap, tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["summarize", str(snap), "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    data = validate(str(out), json.loads(out.read_text()), "summary")
    assert data["schema_version"] == 2 and data["source"]["file"] == "run.pickle"
    assert data["devices"][0]["peak_bytes"] == 4 * 2**20
    assert [g["site"] for g in data["devices"][0]["groups"]] == ["model.py:forward", "model.py:loss"]


def test_summarize_text_lists_every_group(snap, capsys):
    assert main(["summarize", str(snap), "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert "4.00 MiB" in out and "3.00 MiB" in out and "75.0%" in out and "model.py:loss" in out


def test_usage_errors_exit_2(snap, capsys):
    with pytest.raises(SystemExit) as e:
        main(["peak", str(snap), "--top", "0"])
    assert e.value.code == 2
    assert main(["frobnicate"]) == 2  # no file, no command: said before argparse (test_mistakes.py)


def test_python_dash_m_and_the_console_script(snap):
    # `pip install -e .` puts the console script beside the interpreter it installed into.
    script = Path(sys.executable).parent / "memdiff"
    for argv in ([sys.executable, "-m", "memdiff", "peak", str(snap)], [str(script), "peak", str(snap)]):
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "4.00 MiB" in done.stdout


def test_a_bug_in_memdiff_exits_3_with_one_line(snap, capsys, monkeypatch):
    import memdiff.commands.peak

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(memdiff.commands.peak, "peak_report", broken)
    assert main(["peak", str(snap)]) == 3
    err = capsys.readouterr().err
    assert err == ("memdiff: internal error: ZeroDivisionError: division by zero (run with --debug for the "
                   "traceback; please report it)\n")
    assert main(["peak", str(snap), "--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_a_markdown_report_under_an_html_name_is_refused(tmp_path, capsys):
    """`--report x.html` would write markdown that a browser shows raw: one line, exit 2, the flag
    that writes the page named, nothing written."""
    snap = tmp_path / "a.pickle"
    snap.write_bytes(pickle.dumps(SNAP, protocol=4))
    out = tmp_path / "report.html"
    assert main([str(snap), str(snap), "--report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("--report writes the markdown report; the HTML report is --html FILE")
    assert err.count("\n") == 1 and not out.exists()


def test_the_command_gives_numpys_blas_one_thread_unless_the_user_chose(monkeypatch):
    # OpenBLAS's workers spin once started: 2 s of CPU per command on a 16-core machine, for no
    # linear algebra at all. The command (not the library: a program importing memdiff keeps its
    # own threads) sets the default before numpy is imported.
    import memdiff.__main__ as entry
    import memdiff.cli

    seen = []
    monkeypatch.setattr(memdiff.cli, "main", lambda argv=None: seen.append(os.environ.get("OPENBLAS_NUM_THREADS")) or 0)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert entry.run(["--version"]) == 0
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")
    assert entry.run(["--version"]) == 0
    assert seen == ["1", "8"]
