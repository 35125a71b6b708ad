"""load: a snapshot file -> a validated Snapshot of plain Python data.

A snapshot is data, never code. Pickles are read by an unpickler that refuses every global
reference, so no class can be built and no function called: real snapshots hold only dicts,
lists, strings, numbers and tuples. Compression (gzip, bz2, xz) and the container (pickle or
JSON) are detected from the bytes, not the file name.
"""

from __future__ import annotations

import bz2
import contextlib
import gc
import gzip
import hashlib
import io
import json
import lzma
import math
import os
import pickle
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from memdiff.errors import InputError, brief, clip, number
from memdiff.model import Source
from memdiff.progress import Progress
from memdiff.read import accel
from memdiff.read.frames import profiler_frame
from memdiff.read.json_keys import DuplicateKey, duplicate_path, unique_object

# Magic numbers, checked in order; each names the codec and how to open a decompressing stream.
_COMPRESSIONS = (
    (b"\x1f\x8b", "gzip", gzip.open),
    (b"BZh", "bz2", bz2.open),
    (b"\xfd7zXZ\x00", "xz", lzma.open),
)
_OTHER_CONTAINERS = (
    (b"PK\x03\x04", "a zip archive (torch.save writes these; a memory snapshot comes from "
     "torch.cuda.memory._dump_snapshot)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first: zstd -d FILE)"),
)
_CHUNK = 1 << 20


def starts_as_a_snapshot(data: bytes) -> bool:
    """Whether `data` starts as a snapshot file does (a pickle of protocol 2 or newer, or compressed): what a
    JSON or JSON Lines input given a run's file instead can say of it."""
    return data.startswith(b"\x80") or any(data.startswith(magic) for magic, _, _ in _COMPRESSIONS)

# PyTorch numbers devices with an int8 (c10::DeviceIndex), so a real snapshot has at most 128.
MAX_DEVICES = 128
MAX_BYTES = 2**62  # far beyond any device, and safely inside an int64 running total
# What a file can honestly hold. Real snapshots compress at most about 70x (xz; gzip about 35x),
# so a stream that decompresses to more than MAX_RATIO times its size (and past a floor that
# small files never reach) is a bomb; no value in a snapshot is anywhere near MAX_READ bytes;
# and a trace entry or a block takes at least MIN_EVENT_BYTES of the decoded stream unless
# pickle memo references repeat one over and over, which no real snapshot does.
MAX_RATIO = 200
MIN_DECOMPRESSED_CAP = 32 << 20
MAX_READ = 256 << 20
MIN_EVENT_BYTES = 8


class _Bounded(io.RawIOBase):
    """A read-only stream that stops a decoder from reading past `cap` bytes in all, or more than
    MAX_READ in one request, with an InputError saying why: decompression bombs and pickles
    declaring absurd lengths end in seconds, within bounded memory. `progress`, when given, is
    told how many bytes have passed; `under` is closed with it (the file under a decompressor)."""

    def __init__(self, path: str, inner: Any, cap: int, why: str, progress: Optional[Progress] = None,
                 under: Any = None) -> None:
        super().__init__()
        self.path, self.inner, self.cap, self.why = path, inner, cap, why
        self.progress, self.under = progress, under
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        want = len(buffer)
        if want > MAX_READ:
            raise InputError(self.path, f"not a memory snapshot: it declares a value of {want:,} bytes")
        with memoryview(buffer) as view:
            got = self.inner.readinto(view[: min(want, self.cap + 1 - self.count)]) or 0
        self.count += got
        if self.count > self.cap:
            raise InputError(self.path, self.why)
        if self.progress is not None:
            self.progress.update(self.count)
        return got

    def close(self) -> None:
        self.inner.close()
        if self.under is not None:
            self.under.close()
        if self.progress is not None:
            self.progress.close()
        super().close()


@dataclass
class Snapshot:
    """A loaded snapshot: the raw segments and traces, plus where they came from."""

    path: str
    source: Source
    segments: List[Dict[str, Any]]
    device_traces: List[List[Dict[str, Any]]]
    external_annotations: List[Dict[str, Any]]
    decoded_bytes: Optional[int] = None  # the decoded stream's size, which bounds the work it can ask for


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickler that builds plain data only: every global reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")


