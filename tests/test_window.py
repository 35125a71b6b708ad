"""Windows of a trace (--steps, --events, --time-us) and `memdiff slice`: the window's static memory and
peak are those the full trace has there, worked out here by the documented rules
(../shared/docs/snapshot-format.md, "The peak") with a walk of this file's own."""

from __future__ import annotations

import json
import pickle
from typing import Any, Dict, List, Tuple

import pytest
from conftest import alloc, block, free, real_snapshot_names, segment
from test_lifetimes import training

from memdiff.analyse.normalize.engine import summarize
from memdiff.cli import main
from memdiff.read.load import load
from memdiff.read.window import Window, parse_window, windowed


def totals(snap: Dict[str, Any], device: int = 0) -> Tuple[int, List[int]]:
    """(static bytes, the running total after each event, static included) of one device's trace."""
    traces = snap.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    live: Dict[int, int] = {}
    static, deltas = 0, []
    for e in trace:
        change = 0
        if e["action"] == "alloc":
            live[e["addr"]] = change = e["size"]
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                change = -live.pop(e["addr"])
            else:
                static += e["size"]
                change = -e["size"]
        deltas.append(change)
    for seg in snap.get("segments", []):
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for b in seg.get("blocks", []):
            addr = b.get("address", addr)
            if b["state"] == "active_allocated" and addr not in live:
                static += b.get("requested_size", b["size"])
            addr += b["size"]
    out, total = [], static
    for change in deltas:
        total += change
        out.append(total)
    return static, out


def expected_window(snap: Dict[str, Any], a: int, b: int, device: int = 0) -> Tuple[int, int]:
    """(static, peak) of events [a, b): what was live before a, and the highest total in the window."""
    static, running = totals(snap, device)
    before = static if a == 0 else running[a - 1]
    return before, max([before] + running[a:b])


