"""Triton kernels tuned by `@triton.autotune(configs=[...several...], key=[...])` (Liger's kernels,
trl's and unsloth's): on a GPU the first call for each key benchmarks every config (Triton's
`do_bench`, kernels timed on the device) and then launches the fastest. Under emulation nothing can be
timed, and Triton's benchmarker reached the CUDA driver, which a machine without a GPU lacks.

So the Autotuner's benchmarker is replaced, its narrowest and most stable point across Triton's
versions: `Autotuner.do_bench`, which every config's `_bench` calls with the kernel's call wrapped in
Triton's own hooks. The replacement times nothing and gives every config the same time, so Triton
keeps the first config that pruning (`prune_configs_by`, `early_config_prune`) leaves, in the order
the script lists them: which config a GPU would find fastest cannot be known here, and a launch
allocates nothing whatever its config, so the choice changes no memory. The chosen config is then
launched through the direct-launch path (triton_launch.py).

What the GPU does in memory while it tunes is done too: each benchmark allocates Triton's 256 MiB
buffer that flushes the L2 cache between timed runs (its CUDA driver's
`get_empty_cache_for_benchmark`, int32, freed when the benchmark returns), and each call of the kernel
runs Triton's hooks as on the GPU: `reset_to_zero` zeroes its tensors, `restore_value` clones its
tensors before the launch and copies them back after (the clones freed then), and a config's own
`pre_hook` runs. With `cache_results=True` (or TRITON_CACHE_AUTOTUNING=1) a GPU reads the timings
a run before left on disk, under a key that asks the driver for its target; here every key tunes as
on a GPU whose cache does not hold it yet (the first run on a machine), and nothing is written to the
cache. Not modelled: a user's `perf_model` or hook that queries the device, which still reaches the
driver and is refused in one line (escapes.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence

from memdiff.recording.emulate.on_import import patched_on_import

_AUTOTUNER = "triton.runtime.autotuner"
# Triton's CUDA driver flushes the L2 cache between timed runs by zeroing a buffer of this size.
FLUSH_BYTES = 256 * 1024 * 1024


def bench_without_timing(kernel_call: Callable[[], Any], quantiles: Optional[Sequence[float]] = None,
                         **_: Any) -> List[float]:
    """A config's benchmark as its memory goes on a GPU (`triton.testing.do_bench`: one call, then
    the flush buffer, then calls with it alive), timing nothing: every config takes the same time."""
    import torch

    kernel_call()
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int, device="cuda")
    flush.zero_()
    kernel_call()
    del flush
    return [0.0] * (len(quantiles) if quantiles else 1)


def _tuned_here(self: Any, tuning_key: Any, configs: Any, bench_fn: Callable[[], None]) -> bool:
    """Autotuner.check_disk_cache as on a cache miss: tune now; False (no timings read from disk)."""
    bench_fn()
    return False


def _bench(name: str, module: Any) -> Any:
    # a property, not the cached_property it replaces: a data descriptor, so it wins over a
    # benchmarker an Autotuner cached before the emulator started
    return module.Autotuner, "do_bench", property(lambda self: bench_without_timing)


def _cache(name: str, module: Any) -> Any:
    return module.Autotuner, "check_disk_cache", _tuned_here


@contextlib.contextmanager
def tuned_without_benchmarks() -> Iterator[None]:
    """For the block: every `triton.autotune` kernel picks a config as above, whether Triton was
    imported before the emulator started or is imported while it runs."""
    with patched_on_import((_AUTOTUNER,), _bench), patched_on_import((_AUTOTUNER,), _cache):
        yield
