"""The optional compiled reader (memdiff/read/_fastread.c) against the pure path: the same document,
the same summaries to the byte, the same refusals.

CI builds the accelerator (MEMDIFF_REQUIRE_ACCEL=1 makes its absence a failure) and runs the
fast tests a second time under MEMDIFF_PURE=1, so every other test covers both paths too.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest
from conftest import alloc, block, free, py_frames, real_snapshot_names, segment

from memdiff.cli import main
from memdiff.errors import InputError
from memdiff.read import accel
from memdiff.read.load import decode

if accel.reader() is None:
    reason = "the accelerator is not built (pip install -e . with a C compiler) or MEMDIFF_PURE is set"
    if os.environ.get("MEMDIFF_REQUIRE_ACCEL") == "1" and not os.environ.get("MEMDIFF_PURE"):
        raise RuntimeError(reason + "; MEMDIFF_REQUIRE_ACCEL=1 needs it")
    pytest.skip(reason, allow_module_level=True)


def summary_json(capsys, monkeypatch, path: str, pure: bool, extra: tuple = ()) -> str:
    if pure:
        monkeypatch.setenv("MEMDIFF_PURE", "1")
    else:
        monkeypatch.delenv("MEMDIFF_PURE", raising=False)
    code = main(["summarize", path, "--format", "json", *extra])
    out, err = capsys.readouterr()
    return f"{code}\n{out}\n{err}"


def both(capsys, monkeypatch, path: str) -> str:
    fast = summary_json(capsys, monkeypatch, path, pure=False)
    assert fast == summary_json(capsys, monkeypatch, path, pure=True)
    return fast


def write(tmp_path: Path, obj, protocol: int = 4, name: str = "s.pickle") -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return str(path)


def training_like() -> dict:
    """Two devices, shared frames lists (memo references), every key PyTorch writes."""
    fwd, bwd = py_frames("model.py:20:forward", "train.py:9:step"), py_frames("train.py:11:step")
    trace0 = []
    for k in range(300):
        addr = 0x7F0000000000 + (k % 40) * 4096
        trace0 += [alloc(addr, 1024 + k, fwd, time_us=10 * k, compile_context="", user_metadata=""),
                   free(addr, 1024 + k, bwd, time_us=10 * k + 5)]
    trace1 = [alloc(0x7E0000000000, 512, fwd), {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0,
                                                 "device_free": 7, "frames": []}]
    return {"segments": [segment(0, 0x7D0000000000, [block(0x7D0000000000, 2 << 20)]),
                         segment(1, 0x7C0000000000, [block(0x7C0000000000, 4096)])],
            "device_traces": [trace0, trace1], "allocator_settings": {"max_split_size": -1}}


@pytest.mark.parametrize("name", real_snapshot_names())
def test_every_real_snapshot_summarizes_the_same_on_both_paths(capsys, monkeypatch, shared, name):
    out = both(capsys, monkeypatch, str(shared / name))
    assert out.startswith("0\n")


@pytest.mark.parametrize("name", ["bert-4gpu.pickle", "tinyllama-lora-fwdbwd.pickle", "cs336-medium-ctx128-train.pickle"])
def test_a_window_of_a_real_snapshot_summarizes_the_same_on_both_paths(capsys, monkeypatch, shared, name):
    # CI's second run under MEMDIFF_PURE=1 leaves out tests/test_window.py (minutes of the same
    # window code on lists of dicts): a window cut from the columns and from the dicts is held here.
    fast = summary_json(capsys, monkeypatch, str(shared / name), pure=False, extra=("--events", "1000:5000"))
    assert fast.startswith("0\n")
    assert fast == summary_json(capsys, monkeypatch, str(shared / name), pure=True, extra=("--events", "1000:5000"))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_protocol_decodes_to_the_same_entries(tmp_path, protocol):
    snapshot = training_like()
    path = write(tmp_path, snapshot, protocol)
    columns, pure = decode(path, columns=True)[0], decode(path)[0]
    traces = columns["device_traces"]
    assert all(isinstance(t, accel._fastread.Trace) for t in traces)  # the accelerator read it
    assert [list(t) for t in traces] == pure["device_traces"] == snapshot["device_traces"]
    assert {k: v for k, v in columns.items() if k != "device_traces"} == {
        k: v for k, v in pure.items() if k != "device_traces"}
    # Keys keep their order; shared frames lists stay one object, as the unpickler makes them.
    assert list(traces[0][0]) == list(snapshot["device_traces"][0][0])
    assert traces[0][0]["frames"] is traces[0][2]["frames"]


def test_columns_read_as_a_list_of_dicts(tmp_path):
    snapshot = training_like()
    trace = decode(write(tmp_path, snapshot), columns=True)[0]["device_traces"][0]
    plain = snapshot["device_traces"][0]
    assert len(trace) == len(plain) and trace == plain
    assert trace[-1] == plain[-1] and trace[5:11:2] == plain[5:11:2] and trace[::-1] == plain[::-1]
    assert trace.values("time_us") == [e.get("time_us") for e in plain]
    with pytest.raises(IndexError):
        trace[len(plain)]


def test_entries_outside_the_columns_are_kept_whole(tmp_path):
    odd = [alloc(0x1000, 64, [], time_us=1, user_metadata={"tag": [1, 2]}),  # a value of another type
           alloc(0x2000, 2**70, []),  # beyond int64
           {"size": 8, "addr": 0x3000, "action": "alloc", "extra": None},  # another key, another order
           alloc(0x4000, 16.5, [])]  # a float size: the pure path names it
    path = write(tmp_path, {"segments": [], "device_traces": [odd]})
    assert list(decode(path, columns=True)[0]["device_traces"][0]) == odd


def test_a_summary_with_odd_entries_is_the_same_or_the_same_error(tmp_path, capsys, monkeypatch):
    good = training_like()
    assert both(capsys, monkeypatch, write(tmp_path, good, name="good.pickle")).startswith("0\n")
    bad = training_like()
    bad["device_traces"][0][6]["size"] = "12"
    out = both(capsys, monkeypatch, write(tmp_path, bad, name="bad.pickle"))
    assert out.startswith("2\n") and "device_traces[0][6]" in out
    missing = training_like()
    del missing["device_traces"][0][3]["addr"]
    assert both(capsys, monkeypatch, write(tmp_path, missing, name="missing.pickle")).startswith("2\n")


def test_a_compressed_snapshot_is_read_into_columns(tmp_path, capsys, monkeypatch):
    path = tmp_path / "s.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps(training_like(), protocol=4)))
    raw, source, _ = decode(str(path), columns=True)
    assert isinstance(raw["device_traces"][0], accel._fastread.Trace) and source.container == "gzip+pickle protocol 4"
    both(capsys, monkeypatch, str(path))


class Boom:
    def __reduce__(self):
        return (os.system, ("echo owned",))


@pytest.mark.parametrize("where", ["root", "entry", "frames"])
def test_code_in_a_file_is_refused_as_the_pure_path_refuses_it(tmp_path, where):
    snapshot = training_like()
    if where == "root":
        snapshot["x"] = Boom()
    elif where == "entry":
        snapshot["device_traces"][0][4]["user_metadata"] = Boom()
    else:
        snapshot["device_traces"][0][4]["frames"] = [Boom()]
    path = write(tmp_path, snapshot)
    with pytest.raises(InputError) as fast:
        decode(path, columns=True)
    with pytest.raises(InputError) as pure:
        decode(path)
    assert str(fast.value) == str(pure.value) and "refused" in str(fast.value)


def test_a_trace_referenced_twice_is_not_one_columns_object_in_two_places(tmp_path):
    # A memo reference makes one list the trace of two devices: declined, read by the pure path.
    snapshot = training_like()
    snapshot["device_traces"][1] = snapshot["device_traces"][0]
    raw = decode(write(tmp_path, snapshot), columns=True)[0]
    assert raw["device_traces"][0] is raw["device_traces"][1] and isinstance(raw["device_traces"][0], list)


def test_truncated_and_hostile_streams_end_as_the_pure_path_ends_them(tmp_path):
    data = pickle.dumps(training_like(), protocol=4)
    cases = {"truncated": data[: len(data) // 2],
             "huge-length": data[:2] + b"\x8d" + (2**62).to_bytes(8, "little") + b"x",
             "memo-index": data[:2] + b"\x5d\x72" + (2**31).to_bytes(4, "little") + b".",
             "bad-get": data[:2] + b"\x6a" + (10**6).to_bytes(4, "little") + b"."}
    for name, blob in cases.items():
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(blob)
        outcomes = []
        for columns in (True, False):
            try:
                outcomes.append(repr(decode(str(path), columns=columns)[0]))
            except InputError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1], name


def test_slice_of_columns_writes_a_plain_snapshot(tmp_path, capsys):
    path = write(tmp_path, training_like())
    out = tmp_path / "cut.pickle"
    assert main(["slice", path, "--events", "10:50", "-o", str(out)]) == 0
    capsys.readouterr()
    cut = pickle.loads(out.read_bytes())
    assert all(type(t) is list for t in cut["device_traces"]) and len(cut["device_traces"][0]) == 40
    assert main(["summarize", str(out), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr()[0])["devices"]


def test_a_column_of_many_distinct_values_keeps_every_one(tmp_path):
    # Ids take 1 byte while a column has at most 256 distinct values, then 2, then 4 bytes.
    trace = [alloc(0x1000 + 64 * k, 64, [], user_metadata=f"m{k}", stream=k % 300) for k in range(70_000)]
    path = write(tmp_path, {"segments": [], "device_traces": [trace]})
    columns = decode(path, columns=True)[0]["device_traces"][0]
    assert columns.values("user_metadata") == [e["user_metadata"] for e in trace]
    assert columns == trace


# ------------------------------------------------- the entry fast path and the walk's open table

def short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw + b"\x94"  # SHORT_BINUNICODE, MEMOIZE


def hand_made(*entries: bytes) -> bytes:
    """A snapshot in opcodes: memo 0 root, 1 'segments', 2 [], 3 'device_traces', 4 the traces,
    5 the one trace, then the first entry's keys and values (see FIRST), then `entries`."""
    return (b"\x80\x04}\x94(" + short("segments") + b"]\x94" + short("device_traces") + b"]\x94(]\x94("
            + FIRST + b"".join(entries) + b"eeu.")


