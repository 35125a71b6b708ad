"""The HTML report as a file: self-contained, escaped, written where asked, and never fetching anything."""

from __future__ import annotations

import html
import json
import re

import pytest
from conftest import ROOT, alloc, free, py_frames
from test_lifetimes import training

from memdiff.cli import main
from memdiff.render import FORMATS, render

HOSTILE = '</script><img src=x onerror="alert(1)">'


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="memdiff-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def test_a_diff_report_is_one_self_contained_page(write_snapshot, tmp_path, capsys):
    base = write_snapshot(training(steps=2), "base.pickle")
    head = write_snapshot(training(steps=2, leak=True), "head.pickle")
    report = tmp_path / "report.html"
    assert main([base, head, "--html", str(report)]) == 1  # +292.97 KiB, +81.7%: over the default's 50%
    text = capsys.readouterr().out
    page = report.read_text()
    assert "default-src 'none'" in page  # the browser refuses any fetch the page might try
    assert not re.search(r"<link|\ssrc=|@import|https?://(?!www\.w3\.org/2000/svg)", page)
    data = _data(page)
    runs = data["devices"][0]["runs"]
    assert [r["role"] for r in runs] == ["base", "head"]
    assert [r["peak_bytes"] for r in runs][1] > runs[0]["peak_bytes"]
    assert all(r["history"]["totals"] for r in runs)
    # The page's tables are the text report's figures.
    peak_line = next(line for line in text.splitlines() if line.startswith("device 0: peak"))
    assert html.escape(peak_line.split(": ", 1)[1].split(";")[0]) in page
    assert 'class="row' in page and data["devices"][0]["rows"]["r0"]["stacks"]


def test_render_writes_html_as_the_page_and_refuses_a_format_it_lacks():
    import memdiff

    cuda = ROOT / "tests" / "data" / "cuda"
    report = memdiff.diff(cuda / "gpt2-base.pickle.gz", cuda / "gpt2-retain-graph.pickle.gz")
    page = render(report, "html")
    assert page.startswith("<!DOCTYPE html>") and page == memdiff.html_report(report)
    for fmt in ("pdf", "HTML", ""):  # never another format in its place
        with pytest.raises(ValueError) as err:
            render(report, fmt)
        assert all(f in str(err.value) for f in FORMATS)


def test_a_cut_stack_ends_in_the_same_words_in_every_output(write_snapshot):
    # A model 20 modules deep allocates 1 MiB more at its innermost layer, and a new 1 MiB 17 modules deep.
    # Outputs show 16 frames of a stack; the page said "... 4 more frames" and "... 1 more frames", the
    # markdown "... 4 more frames", the text "… 4 more frames".
    import memdiff
    from memdiff.render.text import render_stacks

    deep, deeper = (py_frames(*[f"layer{k}.py:{k + 1}:forward" for k in range(n)]) for n in (17, 20))
    base = write_snapshot({"segments": [], "device_traces": [[alloc(1, 2**20, deeper)]]}, "base.pickle")
    head = write_snapshot({"segments": [], "device_traces": [[alloc(1, 2**21, deeper), alloc(2, 2**20, deep)]]},
                          "head.pickle")
    report = memdiff.diff(base, head)
    said = ["… 4 more frames", "… 4 more frames", "… 1 more frame"]  # the grown row's base and head, the new row
    page_stacks = [st["frames"][-1] for r in _data(render(report, "html"))["devices"][0]["rows"].values()
                   for st in r["stacks"]]
    assert page_stacks == said
    assert [line.strip() for line in render_stacks(report).splitlines() if "more frame" in line] == said
    assert [line for line in render(report, "markdown").splitlines() if "more frame" in line] == said


def test_labels_from_a_snapshot_cannot_break_out_of_the_page(write_snapshot, tmp_path, capsys):
    frames = py_frames(f"model.py:3:{HOSTILE}", "train.py:9:main")
    snap = {"device_traces": [[alloc(0x100, 512, frames), alloc(0x200, 256, frames), free(0x200, 256, frames)]],
            "segments": []}
    path = write_snapshot(snap)
    report = tmp_path / "peak.html"
    assert main(["peak", path, "--html", str(report)]) == 0
    capsys.readouterr()
    page = report.read_text()
    assert HOSTILE not in page
    assert page.count("</script>") == 2  # the data's and the code's own
    assert any(HOSTILE in line for g in _data(page)["devices"][0]["runs"][0]["groups"].values() for line in g["stack"])


