"""End to end on the real snapshots in ../shared: the numbers PyTorch's viewer shows, exactly."""

from __future__ import annotations

import json

import pytest
from conftest import real_snapshot_names

from memdiff.analyse.normalize.engine import summarize
from memdiff.cli import main
from memdiff.model import Summary
from memdiff.read.load import load
from memdiff.read.schema import validate


@pytest.fixture(scope="module")
def summaries(shared):
    return {name: summarize(load(str(shared / name))) for name in real_snapshot_names()}


@pytest.mark.parametrize("name", real_snapshot_names())
def test_peak_and_static_match_expected(summaries, expected, name):
    got = {str(d.device): {"peak_bytes": d.peak_bytes, "static_bytes": d.static_bytes,
                           "trace_events": d.trace_events} for d in summaries[name].devices}
    assert got == expected[name]


@pytest.mark.parametrize("name", real_snapshot_names())
def test_groups_add_up_to_the_peak_and_the_summary_is_valid(summaries, name):
    s = summaries[name]
    for d in s.devices:
        assert sum(g.bytes for g in d.groups) == d.peak_bytes
        assert len({g.signature for g in d.groups}) == len(d.groups)
        assert [g.bytes for g in d.groups] == sorted((g.bytes for g in d.groups), reverse=True)
    data = json.loads(json.dumps(s.to_dict()))
    validate(name, data, "summary")
    assert Summary.from_dict(data) == s


def test_summaries_stay_small(summaries):
    # The summary is what CI keeps instead of the pickle: a few tens of KB at most.
    sizes = {name: len(json.dumps(s.to_dict())) for name, s in summaries.items()}
    assert max(sizes.values()) < 100_000, sizes


def test_the_windows_snapshot_reads_like_a_linux_one(summaries):
    files = {f.file for d in summaries["cs336-windows.pickle"].devices for g in d.groups for f in g.frames}
    assert "cs336-basics/cs336_basics/model.py" in files
    assert not any("\\" in f or ":" in f for f in files)


def test_truncated_training_trace_counts_the_ring_buffer_loss(summaries):
    d = summaries["cs336-medium-ctx256-train.pickle"].devices[0]
    # The analyzer that ignores unmatched frees reports 6.48 GiB here; the viewer's rules give 8.48 GiB.
    assert round(d.peak_bytes / 2**30, 2) == 8.48
    assert d.unmatched_free_count > 0 and d.unmatched_free_bytes > 2**30


def test_peak_command_on_a_real_snapshot(shared, capsys):
    code = main(["peak", str(shared / "cs336-medium-ctx128-train.pickle"), "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "6.53 GiB" in out and "7,013,335,044 B" in out  # the peak, both ways
    assert "at event 9,966 of 19,136" in out
    assert "static      4.75 GiB" in out
    assert "the trace starts mid-run: 438 frees" in out
    assert "AccumulateGrad <- new_empty_strided" in out
    # the two cuBLAS workspaces older than the trace are a group of their own (8,519,680 B each)
    assert "10 other groups" in out and "13 groups live at the peak" in out


def test_peak_device_option(shared, capsys):
    path = str(shared / "diffusion-segments-list.pickle")
    assert main(["peak", path, "--device", "1"]) == 0
    assert "device 1" in capsys.readouterr().out
    assert main(["peak", path, "--device", "0"]) == 2
    assert capsys.readouterr().err == f"memdiff: {path}: no device 0 in this snapshot (devices: 1)\n"
