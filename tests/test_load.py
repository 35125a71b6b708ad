"""Loading: every container and compression, nothing in a file ever runs, bad input named in one line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import pickle
import struct
from pathlib import Path

import pytest
from conftest import alloc, block, py_frames, segment

from memdiff.cli import main

SNAP = {"segments": [segment(0, 0, [block(0, 512, frames=py_frames("model.py:3:forward"))])],
        "device_traces": [[alloc(4096, 100, py_frames("model.py:4:forward"))]],
        "allocator_settings": {"expandable_segments": False}}


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def peak_of(capsys, path):
    code, out, err = run_cli(capsys, "summarize", str(path))
    assert (code, err) == (0, "")
    return json.loads(out)["devices"][0]["peak_bytes"]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_pickle_protocols_2_to_5(tmp_path, capsys, protocol):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(SNAP, protocol=protocol))
    assert peak_of(capsys, path) == 612


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress], ids=["gzip", "bz2", "xz"])
@pytest.mark.parametrize("container", ["pickle", "json"])
def test_compressed_files_are_detected_by_content(tmp_path, capsys, compress, container):
    raw = pickle.dumps(SNAP, protocol=4) if container == "pickle" else json.dumps(SNAP).encode()
    path = tmp_path / "no-telling-extension.bin"
    path.write_bytes(compress(raw))
    assert peak_of(capsys, path) == 612


def _reduce_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-2 bytes that, loaded by pickle.load, call module.name(arg)."""
    a = arg.encode()
    return (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X" + struct.pack("<I", len(a)) + a
            + b"\x85R.")


@pytest.mark.parametrize("module, name", [("os", "system"), (open.__module__, "open")])
def test_a_pickle_that_asks_for_code_is_refused_and_runs_nothing(tmp_path, capsys, module, name):
    marker = tmp_path / "pwned"
    arg = f"touch {marker}" if name == "system" else str(marker)
    payload = _reduce_pickle(module, name, arg) if name == "system" else pickle.dumps(_Opener(str(marker)), 2)
    path = tmp_path / "evil.pickle"
    path.write_bytes(payload)
    code, out, err = run_cli(capsys, "peak", str(path))
    assert code == 2 and out == ""
    assert err == (f"memdiff: {path}: refused: the file asks to import {module}.{name}; "
                   f"memory snapshots never contain code\n")
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 1])
def test_a_snapshot_pickled_with_protocol_0_or_1_reads_as_with_4_and_runs_nothing(tmp_path, capsys, protocol):
    # torch writes protocol 2 or later; a snapshot re-pickled by a script may be 0 or 1 (no PROTO
    # opcode). It was refused as "neither a pickle, JSON, gzip, bz2 nor xz".
    path = tmp_path / "old.pickle"
    path.write_bytes(pickle.dumps(SNAP, protocol=protocol))
    assert peak_of(capsys, path) == 612
    marker = tmp_path / "pwned"
    evil = {0: b"(dp0\nS'k'\np1\ncos\nsystem\np2\n(S'touch %s'\np3\ntp4\nRp5\ns.",
            1: b"}q\x00(X\x01\x00\x00\x00kcos\nsystem\nq\x01(S'touch %s'\ntRu."}[protocol] % str(marker).encode()
    path.write_bytes(evil)
    code, out, err = run_cli(capsys, "peak", str(path))
    assert code == 2 and out == "" and "refused: the file asks to import os.system" in err, err
    assert not marker.exists()
    pickle.loads(evil)  # the payload is live: under plain pickle it runs
    assert marker.exists()