def test_gate_writes_one_page_per_run_into_a_folder(write_snapshot, tmp_path, capsys):
    runs = [write_snapshot(training(steps=2), f"{name}.pickle") for name in ("a", "b")]
    folder = tmp_path / "baselines"
    folder.mkdir()
    for run in runs:
        assert main(["baseline", run, "-o", str(folder / (run.rsplit("/", 1)[1].split(".")[0] + ".json"))]) == 0
    pages = tmp_path / "pages"
    assert main(["gate", "--baselines", str(folder), *runs, "--html", str(pages)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in pages.iterdir()) == ["a.html", "b.html"]
    data = _data((pages / "a.html").read_text())
    base, head = data["devices"][0]["runs"]
    assert base["history"] is None and head["history"]["totals"]  # a baseline stores no history


def test_gate_of_several_runs_writes_into_the_folder_when_only_one_has_its_baseline(write_snapshot, tmp_path, capsys):
    # The action makes the folder for several heads: a second workload added before its baseline
    # (or the first run of two, with none) read the folder as one page's name, exit 2 "is a folder",
    # and the pull request never saw the G008 that says how to make the baseline.
    runs = [write_snapshot(training(steps=2), f"{name}.pickle") for name in ("a", "b")]
    folder, pages = tmp_path / "baselines", tmp_path / "pages"
    folder.mkdir()
    pages.mkdir()
    assert main(["gate", "--baselines", str(folder), *runs, "--html", str(pages)]) == 2
    assert "G008" in capsys.readouterr().err and not list(pages.iterdir())
    assert main(["baseline", runs[0], "-o", str(folder / "a.json")]) == 0
    assert main(["gate", "--baselines", str(folder), *runs, "--html", str(pages)]) == 0
    assert "no baseline at" in capsys.readouterr().err
    assert [p.name for p in pages.iterdir()] == ["a.html"]


def test_an_html_path_in_a_missing_folder_fails_before_any_work(write_snapshot, tmp_path, capsys):
    path = write_snapshot(training(steps=2))
    assert main([path, path, "--html", str(tmp_path / "no" / "r.html")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "does not exist" in err


@pytest.mark.slow  # records the demo's two runs
def test_the_demo_leaves_a_report_beside_its_snapshots(torch, tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path), "--device", "cpu"]) == 0  # checkpointing lowers the peak
    err = capsys.readouterr().err
    assert f"open {tmp_path / 'report.html'}" in err
    runs = _data((tmp_path / "report.html").read_text())["devices"][0]["runs"]
    assert all(r["history"]["totals"] and max(r["history"]["totals"]) == r["peak_bytes"] for r in runs)
    assert runs[1]["peak_bytes"] < runs[0]["peak_bytes"]


def test_the_peak_page_shows_the_devices_facts_as_the_text_does(write_snapshot, tmp_path, capsys):
    # The page said the peak and reserved only; the text's static memory, what the dump held and the
    # trace's length (DevicePeak.facts) were missing from it.
    path = write_snapshot(training(steps=2))
    report = tmp_path / "peak.html"
    assert main(["peak", path, "--html", str(report)]) == 0
    text = capsys.readouterr().out
    page = report.read_text()
    static = next(line for line in text.splitlines() if line.startswith("static "))
    trace = next(line for line in text.splitlines() if line.startswith("trace "))
    words = static.split(None, 3)[3]  # `static  1.00 KiB  live before the trace began, counted from its start`
    assert f'<td class="l">static</td><td>{static.split()[1]} {static.split()[2]}</td><td class="l">{words}</td>' \
        in page
    assert f'<td class="l">trace</td><td>{trace.split()[1]}</td><td class="l">events</td>' in page
    assert "at dump" in text and '<td class="l">at dump</td>' in page
