"""What the emulator does not cover, said as such: the refusals a user sees, one line each.

Two ways a script reaches what the emulator cannot run:
- an op with no meta kernel (PyTorch gives it no shapes without data, or a custom op has no fake
  implementation): the dispatch mode refuses it (`op_refusal`);
- a call that goes around the emulator to the CUDA driver or runtime (a CUDA build's C++ reaching
  the driver, a CPU build's stand-in classes for CUDA ones, NVML): the script's own exception,
  which `escaped` names by the torch feature it came from and the script's line.

Both are bad input for memdiff (exit 2, one line), never a guess at the user's code.
"""

from __future__ import annotations

import traceback
from typing import Any, List, Optional, Sequence, Tuple

from memdiff.errors import InputError
from memdiff.read.installed import InstalledLibraries

# Libraries installed outside site-packages (`pip install --target DIR` on PYTHONPATH), by pip's own
# mark, as a snapshot's frames read them: asked once per file for the process's life.
_installed = InstalledLibraries()

# Namespaces of PyTorch's own ops: a refusal there is PyTorch's missing shape function, not the user's.
TORCH_NAMESPACES = ("aten", "prims", "c10d", "_c10d_functional", "quantized", "profiler")

# What an exception says when it came from reaching CUDA itself (lower case).
CUDA_MESSAGES = ("found no nvidia driver", "torch not compiled with cuda enabled",
                 "cuda driver version is insufficient", "no cuda gpus are available",
                 "tried to instantiate dummy base class", "cuda error", "cudaerror", "nvidia-ml-py", "nvml",
                 "libcuda", "cuda runtime", "cuda_home environment variable is not set")

# A CUDA extension a library builds as the script runs, and what to do instead.
EXTENSION = "a CUDA extension built as the script runs (torch.utils.cpp_extension: apex's fused kernels)"
EXTENSION_INSTEAD = "use the library's PyTorch path"

# The torch source each feature lives in, the feature's name and what to do instead; first match wins.
FEATURES: Tuple[Tuple[str, str, str], ...] = (
    ("torch/cuda/graphs.py", "CUDA graphs (torch.cuda.graph, CUDAGraph, make_graphed_callables)",
     "record a run without graph capture (most scripts have a flag for it)"),
    ("torch/cuda/jiterator.py", "jiterator kernels",
     "wrap the kernel in a torch.library op with a fake implementation"),
    ("torch/cuda/memory.py:list_gpu_processes", "NVML queries (list_gpu_processes)",
     "guard them with an environment variable or skip them when memdiff records"),
    ("torch/_inductor/", "torch.compile's generated kernels", "record the model uncompiled"),
    # torch.utils.cpp_extension.load builds for CUDA where torch says CUDA is there (apex, a library's
    # own kernels): needing nvcc, and kernels that would run on no data. DeepSpeed's op builders are
    # answered before they build (deepspeed_ops.py).
    ("torch/utils/cpp_extension.py", EXTENSION, EXTENSION_INSTEAD),
    # a `@triton.jit` kernel's launch (triton_launch.py) and triton.autotune's tuning
    # (triton_autotune.py) are emulated; Triton's own queries of the driver are not
    ("triton/",
     "Triton's own calls to the GPU (driver queries, a triton.autotune perf_model or hook asking the device)",
     "give the kernel one config, or wrap it in a torch.library custom op and register its fake implementation"),
    ("torch/distributed/", "torch.distributed's device-side calls", "none yet: record this job on GPUs"),
)


def op_refusal(namespace: str, name: str, where: str) -> InputError:
    """The one line for an op the dispatch mode could not run on the meta device."""
    op = f"{namespace}::{name}"
    if namespace in TORCH_NAMESPACES:
        why = (f"PyTorch has no meta kernel for it (no shapes without data), so the emulator cannot run it{where}; "
               f"record this step on a GPU, or run the code that calls it outside emulation")
    else:
        why = (f"a custom op with no fake (meta) implementation{where}: register one with "
               f"torch.library.register_fake and the emulator runs it")
    return _error(op, why)


def extension_refusal(op: str, frames: Sequence[Tuple[str, int]], emulated: str) -> InputError:
    """The one line for a library's CUDA extension the emulator has no stand-in for (`op` names it),
    asked for at `frames` (filename, line; innermost first), before it is built; `emulated` names
    those of the library it runs."""
    return _error(op, f"not emulated: a CUDA extension built as the script runs{called_at(frames)}; "
                      f"{EXTENSION_INSTEAD} (the emulator runs {emulated})")


def _error(path: str, message: str) -> InputError:
    # Imported here: runtime imports torch-free modules only at import time, and so does this one.
    from memdiff.recording.emulate.runtime import EmulationError

    return EmulationError(path, message)