# Memo 6 the first entry; 7 'action', 8 'alloc', 9 'addr', 10 'size', 11 'frames', 12 its frames list,
# 13 'stream', 14 'free_completed'.
FIRST = (b"}\x94(" + short("action") + short("alloc") + short("addr") + b"J\x00\x10\x00\x00"
         + short("size") + b"K\x40" + short("frames") + b"]\x94" + short("stream") + b"K\x00u"
         + b"}\x94(h\x07" + short("free_completed") + b"h\x09J\x00\x10\x00\x00h\x0aK\x40h\x0bh\x0ch\x0dK\x00u")


def fast(put: bytes, *pairs: bytes) -> bytes:
    """An entry in the form the fast path takes: EMPTY_DICT, a put, MARK, pairs, SETITEMS."""
    return b"}" + put + b"(" + b"".join(pairs) + b"u"


def decoded_alike(tmp_path: Path, blob: bytes) -> str:
    """The decoded document (or the error) on both paths, which must agree; the pure path's."""
    path = tmp_path / "hand.pickle"
    path.write_bytes(blob)
    outcomes = []
    for columns in (True, False):
        try:
            doc = decode(str(path), columns=columns)[0]
            outcomes.append(repr({**doc, "device_traces": [list(t) for t in doc["device_traces"]]}))
        except InputError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    return outcomes[1]


