"""The caching allocator's model against real training windows recorded after the model and optimizer
were made (../shared/cuda-truth, tests/data/cuda): from the allocator's state when recording began,
it asks for the GPU's segments and gives torch's own statistics (no torch needed)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from conftest import kept_write

from memdiff.recording.emulate.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_SIZE,
    AllocatorConfig,
    Block,
    CachingAllocator,
    DeviceAddresses,
    Segment,
    round_size,
)

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "tests" / "data" / "cuda"
TRUTH = ROOT.parent / "shared" / "cuda-truth"
MiB = 1 << 20
FAMILIES = ["llama-base", "llama1b-bf16", "bert-base", "t5-base", "vit-base", "resnet50-sgdm"]
GPT2 = ["gpt2-base", "gpt2-sgd", "gpt2-sgd-momentum", "gpt2-adafactor", "gpt2-fused"]


def _path(name: str) -> Path:
    if name in FAMILIES:
        path = TRUTH / f"{name}.pickle.gz"
        if not path.exists():
            if os.environ.get("MEMDIFF_REQUIRE_SHARED"):
                pytest.fail(f"{TRUTH} is missing")
            pytest.skip(f"real training windows not found at {TRUTH} (they live in ../shared beside the project)")
        return path
    return CUDA / f"{name}.pickle.gz"


def _load(name: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A real window's snapshot and its facts (torch.cuda.max_memory_allocated over the window)."""
    path = _path(name)
    with gzip.open(path, "rb") as f:
        snapshot = pickle.load(f)
    facts = path.with_name(f"{name}.facts.json") if name in FAMILIES else path.with_name(f"{name}.pickle.facts.json")
    return snapshot, json.loads(facts.read_text()) if facts.exists() else {}


def _at_start(snapshot: Dict[str, Any]) -> Tuple[Dict[int, Tuple[int, bool, int]], Dict[int, int]]:
    """The segments (address -> size, small, stream) and allocated blocks (address -> size) the
    allocator held when recording began: the snapshot's segments less those the trace made, and the
    blocks the trace frees without having made them or that are still held without having been made."""
    trace = snapshot["device_traces"][0]
    made = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    segments = {s["address"]: (s["total_size"], s["segment_type"] == "small", s["stream"])
                for s in snapshot["segments"] if s["address"] not in made}
    blocks: Dict[int, int] = {}
    live, ever = set(), set()
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
            ever.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                live.discard(e["addr"])
            else:  # made before recording: its block is its request rounded (the rest is found below)
                blocks[e["addr"]] = round_size(e["size"], AllocatorConfig())
    for s in snapshot["segments"]:
        if s["address"] not in made:
            for b in s["blocks"]:
                if b["state"] == "active_allocated" and b["address"] not in ever:
                    blocks[b["address"]] = b["size"]
    return segments, blocks


def _window(snapshot: Dict[str, Any]) -> Tuple[CachingAllocator, Dict[int, Block]]:
    """A model in the state the real allocator was in when recording began; new segments below the
    lowest one, where the driver put them."""
    segments, blocks = _at_start(snapshot)
    model = CachingAllocator(80 << 30)
    model.addresses = DeviceAddresses(min(segments) if segments else 0x7F0000000000)
    held: Dict[int, Block] = {}
    for start, (size, small, stream) in sorted(segments.items()):
        segment = Segment(start, size, stream, small, False)
        model.segments.append(segment)
        model._stat("segment", small, 1)
        model._stat("reserved_bytes", small, size)
        inside = sorted((a, n) for a, n in blocks.items() if start <= a < start + size)
        pieces: List[Tuple[int, int, bool]] = []
        at = start
        for i, (address, n) in enumerate(inside):
            if address > at:
                pieces.append((at, address - at, False))
            end = inside[i + 1][0] if i + 1 < len(inside) else start + size
            rest = end - (address + n)
            # a rest the allocator does not split off stayed in the block (large: 1 MiB or less)
            if 0 < rest and (rest <= SMALL_SIZE if not small else rest < MIN_BLOCK):
                n += rest
            pieces.append((address, n, True))
            at = address + n
        if at < start + size:
            pieces.append((at, start + size - at, False))
        prev = None
        for address, n, allocated in pieces:
            block = Block(address, n, segment, allocated=allocated, requested=n, prev=prev)
            if prev is None:
                segment.first = block
            else:
                prev.next = block
            prev = block
            if allocated:
                held[address] = block
                for name in ("allocated_bytes", "active_bytes", "requested_bytes"):
                    model._stat(name, small, n)
                model._stat("allocation", small, 1)
                model._stat("active", small, 1)
            else:
                model._insert_free(block)
                if len(pieces) > 1:  # a cached piece of a split segment
                    model._stat("inactive_split", small, 1)
                    model._stat("inactive_split_bytes", small, n)
    model.reset_peaks()  # the scripts reset the peaks when they start recording
    return model, held


