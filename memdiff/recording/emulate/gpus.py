"""The GPUs the emulator knows, read from gpus.json: data, not code paths."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Dict, List

from memdiff.errors import InputError


@dataclass(frozen=True)
class Gpu:
    """One GPU as torch.cuda reports it, and what decides its kernels' memory."""

    key: str
    name: str
    major: int
    minor: int
    total_memory: int
    context_bytes: int  # taken by the CUDA context and libraries, never PyTorch's to allocate
    multi_processor_count: int
    max_threads_per_multi_processor: int
    l2_cache_size: int
    warp_size: int
    cublas_workspace: int
    cublaslt_workspace: int

    @property
    def capacity(self) -> int:
        """What PyTorch's allocator can reserve: the memory less the CUDA context's share."""
        return self.total_memory - self.context_bytes


@lru_cache(maxsize=None)
def _table() -> Dict[str, Dict[str, Any]]:
    text = resources.files("memdiff.recording.emulate").joinpath("gpus.json").read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def names() -> List[str]:
    """The GPUs `--emulate` takes."""
    return sorted(_table())


def gpu(key: str) -> Gpu:
    """The GPU named `key` (case and spaces ignored: `H100`, `a100-40gb`); InputError for another name."""
    wanted = key.strip().lower().replace(" ", "-")
    entry = _table().get(wanted)
    if entry is None:
        raise InputError("--emulate", f"no GPU named {key!r}: memdiff emulates {', '.join(names())}")
    return Gpu(key=wanted, name=entry["name"], major=entry["major"], minor=entry["minor"],
               total_memory=entry["total_memory"], context_bytes=entry["context_bytes"],
               multi_processor_count=entry["multi_processor_count"],
               max_threads_per_multi_processor=entry["max_threads_per_multi_processor"],
               l2_cache_size=entry["l2_cache_size"], warp_size=entry["warp_size"],
               cublas_workspace=entry["cublas_workspace"], cublaslt_workspace=entry["cublaslt_workspace"])


@lru_cache(maxsize=None)
def kernels() -> Dict[str, Any]:
    """The kernels' memory rules (kernels.json)."""
    text = resources.files("memdiff.recording.emulate").joinpath("kernels.json").read_text(encoding="utf-8")
    return dict(json.loads(text))
