"""Starting and stopping an emulation: the Emulator's state (runtime.py) given the modes, patches
and guards that make a script's CUDA calls run on it. They import the runtime; the runtime imports
none of them, so that each module of the emulator imports on its own (no circle)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from memdiff.recording.emulate.runtime import Emulator, use_torch


def start(emulator: Emulator) -> contextlib.ExitStack:
    """Put `emulator` in force (torch's CUDA calls answer as its GPU); closing the stack returned
    undoes it. For a process that emulates until it ends (a launched rank), keep the stack."""
    import torch

    use_torch(torch)
    from memdiff.recording.emulate import (
        asked,
        build,
        deepspeed_ops,
        distributed,
        files,
        flex,
        interrupts,
        layout,
        legacy,
        parallel,
        patches,
        rmsnorm,
        rngstate,
        rnn,
        shared,
        smi,
        storages,
        threads,
        triton_autotune,
        triton_launch,
        warnlines,
    )
    from memdiff.recording.emulate.autocast import Autocast
    from memdiff.recording.emulate.host import Host
    from memdiff.recording.emulate.modes import AllocMode, DeviceMode
    from memdiff.recording.launch_lightning import children_waited, probed

    emulator.autocast = Autocast()
    stack = contextlib.ExitStack()
    emulator.device_mode = DeviceMode(emulator)
    emulator.host = Host()
    stack.enter_context(emulator.host.readable())
    stack.enter_context(patches.cuda_answers_as(emulator))
    stack.enter_context(storages.storage_methods(emulator))
    stack.enter_context(rnn.cudnn_answers())
    stack.enter_context(rmsnorm.fused_kernel())
    stack.enter_context(build.cuda_build_answers())
    stack.enter_context(deepspeed_ops.fused_optimizers())
    stack.enter_context(triton_launch.launches_allocate_nothing())
    stack.enter_context(triton_autotune.tuned_without_benchmarks())
    stack.enter_context(legacy.legacy_cuda_types())
    stack.enter_context(distributed.fake_process_groups(emulator))
    stack.enter_context(layout.recorded())
    stack.enter_context(probed())
    stack.enter_context(children_waited())
    stack.enter_context(parallel.data_parallel())
    stack.enter_context(shared.device_storages_shared())
    stack.enter_context(shared.device_tensors_sent(emulator.placement))
    stack.enter_context(asked.devices_asked(emulator))
    stack.enter_context(files.guarded(emulator))
    stack.enter_context(smi.nvidia_smi(emulator.gpu, emulator.count))
    stack.enter_context(warnlines.at_the_script())
    alloc = AllocMode(emulator)
    stack.enter_context(threads.every_thread(emulator.device_mode, alloc))
    stack.enter_context(emulator.device_mode)
    stack.enter_context(flex.flex_attention_kernels(AllocMode))
    stack.enter_context(rngstate.rng_state_operators(AllocMode))
    stack.enter_context(alloc)
    stack.enter_context(interrupts.held_in_finalizers())
    return stack


@contextlib.contextmanager
def emulating(emulator: Emulator) -> Iterator[Emulator]:
    """`emulator` in force for the block."""
    with start(emulator):
        yield emulator