def _replay(snapshot: Dict[str, Any]) -> Tuple[CachingAllocator, List[Tuple[str, int]]]:
    model, live = _window(snapshot)
    events: List[Tuple[str, int]] = []
    model.trace = lambda action, addr, size, stream, ctx: events.append((action, size)) \
        if action.startswith("segment") else None
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = model.malloc(e["size"], e["stream"])
        elif e["action"] == "free_completed":
            model.free(live.pop(e["addr"]))
    return model, events


@pytest.mark.parametrize("name", FAMILIES + GPT2)
def test_a_real_window_replayed_from_its_start_asks_for_the_gpus_segments(name):
    # The GPU's requests and frees of the window, from the blocks the model and optimizer held when
    # recording began: every segment the real allocator made, in order and size, so the reserved
    # peak is the GPU's; and the allocated peak is torch.cuda.max_memory_allocated() to the byte.
    snapshot, facts = _load(name)
    model, events = _replay(snapshot)
    trace = snapshot["device_traces"][0]
    assert events == [(e["action"], e["size"]) for e in trace if e["action"].startswith("segment")]
    assert model.reserved == sum(s["total_size"] for s in snapshot["segments"])
    reserved = peak = sum(size for size, _, _ in _at_start(snapshot)[0].values())
    for e in trace:
        reserved += e["size"] if e["action"] == "segment_alloc" else -e["size"] if e["action"] == "segment_free" else 0
        peak = max(peak, reserved)
    assert model.memory_stats()["reserved_bytes.all.peak"] == peak
    if "cuda_max_allocated_bytes" in facts:
        assert model.memory_stats()["allocated_bytes.all.peak"] == facts["cuda_max_allocated_bytes"]


@pytest.mark.parametrize("name", ["llama-base", "bert-base", "gpt2-adafactor"])
def test_memory_stats_at_the_dump_are_the_real_snapshots(name):
    # What the real snapshot holds when it was written, as memory_stats() counts it then: segments,
    # allocated, active and requested bytes per pool, and the cached pieces of split segments
    # (inactive_split, which torch counts by the net change of each split and merge).
    snapshot, _ = _load(name)
    model, _ = _replay(snapshot)
    stats = model.memory_stats()
    for pool, kind in (("small_pool", "small"), ("large_pool", "large"), ("all", None)):
        segments = [s for s in snapshot["segments"] if kind is None or s["segment_type"] == kind]
        held = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
        split = [b for s in segments if len(s["blocks"]) > 1 for b in s["blocks"] if b["state"] == "inactive"]
        assert stats[f"segment.{pool}.current"] == len(segments)
        assert stats[f"reserved_bytes.{pool}.current"] == sum(s["total_size"] for s in segments)
        assert stats[f"allocated_bytes.{pool}.current"] == sum(b["size"] for b in held)
        assert stats[f"active_bytes.{pool}.current"] == sum(b["size"] for b in held)
        assert stats[f"allocation.{pool}.current"] == stats[f"active.{pool}.current"] == len(held)
        assert stats[f"inactive_split.{pool}.current"] == len(split)
        assert stats[f"inactive_split_bytes.{pool}.current"] == sum(b["size"] for b in split)
    if name == "bert-base":  # recorded from an empty allocator: every request's size is in the trace
        held = [b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        assert stats["requested_bytes.all.current"] == sum(b["requested_size"] for b in held)


def test_memory_stats_has_torchs_keys_in_torchs_order():
    # torch 2.11's _cuda_memoryStats, flattened and sorted by torch.cuda.memory_stats.
    stats = CachingAllocator(80 << 30).memory_stats()
    pooled = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
              "active_bytes", "inactive_split_bytes", "requested_bytes"]
    keys = {f"{n}.{p}.{k}" for n in pooled for p in ("all", "small_pool", "large_pool")
            for k in ("current", "peak", "allocated", "freed")}
    keys |= {f"{n}.{k}" for n in ("oversize_allocations", "oversize_segments")
             for k in ("current", "peak", "allocated", "freed")}
    keys |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
             "max_split_size"}
    assert set(stats) == keys and list(stats) == sorted(keys)
    assert stats["max_split_size"] == -1  # SIZE_MAX read back as int64