ALLOC = (b"h\x07h\x08", b"h\x09J\x00\x20\x00\x00", b"h\x0aM\x00\x01", b"h\x0bh\x0c", b"h\x0dK\x00")


def test_hand_made_entries_decode_as_the_unpickler_decodes_them(tmp_path):
    blob = hand_made(fast(b"\x94", *ALLOC))
    assert blob.count(b"}") == 4 and pickle.loads(blob)["device_traces"][0][2]["addr"] == 0x2000
    assert "'size': 256" in decoded_alike(tmp_path, blob)


@pytest.mark.parametrize("pairs", [
    (b"h\x07h\x08", b"h\x09\x8a\x08" + (-5).to_bytes(8, "little", signed=True), b"h\x0a\x8a\x00"),  # LONG1 forms
    (b"h\x07h\x08", b"h\x09\x8a\x03\xff\xff\x7f", b"h\x0aJ\xff\xff\xff\xff"),  # signed 3- and 4-byte numbers
    (b"h\x07h\x08", b"h\x09h\x08", b"h\x0aK\x01"),  # a string where the address goes: kept whole
    (b"h\x07K\x01", b"h\x09K\x00"),  # a number where the action goes
    (b"h\x07h\x08", b"h\x07h\x0e", b"h\x0aK\x01"),  # a repeated key: the later value, as in a dict
    (b"h\x08h\x08", b"h\x09K\x00"),  # a key that is no column's
    (b"h\x07h\x08", b"h\x0bh\x05"),  # the trace itself as frames: declined, the pure path reads it
    (b"h\x07h\x08", b"h\x0bh\x06"),  # an entry (never stored by the reader) as frames
    (b"h\x07h\x08", b"h\x0bj\x00\x00\x00\x01"),  # a reference past the memo
    (b"h\x07h\x08", b"\x95" + (9).to_bytes(8, "little") + b"h\x0bh\x0c"),  # a FRAME inside the entry
    tuple(b"h\x0aK\x01" for _ in range(17)),  # more pairs than the fast path takes
])
def test_entries_off_the_usual_form_read_as_the_pure_path_reads_them(tmp_path, pairs):
    decoded_alike(tmp_path, hand_made(fast(b"\x94", *pairs), fast(b"\x94", *ALLOC)))


