"""A model of PyTorch's CUDA caching allocator: which blocks and segments a sequence of requests makes.

Pure Python, no torch: it is fed request sizes and frees and keeps the state the real allocator
keeps (c10/cuda/CUDACachingAllocator.cpp, as PyTorch's "CUDA semantics: memory management" notes
describe it), so that the emulated run's allocated, reserved and fragmentation figures, its
segments and its trace come out as the GPU's would:

- sizes are rounded up to 512 bytes (or to PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions);
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from
  the large pool, whose segments are 20 MiB for requests under 10 MiB, else the request rounded
  up to 2 MiB;
- a request takes the smallest cached block of its pool and stream that fits (best fit, lowest
  address first), split when the rest is worth keeping (512 bytes in the small pool, more than
  1 MiB in the large one, and never a block of max_split_size or more);
- a freed block merges with free neighbours of its segment and stays cached: segments are given
  back only by empty_cache(), or when the device is full (every unsplit cached segment, then the
  request again), or past garbage_collection_threshold;
- with expandable_segments, each pool of a stream is one segment that grows at its end by pages
  (2 MiB small, 20 MiB large) instead of a new segment per miss.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

KiB, MiB = 1 << 10, 1 << 20
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB  # the largest request the small pool serves
SMALL_BUFFER = 2 * MiB  # a small-pool segment
MIN_LARGE_ALLOC = 10 * MiB  # requests below this share a LARGE_BUFFER segment
LARGE_BUFFER = 20 * MiB
ROUND_LARGE = 2 * MiB
NO_LIMIT = (1 << 63) - 1
# Where emulated segments start: a device address as CUDA hands them out (2 MiB aligned).
BASE_ADDRESS = 0x7F0000000000


class OutOfMemory(Exception):
    """The request does not fit in the device's memory, even after every cached segment went back."""

    def __init__(self, requested: int, free: int, reserved: int, allocated: int, total: int) -> None:
        super().__init__(f"tried to allocate {requested} bytes with {free} free of {total} "
                         f"({allocated} allocated, {reserved} reserved by PyTorch)")
        self.requested, self.free, self.reserved, self.allocated, self.total = \
            requested, free, reserved, allocated, total


# roundup_power2_divisions applies per power-of-two interval of sizes from 1 MiB to 64 GiB (MiB):
# one count of divisions each; sizes below the first use its count, above the last its count.
INTERVALS = [1 << k for k in range(16)]


@dataclass
class AllocatorConfig:
    """The settings PYTORCH_CUDA_ALLOC_CONF gives (the ones that change sizes and segments)."""

    max_split_size: int = NO_LIMIT
    roundup_power2_divisions: List[int] = field(default_factory=lambda: [0] * len(INTERVALS))
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """PYTORCH_CUDA_ALLOC_CONF's value (`expandable_segments:True,max_split_size_mb:128`); a
        setting memdiff does not know is a ValueError naming it."""
        config = cls(text=text)
        for part in re.split(r",(?![^\[]*\])", text.strip()):
            if not part.strip():
                continue
            key, _, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if key == "max_split_size_mb":
                config.max_split_size = max(int(value), 20) * MiB
            elif key == "expandable_segments":
                config.expandable_segments = value.lower() == "true"
            elif key == "garbage_collection_threshold":
                config.garbage_collection_threshold = float(value)
            elif key == "roundup_power2_divisions":
                config.roundup_power2_divisions = _divisions(value)
            elif key in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                         "pinned_num_register_threads", "pinned_use_background_threads"):
                continue  # no effect on the device's sizes
            else:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF setting {key!r} is not emulated")
        return config

    def divisions(self, size: int) -> int:
        """roundup_power2_divisions' count for a request of `size` bytes."""
        interval = min(max(size.bit_length() - 1 - 20, 0), len(INTERVALS) - 1)
        return self.roundup_power2_divisions[interval]

    def settings(self) -> Dict[str, Any]:
        """The `allocator_settings` a snapshot of this allocator carries, as torch 2.11 writes them."""
        return {"PYTORCH_CUDA_ALLOC_CONF": self.text,
                "max_split_size": -1 if self.max_split_size == NO_LIMIT else self.max_split_size,
                "garbage_collection_threshold": self.garbage_collection_threshold,
                "expandable_segments": self.expandable_segments,
                "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
                "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
                "roundup_power2_divisions": {str(mib): n for mib, n in zip(INTERVALS, self.roundup_power2_divisions)}}


