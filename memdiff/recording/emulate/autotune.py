"""What torch.compile allocates on the GPU while it compiles: Inductor's benchmarks, on the emulated GPU.

A compiled model's first step on a GPU runs benchmarks with real tensors (torch 2.11 and 2.13):

- shape padding (fx_passes/pad_mm.py _should_pad), while the joint graph is compiled: each
  compute-bound matrix product with a dimension that is no multiple of the alignment (4 fp32, 8
  16-bit elements) is timed with random operands of its shapes, as it is and padded (PadBench);
- Triton autotuning (CachingAutotuner.autotune_to_one_config, runtime/triton_heuristics.py): each
  kernel whose heuristics give it more than one config is timed on every config at its first
  launch; every run clones the arguments the kernel writes in place (`mutated_arg_names`,
  maybe_clone_args), freed after the run, except that in the backward and in inference
  (`optimize_mem`) an argument larger than max_memory_allocated() minus memory_allocated() is
  copied to the host instead (copy_args_to_cpu_if_needed);
- every such timing (InductorBenchmarker.benchmark_gpu, runtime/benchmarking.py) runs once, then
  holds an int32 buffer the size of the GPU's L2 cache (50 MiB on an H100) over the timed runs.

The blocks are freed before the step goes on, but the segments they were cut from stay cached, and
the recorded steps' gradients and optimizer state are cut from them: a real compiled GPT-2
(tests/data/cuda/gpt2-compile, H100) starts its window with two 50 MiB segments, six of 394 MiB and
three of 148 MiB (its 50,257-token head's products and weight-shaped operands); without these
benchmarks the emulator mapped 20 and 24 MiB segments instead (reserved +9.2%, now +0.2%).

The configs are Inductor's own: the kernel's heuristics decorator (`pointwise`, `reduction`,
`persistent_reduction`, with its size hints and metadata) is evaluated here with
`return_configs=True`, with a stand-in for Triton's Config class, which this CPU build lacks.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch

_DECORATOR = re.compile(r"^@triton_heuristics\.(\w+)\((.*?)^\)\s*\n@triton\.jit\s*\ndef \w+\((.*?)\):",
                        re.S | re.M)
_TUNED = ("pointwise", "reduction", "persistent_reduction")


class _Config:
    """triton.Config as Inductor's heuristics build it: only its settings are kept."""

    def __init__(self, kwargs: Optional[Dict[str, Any]] = None, num_warps: int = 4, num_stages: int = 2,
                 **rest: Any) -> None:
        self.kwargs = dict(kwargs or {})
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.__dict__.update(rest)