def raw_of(path: str) -> Dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("name", real_snapshot_names())
def test_event_windows_of_real_snapshots_keep_static_and_peak(shared, name):
    snapshot = load(str(shared / name))
    raw = raw_of(str(shared / name))
    raw = raw if isinstance(raw, dict) else {"segments": raw}
    for device in {s["device"] for s in raw.get("segments", [])} | {0}:
        n = len(totals(raw, device)[1])
        for a, b in [(0, n), (n // 3, 2 * n // 3), (n // 2, n), (n - 1, n)]:
            if not 0 <= a < b:
                continue
            got = {d.device: d for d in summarize(windowed(snapshot, Window("events", a, b))).devices}[device]
            assert (got.static_bytes, got.peak_bytes) == expected_window(raw, a, b, device), (device, a, b)
            assert got.trace_events == b - a


def test_a_step_window_carries_in_what_earlier_steps_left_live(write_snapshot):
    snap = training(steps=3, leak=True)
    full = summarize(load(write_snapshot(snap))).devices[0]
    step1 = [s for s in full.steps if s.step == 1][0]
    a, b = step1.start_event, step1.end_event + 1
    got = summarize(windowed(load(write_snapshot(snap)), parse_window("steps", "1"))).devices[0]
    assert (got.static_bytes, got.peak_bytes) == expected_window(snap, a, b)
    assert got.trace_events == b - a
    # The leak's activations from step 0 are live at step 1's start: static memory of the window.
    assert got.static_bytes > totals(snap)[0]


def test_blocks_carried_in_move_off_addresses_the_window_reuses(write_snapshot):
    # 0x1000 opened before the window and never freed, then opened again (the viewer keeps the first
    # open for good): a block at 0x1000 would not count while the window's allocation is open there.
    snap = {"device_traces": [[alloc(0x1000, 100), alloc(0x2000, 7), alloc(0x1000, 50), free(0x2000, 7)]],
            "segments": [segment(0, 0x1000, [block(0x1000, 512), block(0x1200, 512, state="inactive")])]}
    for a in range(4):
        got = summarize(windowed(load(write_snapshot(snap)), Window("events", a, 4))).devices[0]
        assert (got.static_bytes, got.peak_bytes) == expected_window(snap, a, 4), a


@pytest.mark.parametrize("addr", ["0x1000", None, 2.5, True])
def test_allocations_carried_in_at_addresses_that_are_no_integers(write_snapshot, tmp_path, addr):
    # The walk matches a free to its allocation by whatever `addr` holds; a window turns what is
    # live at its start into segments, whose addresses must be integers.
    snap = {"device_traces": [[alloc(addr, 100), alloc(0x2000, 7), free(0x2000, 7), free(addr, 100)]],
            "segments": []}
    path = write_snapshot(snap)
    got = summarize(windowed(load(path), Window("events", 1, 3))).devices[0]
    assert (got.static_bytes, got.peak_bytes) == expected_window(snap, 1, 3) == (100, 107)
    out = str(tmp_path / "small.pickle")
    assert main(["slice", path, "--events", "1:3", "-o", out]) == 0
    assert all(type(seg["address"]) is int for seg in raw_of(out)["segments"])


def test_a_bool_size_is_refused_by_the_full_read_and_the_window_alike(write_snapshot, tmp_path, capsys):
    # A size of True read as a 1 B allocation; both reads now name the entry, one line, exit 2.
    path = write_snapshot({"device_traces": [[{**alloc(0x1000, 100), "size": True}, alloc(0x2000, 7),
                                              free(0x2000, 7)]], "segments": []})
    for args in (["summarize", path], ["slice", path, "--events", "1:3", "-o", str(tmp_path / "small.pickle")]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "device_traces[0][0]: 'size' is bool True, not an integer" in err


@pytest.mark.parametrize("field, value", [("frames", 0), ("frames", "")])
def test_allocations_carried_in_with_values_the_full_read_takes(write_snapshot, tmp_path, capsys, field, value):
    # The full read takes a falsy `frames` as no stack; the window wrote it into its own blocks, then
    # refused what it wrote, blaming fields the file lacks.
    snap = {"device_traces": [[{**alloc(0x1000, 100), field: value}, alloc(0x2000, 7), free(0x2000, 7)]],
            "segments": []}
    path = write_snapshot(snap)
    full = summarize(load(path)).devices[0]
    got = summarize(windowed(load(path), Window("events", 1, 3))).devices[0]
    assert (got.static_bytes, got.peak_bytes) == (full.peak_bytes - 7, full.peak_bytes)
    assert main(["slice", path, "--events", "1:3", "-o", str(tmp_path / "small.pickle")]) == 0, capsys.readouterr().err


def test_slice_writes_a_protocol_4_snapshot_every_command_reads(write_snapshot, tmp_path, capsys):
    src = write_snapshot(training(steps=3, leak=True))
    out = str(tmp_path / "small.pickle")
    assert main(["slice", src, "--steps", "1:3", "-o", out]) == 0
    assert "wrote" in capsys.readouterr().err
    assert open(out, "rb").read(2) == b"\x80\x04"
    assert main(["summarize", out, "-o", str(tmp_path / "s.json")]) == 0
    sliced = json.loads((tmp_path / "s.json").read_text())["devices"][0]
    assert main(["summarize", src, "--steps", "1:3", "-o", str(tmp_path / "w.json")]) == 0
    in_place = json.loads((tmp_path / "w.json").read_text())["devices"][0]
    assert (sliced["static_bytes"], sliced["peak_bytes"]) == (in_place["static_bytes"], in_place["peak_bytes"])
    assert main(["peak", out]) == 0
    assert main([out, out]) == 0
    capsys.readouterr()


def test_diff_of_one_step_of_two_runs(write_snapshot, capsys):
    base = write_snapshot(training(steps=3), "base.pickle")
    head = write_snapshot(training(steps=3, leak=True), "head.pickle")
    assert main([base, head, "--steps", "0", "--format", "json"]) == 0  # step 0 leaks nothing yet
    assert main([base, head, "--steps", "2", "--format", "json"]) == 1  # two steps of activations kept
    capsys.readouterr()


def test_time_windows_cut_by_time_us(shared):
    path = str(shared / "linear-grad.pickle")
    raw = raw_of(path)
    times = [e["time_us"] for e in raw["device_traces"][0]]
    a, b = 5, 20
    got = summarize(windowed(load(path), Window("time_us", times[a], times[b]))).devices[0]
    first = times.index(times[a])
    assert got.trace_events == times.index(times[b]) - first
    assert (got.static_bytes, got.peak_bytes) == expected_window(raw, first, times.index(times[b]))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "9"], "no device has those steps (the trace has steps 0 to 2)"),
    (["--events", "5:2"], "is empty"),
    (["--events", "x"], "is not START:END"),
    (["--steps", "1", "--events", "1:2"], "not allowed with"),
])
def test_bad_windows_are_one_line_exit_2(write_snapshot, tmp_path, capsys, argv, message):
    src = write_snapshot(training(steps=3))
    try:
        code = main(["slice", src, "-o", str(tmp_path / "x.pickle"), *argv])
    except SystemExit as exc:  # usage errors end in argparse
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.pickle").exists()


