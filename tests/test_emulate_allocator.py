"""The caching allocator's model against real CUDA traces recorded from an empty allocator, and the
GPUs and kernel rules as data (no torch needed)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from memdiff.recording.emulate.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    round_size,
)

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "tests" / "data" / "cuda"
SHARED = ROOT.parent / "shared" / "snapshots"
MiB = 1 << 20


def _load(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def _replay(snapshot, real_addresses: bool):
    """Feed a trace recorded from an empty allocator to the model; its segment events and allocator."""
    trace = snapshot["device_traces"][0]
    model = CachingAllocator(80 << 30)
    if real_addresses:  # the driver's addresses decide best-fit ties between equal free blocks
        segment_addresses = iter([e["addr"] for e in trace if e["action"] == "segment_alloc"])
        model._take_addresses = lambda size: next(segment_addresses)
    events = []
    model.trace = lambda action, addr, size, stream, ctx: events.append((action, addr, size))
    live, moved = {}, 0
    for e in trace:
        if e["action"] == "alloc":
            block = model.malloc(e["size"], e["stream"])
            moved += block.address != e["addr"]
            live[e["addr"]] = block
        elif e["action"] == "free_completed":
            model.free(live.pop(e["addr"]))
    return model, events, moved


def _from_empty():
    paths = [CUDA / "ddp" / "rank0.pickle.gz", CUDA / "ddp" / "rank1.pickle.gz"]
    if (SHARED / "linear-grad.pickle").exists():
        paths.append(SHARED / "linear-grad.pickle")
    elif os.environ.get("MEMDIFF_REQUIRE_SHARED"):
        pytest.fail("../shared/snapshots is missing")
    return paths


@pytest.mark.parametrize("path", _from_empty(), ids=lambda p: p.name)
def test_the_allocator_model_makes_the_real_allocators_segments(path):
    # Traces recorded from a fresh process (no block older than the trace): every segment the
    # real allocator asked the driver for, in order and size, and with the driver's addresses
    # every allocation at the address the GPU gave it.
    snapshot = _load(path)
    real = [(e["action"], e["size"]) for e in snapshot["device_traces"][0] if e["action"].startswith("segment")]
    model, events, _ = _replay(snapshot, real_addresses=False)
    assert [(a, s) for a, _, s in events if a.startswith("segment")] == real
    assert model.reserved == sum(s["total_size"] for s in snapshot["segments"])
    model, _, moved = _replay(snapshot, real_addresses=True)
    assert moved == 0
    assert model.allocated == sum(s["allocated_size"] for s in snapshot["segments"])


def test_rounding_pools_and_splitting_follow_the_allocators_rules():
    a = CachingAllocator(1 << 30)
    small = a.malloc(100)  # 512 B block in a 2 MiB small segment
    assert (small.size, small.segment.size, small.segment.small) == (512, SMALL_BUFFER, True)
    big = a.malloc(12 * MiB + 1)  # 10 MiB and over: its own segment, rounded to 2 MiB
    assert big.segment.size == 14 * MiB and big.size == 12 * MiB + 512
    mid = a.malloc(5 * MiB)  # under 10 MiB, and the 2 MiB left beside `big` is too small: a 20 MiB segment
    assert (mid.size, mid.segment.size) == (5 * MiB, LARGE_BUFFER)
    tail = a.malloc(14 * MiB + 600 * 1024)  # best fit: the 15 MiB left of the 20 MiB segment; 424 KiB left, unsplit
    assert tail.segment is mid.segment and tail.size == 15 * MiB
    assert a.allocated == 512 + 5 * MiB + 12 * MiB + 512 + 15 * MiB
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER + 14 * MiB
    a.free(mid)
    a.free(tail)  # merges with its free neighbour: the 20 MiB segment is one free block again
    assert [b.size for b in a.blocks(mid.segment)] == [LARGE_BUFFER]
    a.empty_cache()  # only segments without allocated blocks go back
    assert a.reserved == SMALL_BUFFER + 14 * MiB
    assert a.memory_stats()["reserved_bytes.all.peak"] == SMALL_BUFFER + LARGE_BUFFER + 14 * MiB


def test_a_full_device_frees_its_cache_then_says_out_of_memory():
    a = CachingAllocator(64 * MiB)
    events = []
    a.trace = lambda action, addr, size, stream, ctx: events.append(action)
    first = a.malloc(40 * MiB)
    a.free(first)  # cached: 40 MiB reserved, nothing allocated
    second = a.malloc(50 * MiB)  # does not fit beside the cache: the cache goes back, then it fits
    assert "segment_free" in events and second.segment.size == 50 * MiB
    assert a.counters["num_alloc_retries"] == 1
    with pytest.raises(OutOfMemory):
        a.malloc(20 * MiB)
    assert events[-1] == "oom" and a.counters["num_ooms"] == 1


def test_allocator_settings_are_read_from_pytorch_cuda_alloc_conf():
    config = AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4")
    assert config.expandable_segments and config.max_split_size == 128 * MiB
    assert round_size(1200 * 1024, config) == 1280 * 1024  # 1 MiB..2 MiB in quarters
    with pytest.raises(ValueError, match="not emulated"):
        AllocatorConfig.parse("some_new_knob:3")
    grows = CachingAllocator(1 << 30, AllocatorConfig.parse("expandable_segments:True"))
    events = []
    grows.trace = lambda action, addr, size, stream, ctx: events.append((action, size))
    one, two = grows.malloc(30 * MiB), grows.malloc(30 * MiB)
    assert one.segment is two.segment and one.segment.expandable
    # One segment that grows by 20 MiB pages: 40 MiB for the first, 20 MiB more beside its 10 MiB free end.
    assert [e for e in events if e[0] == "segment_map"] == [("segment_map", 40 * MiB), ("segment_map", 20 * MiB)]
    assert grows.reserved == 60 * MiB


def test_an_unknown_gpu_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h900", "-o", "x.pickle", "--",
                           "python", "train.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "no GPU named 'h900'" in done.stderr and "h100" in done.stderr


def test_gpus_and_kernel_rules_are_data():
    from memdiff.recording.emulate.gpus import gpu, kernels, names

    assert {"h100", "h200", "a100", "l4"} <= set(names())
    assert gpu("H100").total_memory > gpu("L4").total_memory
    rules = kernels()
    assert set(rules["sdpa"]) == {"cudnn", "flash", "efficient", "math"}
    assert json.dumps(rules)  # plain data, no code


def _snapshot_marked(tmp_path, marker):
    trace = [{"action": "alloc", "addr": 1 << 21, "size": 4096, "stream": 0, "time_us": 1, "frames": []},
             {"action": "free_completed", "addr": 1 << 21, "size": 4096, "stream": 0, "time_us": 2, "frames": []}]
    path = tmp_path / "marked.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace], "emulated": marker}, protocol=4))
    return subprocess.run([sys.executable, "-m", "memdiff", "peak", str(path)], capture_output=True, text=True)


def test_the_emulated_marker_is_data_and_read_with_care(tmp_path):
    # A snapshot says it was emulated: memdiff says so, with the name made inert for the terminal.
    done = _snapshot_marked(tmp_path, {"gpu": "H100\x1b[2J\nwarning: fake", "notes": ["eager\x07"]})
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "note: T013 emulated H100\\x1b[2J\\nwarning: fake by memdiff" in done.stdout
    # A marker of the wrong shape is bad input: one line, exit 2.
    done = _snapshot_marked(tmp_path, ["not", "a", "dict"])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "emulated" in done.stderr