@pytest.mark.parametrize("put", [b"q\x0c", b"r\x0c\x00\x00\x00", b"q\x06", b"r\x00\x00\x00\x01", b""])
def test_an_entry_put_over_a_memoized_value_reads_as_the_pure_path_reads_it(tmp_path, put):
    # BINPUT 12 over the frames list, then an entry that gets memo 12 (the pure path: that entry
    # dict as frames); over another entry; far past the stream; no put at all.
    blob = hand_made(fast(put, *ALLOC), fast(b"\x94", b"h\x07h\x08", b"h\x0bh\x0c"))
    decoded_alike(tmp_path, blob)


def test_the_walk_over_columns_matches_the_walk_over_dicts(tmp_path):
    # Thousands open at once (the table grows), reused addresses still open, unmatched frees,
    # allocations never freed: every array and the open allocations in their order agree.
    import random

    from memdiff.analyse.normalize.walk import Walk
    rng = random.Random(35)
    frames = py_frames("model.py:3:forward")
    trace, live = [], []
    for _ in range(20_000):
        r = rng.random()
        if r < 0.55 or not live:
            addr = 0x7F0000000000 + rng.randrange(6_000) * 512
            live.append(addr)
            trace.append(alloc(addr, rng.randrange(1, 1 << 20), frames))
        elif r < 0.95:
            addr = live.pop(rng.randrange(len(live)))
            trace.append(free(addr, 1, frames))
        else:
            trace.append(free(0x100000 + rng.randrange(1 << 30) * 512, rng.randrange(1, 4096), frames))
    path = write(tmp_path, {"segments": [], "device_traces": [trace]})
    columns = decode(path, columns=True)[0]["device_traces"][0]
    assert isinstance(columns, accel._fastread.Trace)
    a, b = Walk(path, 0, columns), Walk(path, 0, trace)
    assert len(a.open_at_end) > 1024 and len(a.unmatched) > 500
    assert list(a.open_at_end.items()) == list(b.open_at_end.items())
    for name in ("deltas", "closed", "allocs", "unmatched"):
        assert getattr(a, name) == getattr(b, name), name


def test_forward_passes_of_a_validation_loop_on_columns(tmp_path):
    # A loop without no_grad: each batch copied by the loop's own stack, then the model's forward;
    # both paths find one pass per batch.
    from memdiff.analyse.lifetimes import _Hints, forward_passes
    from memdiff.model import PhaseSpan
    batch = py_frames("validate.py:30:run_validation")
    layer = py_frames("site-packages/torch/nn/modules/linear.py:125:forward", "model.py:12:forward",
                      "validate.py:31:run_validation")
    trace = []
    for k in range(7):
        trace += [alloc(0x1000 + k * 0x10000, 4096, batch), alloc(0x2000 + k * 0x10000, 8192, layer),
                  alloc(0x3000 + k * 0x10000, 8192, layer)]
    path = write(tmp_path, {"segments": [], "device_traces": [trace]})
    columns = decode(path, columns=True)[0]["device_traces"][0]
    run = [PhaseSpan("forward", 0, len(trace) - 1)]
    allocs = list(range(len(trace)))
    found = [forward_passes(t, allocs, run, {}, _Hints()) for t in (columns, trace)]
    assert found[0] == found[1] and found[0].starts == [3 * k for k in range(7)]