def test_driver_addresses_go_down_in_32_mib_slots_and_fill_their_free_ends():
    # bert-base's first segments, from an empty allocator on the H100 (../shared/cuda-truth): a 90 MiB
    # segment, then 20 MiB ones each 32 MiB below the last, and a 2 MiB small segment in a free end.
    addresses = DeviceAddresses(top=4096 * MiB)
    first = addresses.take(90 * MiB)
    assert first == 4096 * MiB - 96 * MiB
    second = addresses.take(LARGE_BUFFER)
    assert second == first - 32 * MiB
    assert addresses.take(2 * MiB) == second + LARGE_BUFFER  # the lowest free end that fits
    assert addresses.take(LARGE_BUFFER) == second - 32 * MiB
    addresses.give_back(second, LARGE_BUFFER)  # joins the free 12 MiB end of the slot below it
    assert addresses.take(30 * MiB) == second - 12 * MiB


def test_a_split_block_split_again_counts_one_inactive_piece():
    # llama-base's weights as the GPU placed them: two 4 MiB q/k weights then an 11 MiB MLP weight in
    # one 20 MiB segment (the real snapshot's blocks: 4 MiB, 4 MiB, 12 MiB).
    a = CachingAllocator(80 << 30)
    q = a.malloc(4 * MiB)
    stats = a.memory_stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == (1, 16 * MiB)
    k = a.malloc(4 * MiB)  # the inactive piece shrinks; it is still one piece
    stats = a.memory_stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == (1, 12 * MiB)
    mlp = a.malloc(11534336)  # takes the 12 MiB rest whole (1 MiB left is not split off)
    assert [b.size for b in a.blocks(q.segment)] == [4 * MiB, 4 * MiB, 12 * MiB] and mlp.segment is q.segment
    assert a.memory_stats()["inactive_split.all.current"] == 0
    a.free(k)
    a.free(q)  # merges with the free k: still one piece of a split segment
    stats = a.memory_stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == (1, 8 * MiB)
    assert stats["inactive_split.all.freed"] == 1 and stats["inactive_split.all.allocated"] == 2


