"""Record every process of a launched job: put on the children's PYTHONPATH by `memdiff record -o DIR/`.

Python imports `sitecustomize` at start-up in every process, so each rank a launcher starts
(torchrun, accelerate, deepspeed) runs this without any change to the user's code, the way
coverage.py measures subprocesses. It does nothing unless MEMDIFF_RECORD_DIR is set, and never
imports torch itself: when the process's own `import torch` finishes, recording starts (CUDA:
at CUDA's lazy initialization, after the script has picked its device; else the profiler), and
at exit the snapshot is written to DIR/rank{RANK}.pickle (pid{PID}.pickle without a RANK). A
process that allocated nothing (the launcher itself) writes nothing. Any other sitecustomize on
the path still runs, and a failure here prints one line and lets the program go on.
"""

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _say(message):
    print(f"memdiff: {message}", file=sys.stderr)


def _target(folder):
    rank = os.environ.get("RANK", "")
    name = f"rank{rank}.pickle" if rank.isdigit() else f"pid{os.getpid()}.pickle"
    return os.path.join(folder, name)


def _start(torch, folder):
    sys.path.insert(0, os.environ["MEMDIFF_PACKAGE_PARENT"])
    try:
        from memdiff import capture
    finally:
        sys.path.pop(0)
    max_entries = int(os.environ.get("MEMDIFF_RECORD_MAX_ENTRIES", "1000000"))
    stacks = os.environ.get("MEMDIFF_RECORD_STACKS", "all")
    finish = []

    def write():
        if not finish:
            return
        try:
            snapshot = finish.pop()()
            if not capture.recorded_nothing(snapshot):
                capture.dump(snapshot, _target(folder))
        except Exception as exc:  # the user's program has ended; say why its rank has no file
            _say(f"could not write {_target(folder)}: {type(exc).__name__}: {exc}")

    def start_cuda():
        finish.append(capture.start_cuda(torch, max_entries, stacks))
        observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if observer is not None:  # an OOM kills the rank: write what led to it first
            observer(lambda *_: write())

    if torch.cuda.is_available():
        # At CUDA's lazy initialization, not now: starting it here would make a context on
        # device 0 in every rank before the script picks its own.
        torch.cuda._lazy_call(start_cuda)
    else:
        finish.append(capture.start_cpu(torch))
    import atexit
    atexit.register(write)


class _AfterTorch:
    """A meta path finder that lets `import torch` run, then starts recording."""

    def __init__(self, folder):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module
        folder = self.folder

        def exec_module(module):
            run_module(module)
            try:
                _start(module, folder)
            except Exception as exc:
                _say(f"not recording process {os.getpid()}: {type(exc).__name__}: {exc}")
        spec.loader.exec_module = exec_module
        return spec


def _chain():
    """Run the sitecustomize this one hides (a user's, or the distribution's), as Python would have."""
    mine = sys.modules.pop("sitecustomize", None)
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        sys.modules["sitecustomize"] = mine
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("MEMDIFF_RECORD_DIR") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorch(os.environ["MEMDIFF_RECORD_DIR"]))
_chain()
