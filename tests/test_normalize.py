"""The peak rules on small hand-built snapshots whose answers are worked out by hand."""

from __future__ import annotations

import pytest
from conftest import alloc, block, free, py_frames, segment

from memdiff.analyse.normalize.engine import summarize
from memdiff.read.load import load

FWD = py_frames("model.py:10:forward", "train.py:50:<module>")
BWD = py_frames("model.py:20:backward_hook", "train.py:51:<module>")
OPT = py_frames("/venv/lib/python3.12/site-packages/torch/optim/adam.py:99:_init_group",
                "/venv/lib/python3.12/site-packages/torch/optim/adam.py:200:step", "train.py:52:<module>")


def summary_of(write_snapshot, snap):
    return summarize(load(write_snapshot(snap)))


def by_site(device):
    return {g.site: (g.count, g.bytes) for g in device.groups}


def test_simple_trace_peak_and_groups(write_snapshot):
    # 100 + 200 live, then 100 freed, then 50: running 100, 300, 200, 250 -> peak 300 at event 1.
    trace = [alloc(1, 100, FWD), alloc(2, 200, BWD), free(1, 100), alloc(3, 50, FWD)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert (d.static_bytes, d.peak_bytes, d.peak_event_index) == (0, 300, 1)
    assert by_site(d) == {"model.py:forward": (1, 100), "model.py:backward_hook": (1, 200)}
    assert sum(g.bytes for g in d.groups) == d.peak_bytes
    assert d.groups[0].site == "model.py:backward_hook"  # largest first


def test_ring_buffer_truncation_counts_unmatched_frees_from_the_start(write_snapshot):
    # Address 9 was allocated before the trace: its free says 1000 bytes were live from the start.
    trace = [alloc(1, 300, FWD), free(9, 1000, OPT), alloc(2, 500, FWD)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    # running: 1000, 1300, 300, 800 -> peak 1300 at event 0
    assert (d.static_bytes, d.peak_bytes, d.peak_event_index) == (1000, 1300, 0)
    assert (d.unmatched_free_count, d.unmatched_free_bytes) == (1, 1000)
    sites = by_site(d)
    assert sites["freed at adam.py:_init_group"] == (1, 1000)
    assert sites["model.py:forward"] == (1, 300)


def test_address_reuse_matches_the_latest_allocation(write_snapshot):
    trace = [alloc(1, 100, FWD), free(1, 100), alloc(1, 400, BWD), alloc(2, 10, FWD)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert (d.static_bytes, d.peak_bytes, d.peak_event_index) == (0, 410, 3)
    assert by_site(d) == {"model.py:backward_hook": (1, 400), "model.py:forward": (1, 10)}


def test_free_requested_without_free_completed_stays_live(write_snapshot):
    # Another stream still uses the block: only free_completed ends it.
    trace = [alloc(1, 100, FWD), free(1, 100, completed=False), alloc(2, 100, FWD)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert (d.peak_bytes, d.peak_event_index) == (200, 2)
    assert by_site(d) == {"model.py:forward": (2, 200)}


def test_blocks_live_at_dump_without_trace_allocation_are_static(write_snapshot):
    trace = [alloc(0x1000, 64, FWD), free(0x1000, 64), alloc(0x2000, 32, FWD)]
    segs = [segment(0, 0x1000, [block(0x1000, 64, "inactive"), block(0x1040, 512, frames=OPT)]),
            segment(0, 0x2000, [block(0x2000, 32), block(0x2020, 8, "active_pending_free")])]
    d = summary_of(write_snapshot, {"segments": segs, "device_traces": [trace]}).devices[0]
    # static: the 512-byte block (0x2000 is open after the walk, pending-free is not added)
    assert d.static_bytes == 512
    assert (d.peak_bytes, d.peak_event_index) == (576, 0)
    assert by_site(d) == {"adam.py:_init_group": (1, 512), "model.py:forward": (1, 64)}
    assert d.reserved_bytes_at_dump == 64 + 512 + 32 + 8
    assert d.allocated_bytes_at_dump == 512 + 32


def test_static_blocks_without_frames_get_their_own_group(write_snapshot):
    segs = [segment(0, 0, [block(0, 1 << 20), block(1 << 20, 1 << 10)])]
    d = summary_of(write_snapshot, {"segments": segs, "device_traces": [[]]}).devices[0]
    assert (d.static_bytes, d.peak_bytes, d.peak_event_index) == ((1 << 20) + (1 << 10),) * 2 + (None,)
    # Nothing in the trace says what they are: their category (parameter) is a guess, and the site says so.
    assert by_site(d) == {"<no stack: live before the trace, category guessed>": (2, (1 << 20) + (1 << 10))}


def test_allocations_without_stack_are_grouped_apart_from_static_ones(write_snapshot):
    trace = [alloc(1, 10), free(7, 5)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert by_site(d) == {"<no stack>": (1, 10), "<no stack: live before the trace>": (1, 5)}


def test_oom_entries_are_reported_and_do_not_change_the_total(write_snapshot):
    trace = [alloc(1, 100, FWD, time_us=1_000),
             {"action": "oom", "size": 4096, "device_free": 1024, "stream": 0, "time_us": 2_000}]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert d.peak_bytes == 100
    assert [(o.event_index, o.requested_bytes, o.device_free_bytes, o.time_us) for o in d.oom_events] == [
        (1, 4096, 1024, 2_000)]


def test_empty_trace_has_no_peak_event(write_snapshot):
    d = summary_of(write_snapshot, {"segments": [segment(0, 0, [block(0, 256)])], "device_traces": [[]]}).devices[0]
    assert (d.trace_events, d.static_bytes, d.peak_bytes, d.peak_event_index, d.peak_time_us) == (0, 256, 256, None, None)
    assert d.timeline == []


def test_several_devices_are_summarized_separately(write_snapshot):
    traces = [[alloc(1, 100, FWD)], [], [alloc(1, 300, BWD), free(1, 300), alloc(2, 50, FWD)], []]
    s = summary_of(write_snapshot, {"segments": [segment(1, 0, [block(0, 7)])], "device_traces": traces})
    assert [(d.device, d.peak_bytes, d.static_bytes) for d in s.devices] == [(0, 100, 0), (1, 7, 7), (2, 300, 0)]


def test_legacy_blocks_follow_each_other_from_the_segment_address(write_snapshot):
    # torch 2.0: no block address, the stack in history; one `snapshot` event in the trace.
    hist = [{"addr": 0, "real_size": 100, "frames": FWD}]
    blocks = [block(None, 100, history=hist, frames=None), block(None, 50, "inactive"),
              block(None, 200, history=[{"addr": 150, "real_size": 200, "frames": OPT}], frames=None)]
    for b in blocks:
        b.pop("frames")
    trace = [{"action": "snapshot", "addr": 0, "size": 300, "stream": 0}]
    s = summary_of(write_snapshot, {"segments": [segment(0, 0, blocks)], "device_traces": [trace]})
    d = s.devices[0]
    assert s.source.generation == "legacy-history"
    assert (d.static_bytes, d.peak_bytes) == (300, 300)
    assert by_site(d) == {"adam.py:_init_group": (1, 200), "model.py:forward": (1, 100)}


def test_bare_segment_list_uses_the_segments_devices(write_snapshot):
    s = summary_of(write_snapshot, [segment(1, 0, [block(0, 64, frames=FWD), block(64, 64, "inactive")])])
    assert s.source.generation == "segments-list"
    assert [(d.device, d.peak_bytes) for d in s.devices] == [(1, 64)]


def test_profiler_frames_are_parsed_into_file_line_and_function(write_snapshot):
    frames = [{"filename": "none", "line": 0, "name": "<built-in method zeros_like of type object at 0x7f6b19acea40>"},
              {"filename": "none", "line": 0, "name": "torch/optim/adam.py(139): _init_group"},
              {"filename": "none", "line": 0, "name": "nn.Module: Linear_0"},
              {"filename": "none", "line": 0, "name": "train.py(7): <module>"}]
    s = summary_of(write_snapshot, {"segments": [], "device_traces": [[alloc(1, 32, frames, category="optimizer_state")]]})
    g = s.devices[0].groups[0]
    assert s.source.generation == "profiler"
    assert g.site == "adam.py:_init_group <- zeros_like"
    assert [(f.file, f.line, f.name) for f in g.frames] == [
        ("", 0, "<built-in method zeros_like of type object at 0x…>"),
        ("torch/optim/adam.py", 139, "_init_group"),
        ("", 0, "nn.Module: Linear_0"),
        ("train.py", 7, "<module>")]


def test_peak_time_and_trace_span_come_from_time_us(write_snapshot):
    trace = [alloc(1, 10, FWD, time_us=5), alloc(2, 10, FWD, time_us=9), free(2, 10, time_us=12)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert (d.peak_event_index, d.peak_time_us, d.trace_start_time_us, d.trace_end_time_us) == (1, 9, 5, 12)


def test_a_reused_open_address_keeps_the_older_allocation_live(write_snapshot):
    # Two allocs at one address without a free between them: the viewer keeps the first live.
    trace = [alloc(1, 100, FWD), alloc(1, 40, BWD), free(1, 40)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert (d.peak_bytes, d.peak_event_index) == (140, 1)
    assert by_site(d) == {"model.py:forward": (1, 100), "model.py:backward_hook": (1, 40)}


def test_timeline_is_downsampled_and_keeps_the_peak(write_snapshot):
    trace = []
    for i in range(1000):
        trace += [alloc(i, 10 + (i == 637) * 10_000, FWD), free(i, 10 + (i == 637) * 10_000)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert len(d.timeline) == 100
    assert [d.peak_event_index, d.peak_bytes] in d.timeline
    assert max(v for _, v in d.timeline) == d.peak_bytes == 10_010


@pytest.mark.parametrize("bad, message", [
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": "12"}]]},
     "device_traces[0][0]: 'size' is str '12', not an integer"),
    ({"segments": [], "device_traces": [[alloc(1, 5), {"action": "alloc", "size": 3}]]},
     "device_traces[0][1]: missing 'addr'"),
    ({"segments": [], "device_traces": [[alloc(1, 5, [{"filename": 3, "line": 1, "name": "f"}])]]},
     "a frame has wrong types"),
    # An entry's TypeError is said in the file's words (it was an UnboundLocalError, found by
    # mypy, then Python's `unhashable type: 'list'`).
    ({"segments": [], "device_traces": [[{"action": "alloc", "addr": [], "size": 5}]]},
     "device_traces[0][0].addr: list of 0 items is not an address"),
    ({"segments": [], "device_traces": [[alloc(1, 5), ["alloc", 2, 5]]]},
     "device_traces[0][1]: list of 3 items, not a dict"),
    # A stack is found where it is, a segment's block too, under the later entries that are fine.
    ({"segments": [{"device": 0, "address": 0, "total_size": 512, "stream": 0, "segment_type": "small",
                    "blocks": [{"size": 512, "requested_size": 100, "state": "active_allocated", "frames": 3}]}],
      "device_traces": [[alloc(1000, 5)]]},
     "segments[0].blocks[0]: 'frames' is int 3, not a list"),
])
def test_malformed_trace_entries_name_the_entry(write_snapshot, bad, message):
    from memdiff.errors import InputError
    with pytest.raises(InputError) as err:
        summary_of(write_snapshot, bad)
    assert message in err.value.message


def test_frames_are_normalized_once_per_distinct_frames_list(write_snapshot, monkeypatch):
    # Real snapshots share frames lists between events (pickle memo references): the normalizer
    # must work once per distinct list, not once per event.
    import memdiff.read.frames

    calls = []
    real_site = memdiff.read.frames._site
    monkeypatch.setattr(memdiff.read.frames, "_site", lambda kept: calls.append(1) or real_site(kept))
    shared_fwd, shared_bwd = list(FWD), list(BWD)
    trace = [alloc(i, 10, shared_fwd) for i in range(500)] + [alloc(1000 + i, 20, shared_bwd) for i in range(500)]
    d = summary_of(write_snapshot, {"segments": [], "device_traces": [trace]}).devices[0]
    assert by_site(d) == {"model.py:backward_hook": (500, 10_000), "model.py:forward": (500, 5_000)}
    assert len(calls) == 2


def test_user_labels_and_annotations_are_shown_and_change_no_count(write_snapshot, capsys):
    # torch 2.10+ writes `user_metadata` on trace entries (_set_memory_metadata), 2.14+ `annotate`
    # entries (_annotate_tensor): a label attached to a live allocation, never an allocation.
    from memdiff.cli import main

    def trace(annotated: bool):
        entries = [alloc(4096, 1024, user_metadata="comm-buffers"),
                   alloc(8192, 2048, user_metadata=""),
                   alloc(12288, 512, user_metadata={"pool": 1})]
        if annotated:
            entries += [{"action": "annotate", "addr": 4096, "size": 1024, "stream": 0,
                         "user_metadata": "saved for backward"},
                        {"action": "annotate", "addr": 99, "size": 0, "stream": 0, "user_metadata": "x" * 10**6}]
        entries += [alloc(16384, 256), free(16384, 256)]
        if annotated:  # after the peak: not shown at it
            entries.append({"action": "annotate", "addr": 8192, "size": 2048, "stream": 0, "user_metadata": "late"})
        return {"segments": [], "device_traces": [entries]}

    plain = summarize(load(write_snapshot(trace(False), "plain.pickle"))).devices[0]
    labelled = summarize(load(write_snapshot(trace(True), "labelled.pickle"))).devices[0]
    for key in ("peak_bytes", "static_bytes", "unmatched_free_count", "allocated_bytes_at_dump"):
        assert getattr(labelled, key) == getattr(plain, key)
    assert [(g.count, g.bytes) for g in labelled.groups] == [(g.count, g.bytes) for g in plain.groups]
    # The empty label is none; one that is not a string is described, not trusted; one after the
    # peak is not shown at it.
    assert labelled.bytes_by_label == {"comm-buffers + saved for backward": 1024, "dict of 1 item": 512}
    assert main(["peak", write_snapshot(trace(True), "labelled.pickle")]) == 0
    out = capsys.readouterr().out
    assert "label (user_metadata, annotations)" in out and "comm-buffers + saved for backward" in out


def prof(*names):
    return [{"filename": "none", "line": 0, "name": n} for n in names]


def test_a_free_the_profiler_missed_does_not_count_blocks_twice(write_snapshot):
    """Profiler route: a free made on another thread is not seen (gloo's), so two open allocations'
    ranges overlap; torch's converter lays its blocks (no addresses) out one after another, and
    from there the places differ from the trace's addresses. The trace's own running total is the
    truth: blocks it holds open are not also older than it."""
    f = prof("<built-in method empty of type object at 0x7f>", "train.py(10): main")
    trace = [alloc(0x1000, 4096, f), alloc(0x1800, 4096, f), alloc(0x3000, 1000, f), free(0x3000, 1000, f)]
    blocks = [{"size": 4096, "state": "active_allocated"}, {"size": 4096, "state": "active_allocated"}]
    d = summary_of(write_snapshot, {"segments": [segment(0, 0x1000, blocks)], "device_traces": [trace]}).devices[0]
    assert (d.static_bytes, d.peak_bytes) == (0, 4096 + 4096 + 1000)


def test_the_fsdp2_rank_ci_misread_reads_as_its_own_trace():
    """The rank of tests/scenarios/fsdp_train.py --no-reshard whose capture (CI, 2026-11-26) read
    24 MiB of its blocks as older than the trace: its peak is its trace's own running maximum,
    and its parameters are its shard of the model's (4 blocks of Linear(512, 1024) and
    Linear(1024, 512) over 2 ranks)."""
    import gzip
    import pickle
    from pathlib import Path

    path = Path(__file__).parent / "data" / "cpu" / "fsdp2-missed-free-rank1.pickle.gz"
    with gzip.open(path) as f:
        trace = pickle.load(f)["device_traces"][-1]
    live, running, peak = {}, 0, 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            running += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            running -= live.pop(e["addr"])
        peak = max(peak, running)
    from memdiff.analyse.classify import load_rules
    from memdiff.read.inputs import read_summary

    d = read_summary(str(path), load_rules()).devices[0]
    assert (d.static_bytes, d.peak_bytes) == (0, peak)
    weights = 4 * (512 * 1024 * 2 + 1024 + 512) * 4
    assert sum(g.bytes for g in d.groups if g.category == "parameter") == weights // 2