class _Refused(Exception):
    pass


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector off inside the block, then restore it.

    While a million-event snapshot is decoded, the collector scans the growing heap again and
    again (0.9 of 2.2 s at 1M events), and if it resumes while those objects are alive it scans
    them once more. Snapshot data is plain containers: reference counting frees it, so the
    block should decode, reduce and drop the snapshot before the collector comes back.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_file(path: str, what: str = "a snapshot") -> int:
    """The file's size, or an InputError saying why it cannot be `what` (a baseline said "snapshot")."""
    if not os.path.exists(path):
        raise InputError(path, "no such file")
    if os.path.isdir(path):
        if what == "a snapshot":
            # A job's folder is the likely one: say which commands read a job, and what this one takes.
            raise InputError(path, "is a directory, not a snapshot file: give one of its files (a job's folder of "
                                   "rank files is read by `memdiff ranks`, the diff, `gate` and `baseline`)")
        raise InputError(path, f"is a directory, not {what}{'' if what.endswith(' file') else ' file'}")
    if not os.path.isfile(path):
        # A FIFO or a device has no size to bound the read by (/dev/urandom never ends); it read as
        # "empty file". Stat, not open: opening a FIFO with no writer would wait for one.
        raise InputError(path, f"is {_kind(path)}, not a regular file: write {what} to a file and give that")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(path, "empty file")
    return size