def _is_torch(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return "/torch/" in path or "/triton/" in path


def _is_script(filename: str) -> bool:
    path = filename.replace("\\", "/")
    return not (_is_torch(path) or "/memdiff/" in path or path.startswith("<") or "/lib/python" in path
                or _package_path(path) is not None)


def _library(filename: str) -> bool:
    return _package_path(filename.replace("\\", "/")) is not None


def _package_path(path: str) -> Optional[str]:
    """A library file's path in its installed package (`trl/trainer/utils.py`): below site-packages,
    or beside the dist-info pip leaves wherever it installs (read/installed.py); None for others."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return _installed.package_path(path)


def located(filename: str, line: int) -> str:
    """`train.py:42` for a script's own file; for a library's, its path in the installed package
    (`trl/trainer/utils.py:1645`, not `utils.py:1645`), as a reader finds it."""
    path = filename.replace("\\", "/")
    package = _package_path(path)
    return f"{package if package is not None else path.rsplit('/', 1)[-1]}:{line}"


def called_at(frames: Sequence[Tuple[str, int]]) -> str:
    """`, called at train.py:42` from (filename, line) frames, innermost first: the innermost frame of
    the script or a library (not torch, memdiff or Python's own), and where that is a library's code,
    the script's own line that led there (`, called at trl/trainer/utils.py:1645 from train.py:88`);
    "" when there is none."""
    outside = [(f, n) for f, n in frames if _is_script(f) or (_library(f) and not _is_torch(f))]
    if not outside:
        return ""
    where = f", called at {located(*outside[0])}"
    if _library(outside[0][0]):
        script = next(((f, n) for f, n in outside if _is_script(f)), None)
        where += f" from {located(*script)}" if script else ""
    return where


def escaped(exc: BaseException) -> Optional[InputError]:
    """The refusal for an exception the script raised because a call went around the emulator to
    CUDA itself, naming the torch feature and the script's line; None for any other exception (the
    script's own failure, shown as Python shows it)."""
    said = str(exc).lower()
    if not isinstance(exc, (RuntimeError, AssertionError, ModuleNotFoundError, OSError, AttributeError)):
        return None
    if not any(text in said for text in CUDA_MESSAGES):
        return None
    frames: List[traceback.FrameSummary] = traceback.extract_tb(exc.__traceback__)
    where = called_at([(f.filename, f.lineno or 0) for f in reversed(frames)])
    inner = [f for f in frames if _is_torch(f.filename)]
    for marker, feature, instead in FEATURES:
        path, _, function = marker.partition(":")
        if any(path in f.filename.replace("\\", "/") and (not function or f.name == function) for f in inner):
            return _error(feature, f"not emulated: it reached CUDA itself{where} ({_first_line(exc)}); {instead}")
    called = f"{_module_of(inner[0].filename)}.{inner[0].name}" if inner else type(exc).__name__
    return _error(called, f"not emulated: it reached CUDA itself{where} ({_first_line(exc)})")


def refusing(marker: str) -> type:
    """A stand-in class for a torch feature the emulator does not cover (FEATURES' `marker`): made or
    called, it is the one-line refusal naming the feature and the script's line, on both builds of
    torch (a CUDA build's own class would reach the driver with a message that names no feature). A
    class, as what it stands for is one in annotations (`torch.cuda.CUDAGraph | None`)."""
    feature, instead = next((f, i) for m, f, i in FEATURES if m == marker)

    class Refused:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            where = called_at([(f.filename, f.lineno or 0) for f in reversed(traceback.extract_stack()[:-1])])
            raise _error(feature, f"not emulated{where}; {instead}")
    Refused.__qualname__ = Refused.__name__ = f"emulated.{feature.split(' ')[0]}"
    return Refused


def failure_line(exc: BaseException) -> str:
    """The script's own exception in one line, worded as the emulator's refusals are: its type and first line,
    then the script's line (`RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float !=
    c10::BFloat16, called at train.py:6`), for a caller that says why a run failed without its traceback."""
    frames: List[traceback.FrameSummary] = traceback.extract_tb(exc.__traceback__)
    where = called_at([(f.filename, f.lineno or 0) for f in reversed(frames)])
    return f"{type(exc).__name__}: {_first_line(exc)}{where}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 120 else line[:117] + "..."


def _module_of(filename: str) -> str:
    """torch/cuda/graphs.py -> torch.cuda.graphs."""
    path = filename.replace("\\", "/")
    start = max(path.rfind("/torch/"), path.rfind("/triton/"))
    dotted = path[start + 1:] if start >= 0 else path.rsplit("/", 1)[-1]
    return dotted[:-3].replace("/", ".").removesuffix(".__init__") if dotted.endswith(".py") else dotted