def test_a_summary_has_no_trace_to_window(write_snapshot, tmp_path, capsys):
    src = write_snapshot(training(steps=2))
    out = str(tmp_path / "s.json")
    assert main(["summarize", src, "-o", out]) == 0
    assert main(["peak", out, "--steps", "0"]) == 2
    assert "keeps no trace" in capsys.readouterr().err


def test_baseline_gate_and_ranks_take_the_window(write_snapshot, tmp_path, capsys):
    src = write_snapshot(training(steps=3, leak=True))
    base = str(tmp_path / "b.json")
    assert main(["baseline", src, "-o", base, "--steps", "0"]) == 0
    assert main(["gate", src, "--baseline", base, "--steps", "0", "--fail-over", "1KiB"]) == 0
    # The leak's two more steps of activations, kept.
    assert main(["gate", src, "--baseline", base, "--steps", "2", "--fail-over", "1KiB"]) == 1
    job = tmp_path / "job"
    job.mkdir()
    for rank in (0, 1):
        (job / f"rank{rank}.pickle").write_bytes(open(src, "rb").read())
    capsys.readouterr()
    assert main(["ranks", str(job), "--steps", "1", "--format", "json"]) == 0
    ranks = json.loads(capsys.readouterr().out)
    one = summarize(windowed(load(src), parse_window("steps", "1"))).devices[0].peak_bytes
    assert ranks["max_bytes"] == ranks["median_bytes"] == one