def _kind(path: str) -> str:
    """What a path that is no regular file or folder is, in words."""
    mode = os.stat(path).st_mode
    for test, word in ((stat.S_ISFIFO, "a FIFO (a pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "no regular file"


# A baseline is a few KB per rank, and a job's holds every rank: a thousand ranks make a few
# MB. Rules files are smaller still. A JSON input past this is no file memdiff wrote or a person
# edited, and reading it whole would take gigabytes of memory and many seconds.
MAX_JSON_BYTES = 64 << 20
# Baselines, summaries and rules nest less than ten levels deep; allocator settings a few more.
MAX_JSON_DEPTH = 64


def read_small(path: str, what: str) -> bytes:
    """The bytes of a file meant to be small (a baseline, a rules file), its size checked before
    it is read: at most MAX_JSON_BYTES."""
    size = _check_file(path, what)
    if size > MAX_JSON_BYTES:
        raise InputError(path, f"{size:,} bytes is too large for {what} (at most {MAX_JSON_BYTES:,})")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # the file may grow after the check
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_JSON_BYTES:
        raise InputError(path, f"too large for {what} (at most {MAX_JSON_BYTES:,} bytes)")
    return data


def read_json(path: str, what: str, allow_nan: bool = False) -> Any:
    """The document in a small JSON file (read_small), decoded by parse_json; a snapshot given instead is
    said to be one (`--fit run.pickle`), not `invalid JSON: not UTF-8 text`."""
    data = read_small(path, what)
    if starts_as_a_snapshot(data):
        raise InputError(path, f"is a snapshot (pickled or compressed), not {what}")
    return parse_json(path, data, allow_nan)


class _NotJson(ValueError):
    pass


def _not_json(name: str) -> Any:
    raise _NotJson(name)


def parse_json(path: str, data: bytes, allow_nan: bool = True) -> Any:
    """Every JSON input's decoder: the document, or one InputError line saying what is wrong.
    Without `allow_nan`, NaN and Infinity (not JSON, and compared as no limit at all) are refused.
    A key given twice in one object is refused, naming its JSON path (read/json_keys.py)."""
    try:
        doc = json.loads(data, object_pairs_hook=unique_object, parse_constant=None if allow_nan else _not_json)
    except DuplicateKey:
        where = duplicate_path(data)
        said = "a key" if not where else \
            f"{'.'.join(clip(str(p)) for p in where[:-1]) or '(top level)'}: the key {clip(str(where[-1]))!r}"
        raise InputError(path, f"invalid JSON: {clip(said, 300)} is given twice in one object (JSON keeps only the "
                               f"last, silently): keep one") from None
    except _NotJson as exc:
        raise InputError(path, f"invalid JSON: {exc} is not a number (JSON has no NaN or Infinity)") from None
    except UnicodeDecodeError as exc:
        raise InputError(path, f"invalid JSON: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise InputError(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError:  # Python refuses integers of more than 4,300 digits
        raise InputError(path, "invalid JSON: a number too long to read") from None
    except RecursionError:
        raise InputError(path, f"invalid JSON: nested more than {MAX_JSON_DEPTH} levels deep") from None
    _check_depth(path, doc)
    return doc


def _check_depth(path: str, doc: Any) -> None:
    # Without recursion: what validates and copies the document later recurses, and a few
    # hundred levels would exhaust the stack there.
    level: List[Any] = [doc]
    for _ in range(MAX_JSON_DEPTH):
        level = [v for c in level if isinstance(c, (dict, list))
                 for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
        if not level:
            return
    raise InputError(path, f"invalid JSON: nested more than {MAX_JSON_DEPTH} levels deep")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    return h.hexdigest()


def _open_stream(path: str, size: int) -> Tuple[io.BufferedReader, _Bounded, Optional[str]]:
    """A buffered stream of the file's content, decompressed as it is read when its magic number
    says so (never whole in memory or on disk), and the bounded stream under it (which counts the
    bytes decoded). Progress is the share of the file read, compressed or not."""
    raw = open(path, "rb", buffering=0)  # the BufferedReader below is the only buffer
    head = raw.read(8)
    raw.seek(0)
    progress = Progress(path, size)
    for magic, codec, opener in _COMPRESSIONS:
        if head.startswith(magic):
            cap = max(MIN_DECOMPRESSED_CAP, MAX_RATIO * size)
            why = (f"not a memory snapshot: its {codec} data decompresses to more than {cap:,} bytes, "
                   f"over {MAX_RATIO}x the file (real snapshots compress about 10-70x): a decompression bomb?")
            compressed = io.BufferedReader(_Bounded(path, raw, size, "the file grew while it was read", progress),
                                           _CHUNK)
            bounded = _Bounded(path, opener(compressed, "rb"), cap, why, under=compressed)
            return io.BufferedReader(bounded, _CHUNK), bounded, codec
    bounded = _Bounded(path, raw, size, "the file grew while it was read", progress)
    return io.BufferedReader(bounded, _CHUNK), bounded, None


def _is_codec_error(exc: BaseException, codec: Optional[str]) -> bool:
    # Decompressors fail with these; a truncated stream ends with this EOFError message.
    return codec is not None and (isinstance(exc, (OSError, zlib.error, lzma.LZMAError))
                                  or (isinstance(exc, EOFError) and "Compressed file ended" in str(exc)))


# How a dict or list pickled with protocol 0 (`(dp0`, `(lp0`) or 1 (`}q`, `]q`, `}(` without a memo)
# begins; anything else without a PROTO opcode is no pickle memdiff reads.
_OLD_PICKLE_STARTS = (b"(d", b"(l", b"}q", b"]q", b"}r", b"]r", b"}(", b"](")


# The byte-order marks a JSON file may open with (UTF-8's, from a Windows editor; UTF-16's, from
# Windows PowerShell's `>`), which json.loads reads: a summary saved so read as `neither a pickle,
# JSON, ...`, where a baseline saved so was read.
_TEXT_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def _parse(path: str, stream: io.BufferedReader, codec: Optional[str]) -> Tuple[Any, str]:
    """Decode a pickle (protocols 0-5, data only) or JSON document from `stream`; (object, container)."""
    head = stream.peek(64)[:64]
    if not head:
        raise InputError(path, f"empty after {codec} decompression")
    for magic, what in _OTHER_CONTAINERS:
        if head.startswith(magic):
            raise InputError(path, f"not a memory snapshot: {what}")
    if head[0] == 0x80:
        protocol = head[1] if len(head) > 1 else -1
        if not 0 <= protocol <= 5:
            raise InputError(path, f"unsupported pickle protocol {protocol} (memdiff reads 0 to 5)")
        return _DataOnlyUnpickler(stream).load(), f"pickle protocol {protocol}"
    if head[:2] in _OLD_PICKLE_STARTS:
        # No PROTO opcode: a dict or list pickled with protocol 0 (text) or 1 (binary), which torch
        # never writes but a re-pickled snapshot may be; the same data-only unpickler reads it.
        return _DataOnlyUnpickler(stream).load(), f"pickle protocol {0 if head[:1] == b'(' else 1}"
    if head.lstrip()[:1] in (b"{", b"[") or head.startswith(_TEXT_BOMS):
        return parse_json(path, stream.read()), "json"
    raise InputError(path, "not a memory snapshot: the content is neither a pickle, a JSON object or list, "
                           "gzip, bz2 nor xz")


def _read_columns(path: str, size: int) -> Optional[Tuple[Any, str, int]]:
    """_read_document by the compiled reader, its traces in columns; None when it is not built,
    is switched off, or declines the file (anything but a plain-data pickle of the usual shape:
    the pure path then reads it, refusing what it refuses with its own messages)."""
    fast = accel.reader()
    if fast is None:
        return None
    try:
        stream, bounded, codec = _open_stream(path, size)
    except OSError:
        return None
    try:
        with stream:
            head = stream.peek(2)[:2]
            if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
                return None
            done = fast.read(stream)
    except InputError:
        raise
    except Exception:  # noqa: BLE001 - whatever the stream raised, the pure path meets and words it
        return None
    if done is None:
        return None
    container = f"pickle protocol {head[1]}"
    return done[0], f"{codec}+{container}" if codec else container, bounded.count


def _read_document(path: str, size: int, columns: bool) -> Tuple[Any, str, int]:
    """The decoded document, its container (`pickle protocol 4`, `gzip+json`, ...) and the number
    of bytes decoded (after decompression); with `columns`, its traces may be read-only columns."""
    fast = _read_columns(path, size) if columns else None
    if fast is not None:
        return fast
    try:
        stream, bounded, codec = _open_stream(path, size)
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        with stream:
            obj, container = _parse(path, stream, codec)
    except _Refused as exc:
        raise InputError(path, f"refused: the file asks to import {clip(str(exc))}; "
                               "memory snapshots never contain code") from None
    except InputError:
        raise
    except MemoryError:
        # The C unpickler allocates a declared length before it reads: 3 GB from a 3 KB file.
        raise InputError(path, "not a memory snapshot: decoding it needs more memory than there is "
                               "(it declares values far larger than the file)") from None
    except Exception as exc:  # noqa: BLE001 - anything a corrupt stream makes the decoders raise
        if _is_codec_error(exc, codec):
            raise InputError(path, f"corrupt or truncated {codec} data ({clip(str(exc), 200)})") from None
        if isinstance(exc, (EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError,
                            AttributeError, OSError, OverflowError)):
            # Python's words in one line: a persistent id's message holds a newline, shown as `\n`.
            said = " ".join(str(exc).split())
            raise InputError(path, f"truncated or corrupt pickle ({type(exc).__name__}: {clip(said, 200)})") from None
        raise
    return obj, f"{codec}+{container}" if codec else container, bounded.count


def _expect(path: str, where: str, value: Any, kind: type, what: str) -> None:
    # bool is an int subclass; a flag where a size belongs is still wrong.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(path, f"{where}: expected {what}, got {brief(value)}")


def _size(path: str, where: str, value: Any) -> None:
    _expect(path, where, value, int, "an integer")
    if not 0 <= value <= MAX_BYTES:
        raise InputError(path, f"{where}: {number(value)} is not a size in bytes (0 to {MAX_BYTES:,})")


def _validate_segments(path: str, segments: Any) -> None:
    _expect(path, "segments", segments, list, "a list")
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        _expect(path, where, seg, dict, "a dict")
        for key in ("device", "address", "total_size"):
            if key not in seg:
                raise InputError(path, f"{where}: missing '{key}'")
            _expect(path, f"{where}.{key}", seg[key], int, "an integer")
        for key in ("total_size", "allocated_size"):
            if key in seg:
                _size(path, f"{where}.{key}", seg[key])
        if not 0 <= seg["device"] < MAX_DEVICES:
            raise InputError(path, f"{where}.device: {number(seg['device'])} is not a device index "
                                   f"(PyTorch's run 0-{MAX_DEVICES - 1})")
        _expect(path, f"{where}.blocks", seg.get("blocks", []), list, "a list")
        for j, block in enumerate(seg.get("blocks", [])):
            bwhere = f"{where}.blocks[{j}]"
            _expect(path, bwhere, block, dict, "a dict")
            if "size" not in block or "state" not in block:
                raise InputError(path, f"{bwhere}: missing 'size' or 'state'")
            _size(path, f"{bwhere}.size", block["size"])
            _expect(path, f"{bwhere}.state", block["state"], str, "a string")
            if "address" in block:
                _expect(path, f"{bwhere}.address", block["address"], int, "an integer")
            if "requested_size" in block:
                _size(path, f"{bwhere}.requested_size", block["requested_size"])
            history = block.get("history")
            if history is not None:
                _expect(path, f"{bwhere}.history", history, list, "a list")
                for k, h in enumerate(history):
                    _expect(path, f"{bwhere}.history[{k}]", h, dict, "a dict")


SETTINGS_NODES = 10_000  # allocator settings are a few dozen values


def _emulated(path: str, marker: Any) -> Optional[Dict[str, Any]]:
    """The `emulated` marker memdiff's emulator writes: the GPU's name and the approximations made."""
    if marker is None:
        return None
    _expect(path, "emulated", marker, dict, "a dict")
    gpu, notes = marker.get("gpu"), marker.get("notes", [])
    _expect(path, "emulated.gpu", gpu, str, "a string")
    _expect(path, "emulated.notes", notes, list, "a list")
    return {"gpu": clip(gpu, 80), "notes": [clip(n, 300) for n in notes[:20] if isinstance(n, str)]}


def _json_safe(value: Any, budget: List[int], depth: int = 0) -> Any:
    """`value` as strict JSON can hold it, for the summary that carries it: keys as text, tuples as
    lists, strings and integers bounded, anything else (NaN, infinities, bytes) described. At most
    `budget[0]` values are copied in all, so memo references repeating one list cannot make the
    copy exponential."""
    budget[0] -= 1
    if depth > 8 or budget[0] < 0:
        return "..."
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else brief(k))[:200]: _json_safe(v, budget, depth + 1)
                for k, v in list(value.items())[:1000]}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, budget, depth + 1) for v in value[:1000]]
    if value is None or isinstance(value, bool) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, int) and value.bit_length() <= 64:
        return value
    if isinstance(value, str) and len(value) <= 200:
        return value
    return brief(value)


