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
  address first), split when the rest is worth keeping (512 bytes in the small pool or with
  expandable segments, more than 1 MiB in the large one, and never a block of max_split_size or
  more);
- a freed block merges with free neighbours of its segment and stays cached: segments are given
  back only by empty_cache(), or when the device is full (with max_split_size, the oversize cached
  segments first; then every unsplit cached segment, and the request again), or past
  garbage_collection_threshold under a memory fraction (the oldest unsplit large segments);
- a new segment's address is the driver's (DeviceAddresses): best fit breaks ties between equal
  free blocks by address, so where the driver puts segments decides which block a request reuses;
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
# The top of the emulated device's address space: the driver hands out segments below it.
BASE_ADDRESS = 0x7F0000000000
# The driver maps each new segment into a slot of whole 32 MiB (aligned to 32 MiB), each below the
# last, and puts a later segment that fits into the unused end of an earlier slot, lowest address
# first. Read off the segment_alloc addresses of real H100 traces (driver 580, CUDA 13.0, torch
# 2.11): the DDP ranks of tests/data/cuda/ddp and ../shared/cuda-truth/bert-base, recorded from an
# empty allocator, keep this order for 97% of their pairs of segments (the rest: allocations of the
# CUDA libraries themselves, which the allocator does not see, took holes first); with these
# addresses the model makes the segments of all nine real windows (../shared/cuda-truth and the
# GPT-2 runs of tests/data/cuda), where addresses that only grow gave llama-base 316 MiB less
# (the same-sized free blocks of its backward were reused in the other order). An estimate of the
# driver's rule, not its documentation.
ADDRESS_SLOT = 32 * MiB


class OutOfMemory(Exception):
    """The request does not fit in the device's memory, even after every cached segment went back;
    `requested` is the segment it asked the device for, as torch's message says."""

    def __init__(self, requested: int, free: int, reserved: int, allocated: int, total: int) -> None:
        super().__init__(f"tried to allocate {requested} bytes with {free} free of {total} "
                         f"({allocated} allocated, {reserved} reserved by PyTorch)")
        self.requested, self.free, self.reserved, self.allocated, self.total = \
            requested, free, reserved, allocated, total


