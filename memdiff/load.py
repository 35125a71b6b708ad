"""load: a snapshot file -> a validated Snapshot of plain Python data.

A snapshot is data, never code. Pickles are read by an unpickler that refuses every global
reference, so no class can be built and no function called: real snapshots hold only dicts,
lists, strings, numbers and tuples. Compression (gzip, bz2, xz) and the container (pickle or
JSON) are detected from the bytes, not the file name.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from memdiff.errors import InputError
from memdiff.model import Source

# Magic numbers, checked in order; the value names the codec and its decompressor.
_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", gzip.decompress),
    (b"BZh", "bz2", bz2.decompress),
    (b"\xfd7zXZ\x00", "xz", lzma.decompress),
)
_OTHER_CONTAINERS = (
    (b"PK\x03\x04", "a zip archive (torch.save writes these; a memory snapshot comes from "
     "torch.cuda.memory._dump_snapshot)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first: zstd -d FILE)"),
)

_PROFILER_NAME = re.compile(r"\.py\(\d+\): ")


@dataclass
class Snapshot:
    """A loaded snapshot: the raw segments and traces, plus where they came from."""

    path: str
    source: Source
    segments: List[Dict[str, Any]]
    device_traces: List[List[Dict[str, Any]]]
    external_annotations: List[Dict[str, Any]]


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickler that builds plain data only: every global reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")


class _Refused(Exception):
    pass


def read_bytes(path: str) -> bytes:
    """The file's bytes, or an InputError saying why they cannot be read."""
    if not os.path.exists(path):
        raise InputError(path, "no such file")
    if os.path.isdir(path):
        raise InputError(path, "is a directory, not a snapshot file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from exc
    if not data:
        raise InputError(path, "empty file")
    return data


def decompress(path: str, data: bytes) -> Tuple[bytes, Optional[str]]:
    """Undo gzip/bz2/xz compression found by magic number; returns (bytes, codec or None)."""
    for magic, codec, fn in _COMPRESSIONS:
        if data.startswith(magic):
            try:
                out = fn(data)
            except (OSError, EOFError, ValueError, lzma.LZMAError) as exc:
                raise InputError(path, f"corrupt or truncated {codec} data ({exc})") from exc
            if not out:
                raise InputError(path, f"empty after {codec} decompression")
            return out, codec
    return data, None


def parse(path: str, data: bytes) -> Tuple[Any, str]:
    """Decode a pickle (protocols 2-5, data only) or JSON document; returns (object, container)."""
    for magic, what in _OTHER_CONTAINERS:
        if data.startswith(magic):
            raise InputError(path, f"not a memory snapshot: {what}")
    if data[0] == 0x80:
        protocol = data[1] if len(data) > 1 else -1
        if not 2 <= protocol <= 5:
            raise InputError(path, f"unsupported pickle protocol {protocol} (memdiff reads 2 to 5)")
        try:
            obj = _DataOnlyUnpickler(io.BytesIO(data)).load()
        except _Refused as exc:
            raise InputError(
                path,
                f"refused: the file asks to import {exc}; memory snapshots never contain code",
            ) from None
        except (EOFError, pickle.UnpicklingError, ValueError, TypeError,
                IndexError, KeyError, AttributeError, MemoryError) as exc:
            raise InputError(path, f"truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None
        return obj, f"pickle protocol {protocol}"
    head = data[:64].lstrip()
    if head[:1] in (b"{", b"["):
        try:
            return json.loads(data), "json"
        except UnicodeDecodeError as exc:
            raise InputError(path, f"invalid JSON: not UTF-8 text ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise InputError(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    raise InputError(path, "not a memory snapshot: the content is neither a pickle, JSON, "
                           "gzip, bz2 nor xz")


def _expect(path: str, where: str, value: Any, kind: type, what: str) -> None:
    # bool is an int subclass; a flag where a size belongs is still wrong.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(path, f"{where}: expected {what}, got {type(value).__name__} {value!r:.40}")


def _validate_segments(path: str, segments: Any) -> None:
    _expect(path, "segments", segments, list, "a list")
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        _expect(path, where, seg, dict, "a dict")
        for key in ("device", "address", "total_size"):
            if key not in seg:
                raise InputError(path, f"{where}: missing '{key}'")
            _expect(path, f"{where}.{key}", seg[key], int, "an integer")
        _expect(path, f"{where}.blocks", seg.get("blocks", []), list, "a list")
        for j, block in enumerate(seg.get("blocks", [])):
            bwhere = f"{where}.blocks[{j}]"
            _expect(path, bwhere, block, dict, "a dict")
            if "size" not in block or "state" not in block:
                raise InputError(path, f"{bwhere}: missing 'size' or 'state'")
            _expect(path, f"{bwhere}.size", block["size"], int, "an integer")
            _expect(path, f"{bwhere}.state", block["state"], str, "a string")
            for key in ("address", "requested_size"):
                if key in block:
                    _expect(path, f"{bwhere}.{key}", block[key], int, "an integer")


def _generation(raw: Any, segments: List[Dict[str, Any]], traces: List[List[Dict[str, Any]]]) -> str:
    """A label for the format generation (see README, "Formats"); drives no logic."""
    if isinstance(raw, list):
        return "segments-list"
    first_blocks = [b for s in segments for b in s.get("blocks", [])[:1]]
    if any("history" in b and "address" not in b for b in first_blocks):
        return "legacy-history"
    sample = [e for t in traces for e in t[:50]]
    frames = [f for e in sample for f in (e.get("frames") or [])[:3] if isinstance(f, dict)]
    if any(f.get("filename") == "none" and _PROFILER_NAME.search(str(f.get("name", ""))) for f in frames):
        return "profiler"
    if not sample:
        return "no-trace"
    return "trace-timed" if any("time_us" in e for e in sample) else "trace-untimed"


def to_snapshot(path: str, raw: Any, source: Source) -> Snapshot:
    """Check that `raw` has a snapshot's shape and wrap it; InputError naming the problem if not."""
    if isinstance(raw, list):
        segments: Any = raw
        traces: Any = []
        annotations: Any = []
        keys: List[str] = []
    elif isinstance(raw, dict):
        if "segments" not in raw and "device_traces" not in raw:
            found = ", ".join(repr(k) for k in list(raw)[:5]) or "none"
            raise InputError(
                path, f"not a memory snapshot: a dict without 'segments' or 'device_traces' (keys: {found})"
            )
        segments = raw.get("segments", [])
        traces = raw.get("device_traces", [])
        annotations = raw.get("external_annotations") or []
        keys = sorted(str(k) for k in raw)
        settings = raw.get("allocator_settings")
        if settings is not None:
            _expect(path, "allocator_settings", settings, dict, "a dict")
            source.allocator_settings = settings
    else:
        raise InputError(path, f"not a memory snapshot: the file holds a {type(raw).__name__}")
    _validate_segments(path, segments)
    _expect(path, "device_traces", traces, list, "a list")
    for i, trace in enumerate(traces):
        _expect(path, f"device_traces[{i}]", trace, list, "a list")
    _expect(path, "external_annotations", annotations, list, "a list")
    entry_keys = sorted({k for t in traces for e in t[:1000] if isinstance(e, dict) for k in e})
    source.keys = keys + [f"trace.{k}" for k in entry_keys]
    source.generation = _generation(raw, segments, traces)
    return Snapshot(path=path, source=source, segments=segments, device_traces=traces,
                    external_annotations=annotations)


def decode(path: str) -> Tuple[Any, Source]:
    """Read, decompress and decode a file: (the document, its Source with generation still unset)."""
    data = read_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    size = len(data)
    payload, codec = decompress(path, data)
    del data
    raw, container = parse(path, payload)
    del payload
    source = Source(
        file=os.path.basename(path),
        sha256=digest,
        size_bytes=size,
        container=f"{codec}+{container}" if codec else container,
        generation="",
        keys=[],
    )
    return raw, source


def load(path: str) -> Snapshot:
    """Read, decompress, decode and validate one snapshot file."""
    raw, source = decode(path)
    return to_snapshot(path, raw, source)