def _divisions(value: str) -> List[int]:
    """roundup_power2_divisions: one count for every size, or `[256:1,512:2,>:4]` per interval (MiB)."""
    if not value.startswith("["):
        return [int(value)] * len(INTERVALS)
    out = [0] * len(INTERVALS)
    last = -1
    for item in value.strip("[]").split(","):
        size, _, count = item.partition(":")
        if size.strip() == ">":
            for k in range(last + 1, len(INTERVALS)):
                out[k] = int(count)
            continue
        mib = int(size)
        if mib not in INTERVALS:
            raise ValueError(f"roundup_power2_divisions: {mib} is not a power of two from 1 to 32768 (MiB)")
        last = INTERVALS.index(mib)
        out[last] = int(count)
    return out


def round_size(size: int, config: AllocatorConfig) -> int:
    """The block size a request of `size` bytes takes."""
    if size <= MIN_BLOCK:
        return MIN_BLOCK
    divisions = config.divisions(size)
    if divisions > 1 and size > MIN_BLOCK * divisions:
        floor = 1 << (size.bit_length() - 1)
        if floor == size:
            return size
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        return -(-size // step) * step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment a rounded request that finds no cached block asks the device for."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    """A piece of a segment: allocated to one tensor's storage, or cached (free)."""

    address: int
    size: int
    segment: "Segment"
    allocated: bool = False
    requested: int = 0
    context: Any = None  # what the caller gave when it was allocated (its frames)
    prev: Optional["Block"] = None
    next: Optional["Block"] = None


@dataclass(eq=False)
class Segment:
    """One cudaMalloc (or, expandable, one growing mapping) of a pool and stream."""

    address: int
    size: int
    stream: int
    small: bool
    expandable: bool
    context: Any = None
    first: Optional[Block] = None


@dataclass
class Stat:
    """A counter as torch's memory_stats keeps it: now, the high-water mark, added, taken away."""

    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.allocated += n
        self.peak = max(self.peak, self.current)

    def sub(self, n: int) -> None:
        self.current -= n
        self.freed += n


TraceHook = Callable[[str, int, int, int, Any], None]  # action, address, size, stream, context


class CachingAllocator:
    """One device's caching allocator. `malloc` gives a Block, `free` takes it back; `trace` (if set)
    is told each event as the real allocator records it (alloc, free_requested, free_completed,
    segment_alloc, segment_free, segment_map, segment_unmap, oom)."""

    def __init__(self, total_memory: int, config: Optional[AllocatorConfig] = None) -> None:
        self.total_memory = total_memory
        self.config = config or AllocatorConfig()
        self.trace: Optional[TraceHook] = None
        self.segments: List[Segment] = []
        # Free blocks per pool, sorted by (stream, size, address): the real allocator's BlockComparatorSize.
        self._free: Dict[bool, List[Tuple[int, int, int, Block]]] = {True: [], False: []}
        self._next_address = BASE_ADDRESS
        self._expandable: Dict[Tuple[int, bool], Segment] = {}
        pools = ("all", "small_pool", "large_pool")
        self.stats: Dict[str, Dict[str, Stat]] = {
            name: {p: Stat() for p in pools}
            for name in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "inactive_split_bytes",
                         "allocation", "segment", "active", "inactive_split")}
        self.counters = {"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 0,
                         "num_sync_all_streams": 0}

    # -- the statistics ---------------------------------------------------------------------------

    def _stat(self, name: str, small: bool, n: int) -> None:
        for pool in ("all", "small_pool" if small else "large_pool"):
            stat = self.stats[name][pool]
            stat.add(n) if n >= 0 else stat.sub(-n)

    @property
    def allocated(self) -> int:
        """Bytes of allocated blocks (torch.cuda.memory_allocated)."""
        return self.stats["allocated_bytes"]["all"].current

    @property
    def reserved(self) -> int:
        """Bytes of segments (torch.cuda.memory_reserved)."""
        return self.stats["reserved_bytes"]["all"].current

    def memory_stats(self) -> Dict[str, int]:
        """torch.cuda.memory_stats()'s flat dictionary."""
        out: Dict[str, int] = dict(self.counters)
        for name, pools in self.stats.items():
            for pool, stat in pools.items():
                for key in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{key}"] = getattr(stat, key)
        out["max_split_size"] = -1 if self.config.max_split_size == NO_LIMIT else self.config.max_split_size
        return out

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats()."""
        for pools in self.stats.values():
            for stat in pools.values():
                stat.peak = stat.current

    def _emit(self, action: str, address: int, size: int, stream: int, context: Any) -> None:
        if self.trace is not None:
            self.trace(action, address, size, stream, context)

    # -- the free lists ---------------------------------------------------------------------------

    def _insert_free(self, block: Block) -> None:
        bisect.insort(self._free[block.segment.small], (block.segment.stream, block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.segment.small]
        i = bisect.bisect_left(pool, (block.segment.stream, block.size, block.address))
        del pool[i]

    def _find_free(self, small: bool, stream: int, size: int) -> Optional[Block]:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i == len(pool) or pool[i][0] != stream:
            return None
        block = pool[i][3]
        limit = self.config.max_split_size
        if limit != NO_LIMIT:
            # An oversized cached block serves neither small requests nor large ones it would waste.
            if size < limit and block.size >= limit:
                return None
            if size >= limit and block.size >= size + LARGE_BUFFER:
                return None
        return block

    # -- malloc and free --------------------------------------------------------------------------

    def malloc(self, requested: int, stream: int = 0, context: Any = None) -> Block:
        """A block for a request of `requested` bytes on `stream`; OutOfMemory when it cannot fit."""
        size = round_size(requested, self.config)
        small = size <= SMALL_SIZE
        block = self._find_free(small, stream, size)
        if block is None and self.config.garbage_collection_threshold > 0 and \
                self.reserved > self.config.garbage_collection_threshold * self.total_memory:
            self._release_cached(lambda s: True)
            block = self._find_free(small, stream, size)
        if block is None:
            block = self._grow(small, stream, size, context)
        if block is None:
            self.counters["num_alloc_retries"] += 1
            self._release_cached(lambda s: True)
            block = self._grow(small, stream, size, context)
        if block is None:
            self.counters["num_ooms"] += 1
            free = self.total_memory - self.reserved
            self._emit("oom", 0, requested, stream, free)
            raise OutOfMemory(requested, free, self.reserved, self.allocated, self.total_memory)
        self._remove_free(block)
        rest = block.size - size
        split = rest >= MIN_BLOCK if small else (size < self.config.max_split_size and rest > SMALL_SIZE)
        if split:
            tail = Block(block.address + size, rest, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
            if not block.segment.expandable:
                self._stat("inactive_split_bytes", small, rest)
                self._stat("inactive_split", small, 1)
        elif self._was_split(block):
            self._stat("inactive_split_bytes", small, -block.size)
            self._stat("inactive_split", small, -1)
        block.allocated, block.requested, block.context = True, requested, context
        self._stat("allocated_bytes", small, block.size)
        self._stat("active_bytes", small, block.size)
        self._stat("requested_bytes", small, requested)
        self._stat("allocation", small, 1)
        self._stat("active", small, 1)
        self._emit("alloc", block.address, requested, stream, context)
        return block

    def free(self, block: Block, context: Any = None) -> None:
        """Give a block back: cached, merged with free neighbours of its segment."""
        small = block.segment.small
        self._emit("free_requested", block.address, block.requested, block.segment.stream, context)
        self._emit("free_completed", block.address, block.requested, block.segment.stream, context)
        self._stat("allocated_bytes", small, -block.size)
        self._stat("active_bytes", small, -block.size)
        self._stat("requested_bytes", small, -block.requested)
        self._stat("allocation", small, -1)
        self._stat("active", small, -1)
        block.allocated, block.requested, block.context = False, 0, None
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if not block.segment.expandable:
                    self._stat("inactive_split_bytes", small, -neighbour.size)
                    self._stat("inactive_split", small, -1)
                self._merge(block, neighbour)
        if self._was_split(block) and not block.segment.expandable:
            self._stat("inactive_split_bytes", small, block.size)
            self._stat("inactive_split", small, 1)
        self._insert_free(block)

    @staticmethod
    def _was_split(block: Block) -> bool:
        return block.prev is not None or block.next is not None

    @staticmethod
    def _merge(block: Block, other: Block) -> None:
        if other is block.prev:
            block.address = other.address
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
            else:
                block.segment.first = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): every cached segment with no allocated block goes back."""
        self._release_cached(lambda s: True)

    # -- segments ---------------------------------------------------------------------------------

    def _grow(self, small: bool, stream: int, size: int, context: Any) -> Optional[Block]:
        """A new free block that fits `size`: a new segment, or an expandable segment mapped further."""
        if self.config.expandable_segments:
            return self._map_more(small, stream, size, context)
        total = allocation_size(size)
        if self.reserved + total > self.total_memory:
            return None
        segment = Segment(self._take_addresses(total), total, stream, small, False, context)
        block = Block(segment.address, total, segment)
        segment.first = block
        self.segments.append(segment)
        self.counters["num_device_alloc"] += 1
        self._stat("reserved_bytes", small, total)
        self._stat("segment", small, 1)
        self._emit("segment_alloc", segment.address, total, stream, context)
        self._insert_free(block)
        return block

    def _take_addresses(self, size: int) -> int:
        address = self._next_address
        self._next_address += -(-size // ROUND_LARGE) * ROUND_LARGE
        return address

    def _map_more(self, small: bool, stream: int, size: int, context: Any) -> Optional[Block]:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        segment = self._expandable.get((stream, small))
        if segment is None:
            # A segment's address range is reserved up front (the device's size); pages map into it.
            segment = Segment(self._take_addresses(self.total_memory), 0, stream, small, True, context)
            self._expandable[(stream, small)] = segment
            self.segments.append(segment)
            self._stat("segment", small, 1)
        last = segment.first
        while last is not None and last.next is not None:
            last = last.next
        tail_free = last.size if last is not None and not last.allocated else 0
        grow = -(-(size - tail_free) // page) * page
        if self.reserved + grow > self.total_memory:
            return None
        start = segment.address + segment.size
        segment.size += grow
        self.counters["num_device_alloc"] += 1
        self._stat("reserved_bytes", small, grow)
        self._emit("segment_map", start, grow, stream, context)
        if tail_free and last is not None:
            self._remove_free(last)
            last.size += grow
            self._insert_free(last)
            return last
        block = Block(start, grow, segment, prev=last)
        if last is not None:
            last.next = block
        else:
            segment.first = block
        self._insert_free(block)
        return block

    def _release_cached(self, wanted: Callable[[Segment], bool]) -> None:
        for segment in list(self.segments):
            block = segment.first
            if block is None or block.allocated or block.next is not None or not wanted(segment):
                if segment.expandable:
                    self._unmap_tail(segment)
                continue
            self._remove_free(block)
            self.segments.remove(segment)
            self.counters["num_device_free"] += 1
            if segment.expandable:
                del self._expandable[(segment.stream, segment.small)]
                self._emit("segment_unmap", segment.address, segment.size, segment.stream, None)
            else:
                self._emit("segment_free", segment.address, segment.size, segment.stream, None)
            self._stat("reserved_bytes", segment.small, -segment.size)
            self._stat("segment", segment.small, -1)

    def _unmap_tail(self, segment: Segment) -> None:
        """An expandable segment gives back the whole pages of its free end."""
        page = SMALL_BUFFER if segment.small else LARGE_BUFFER
        last = segment.first
        while last is not None and last.next is not None:
            last = last.next
        if last is None or last.allocated:
            return
        drop = (last.address + last.size - max(last.address, segment.address)) // page * page
        if drop <= 0:
            return
        self._remove_free(last)
        last.size -= drop
        segment.size -= drop
        self._emit("segment_unmap", segment.address + segment.size, drop, segment.stream, None)
        self._stat("reserved_bytes", segment.small, -drop)
        if last.size:
            self._insert_free(last)
        elif last.prev is not None:
            last.prev.next = None
        else:
            segment.first = None

    def blocks(self, segment: Segment) -> List[Block]:
        """A segment's blocks in address order."""
        out, block = [], segment.first
        while block is not None:
            out.append(block)
            block = block.next
        return out
