"""The history: memory over a whole trace by category, downsampled without losing a peak."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import real_snapshot_names
from test_lifetimes import training

from memdiff.analyse.classify import load_rules
from memdiff.analyse.history import window_maxima
from memdiff.model import Summary
from memdiff.read.inputs import read_summary
from memdiff.read.schema import validate


def test_a_windows_maximum_survives_downsampling():
    totals = np.zeros(10_000, dtype=np.int64)
    totals[4_321] = 7  # one spike, far from any window edge
    totals[9_999] = 3
    points = window_maxima(totals, 100)
    assert len(points) == 100
    assert 4_321 in points and 9_999 in points
    assert totals[points].max() == 7
    assert list(points) == sorted(points)


def test_short_traces_keep_every_event():
    assert window_maxima(np.array([3, 1, 2]), 100).tolist() == [0, 1, 2]
    assert window_maxima(np.zeros(0, dtype=np.int64), 100).tolist() == []


def test_ties_keep_the_first_event_as_the_peak_does():
    assert window_maxima(np.array([5, 5, 1, 1]), 2).tolist() == [0, 2]


def _history(write_snapshot, snap, **kw):
    return read_summary(write_snapshot(snap), load_rules(), history=True, **kw).devices[0]


def test_categories_add_up_to_the_total_at_every_point(write_snapshot):
    d = _history(write_snapshot, training(steps=2))
    h = d.history
    assert len(h.events) == len(h.totals) == d.trace_events  # a short trace: every event is a point
    for k in range(len(h.events)):
        assert sum(v[k] for v in h.categories.values()) == h.totals[k]
    k = h.totals.index(d.peak_bytes)
    assert h.events[k] == d.peak_event_index
    assert {c: v[k] for c, v in h.categories.items() if v[k]} == {c: b for c, b in d.categories.items() if b}


def test_each_allocation_gets_its_groups_category_over_the_whole_trace(write_snapshot):
    d = _history(write_snapshot, training(steps=2))
    h = d.history
    # The parameter (live before the trace, re-versioned by every update) is a parameter at every
    # point but the one between an update's free and its new version's alloc (as the peak rules
    # count it), and the three 100,000-byte activations of a step are activations while they live.
    assert [b for b in h.categories["parameter"] if b != 4096] == [0, 0]
    assert max(h.categories["activation"]) == 300_004  # and the 4-byte loss
    assert h.categories["activation"][0] == 0
    assert max(h.categories["optimizer_state"]) == 8192


def test_a_leak_shows_as_activations_that_never_fall(write_snapshot):
    h = _history(write_snapshot, training(steps=3, leak=True)).history
    assert h.categories["activation"][-1] == 900_000  # three steps of activations held by the loop


def test_bars_are_allocations_live_at_the_peak_in_its_groups(write_snapshot):
    d = _history(write_snapshot, training(steps=2))
    signatures = {g.signature for g in d.groups}
    assert d.history.bars and {b.signature for b in d.history.bars} <= signatures
    for b in d.history.bars:
        assert b.start_event <= d.peak_event_index < b.end_event
    assert sum(b.bytes for b in d.history.bars) <= d.peak_bytes


def test_a_history_round_trips_through_the_summary_json(write_snapshot):
    summary = read_summary(write_snapshot(training(steps=2)), load_rules(), history=True)
    data = validate("summary", summary.to_dict(), "summary")
    assert Summary.from_dict(data).devices[0].history == summary.devices[0].history


def test_without_asking_there_is_no_history(write_snapshot):
    assert read_summary(write_snapshot(training(steps=2)), load_rules()).devices[0].history is None


@pytest.mark.parametrize("name", real_snapshot_names())
def test_real_snapshots_history_at_the_peak_is_the_summarys(shared, name):
    summary = read_summary(str(shared / name), load_rules(), history=True)
    for d in summary.devices:
        h = d.history
        if not h.totals:
            continue
        assert max(h.totals) == d.peak_bytes
        k = h.totals.index(d.peak_bytes)
        assert {c: v[k] for c, v in h.categories.items() if v[k]} == {c: b for c, b in d.categories.items() if b}
        assert len(h.events) <= 800