class _Opener:
    """Pickles as a call to builtins.open(path, 'w'): loading it with pickle.load creates the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_malicious_payload_really_would_run_under_plain_pickle(tmp_path):
    # Guards the test above: the payload is live, so its file not appearing means something.
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Opener(str(marker)), 2)).close()
    assert marker.exists()


def _bad_inputs(tmp: Path):
    d = tmp / "adir"
    d.mkdir()
    good = pickle.dumps(SNAP, protocol=4)
    cases = {
        "missing": (tmp / "nope.pickle", "no such file"),
        "directory": (d, "is a directory, not a snapshot file"),
        "empty": (b"", "empty file"),
        "truncated": (good[: len(good) // 2], "truncated or corrupt pickle"),
        "random": (bytes(range(7, 250)) * 4, "not a memory snapshot: the content is neither a pickle, a JSON object or list"),
        "truncated gzip": (gzip.compress(good)[:40], "corrupt or truncated gzip data"),
        "state_dict-like": (pickle.dumps({"layer.weight": [0.1, 0.2], "layer.bias": [0.0]}, 4),
                            "not a memory snapshot: a dict without 'segments' or 'device_traces' "
                            "(keys: 'layer.weight', 'layer.bias')"),
        "torch.save zip": (b"PK\x03\x04" + b"\0" * 60, "not a memory snapshot: a zip archive"),
        # torch.save(..., _use_new_zipfile_serialization=False) pickles its magic number first (protocol 2),
        # then its own pickles: it read `the file holds int of 77 bits`.
        "torch.save legacy": (pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2),
                              "not a memory snapshot: a file torch.save wrote in its legacy format"),
        "a number": (pickle.dumps(5, 4), "not a memory snapshot: the file holds int 5"),
        # Python's message, one line of words (its newline was shown as `\n`).
        "persistent id": (b"\x80\x02P1\n.", "truncated or corrupt pickle (UnpicklingError: A load persistent id "
                                            "instruction was encountered, but no persistent_load function"),
        "segments not a list": (pickle.dumps({"segments": {"a": 1}, "device_traces": []}, 4),
                                "segments: expected a list, got dict"),
        "size a string": (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1,
                                                                               "size": "12"}]]}, 4),
                          "device_traces[0][0]: 'size' is str '12', not an integer"),
        "size negative": (pickle.dumps({"segments": [], "device_traces": [[
            {"action": "alloc", "addr": 1, "size": 100}, {"action": "alloc", "addr": 2, "size": -5}]]}, 4),
            "device_traces[0][1].size: -5 is not a size in bytes"),
        "size negative in json": (json.dumps({"segments": [], "device_traces": [[
            {"action": "free_completed", "addr": 2, "size": -5}]]}).encode(),
            "device_traces[0][0].size: -5 is not a size in bytes"),
        "block size a string": (pickle.dumps({"segments": [{"device": 0, "address": 0, "total_size": 5, "blocks": [
            {"size": "5", "state": "inactive"}]}], "device_traces": []}, 4),
            "segments[0].blocks[0].size: expected an integer, got str '5'"),
        "invalid json": (b'{"segments": [1, 2,\n x]', "invalid JSON at line 2 column 2: Expecting value"),
        "a list of numbers": (pickle.dumps([1, 2, 3], 4), "segments[0]: expected a dict, got int 1"),
        # A FIFO or a device has no end to bound the read by: they read as "empty file".
        "fifo": (tmp / "pipe", "is a FIFO (a pipe), not a regular file"),
        "character device": (Path("/dev/urandom"), "is a character device, not a regular file"),
    }
    os.mkfifo(tmp / "pipe")
    out = {}
    for name, (content, message) in cases.items():
        if isinstance(content, bytes):
            path = tmp / (name.replace(" ", "_") + ".pickle")
            path.write_bytes(content)
        else:
            path = content
        out[name] = (path, message)
    return out


BAD = ["missing", "directory", "empty", "truncated", "random", "truncated gzip", "state_dict-like",
       "torch.save zip", "torch.save legacy", "a number", "persistent id", "segments not a list", "size a string", "size negative", "size negative in json",
       "block size a string", "invalid json",
       "a list of numbers", "fifo", "character device"]


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["summarize", "peak"])
def test_bad_input_exits_2_with_one_line_naming_file_and_problem(tmp_path, capsys, case, command):
    path, message = _bad_inputs(tmp_path)[case]
    code, out, err = run_cli(capsys, command, str(path))
    assert code == 2
    assert out == ""
    assert err.startswith(f"memdiff: {path}: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", ["peak", "summarize", "whatif"])
def test_a_jobs_folder_given_to_a_one_run_command_says_which_commands_read_jobs(command, capsys):
    # The real two-rank DDP job recorded on H100s: the README said every command takes a job.
    job = Path(__file__).resolve().parent / "data" / "cuda" / "ddp"
    code, out, err = run_cli(capsys, command, str(job))
    assert (code, out) == (2, "")
    assert err == (f"memdiff: {job}: is a directory, not a snapshot file: give one of its files (a job's folder of "
                   "rank files is read by `memdiff ranks`, the diff, `gate` and `baseline`)\n")


def test_debug_shows_the_traceback(tmp_path, capsys):
    path, _ = _bad_inputs(tmp_path)["truncated"]
    code, _, err = run_cli(capsys, "summarize", "--debug", str(path))
    assert code == 2 and "Traceback" in err and err.rstrip().endswith("truncated or corrupt pickle (UnpicklingError: pickle data was truncated)")


def test_failed_output_write_leaves_no_file_and_says_why(tmp_path, capsys):
    src = tmp_path / "s.pickle"
    src.write_bytes(pickle.dumps(SNAP, 4))
    target = tmp_path / "missing-dir" / "out.json"
    code, _, err = run_cli(capsys, "summarize", str(src), "-o", str(target))
    assert code == 2 and err.startswith(f"memdiff: {target}: the folder ") and "does not exist" in err
    assert not target.exists()


def test_unknown_keys_are_ignored(tmp_path, capsys):
    snap = json.loads(json.dumps(SNAP))
    snap["future_key"] = {"x": 1}
    snap["device_traces"][0][0]["future_field"] = [1, 2]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(snap))
    assert peak_of(capsys, path) == 612
    assert os.path.exists(path)
