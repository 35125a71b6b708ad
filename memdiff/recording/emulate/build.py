"""The CUDA build's versions (CUDA, cuDNN, NCCL), answered on torch's CPU build while the emulator runs.

A CPU build of torch says it has no CUDA (`torch.version.cuda` is None), no cuDNN and no NCCL, and
scripts and libraries take that for a machine without a GPU even though `torch.cuda.is_available()`
answers true: transformers refuses `TrainingArguments(tf32=True)` ("requires Ampere or a newer GPU
arch, cuda>=11"), DDP's `bf16_compress_hook` and torch.distributed's logging read
`torch.cuda.nccl.version()`, which fails on the CPU build with an AttributeError. The answers are
those of torch's CUDA wheel (kernels.json's `cuda_build`), so the script runs as on the GPU; a CUDA
build of torch answers for itself and is left alone.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

import torch

from memdiff.recording.emulate import swap
from memdiff.recording.emulate.gpus import kernels


@contextlib.contextmanager
def cuda_build_answers() -> Iterator[None]:
    """torch.version.cuda, torch.backends.cudnn.version()/is_available() and torch.cuda.nccl.version()
    answer as the CUDA build for the block, on a CPU build of torch."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        yield
        return
    import torch.backends.cudnn as cudnn
    import torch.cuda.nccl as nccl

    build = kernels()["cuda_build"]
    nccl_version = tuple(int(part) for part in build["nccl"])
    replaced: List[Tuple[Any, str, Any]] = [
        (torch.version, "cuda", str(build["cuda"])),
        (cudnn, "version", lambda: int(build["cudnn"])),
        (cudnn, "is_available", lambda: True),
        (nccl, "version", lambda: nccl_version),
    ]
    with swap.replaced(replaced):
        yield