def test_peak_of_a_window_says_it_is_one(shared, tmp_path, capsys):
    src = str(shared / "cs336-medium-ctx256-train.pickle")
    out = str(tmp_path / "w.pickle")
    assert main(["slice", src, "--events", "6000:12000", "-o", out]) == 0
    assert raw_of(out)["memdiff_window"] == {"window": "--events 6000:12000", "of": "cs336-medium-ctx256-train.pickle"}
    capsys.readouterr()
    for argv in (["peak", out], ["peak", src, "--events", "6000:12000"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "live when the window began" in text and "this is a window of a longer trace" in text
        assert "max_entries" not in text and "at dump" not in text
    assert main(["peak", src]) == 0
    assert "max_entries" in capsys.readouterr().out  # the full trace does start mid-run


def viewer_blocks(raw: Dict[str, Any], device: int) -> List[Tuple[int, int]]:
    """(address, requested bytes) of the active blocks as PyTorch's viewer places them: one after
    another from their segment's address (MemoryViz's annotate_snapshot reads no block address)."""
    out = []
    for seg in raw["segments"]:
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.append((addr, b.get("requested_size", b["size"])))
            addr += b["size"]
    return out


def test_the_viewer_places_carried_blocks_where_memdiff_does(shared, tmp_path):
    out = str(tmp_path / "w.pickle")
    assert main(["slice", str(shared / "cs336-medium-ctx256-train.pickle"), "--events", "6000:12000", "-o", out]) == 0
    raw = raw_of(out)
    by_address = sorted((b["address"], b["requested_size"]) for s in raw["segments"] for b in s["blocks"])
    assert by_address and sorted(viewer_blocks(raw, 0)) == by_address


@pytest.mark.slow
def test_pytorchs_own_snapshot_tools_read_a_slice(torch, shared, tmp_path):
    from torch.cuda import _memory_viz

    out = str(tmp_path / "w.pickle")
    assert main(["slice", str(shared / "cs336-medium-ctx128-train.pickle"), "--events", "2000:9000", "-o", out]) == 0
    raw = raw_of(out)
    assert "7000 entries" in _memory_viz.trace(raw)
    assert f"segments: {len(raw['segments'])}" in _memory_viz.segsum(raw)
    assert "<html" in _memory_viz.trace_plot(raw).lower()


def test_a_window_drops_the_ring_buffer_bookkeeping(write_snapshot, tmp_path):
    snap = training(steps=2)
    snap["allocator_settings"] = {"trace_alloc_overflowed": True, "trace_alloc_max_entries": 100,
                                  "expandable_segments": True}
    out = str(tmp_path / "w.pickle")
    assert main(["slice", write_snapshot(snap), "--steps", "1", "-o", out]) == 0
    assert raw_of(out)["allocator_settings"] == {"expandable_segments": True}


@pytest.mark.parametrize("window, message", [
    (["--events", "99999999:100000000"], "no trace event is inside it (device 0: events 0 to "),
    (["--events", "400:"], "no trace event is inside it (device 0: events 0 to "),
    (["--time-us", "1:2"], "no trace event is inside it (device 0: time_us "),
    (["--time-us", "99999999999999999:"], "no trace event is inside it (device 0: time_us "),
])
def test_a_window_holding_no_event_is_refused_by_every_command(write_snapshot, tmp_path, capsys, window, message):
    snap = training(steps=2)
    for t, e in enumerate(snap["device_traces"][0]):
        e["time_us"] = 1000 + t
    n = len(snap["device_traces"][0])
    assert n < 400
    src = write_snapshot(snap)
    job = tmp_path / "job"
    job.mkdir()
    (job / "rank0.pickle").write_bytes(open(src, "rb").read())
    out = tmp_path / "x"
    base = str(tmp_path / "b.json")
    assert main(["baseline", src, "-o", base]) == 0
    capsys.readouterr()
    commands = [["slice", src, "-o", str(out)], ["peak", src], ["summarize", src, "-o", str(out)],
                ["diff", src, src], [src, src], ["baseline", src, "-o", str(out)],
                ["gate", src, "--baseline", base], ["ranks", str(job)], ["forecast", f"{src}=1", f"{src}=2"]]
    for argv in commands:
        assert main([*argv, *window]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not out.exists(), argv
    capsys.readouterr()
    # The first and last events still are the trace's.
    assert main(["peak", src, "--events", f"{n - 1}:{n + 5}"]) == 0
    assert main(["peak", src, "--time-us", f":{1001}"]) == 0
    capsys.readouterr()


def moments_and_windows(d: Any) -> List[Tuple[int, int, Dict[str, int], List[Any], List[Tuple[int, int]]]]:
    """(event, bytes, categories, groups, windows holding it) for the full trace's peak and each phase's
    peak, as the full trace's own summary gives them (no window involved): the phase run and the step
    around each, whose highest event it is when the run is its phase's highest."""
    runs = [(s, r) for s in d.steps for r in s.phases]
    out = []
    moments = [(d.peak_event_index, d.peak_bytes, d.categories, d.groups)]
    moments += [(p.peak_event_index, p.peak_bytes, p.categories, p.groups or d.groups) for p in d.phase_peaks]
    for event, peak, categories, groups in moments:
        if event is None:  # the peak is the memory live before the trace: the whole trace is its window
            out.append((-1, peak, categories, groups, [(0, d.trace_events)] if d.trace_events else []))
            continue
        windows = [(r.start_event, r.end_event + 1) for _, r in runs if r.start_event <= event <= r.end_event]
        windows += [(s.start_event, s.end_event + 1) for s, _ in runs if s.start_event <= event <= s.end_event]
        windows += [(max(0, event - 700), event + 1), (event, event + 1)]
        out.append((event, peak, categories, groups, sorted(set(windows))))
    return out


def groups_of(groups: List[Any]) -> List[Tuple[str, str, int, int]]:
    return sorted((g.category, g.site, g.count, g.bytes) for g in groups)


def assert_window_moments_are_the_full_traces(path: str) -> int:
    """Every window around a moment of the full trace whose own peak is that event has its bytes,
    categories and groups: memory carried in keeps the category the full trace gives it. Returns how
    many windows were compared."""
    from memdiff.analyse.classify import load_rules
    from memdiff.read.inputs import read_summary

    rules = load_rules()
    full = read_summary(path, rules)
    compared = 0
    for d in full.devices:
        for event, peak, categories, groups, windows in moments_and_windows(d):
            for a, b in windows:
                got = {x.device: x for x in read_summary(path, rules, history=True,
                                                         window=Window("events", a, b)).devices}
                w = got[d.device]
                if (-1 if w.peak_event_index is None else a + w.peak_event_index) != event:
                    continue  # the window's own peak is another event
                assert (w.peak_bytes, w.categories) == (peak, categories), (path, d.device, event, a, b)
                assert groups_of(w.groups) == groups_of(groups), (path, d.device, event, a, b)
                # Its history, drawn from every allocation, says the same at the peak.
                h = w.history
                if h is not None and h.totals:
                    k = h.totals.index(w.peak_bytes)
                    assert {c: v[k] for c, v in h.categories.items() if v[k]} == {c: n for c, n in categories.items()
                                                                                   if n}, (path, event, a, b)
                compared += 1
    return compared


@pytest.mark.parametrize("name", real_snapshot_names())
def test_a_window_keeps_the_full_traces_categories_at_its_peak(shared, name, tmp_path, capsys):
    raw = raw_of(str(shared / name))
    if not isinstance(raw, dict) or not any(raw.get("device_traces", [])):
        # Nothing to cut: a window of it is refused in one line rather than made up.
        assert main(["slice", str(shared / name), "--events", "0:1", "-o", str(tmp_path / "w.pickle")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no trace events to cut" in err, err
        assert not (tmp_path / "w.pickle").exists()
        return
    assert assert_window_moments_are_the_full_traces(str(shared / name)) > 0


def test_a_slice_keeps_the_full_traces_categories(shared, tmp_path, capsys):
    src = str(shared / "cs336-medium-ctx128-train.pickle")
    out = str(tmp_path / "w.pickle")
    assert main(["slice", src, "--events", "9000:11000", "-o", out]) == 0
    capsys.readouterr()
    for argv in (["peak", out, "--format", "json"], ["peak", src, "--events", "9000:11000", "--format", "json"]):
        assert main(argv) == 0
        w = json.loads(capsys.readouterr().out)["devices"][0]
        assert main(["peak", src, "--events", f"{9000 + w['peak_event_index']}:{9000 + w['peak_event_index'] + 1}",
                     "--format", "json"]) == 0
        at = json.loads(capsys.readouterr().out)["devices"][0]
        assert w["categories"] == at["categories"] and w["peak_bytes"] == at["peak_bytes"]


def assert_cpu_windows_keep_pytorchs_categories(path: str) -> None:
    """On a CPU capture: the full trace's moments again, and at each window's peak the parameters,
    gradients and optimizer state that PyTorch's own `category` (its arguable labels read as
    docs/categories.md documents them) says are live at that event of the full trace (the
    weights' in-place updates are frees and new versions: a window alone read them as memory freed)."""
    from scenario_suite import pytorch_categories_at

    from memdiff.analyse.classify import load_rules
    from memdiff.read.inputs import read_summary
    from memdiff.read.load import decode

    assert assert_window_moments_are_the_full_traces(path) > 0
    trace = decode(path)[0]["device_traces"][-1]
    full = read_summary(path, load_rules()).devices[0]
    assert len(full.steps) >= 2
    n = full.trace_events
    starts = [(s.start_event, parse_window("steps", str(s.step))) for s in full.steps[1:]]
    starts += [(a, Window("events", a, b)) for a, b in [(n // 3, 2 * n // 3), (n // 2, n), (n // 4, n // 4 + 500)]]
    for a, window in starts:
        w = read_summary(path, load_rules(), window=window).devices[0]
        assert w.peak_event_index is not None
        theirs = pytorch_categories_at(trace, a + w.peak_event_index, documented=True)
        for category in ("parameter", "optimizer_state", "gradient"):
            assert w.categories.get(category, 0) == theirs.get(category, 0), (window, category, w.categories, theirs)
        assert theirs["parameter"] > 0


@pytest.mark.slow
def test_windows_of_a_cpu_capture_keep_pytorchs_categories(scenarios):
    assert_cpu_windows_keep_pytorchs_categories(str(scenarios("gpt2-base")["gpt2-base"]))


def test_a_slice_of_a_slice_keeps_the_full_traces_kinds(shared, tmp_path, capsys):
    src = str(shared / "cs336-medium-ctx128-train.pickle")
    once, twice = str(tmp_path / "once.pickle"), str(tmp_path / "twice.pickle")
    assert main(["slice", src, "--events", "8000:12000", "-o", once]) == 0
    assert main(["slice", once, "--events", "1000:3000", "-o", twice]) == 0
    capsys.readouterr()
    for argv in (["peak", twice, "--format", "json"], ["peak", src, "--events", "9000:11000", "--format", "json"]):
        assert main(argv) == 0
        got = json.loads(capsys.readouterr().out)["devices"][0]
        assert got["categories"]["parameter"] > 0
        if argv[1] == twice:
            first = got
    assert (first["peak_bytes"], first["static_bytes"], first["categories"]) == (
        got["peak_bytes"], got["static_bytes"], got["categories"])


@pytest.mark.parametrize("kind", ["not a dict", {"freed": "yes"}, {"frames": None, "freed": False,
                                                                   "before_trace": True, "guess": "weights",
                                                                   "update": False, "lifetime": "x"}])
def test_a_tampered_kind_in_a_slice_is_one_line_exit_2(write_snapshot, tmp_path, capsys, kind):
    out = str(tmp_path / "w.pickle")
    assert main(["slice", write_snapshot(training(steps=3)), "--steps", "1", "-o", out]) == 0
    raw = raw_of(out)
    block = next(b for s in raw["segments"] for b in s["blocks"])
    block["memdiff_kind"] = kind
    bad = write_snapshot(raw, "bad.pickle")
    capsys.readouterr()
    assert main(["peak", bad]) == 2
    err = capsys.readouterr().err
    assert "memdiff_kind" in err and len(err.strip().splitlines()) == 1
    # Outside a window the key is nobody's: it is not read.
    del raw["memdiff_window"]
    assert main(["peak", write_snapshot(raw, "plain.pickle")]) == 0
    capsys.readouterr()