class _InductorConfig(_Config):
    """triton_heuristics.InductorConfig over the stand-in Config."""

    def __init__(self, *args: Any, dynamic_scale_rblock: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dynamic_scale_rblock = dynamic_scale_rblock


class Plan:
    """What a kernel's first launch benchmarks: how many configs, the names of its arguments and of
    those it writes in place, and whether it may copy them to the host instead (optimize_mem)."""

    def __init__(self, configs: int, arguments: List[str], mutated: List[str], optimize_mem: bool) -> None:
        self.configs = configs
        self.arguments = arguments
        self.mutated = mutated
        self.optimize_mem = optimize_mem


def plan(source: str) -> Optional[Plan]:
    """The autotuning plan of a Triton kernel's source as Inductor wrote it; None when it has no
    heuristics decorator this module knows (a template, a user kernel, a fixed config)."""
    from torch._inductor.runtime import hints
    from torch._inductor.runtime import triton_heuristics as heuristics

    found = _DECORATOR.search(source)
    if found is None or found.group(1) not in _TUNED:
        return None
    kind, arguments, signature = found.groups()
    names = {"ReductionHint": hints.ReductionHint, "TileHint": hints.TileHint, "AutotuneHint": hints.AutotuneHint,
             "DeviceProperties": hints.DeviceProperties, "AttrsDescriptor": lambda *a, **k: None,
             "__file__": "", "heuristic": getattr(heuristics, kind)}
    with mock.patch.object(heuristics, "Config", _Config), \
            mock.patch.object(heuristics, "InductorConfig", _InductorConfig):
        meta = eval(f"dict({arguments})", names)  # noqa: S307 (Inductor's own generated text)
        configs = eval(f"heuristic({arguments}, return_configs=True)", names)  # noqa: S307
    inductor_meta = meta.get("inductor_meta") or {}
    parameters = [p.split(":")[0].strip() for p in signature.split(",") if p.strip()]
    return Plan(len(configs), parameters, list(inductor_meta.get("mutated_arg_names") or []),
                bool(inductor_meta.get("optimize_mem")))


def _storage_bytes(t: torch.Tensor) -> int:
    """clone_preserve_strides' allocation: the elements the strides reach."""
    if t.numel() == 0:
        return 0
    reach = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return int(reach) * t.element_size()


def benchmark(emulator: Any, kernel_plan: Plan, args: Sequence[Any]) -> None:
    """The allocations of the first launch's benchmarking of every config (module docstring)."""
    if kernel_plan.configs <= 1:
        return
    index = emulator.placement.current()
    device = emulator.device(index)
    mutated = [a for name, a in zip(kernel_plan.arguments, args)
               if name in kernel_plan.mutated and isinstance(a, torch.Tensor) and a.is_meta]
    sizes: List[int] = []
    if kernel_plan.optimize_mem:
        stats = device.allocator.memory_stats()
        budget = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        for t in mutated:
            size = _storage_bytes(t)
            if size <= budget:  # else copied to the host
                budget -= size
                sizes.append(size)
    else:
        sizes = [_storage_bytes(t) for t in mutated]
    flush = emulator.gpu.l2_cache_size // 4 * 4

    def run_once() -> None:
        clones: List[Tuple[Any, int]] = [(emulator.allocate(s, emulator.frames("clone"), index), s)
                                         for s in sizes if s]
        for block, _ in reversed(clones):
            emulator.release(block, index)

    for _ in range(kernel_plan.configs):
        run_once()  # the warm-up run
        buffer = emulator.allocate(flush, emulator.frames("empty"), index)
        run_once()  # the timed runs, each as this one
        emulator.release(buffer, index)


def _flush_bytes(emulator: Any) -> int:
    return int(emulator.gpu.l2_cache_size) // 4 * 4


def _timed(emulator: Any, index: int, run: Any) -> None:
    """InductorBenchmarker.benchmark_gpu of `run`: a warm-up run, then the L2 flush buffer held over
    the timed runs (each allocating as the warm-up did)."""
    run()
    buffer = emulator.allocate(_flush_bytes(emulator), emulator.frames("empty"), index)
    run()
    emulator.release(buffer, index)


class PadBench:
    """Inductor's shape padding decision for a matrix product (fx_passes/pad_mm.py _should_pad, torch
    2.11 and 2.13) benchmarks on the GPU with real tensors while the joint graph is compiled: random
    operands of the product's shapes, the product as it is and with its misaligned dimensions padded
    (constant_pad_nd copies), each timed by benchmark_gpu (module docstring). The emulator makes those
    allocations and answers "do not pad": which is faster is the GPU's timing, and the real compiled
    GPT-2's buffers are the unpadded plan's. A product asked again with the same shapes is answered
    from pad_mm's cache, with no benchmark."""

    def __init__(self, emulator: Any) -> None:
        self.emulator = emulator
        self.asked: set = set()

    def should_pad(self, match: Any, mat1: Any, mat2: Any, op: Any, input: Any = None) -> bool:
        """pad_mm._should_pad's allocations on the emulated GPU; False (the product is not padded)."""
        from torch._inductor import config
        from torch._inductor.fx_passes import pad_mm

        aten = torch.ops.aten
        bmm = op is aten.bmm
        if not (bmm or op is aten.mm or op is aten.addmm) or config.force_shape_pad:
            return bool(config.force_shape_pad)
        m, k, n = (mat1.shape[1], mat1.shape[2], mat2.shape[2]) if bmm else (mat1.shape[0], mat1.shape[1],
                                                                             mat2.shape[1])
        if not all(isinstance(d, int) for d in (m, k, n)):
            return False
        mp = pad_mm.get_padded_length(m, pad_mm.get_alignment_size(mat1))
        kp = pad_mm.get_padded_length(k, pad_mm.get_alignment_size(mat1))
        np_ = pad_mm.get_padded_length(n, pad_mm.get_alignment_size(mat2))
        if not _compute_bound(m, k, n, mat1.dtype, self.emulator.gpu):
            return False
        key = (str(op), tuple(mat1.shape), tuple(mat1.stride()), tuple(mat2.shape), tuple(mat2.stride()),
               str(mat1.dtype), None if input is None else tuple(input.shape))
        if key in self.asked:
            return False
        self.asked.add(key)
        emulator = self.emulator
        index = emulator.placement.current()
        size = mat1.element_size()
        batch = mat1.shape[0] if bmm else 1
        held: List[Any] = []

        def take(nbytes: int, op_name: str) -> Any:
            block = emulator.allocate(nbytes, emulator.frames(op_name), index)
            held.append(block)
            return block

        def give(block: Any) -> None:
            held.remove(block)
            emulator.release(block, index)

        take(_storage_bytes(mat1), "randn")
        take(_storage_bytes(mat2), "randn")
        if op is aten.addmm and input is not None:
            take(_storage_bytes(input), "randn")
        pre1 = mp + kp and pad_mm.should_exclude_padding_time(match, "mat1")
        pre2 = kp + np_ and pad_mm.should_exclude_padding_time(match, "mat2")
        if pre1:
            take(batch * (m + mp) * (k + kp) * size, "constant_pad_nd")
        if pre2:
            take(batch * (k + kp) * (n + np_) * size, "constant_pad_nd")
        if op is aten.addmm and input is not None:
            take(_storage_bytes(input), "randn")  # input_pad, the padded call's bias

        def original() -> None:
            give(take(batch * m * n * size, str(op).split(".")[-1]))

        def padded() -> None:
            made = []
            if (mp or kp) and not pre1:
                made.append(take(batch * (m + mp) * (k + kp) * size, "constant_pad_nd"))
            if (kp or np_) and not pre2:
                made.append(take(batch * (k + kp) * (n + np_) * size, "constant_pad_nd"))
            made.append(take(batch * (m + mp) * (n + np_) * size, str(op).split(".")[-1]))
            for block in reversed(made):
                give(block)

        _timed(emulator, index, original)
        _timed(emulator, index, padded)
        for block in reversed(list(held)):
            give(block)
        return False


def _compute_bound(m: int, k: int, n: int, dtype: torch.dtype, gpu: Any) -> bool:
    """pad_mm.is_mm_compute_bound: the product's arithmetic intensity against half the GPU's machine
    balance (peak FLOPS over DRAM bandwidth, which torch reads from Triton and nvidia-smi on the GPU);
    here the H100's datasheet figures (fp32 67 TFLOPS, 16-bit 989 dense, 3.35 TB/s), an ESTIMATE for
    the other GPUs, and bf16 products deeper than they are wide always, before sm90."""
    denominator = m * k + n * k + m * n
    if denominator == 0:
        return False
    if dtype is torch.bfloat16 and k > m and k > n and gpu.major < 9:
        return True
    tflops = 67.0 if dtype == torch.float32 else 989.0
    return bool((m * n * k) / denominator > 0.5 * 1000 * tflops / 3350.0)