def test_expandable_segments_split_a_large_block_for_any_rest_of_512_bytes():
    # should_split: with expandable segments the large pool keeps rests of kMinBlockSize, not only
    # those over 1 MiB (kSmallSize).
    a = CachingAllocator(80 << 30, AllocatorConfig.parse("expandable_segments:True"))
    first = a.malloc(19 * MiB)  # one 20 MiB page: 1 MiB left, split off
    assert [b.size for b in a.blocks(first.segment)] == [19 * MiB, 1 * MiB]
    second = a.malloc(5 * MiB // 2)  # the free 1 MiB end and a page more
    assert [b.size for b in a.blocks(first.segment)] == [19 * MiB, 5 * MiB // 2, 37 * MiB // 2]
    assert second.address == first.address + 19 * MiB


def test_garbage_collection_needs_a_memory_fraction_and_frees_the_oldest_cached_segments():
    def run(fraction):
        a = CachingAllocator(1 << 30, AllocatorConfig.parse("garbage_collection_threshold:0.5"))
        if fraction:
            a.set_memory_fraction(1 << 30)  # collect past 512 MiB reserved
        x, y = a.malloc(200 * MiB), a.malloc(200 * MiB)
        a.free(x)
        a.malloc(250 * MiB)  # x is cached one search before y
        a.free(y)
        a.malloc(300 * MiB)  # no cached block fits: 650 MiB reserved, 138 MiB past the threshold
        return a, x, y
    a, _, _ = run(fraction=False)  # the real allocator collects only under a memory fraction
    assert a.reserved == 950 * MiB and a.counters["num_device_free"] == 0
    a, x, y = run(fraction=True)  # x waited two searches, y one (the average 1.5): x alone goes back
    assert a.reserved == 750 * MiB and a.counters["num_device_free"] == 1
    assert x.segment not in a.segments and y.segment in a.segments


def test_max_split_size_frees_an_oversize_cached_segment_before_the_whole_cache():
    # release_available_cached_blocks: the smallest oversize cached segment that covers the request
    # goes back; small cached segments stay.
    a = CachingAllocator(300 * MiB, AllocatorConfig.parse("max_split_size_mb:100"))
    small, big, bigger = a.malloc(1000), a.malloc(120 * MiB), a.malloc(150 * MiB)
    a.free(small)
    a.free(big)
    a.free(bigger)
    a.malloc(130 * MiB)  # 150 MiB is oversize for 130 (not within 20 MiB): no fit, no room
    stats = a.memory_stats()
    assert stats["num_device_free"] == 1 and stats["num_alloc_retries"] == 0
    assert stats["segment.small_pool.current"] == 1 and stats["oversize_segments.current"] == 2


STATS_AFTER = """
import json, runpy, sys
import torch
families, out, name = sys.argv[1:]
sys.argv = [families, out, name]
kept = runpy.run_path(families, run_name="__main__")  # its model and optimizer stay held, as at its dump
json.dump({"stats": torch.cuda.memory_stats(), "mem_get_info": torch.cuda.mem_get_info(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(), "memory_reserved": torch.cuda.memory_reserved(),
           "memory_allocated": torch.cuda.memory_allocated(), "summary": torch.cuda.memory_summary()},
          open(f"{out}/{name}.stats.json", "w"))
"""


@pytest.mark.slow
def test_the_emulated_llama_window_reserves_what_the_h100_reserved(tmp_path, torch):
    # families.py's llama-base under --emulate h100: its window's segments, torch.cuda's answers at
    # its dump and its max_memory_allocated are the real H100 run's (../shared/cuda-truth).
    import subprocess
    import sys

    from memdiff import api
    from memdiff.recording.emulate.gpus import gpu

    pytest.importorskip("transformers")
    snapshot, facts = _load("llama-base")
    script = tmp_path / "stats_after.py"
    script.write_text(STATS_AFTER)
    kept = tmp_path / "writes"  # the script's facts and stats files are its own writes: in the run's overlay
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "record.pickle"), "--keep-writes", str(kept), "--",
                           sys.executable, str(script),
                           str(TRUTH / "families.py"), str(tmp_path), "llama-base"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert done.returncode == 0, done.stderr[-3000:]
    real = api.summarize(_path("llama-base")).devices[0]
    emulated = api.summarize(tmp_path / "llama-base.pickle").devices[0]
    assert emulated.reserved_peak_bytes == real.reserved_peak_bytes  # 4694 MiB
    own = json.loads(kept_write(kept, tmp_path / "llama-base.facts.json").read_text())
    assert own["cuda_max_allocated_bytes"] == facts["cuda_max_allocated_bytes"]
    answers = json.loads(kept_write(kept, tmp_path / "llama-base.stats.json").read_text())
    stats = answers["stats"]
    segments = snapshot["segments"]
    reserved = sum(s["total_size"] for s in segments)
    assert answers["memory_reserved"] == stats["reserved_bytes.all.current"] == reserved
    # the window reserves most at its end
    assert answers["max_memory_reserved"] == stats["reserved_bytes.all.peak"] == reserved
    assert answers["memory_allocated"] == sum(s["allocated_size"] for s in segments)
    for kind in ("small", "large"):
        assert stats[f"segment.{kind}_pool.current"] == sum(s["segment_type"] == kind for s in segments)
    h100 = gpu("h100")  # cudaMemGetInfo: the device's memory less the CUDA context's and the allocator's
    assert answers["mem_get_info"] == [h100.capacity - reserved, h100.total_memory]
    row = next(line for line in answers["summary"].splitlines() if line.startswith("| GPU reserved memory"))
    assert f"{reserved // MiB} MiB" in row  # torch's own table, of the emulated statistics


def test_a_large_request_takes_a_bigger_oversize_block_only_within_max_non_split_rounding():
    # get_free_block: a request of max_split_size or more takes a cached block less than
    # max_non_split_rounding_mb (kLargeBuffer unless set) bigger than itself, unsplit.
    for conf, reused in (("max_split_size_mb:100", False),
                         ("max_split_size_mb:100,max_non_split_rounding_mb:64", True)):
        a = CachingAllocator(80 << 30, AllocatorConfig.parse(conf))
        a.free(a.malloc(150 * MiB))
        block = a.malloc(120 * MiB)
        assert (block.size == 150 * MiB) == reused and a.reserved == (150 if reused else 270) * MiB
    with pytest.raises(ValueError, match="max_non_split_rounding_mb too small"):
        AllocatorConfig.parse("max_non_split_rounding_mb:8")
