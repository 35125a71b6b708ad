"""The progress line of long reads: on a terminal only, after the delay, never in JSON on stdout."""

from __future__ import annotations

import gzip
import io
import pickle

import pytest
from test_lifetimes import training

from memdiff import progress
from memdiff.cli import main
from memdiff.read.load import load


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def tty(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    yield term
    progress.enable(None)


@pytest.mark.parametrize("gz", [False, True])
def test_a_read_on_a_terminal_shows_progress_and_clears_it(tmp_path, tty, gz):
    path = tmp_path / ("s.pickle.gz" if gz else "s.pickle")
    data = pickle.dumps(training(steps=3), protocol=4)
    path.write_bytes(gzip.compress(data) if gz else data)
    progress.enable(tty)
    load(str(path))
    shown = tty.getvalue()
    assert "memdiff: reading s.pickle" in shown and "100%" in shown
    assert shown.endswith("\r\x1b[K")  # the line is cleared when the read ends


def test_nothing_when_stderr_is_no_terminal(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    piped = io.StringIO()
    progress.enable(piped)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(training(steps=2), protocol=4))
    load(str(path))
    progress.enable(None)
    assert piped.getvalue() == ""


def test_nothing_before_the_delay(tmp_path, monkeypatch):
    term = Terminal()
    progress.enable(term)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(training(steps=2), protocol=4))
    load(str(path))  # far shorter than the default delay of progress.DELAY_S
    progress.enable(None)
    assert term.getvalue() == ""


@pytest.mark.parametrize("argv, shown", [(["summarize"], False), (["summarize", "--format", "text"], True),
                                         (["peak", "--format", "json"], False), (["peak"], True)])
def test_the_cli_shows_it_unless_json_goes_to_stdout(tmp_path, monkeypatch, capsys, argv, shown):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(training(steps=2), protocol=4))
    assert main([*argv, str(path)]) == 0
    progress.enable(None)
    assert ("memdiff: reading" in term.getvalue()) == shown


@pytest.mark.slow  # spawns worker processes
def test_worker_processes_show_it_when_the_parent_does(tmp_path, monkeypatch):
    from memdiff.read import inputs
    monkeypatch.setattr(inputs, "PARALLEL_MIN_BYTES", 0)  # two small files in two workers
    monkeypatch.setattr(inputs, "worker_count", lambda sizes: 2)
    paths = []
    for k in range(2):
        path = tmp_path / f"s{k}.pickle"
        path.write_bytes(pickle.dumps(training(steps=2), protocol=4))
        paths.append(str(path))
    progress.enable(Terminal())
    assert inputs.read_each(progress_shown, [(p,) for p in paths]) == [True, True]
    progress.enable(None)
    assert inputs.read_each(progress_shown, [(p,) for p in paths]) == [False, False]


def progress_shown(path: str) -> bool:
    return progress.enabled()


def test_a_file_name_cannot_bend_the_line(tmp_path, tty):
    path = tmp_path / "s\x1b[2J\nx.pickle"
    path.write_bytes(pickle.dumps(training(steps=2), protocol=4))
    progress.enable(tty)
    load(str(path))
    assert "\x1b[2J" not in tty.getvalue() and "\n" not in tty.getvalue()
    assert "s\\x1b[2J\\nx.pickle" in tty.getvalue()
