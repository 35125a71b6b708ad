"""The optional compiled reader (memdiff/_fastread.c) against the pure path: the same document,
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

from memdiff import accel
from memdiff.cli import main
from memdiff.errors import InputError
from memdiff.load import decode

if accel.reader() is None:
    reason = "the accelerator is not built (pip install -e . with a C compiler) or MEMDIFF_PURE is set"
    if os.environ.get("MEMDIFF_REQUIRE_ACCEL") == "1" and not os.environ.get("MEMDIFF_PURE"):
        raise RuntimeError(reason + "; MEMDIFF_REQUIRE_ACCEL=1 needs it")
    pytest.skip(reason, allow_module_level=True)


def summary_json(capsys, monkeypatch, path: str, pure: bool) -> str:
    if pure:
        monkeypatch.setenv("MEMDIFF_PURE", "1")
    else:
        monkeypatch.delenv("MEMDIFF_PURE", raising=False)
    code = main(["summarize", path, "--format", "json"])
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