def _generation(raw: Any, segments: List[Dict[str, Any]], traces: List[List[Dict[str, Any]]]) -> str:
    """A label for the format generation (README, "What memdiff reads"); drives no logic."""
    if isinstance(raw, list):
        return "segments-list"
    first_blocks = [b for s in segments for b in s.get("blocks", [])[:1]]
    if any("history" in b and "address" not in b for b in first_blocks):
        return "legacy-history"
    sample = [e for t in traces for e in t[:50]]
    frames = [f for e in sample if isinstance(e, dict) and isinstance(e.get("frames"), list)
              for f in e["frames"][:3] if isinstance(f, dict)]
    if any(f.get("filename") == "none" and isinstance(f.get("name"), str) and profiler_frame(f["name"])
           for f in frames):
        return "profiler"
    if not sample:
        return "no-trace"
    return "trace-timed" if any(isinstance(e, dict) and "time_us" in e for e in sample) else "trace-untimed"


# The number torch.save's legacy (non-zip) format pickles first, before pickles of its own: what a
# data-only reader of one pickle finds there (it read `the file holds int of 77 bits`).
TORCH_SAVE_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def to_snapshot(path: str, raw: Any, source: Source, decoded_bytes: Optional[int] = None) -> Snapshot:
    """Check that `raw` has a snapshot's shape and wrap it; InputError naming the problem if not.
    `decoded_bytes`, the size of the stream it was decoded from, bounds the trace entries and
    blocks it can honestly hold."""
    if isinstance(raw, list):
        segments: Any = raw
        traces: Any = []
        annotations: Any = []
        keys: List[str] = []
    elif isinstance(raw, dict):
        if "segments" not in raw and "device_traces" not in raw:
            found = ", ".join(repr(k[:40]) if isinstance(k, str) else brief(k) for k in list(raw)[:5]) or "none"
            raise InputError(
                path, f"not a memory snapshot: a dict without 'segments' or 'device_traces' (keys: {found})"
            )
        segments = raw.get("segments", [])
        traces = raw.get("device_traces", [])
        annotations = raw.get("external_annotations") or []
        keys = sorted(k[:200] if isinstance(k, str) else brief(k) for k in raw)
        source.emulated = _emulated(path, raw.get("emulated"))
        settings = raw.get("allocator_settings")
        if settings is not None:
            _expect(path, "allocator_settings", settings, dict, "a dict")
            source.allocator_settings = _json_safe(settings, [SETTINGS_NODES])
    elif raw.__class__ is int and raw == TORCH_SAVE_LEGACY_MAGIC:
        raise InputError(path, "not a memory snapshot: a file torch.save wrote in its legacy format "
                               "(_use_new_zipfile_serialization=False); a memory snapshot comes from "
                               "torch.cuda.memory._dump_snapshot")
    else:
        raise InputError(path, f"not a memory snapshot: the file holds {brief(raw)}")
    _expect(path, "segments", segments, list, "a list")
    _expect(path, "device_traces", traces, list, "a list")
    # Before anything walks them: entries and blocks a file cannot honestly hold.
    items = (sum(len(t) for t in traces if isinstance(t, accel.TRACES))
             + sum(len(s["blocks"]) for s in segments if isinstance(s, dict) and isinstance(s.get("blocks"), list)))
    if decoded_bytes is not None and items > max(1, decoded_bytes) / MIN_EVENT_BYTES:
        raise InputError(path, f"not a memory snapshot: {items:,} trace entries and blocks in {decoded_bytes:,} "
                               f"bytes (pickle references repeating them; real ones take dozens of bytes each)")
    if len(traces) > MAX_DEVICES:
        raise InputError(path, f"device_traces: {len(traces):,} devices, more than PyTorch numbers "
                               f"({MAX_DEVICES}): not a real snapshot")
    _validate_segments(path, segments)
    for i, trace in enumerate(traces):
        if not isinstance(trace, accel.TRACES):
            _expect(path, f"device_traces[{i}]", trace, list, "a list")
    _expect(path, "external_annotations", annotations, list, "a list")
    entry_keys = sorted({str(k) for t in traces for e in t[:1000] if isinstance(e, dict) for k in e})
    source.keys = keys + [f"trace.{k}" for k in entry_keys]
    source.generation = _generation(raw, segments, traces)
    return Snapshot(path=path, source=source, segments=segments, device_traces=traces,
                    external_annotations=annotations, decoded_bytes=decoded_bytes)


def decode(path: str, columns: bool = False) -> Tuple[Any, Source, int]:
    """Read, decompress and decode a file: (the document, its Source with generation still unset,
    the number of bytes decoded). With `columns`, a device's trace may come as the accelerator's
    read-only columns (memdiff.read.accel) rather than a list of dicts: for readers that only analyse.

    The file is streamed into the decoder, never held whole in memory beside what it decodes to.
    """
    size = _check_file(path)
    # hashlib and file reads release the GIL: the hash runs on another core while this one
    # decodes, so it costs no wall time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        hashing = pool.submit(_sha256, path)
        raw, container, decoded = _read_document(path, size, columns)
        digest = hashing.result()
    source = Source(file=os.path.basename(path), sha256=digest, size_bytes=size, container=container,
                    generation="", keys=[])
    return raw, source, decoded


def load(path: str, columns: bool = False) -> Snapshot:
    """Read, decompress, decode and validate one snapshot file (`columns` as for decode)."""
    return to_snapshot(path, *decode(path, columns))