class DeviceAddresses:
    """The driver's choice of address for each new segment (see ADDRESS_SLOT): slots of whole 32 MiB
    taken downwards from `top`, and the free ends of slots (and segments given back) filled lowest
    address first."""

    def __init__(self, top: int = BASE_ADDRESS) -> None:
        self._low = top
        self._holes: List[Tuple[int, int]] = []  # (address, bytes), in address order

    def take(self, size: int) -> int:
        """The address of a new mapping of `size` bytes (rounded up to the driver's 2 MiB pages)."""
        size = -(-size // ROUND_LARGE) * ROUND_LARGE
        for i, (address, free) in enumerate(self._holes):
            if free >= size:
                if free == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (address + size, free - size)
                return address
        span = -(-size // ADDRESS_SLOT) * ADDRESS_SLOT
        self._low -= span
        if span > size:
            bisect.insort(self._holes, (self._low + size, span - size))
        return self._low

    def give_back(self, address: int, size: int) -> None:
        """A mapping the allocator freed: its addresses can be handed out again."""
        size = -(-size // ROUND_LARGE) * ROUND_LARGE
        i = bisect.bisect_left(self._holes, (address, 0))
        self._holes.insert(i, (address, size))
        # Join it with the holes it touches.
        if i + 1 < len(self._holes) and address + size == self._holes[i + 1][0]:
            self._holes[i] = (address, size + self._holes.pop(i + 1)[1])
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == address:
            start, before = self._holes[i - 1]
            self._holes[i - 1] = (start, before + self._holes.pop(i)[1])


# roundup_power2_divisions applies per power-of-two interval of sizes from 1 MiB to 64 GiB (MiB):
# one count of divisions each; sizes below the first use its count, above the last its count.
INTERVALS = [1 << k for k in range(16)]


@dataclass
class AllocatorConfig:
    """The settings PYTORCH_CUDA_ALLOC_CONF gives (the ones that change sizes and segments)."""

    max_split_size: int = NO_LIMIT
    # how much bigger than a request of max_split_size or more a cached block it takes may be
    # (max_non_split_rounding_mb; kLargeBuffer unless set, and never less)
    max_non_split_rounding: int = LARGE_BUFFER
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
            elif key == "max_non_split_rounding_mb":
                if int(value) * MiB < LARGE_BUFFER:
                    raise ValueError("CachingAllocator option max_non_split_rounding_mb too small, must be >= 20")
                config.max_non_split_rounding = int(value) * MiB
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
    gc_base: int = 0  # its pool's count of searches when it was cached (garbage collection's age)


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
POOLED = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
          "inactive_split_bytes", "requested_bytes")
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class CachingAllocator:
    """One device's caching allocator. `malloc` gives a Block, `free` takes it back; `trace` (if set)
    is told each event as the real allocator records it (alloc, free_requested, free_completed,
    segment_alloc, segment_free, segment_map, segment_unmap, oom). `total_memory` is what the device
    has for it (its memory less the CUDA context's)."""

    def __init__(self, total_memory: int, config: Optional[AllocatorConfig] = None) -> None:
        self.total_memory = total_memory
        self.config = config or AllocatorConfig()
        self.trace: Optional[TraceHook] = None
        self.segments: List[Segment] = []
        # Free blocks per pool, sorted by (stream, size, address): the real allocator's BlockComparatorSize.
        self._free: Dict[bool, List[Tuple[int, int, int, Block]]] = {True: [], False: []}
        self.addresses = DeviceAddresses()
        self._expandable: Dict[Tuple[int, bool], Segment] = {}
        # torch.cuda.set_per_process_memory_fraction's bytes (allowed_memory_maximum), None until set
        self.allowed: Optional[int] = None
        self._searches = {True: 0, False: 0}  # get_free_block calls per pool, counted for garbage collection
        self.stats: Dict[str, Dict[str, Stat]] = {
            name: {p: Stat() for p in ("all", "small_pool", "large_pool")} for name in POOLED}
        self.oversize = {"oversize_allocations": Stat(), "oversize_segments": Stat()}
        self.counters = {name: 0 for name in COUNTERS}

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
        """torch.cuda.memory_stats()'s flat dictionary, its keys sorted as torch sorts them: the
        counters, max_split_size, each pooled statistic per pool and the oversize counts."""
        out: Dict[str, int] = dict(self.counters)
        keys = ("current", "peak", "allocated", "freed")
        for name, pools in self.stats.items():
            for pool, stat in pools.items():
                for key in keys:
                    out[f"{name}.{pool}.{key}"] = getattr(stat, key)
        for name, stat in self.oversize.items():
            for key in keys:
                out[f"{name}.{key}"] = getattr(stat, key)
        # max_split_size is a size_t in torch's stats, read back as int64: its unset value is -1.
        out["max_split_size"] = -1 if self.config.max_split_size == NO_LIMIT else self.config.max_split_size
        return dict(sorted(out.items()))

    def reset_peaks(self) -> None:
        """torch.cuda.reset_peak_memory_stats()."""
        for stat in self._all_stats():
            stat.peak = stat.current

    def reset_accumulated(self) -> None:
        """torch.cuda.reset_accumulated_memory_stats(): every `allocated` and `freed`, and the counters."""
        for stat in self._all_stats():
            stat.allocated = stat.freed = 0
        self.counters = {name: 0 for name in COUNTERS}

    def _all_stats(self) -> List[Stat]:
        return [stat for pools in self.stats.values() for stat in pools.values()] + list(self.oversize.values())

    def set_memory_fraction(self, allowed: int) -> None:
        """torch.cuda.set_per_process_memory_fraction: segments may total `allowed` bytes at most, and
        garbage_collection_threshold takes effect (the real allocator collects only under a fraction)."""
        self.allowed = allowed

    def _emit(self, action: str, address: int, size: int, stream: int, context: Any) -> None:
        if self.trace is not None:
            self.trace(action, address, size, stream, context)

    # -- the free lists ---------------------------------------------------------------------------

    def _insert_free(self, block: Block) -> None:
        block.gc_base = self._searches[block.segment.small]
        bisect.insort(self._free[block.segment.small], (block.segment.stream, block.size, block.address, block))

    def _remove_free(self, block: Block) -> None:
        pool = self._free[block.segment.small]
        i = bisect.bisect_left(pool, (block.segment.stream, block.size, block.address))
        del pool[i]

    def _collecting(self) -> bool:
        return self.allowed is not None and self.config.garbage_collection_threshold > 0

    def _find_free(self, small: bool, stream: int, size: int) -> Optional[Block]:
        if self._collecting():
            self._searches[small] += 1  # a cached block's age counts the searches since it was cached
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i == len(pool) or pool[i][0] != stream:
            return None
        block = pool[i][3]
        limit = self.config.max_split_size
        if limit != NO_LIMIT:
            # An oversized cached block serves neither small requests nor large ones it would waste
            # (get_free_block: a request under max_split_size never takes a block of it or more; one of
            # it or more only a block less than max_non_split_rounding bigger).
            if size < limit and block.size >= limit:
                return None
            if size >= limit and block.size >= size + self.config.max_non_split_rounding:
                return None
        return block

    # -- malloc and free --------------------------------------------------------------------------

    def malloc(self, requested: int, stream: int = 0, context: Any = None) -> Block:
        """A block for a request of `requested` bytes on `stream`; OutOfMemory when it cannot fit."""
        size = round_size(requested, self.config)
        small = size <= SMALL_SIZE
        block = self._find_free(small, stream, size)
        if block is None:
            # As DeviceCachingAllocator::malloc: collect (under a fraction), ask the device; then free
            # the oversize cached segments that make room and ask again; then every unsplit cached
            # segment, and ask a last time (the retry torch counts).
            if self._collecting():
                self._collect_garbage()
            block = self._grow(small, stream, size, context)
            if block is None and self._release_oversize(small, stream, size):
                block = self._grow(small, stream, size, context)
            if block is None:
                self._release_cached()
                self.counters["num_alloc_retries"] += 1
                block = self._grow(small, stream, size, context)
        if block is None:
            self.counters["num_ooms"] += 1
            free = self.total_memory - self.reserved
            # The trace names the rounded request; torch's message the segment it failed to get.
            self._emit("oom", 0, size, stream, free)
            raise OutOfMemory(allocation_size(size), free, self.reserved, self.allocated, self.total_memory)
        self._remove_free(block)
        rest = block.size - size
        # should_split: the small pool and expandable segments keep any rest of 512 bytes or more; the
        # large pool only a rest of more than kSmallSize (1 MiB), and never splits for a request of
        # max_split_size or more.
        if small or self.config.expandable_segments:
            split = rest >= MIN_BLOCK
        else:
            split = size < self.config.max_split_size and rest > SMALL_SIZE
        counted = not block.segment.expandable  # inactive_split leaves expandable segments out
        if split:
            already_split = self._was_split(block)
            tail = Block(block.address + size, rest, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert_free(tail)
            if counted and already_split:  # an inactive split block shrinks by what is taken
                self._stat("inactive_split_bytes", small, -size)
            elif counted:  # a whole block is split: its rest is a new inactive split block
                self._stat("inactive_split_bytes", small, rest)
                self._stat("inactive_split", small, 1)
        elif counted and self._was_split(block):
            self._stat("inactive_split_bytes", small, -block.size)
            self._stat("inactive_split", small, -1)
        block.allocated, block.requested, block.context = True, requested, context
        self._emit("alloc", block.address, requested, stream, context)
        self._stat("allocation", small, 1)
        self._stat("allocated_bytes", small, block.size)
        self._stat("active", small, 1)
        self._stat("active_bytes", small, block.size)
        self._stat("requested_bytes", small, requested)
        if block.size >= self.config.max_split_size:
            self.oversize["oversize_allocations"].add(1)
        return block

    def free(self, block: Block, context: Any = None) -> None:
        """Give a block back: cached, merged with free neighbours of its segment."""
        small = block.segment.small
        self._stat("allocation", small, -1)
        self._stat("allocated_bytes", small, -block.size)
        self._emit("free_requested", block.address, block.requested, block.segment.stream, context)
        if block.size >= self.config.max_split_size:
            self.oversize["oversize_allocations"].sub(1)
        self._emit("free_completed", block.address, block.requested, block.segment.stream, context)
        size, requested = block.size, block.requested
        block.allocated, block.requested, block.context = False, 0, None
        # free_block counts the net change of inactive split blocks: each free neighbour merged in is
        # one fewer, and the merged block is one if it is still part of a split segment.
        blocks, split_bytes = 0, 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                blocks, split_bytes = blocks - 1, split_bytes - neighbour.size
                self._merge(block, neighbour)
        if self._was_split(block):
            blocks, split_bytes = blocks + 1, split_bytes + block.size
        if not block.segment.expandable:
            self._stat("inactive_split", small, blocks)
            self._stat("inactive_split_bytes", small, split_bytes)
        self._stat("active", small, -1)
        self._stat("active_bytes", small, -size)
        self._stat("requested_bytes", small, -requested)
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
        self._release_cached()

    # -- segments ---------------------------------------------------------------------------------

    def _fits(self, grow: int) -> bool:
        """Whether the device (and the memory fraction, when set) has room for `grow` bytes more."""
        if self.allowed is not None and self.reserved + grow > self.allowed:
            return False
        return self.reserved + grow <= self.total_memory

    def _grow(self, small: bool, stream: int, size: int, context: Any) -> Optional[Block]:
        """A new free block that fits `size`: a new segment, or an expandable segment mapped further."""
        if self.config.expandable_segments:
            return self._map_more(small, stream, size, context)
        total = allocation_size(size)
        if not self._fits(total):
            return None
        segment = Segment(self._take_addresses(total), total, stream, small, False, context)
        block = Block(segment.address, total, segment)
        segment.first = block
        self.segments.append(segment)
        self.counters["num_device_alloc"] += 1
        self._stat("segment", small, 1)
        self._stat("reserved_bytes", small, total)
        if total >= self.config.max_split_size:
            self.oversize["oversize_segments"].add(1)
        self._emit("segment_alloc", segment.address, total, stream, context)
        self._insert_free(block)
        return block

    def _take_addresses(self, size: int) -> int:
        return self.addresses.take(size)

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
        if not self._fits(grow):
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

    def _release_segment(self, segment: Segment) -> None:
        """cudaFree of a cached segment that holds one free block (release_block)."""
        block = segment.first
        assert block is not None and not block.allocated and block.next is None
        self._remove_free(block)
        self.segments.remove(segment)
        self.counters["num_device_free"] += 1
        self._emit("segment_free", segment.address, segment.size, segment.stream, None)
        self.addresses.give_back(segment.address, segment.size)
        self._stat("segment", segment.small, -1)
        self._stat("reserved_bytes", segment.small, -segment.size)
        if segment.size >= self.config.max_split_size:
            self.oversize["oversize_segments"].sub(1)

    def _release_cached(self) -> None:
        """release_cached_blocks: every unsplit cached block goes back, the large pool's first, each
        pool in its search order (stream, size, address); expandable segments unmap their free end."""
        self.counters["num_sync_all_streams"] += 1  # it waits for every stream first
        for small in (False, True):
            for _, _, _, block in list(self._free[small]):
                if not block.segment.expandable and block.prev is None and block.next is None:
                    self._release_segment(block.segment)
        for segment in [s for s in self.segments if s.expandable]:
            head = segment.first
            if head is not None and not head.allocated and head.next is None:
                self._remove_free(head)
                self.segments.remove(segment)
                self.counters["num_device_free"] += 1
                del self._expandable[(segment.stream, segment.small)]
                self._emit("segment_unmap", segment.address, segment.size, segment.stream, None)
                self._stat("reserved_bytes", segment.small, -segment.size)
                self._stat("segment", segment.small, -1)
            else:
                self._unmap_tail(segment)

    def _release_oversize(self, small: bool, stream: int, size: int) -> bool:
        """release_available_cached_blocks (only with max_split_size set): the smallest cached oversize
        block of the stream that covers the request goes back; failing one, the largest ones until
        enough has gone. Whether anything went back."""
        limit = self.config.max_split_size
        if limit == NO_LIMIT:
            return False
        want = max(size, limit)
        pool = self._free[small]
        i = bisect.bisect_left(pool, (stream, want, -1))
        if i < len(pool) and pool[i][0] == stream:
            self._release_segment(pool[i][3].segment)
            return True
        released = 0
        for _, bsize, _, block in reversed(pool[:i]):
            if released >= want or bsize < limit or block.segment.stream != stream:
                break
            released += bsize
            self._release_segment(block.segment)
        return released >= want

    def _collect_garbage(self) -> None:
        """garbage_collect_cached_blocks: past garbage_collection_threshold of the memory fraction, the
        unsplit cached large blocks that waited longest (at least the average wait, counted in searches
        of the pool) go back, round after round, until what went back covers the excess."""
        assert self.allowed is not None
        threshold = int(self.config.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        searches = self._searches[False]
        ages = {id(e[3]): searches - e[3].gc_base for e in self._free[False]
                if e[3].prev is None and e[3].next is None and not e[3].segment.expandable}
        total_age, count = sum(ages.values()), len(ages)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            average = total_age / count
            freed = False
            for _, _, _, block in list(self._free[False]):
                age = ages.get(id(block))
                if age is not None and age >= average:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    del ages[id(block)]
                    self._release_segment(block.segment)

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
        self.counters["num_device_free"] += 1
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
