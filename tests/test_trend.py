"""History on the main branch: `memdiff history append`, and the gate's trend in the comment and the page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import cli, py_frames, weights_and_activations

from memdiff.compare.findings import BY_CODE
from memdiff.compare.trend import BLOCKS, read_history, sparkline, trend_of
from memdiff.model import TrendDevice, TrendEntry
from memdiff.units import format_bytes

MiB = 2**20
FWD = py_frames("site-packages/torch/nn/modules/linear.py:125:forward", "model.py:9:forward", "train.py:8:<module>")
# The main branch's 20 commits: the activations of each run, in MiB (weights: 100 MiB). Flat, a
# step up at commit 8, a step down at 15, and a creep at the end.
MAIN = [40] * 7 + [48] * 7 + [44] * 3 + [45, 46, 47]



def snapshot(path: Path, activation: int, parameter: int = 100 * MiB) -> Path:
    return weights_and_activations(path, activation, parameter, forward=FWD)


run = cli


def commit(k: int) -> str:
    return f"{k:02d}" + "c0ffee" * 6 + "ab"


@pytest.fixture
def main_branch(tmp_path, capsys):
    """A history of 20 main-branch runs of `train` (one per commit), and its baseline (the first)."""
    history = tmp_path / "history" / "main.jsonl"
    for k, activation in enumerate(MAIN):
        snap = snapshot(tmp_path / "train.pickle", activation * MiB)
        code, _, err = run(capsys, "history", "append", snap, "--to", history, "--commit", commit(k),
                           "--date", f"2026-11-{k + 1:02d}T12:00:00Z")
        assert code == 0, err
        assert err.endswith(f"; {k + 1} lines\n" if k else "; 1 line\n"), err
    assert run(capsys, "baseline", tmp_path / "train.pickle", "-o", tmp_path / "baselines" / "train.json")[0] == 0
    return history


def test_append_writes_one_valid_line_per_run(main_branch):
    lines = main_branch.read_text().splitlines()
    assert len(lines) == 20
    first = json.loads(lines[0])
    assert first["schema_version"] == 1 and first["workload"] == "train" and first["commit"] == commit(0)
    assert first["devices"] == [{"device": 0, "peak_bytes": 140 * MiB,
                                 "categories": {"activation": 40 * MiB, "parameter": 100 * MiB}}]
    assert [e.devices[0].peak_bytes for e in read_history(str(main_branch))] == [(100 + a) * MiB for a in MAIN]


def test_a_trend_words_a_change_as_the_diff_does_past_999_percent():
    # A peak of 2 MiB that became 40 MiB (a cache left on) grew 1,900%: the diff's rows and headline say
    # x20.0, and the trend said +1900.0%; from 4 B (a scalar) it is new in both, not x5,242,880.0.
    entries = [TrendEntry(commit(k), f"2026-11-0{k + 1}T12:00:00Z", "train", [TrendDevice(0, peak)])
               for k, peak in enumerate([2 * MiB, 40 * MiB, 40 * MiB, 4])]
    trend = trend_of(entries, "train", 0, 20 * MiB)
    assert [p.change_text for p in trend.points] == ["", "+38.00 MiB (x20.0)", "unchanged", "-40.00 MiB (-100.0%)"]
    assert trend.head_change_text == "+20.00 MiB (new)"


def test_the_sparkline_scales_lowest_to_highest():
    assert sparkline([1, 5, 9]) == BLOCKS[0] + BLOCKS[4] + BLOCKS[7]
    assert sparkline([3, 3]) == BLOCKS[3] * 2


def test_a_trend_of_twenty_commits_by_hand(main_branch):
    entries = read_history(str(main_branch))
    t = trend_of(entries, "train", 0, 150 * MiB, "this PR", points=20)
    assert t is not None and len(t.points) == 20 and len(t.sparkline) == 20
    # Peaks 140..148 MiB on main, this PR 150 MiB: it is the top block, the flat start the bottom.
    assert t.head_block == BLOCKS[7] and t.sparkline[0] == BLOCKS[0]
    assert t.text == ("train, device 0: the last 20 peaks on main ran from 140.00 MiB to 148.00 MiB (it moved at 5 "
                      f"of 19 commits); latest 147.00 MiB at {commit(19)[:12]}; this PR 150.00 MiB, +3.00 MiB (+2.0%) "
                      "against the latest, above all 20")
    assert t.rows[0] == ["this PR", "", "150.00 MiB", "+3.00 MiB (+2.0%)"]
    assert t.rows[1][:3] == [commit(19)[:12], "2026-11-20T12:00:00Z", "147.00 MiB"]
    assert len(trend_of(entries, "train", 0, 150 * MiB, points=5).points) == 5
    assert trend_of(entries, "eval", 0, 150 * MiB) is None


def test_one_or_a_flat_history_reads_as_a_sentence(main_branch):
    entries = read_history(str(main_branch))
    one = trend_of(entries[:1], "train", 0, 140 * MiB, "this PR")
    assert one is not None and one.text == (f"train, device 0: one peak on main so far, 140.00 MiB at "
                                            f"{commit(0)[:12]}; this PR 140.00 MiB, unchanged")
    grown = trend_of(entries[:1], "train", 0, 141 * MiB, "this PR")
    assert grown is not None and grown.text.endswith("this PR 141.00 MiB, +1.00 MiB (+0.7%) against it")
    flat = trend_of(entries[:3], "train", 0, 140 * MiB, "this PR")
    assert flat is not None and flat.text.startswith("train, device 0: the last 3 peaks on main were all 140.00 MiB "
                                                     "(it moved at 0 of 2 commits)")


def test_the_gate_shows_the_trend_in_the_comment_text_and_json(main_branch, tmp_path, capsys):
    head = snapshot(tmp_path / "train.pickle", 50 * MiB)
    baseline = tmp_path / "baselines" / "train.json"
    code, out, _ = run(capsys, "gate", head, "--baseline", baseline, "--history", main_branch, "--format", "markdown",
                       "--head-label", "abc1234")
    assert code == 0  # 147 -> 150 MiB: within the default rule
    line = next(x for x in out.splitlines() if " → **`" in x)
    spark, head_block = re.match(r"`(.+)` → \*\*`(.)`\*\*", line).groups()
    assert len(spark) == 20 and head_block == BLOCKS[7]
    assert "abc1234 150.00 MiB, +3.00 MiB (+2.0%) against the latest, above all 20" in line
    trend_part = out.split("#### Peak on the main branch")[1]
    table = [x for x in trend_part.splitlines() if x.startswith("| ")]
    assert len(table) == 1 + 21 and "| abc1234 " in table[1]  # header, this run, 20 commits
    code, out, _ = run(capsys, "gate", head, "--baseline", baseline, "--history", main_branch)
    assert "trend on main: " + spark + " -> " + head_block in out
    code, out, _ = run(capsys, "gate", head, "--baseline", baseline, "--history", main_branch, "--format", "json",
                       "--history-points", "8")
    [doc] = json.loads(out)
    assert [p["peak_bytes"] for p in doc["trends"][0]["points"]] == [(100 + a) * MiB for a in MAIN[-8:]]
    # the table's words, each point against the one before it (148, 148, 144, 144, 144, 145, 146, 147 MiB;
    # the oldest shown has none), and this run's 150 MiB against the latest
    assert [p["change_text"] for p in doc["trends"][0]["points"]] == [
        "", "unchanged", "-4.00 MiB (-2.7%)", "unchanged", "unchanged", *["+1.00 MiB (+0.7%)"] * 3]
    assert doc["trends"][0]["head_change_text"] == "+3.00 MiB (+2.0%)"


def test_a_history_without_the_workload_says_so(main_branch, tmp_path, capsys):
    head = snapshot(tmp_path / "eval.pickle", 50 * MiB)
    assert run(capsys, "baseline", head, "-o", tmp_path / "baselines" / "eval.json")[0] == 0
    code, out, _ = run(capsys, "gate", head, "--baselines", tmp_path / "baselines", "--history", main_branch)
    assert code == 0
    assert "the history has no peak of 'eval' on main yet (it holds train)" in out
    assert "trend on main: " + BY_CODE["G007"].example_output in out.splitlines()


def test_an_empty_history_file_is_an_empty_history(main_branch, tmp_path, capsys):
    # `touch history.jsonl`: as a missing file is, an empty one is a history with no run yet.
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    code, out, err = run(capsys, "gate", tmp_path / "train.pickle", "--baseline", tmp_path / "baselines" / "train.json",
                         "--history", empty)
    assert code == 0, err
    assert "the history has no peak of 'train' on main yet" in out
    code, _, err = run(capsys, "history", "append", tmp_path / "train.pickle", "--to", empty, "--commit", commit(0))
    assert code == 0, err
    [line] = empty.read_text().splitlines()
    assert json.loads(line)["commit"] == commit(0)


@pytest.mark.parametrize("line, message", [
    ('{"schema_version": 1, "commit": "a"}', "line 2: not a valid memdiff history"),
    ("not json", "line 2: invalid JSON"),
    ('{"schema_version": 9, "commit": "a", "date": "", "workload": "w", "devices": []}', "schema_version 9"),
])
def test_a_broken_history_is_bad_input_and_never_appended_to(main_branch, tmp_path, capsys, line, message):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(main_branch.read_text().splitlines()[0] + "\n" + line + "\n")
    before = broken.read_text()
    code, _, err = run(capsys, "history", "append", tmp_path / "train.pickle", "--to", broken, "--commit", "x")
    assert code == 2 and message in err and err.count("\n") == 1
    assert broken.read_text() == before
    code, _, err = run(capsys, "gate", tmp_path / "train.pickle", "--baseline", tmp_path / "baselines" / "train.json",
                       "--history", broken)
    assert code == 2 and message in err


def test_the_page_carries_the_trend(main_branch, tmp_path, capsys):
    head = snapshot(tmp_path / "train.pickle", 50 * MiB)
    page = tmp_path / "r.html"
    run(capsys, "gate", head, "--baseline", tmp_path / "baselines" / "train.json", "--history", main_branch,
        "--html", page)
    text = page.read_text()
    assert text.count('class="trend-point"') == 20 and text.count('class="trend-head"') == 1
    assert "this run: 150.00 MiB, +3.00 MiB (+2.0%)" in text


@pytest.mark.slow
def test_the_trend_draws_in_a_real_browser(main_branch, tmp_path, capsys):
    from browser import open_report
    from test_browser import _browser_or_skip

    executable = _browser_or_skip()
    head = snapshot(tmp_path / "train.pickle", 50 * MiB)
    page = tmp_path / "r.html"
    run(capsys, "gate", head, "--baseline", tmp_path / "baselines" / "train.json", "--history", main_branch,
        "--html", page, "--head-label", "this PR")
    seen = open_report(page, screenshot=tmp_path / "r.png", executable=executable)
    assert seen.console_errors == [] and seen.requests == []
    [trend] = seen.trends
    points, head_point = trend["points"], trend["head"]
    assert trend["width"] > 300 and trend["height"] > 100 and trend["line"] == 20
    assert [p["bytes"] for p in points] == [(100 + a) * MiB for a in MAIN]
    assert [p["commit"] for p in points] == [commit(k) for k in range(20)]
    assert all(p["inside"] for p in points) and head_point["inside"]
    # Left to right in commit order, this PR last; higher peaks drawn higher (smaller y).
    xs = [p["x"] for p in points] + [head_point["x"]]
    assert xs == sorted(xs) and len(set(xs)) == 21
    ys = {p["bytes"]: round(p["y"], 1) for p in points}
    order = sorted(ys)
    assert [ys[b] for b in order] == sorted((ys[b] for b in order), reverse=True)
    assert head_point["y"] < min(ys.values())  # 150 MiB: above every main peak
    assert head_point["bytes"] == 150 * MiB and head_point["title"] == "this PR: 150.00 MiB, +3.00 MiB (+2.0%)"
    assert points[-1]["title"] == f"{commit(19)[:12]} 2026-11-20T12:00:00Z: {format_bytes(147 * MiB)}"


def test_names_in_a_history_stay_inert_in_every_report(tmp_path, capsys):
    """A history is data: a workload or commit holding a newline, a workflow command or a mention
    starts no line and notifies no one."""
    snap = snapshot(tmp_path / "train.pickle", 40 * MiB)
    assert run(capsys, "baseline", snap, "-o", tmp_path / "train.json", "--name", "w\n::stop-commands::x @team")[0] == 0
    history = tmp_path / "h.jsonl"
    for k in range(2):
        code, _, err = run(capsys, "history", "append", snap, "--to", history, "--workload",
                           "w\n::stop-commands::x @team", "--commit", f"c{k}\n::error::planted")
        assert code == 0 and err.count("\n") == 1
    for fmt in ("text", "markdown"):
        code, out, _ = run(capsys, "gate", snap, "--baseline", tmp_path / "train.json", "--history", history,
                           "--format", fmt)
        assert code == 0 and "peaks on main" in out
        assert not any(line.startswith("::") for line in out.splitlines())
        if fmt == "markdown":  # the trend's words are markdown text (names in code spans notify no one)
            trend = out.split("#### Peak on the main branch")[1].split("**Rule:**")[0]
            assert "@team" not in trend and "@\u2060team" in trend
    run(capsys, "gate", snap, "--baseline", tmp_path / "train.json", "--history", history, "--html", tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<svg class=\"trend\"" in page and "::error::planted" in page and "\n::error" not in page


def test_a_date_that_is_no_iso_date_is_refused_not_stored(shared, tmp_path, capsys):
    """`--date yesterday` was stored as the line's date, which the trend shows as the run's."""
    from memdiff.cli import main

    history = tmp_path / "h.jsonl"
    run = str(shared / "linear-grad.pickle")
    for date in ("yesterday", "2026-13-01"):
        with pytest.raises(SystemExit) as stop:
            main(["history", "append", run, "--to", str(history), "--commit", "abc", "--date", date])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"argument --date: '{date}' is not an ISO 8601 date" in err
    assert not history.exists()
    for date in ("2026-12-01", "2026-12-01T06:28:06Z", "2026-12-01T07:28:06+01:00"):  # git's %cI is the last form
        assert main(["history", "append", run, "--to", str(history), "--commit", "abc", "--date", date]) == 0
    assert [json.loads(line)["date"] for line in history.read_text().splitlines()][-1] == "2026-12-01T07:28:06+01:00"


@pytest.mark.parametrize("given", ["snapshot", "baseline"])
def test_a_run_or_a_baseline_given_as_the_history_says_what_it_is(shared, tmp_path, capsys, given):
    """A baseline given to --to or --history read `line 1: invalid JSON at line 1 column 2: Expecting property
    name`, a snapshot `line 1: invalid JSON: not UTF-8 text`."""
    from memdiff.cli import main

    run = str(shared / "linear-grad.pickle")
    wrong = run if given == "snapshot" else str(tmp_path / "b.json")
    if given == "baseline":
        assert main(["baseline", run, "-o", wrong]) == 0
    before = Path(wrong).read_bytes()
    capsys.readouterr()
    assert main(["history", "append", run, "--to", wrong, "--commit", "abc"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith(f"memdiff: {wrong}: is ")
    assert ("is a snapshot, not a history file" if given == "snapshot" else "not a history file") in said
    assert Path(wrong).read_bytes() == before
