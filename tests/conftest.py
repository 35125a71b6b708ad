"""Shared fixtures: the real snapshots in ../shared and builders for small hand-made snapshots."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "snapshots"
# A suite run inside a test (pytester.runpytest_subprocess): memdiff's plugin and xdist load from
# their entry points as in a user's suite; this environment's other plugins, which those tests
# never use, stay out (Hypothesis's and anyio's imports are 3 of a run's 10 s of CPU).
INNER_PYTEST = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:benchmark")


def required_or_skip(variable: str, reason: str) -> None:
    """Skip for `reason`; where CI sets `variable`=1 (what it installs must be there), fail instead."""
    if os.environ.get(variable) == "1":
        pytest.fail(f"{reason}; {variable}=1 makes this a failure")
    pytest.skip(reason)


def missing_shared(reason: str) -> None:
    """Skip for `reason`, shared material being absent; under MEMDIFF_REQUIRE_SHARED=1 (CI), fail."""
    required_or_skip("MEMDIFF_REQUIRE_SHARED", reason)


@pytest.fixture(scope="session")
def shared() -> Path:
    """The real snapshots folder; skips (or fails, under MEMDIFF_REQUIRE_SHARED=1) when absent."""
    if not (SHARED / "expected.json").is_file():
        missing_shared(f"real snapshots not found at {SHARED} (they live in ../shared beside the project)")
    return SHARED


@pytest.fixture(scope="session")
def expected(shared: Path) -> Dict[str, Any]:
    """expected.json: per file and device, trace_events, static_bytes and peak_bytes."""
    return json.loads((shared / "expected.json").read_text())


def assert_held_to_real(emulated, real, label: str) -> None:
    """An emulated run's device summary against the real GPU run's: the peak within 1%, the caching
    allocator's segments within 2%, the peak in the same phase, the same categories at it, and the
    model's bytes (parameters, optimizer state, gradients, workspace) equal to the byte."""
    assert abs(emulated.peak_bytes / real.peak_bytes - 1) <= 0.01, (label, emulated.peak_bytes, real.peak_bytes)
    assert abs(emulated.reserved_peak_bytes / real.reserved_peak_bytes - 1) <= 0.02, label
    assert emulated.phase_at_peak == real.phase_at_peak, label
    assert set(emulated.categories) == set(real.categories), label
    for category in ("parameter", "optimizer_state", "gradient", "workspace"):
        assert emulated.categories.get(category, 0) == real.categories.get(category, 0), (label, category)


def missing_capture_dependency(reason: str) -> None:
    """Skip for a missing capture dependency, or fail where CI requires them (MEMDIFF_REQUIRE_TORCH=1)."""
    required_or_skip("MEMDIFF_REQUIRE_TORCH", reason)


@pytest.fixture(scope="session")
def torch():
    """The torch module; skips (or fails, under MEMDIFF_REQUIRE_TORCH=1) when it is not installed."""
    try:
        import torch as module
    except ImportError:
        missing_capture_dependency("torch is not installed (pip install torch==2.13.0 for the CPU build)")
    return module


@pytest.fixture
def no_torch(monkeypatch):
    """A Python where `import torch` fails, as on a machine without it."""
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)


def real_snapshot_names() -> List[str]:
    """Snapshot file names listed in expected.json (empty when ../shared is absent)."""
    path = SHARED / "expected.json"
    return sorted(json.loads(path.read_text())) if path.is_file() else ["<missing ../shared>"]


# Frames as PyTorch records them with stacks="python".
def py_frames(*calls: str, root: str = "/home/a/proj") -> List[Dict[str, Any]]:
    """Frames innermost first from 'file.py:line:function' specs; bare names live under `root`."""
    out = []
    for call in calls:
        file, line, name = call.rsplit(":", 2)
        if not file.startswith("/") and "site-packages" not in file:
            file = f"{root}/{file}"
        out.append({"filename": file, "line": int(line), "name": name})
    return out


def alloc(addr: int, size: int, frames: Optional[List[Dict[str, Any]]] = None, **kw: Any) -> Dict[str, Any]:
    """An `alloc` trace entry."""
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames or [], **kw}


def free(addr: int, size: int, frames: Optional[List[Dict[str, Any]]] = None, completed: bool = True,
         **kw: Any) -> Dict[str, Any]:
    """A `free_completed` (or `free_requested`) trace entry."""
    action = "free_completed" if completed else "free_requested"
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames or [], **kw}


def segment(device: int, address: int, blocks: List[Dict[str, Any]], **kw: Any) -> Dict[str, Any]:
    """A segment whose total size is the sum of its blocks."""
    total = sum(b["size"] for b in blocks)
    return {"device": device, "address": address, "total_size": total, "allocated_size": sum(
        b["size"] for b in blocks if b["state"] == "active_allocated"), "stream": 0,
            "segment_type": "large", "blocks": blocks, **kw}


def block(address: Optional[int], size: int, state: str = "active_allocated",
          frames: Optional[List[Dict[str, Any]]] = None, **kw: Any) -> Dict[str, Any]:
    """A block; `address=None` makes a torch 2.0 style block without an address."""
    b = {"size": size, "requested_size": size, "state": state, "frames": frames or [], **kw}
    if address is not None:
        b["address"] = address
    return b


@pytest.fixture
def write_snapshot(tmp_path: Path):
    """Write an object as a snapshot file (pickle protocol 4 by default) and return its path."""
    def write(obj: Any, name: str = "snap.pickle", protocol: int = 4) -> str:
        path = tmp_path / name
        if name.endswith(".json"):
            path.write_text(json.dumps(obj))
        else:
            path.write_bytes(pickle.dumps(obj, protocol=protocol))
        return str(path)
    return write


@pytest.fixture(scope="session")
def scenarios(torch, tmp_path_factory, request):
    """scenarios(*names) -> {name: snapshot path}: runs of the scenario suite (tests/scenario_suite.py),
    captured on CPU once per session. Skips (fails under MEMDIFF_REQUIRE_TORCH=1) without transformers."""
    if sys.version_info < (3, 11):
        pytest.skip("the scenario suite's transformers 5.23 needs Python 3.11+")
    try:
        import transformers  # noqa: F401
    except ImportError:
        missing_capture_dependency("transformers is not installed (pip install -e '.[test]')")
    from filelock import FileLock
    from scenario_suite import SCENARIOS, capture

    # One capture of the whole suite: the families run in parallel and import transformers once.
    # Under xdist each worker has a base folder of its own inside the session's: the capture goes
    # beside them, made by the first worker that needs it while any other waits for it.
    base = tmp_path_factory.getbasetemp()
    shared_base = base.parent if hasattr(request.config, "workerinput") else base
    folder, made = shared_base / "scenarios", shared_base / "scenarios.json"
    with FileLock(str(shared_base / "scenarios.lock")):
        if made.exists():
            paths = {name: Path(path) for name, path in json.loads(made.read_text()).items()}
        else:
            folder.mkdir(exist_ok=True)
            paths = capture(sorted(SCENARIOS), folder)
            made.write_text(json.dumps({name: str(path) for name, path in paths.items()}))

    def get(*names: str) -> Dict[str, Path]:
        return {name: paths[name] for name in names}
    return get


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    """The longest work first, so that the quick files fill the end of a run under `-n auto --dist
    loadfile` (the README's command hands each worker whole files in this order, pyproject.toml): the
    scenario suite's tests, whose capture (minutes, every core busy) starts at once while a worker that
    needs it too waits for it; then the files by how many of their tests are `slow` (they start
    processes, seconds to minutes each), most first; then the rest, as collected."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: ("scenarios" not in item.fixturenames, -slow[item.path]))


def cli(capsys, *argv: Any):
    """(exit code, stdout, stderr) of memdiff run in this process with `argv`."""
    from memdiff.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def reserved_after(path: Path, device: int, index: int) -> int:
    """What PyTorch's caching allocator held on `device` just after trace event `index` of the snapshot at
    `path` (gzipped or not): its segments at the dump, less the segment events after that event."""
    import gzip

    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        snap = pickle.load(f)
    held = sum(s["total_size"] for s in snap["segments"] if s["device"] == device)
    sign = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    return held - sum(sign.get(e["action"], 0) * e["size"] for e in snap["device_traces"][device][index + 1:])


def read_back(n: int) -> float:
    """The number the `n`-th read (from 0) of a run's device floats without values gives under
    `memdiff record --emulate`, written from the policy docs/emulate.md states ("Values read back"), not
    from memdiff's code: 0.5 x 8,192 / (8,192 + n), as a float32 number."""
    import torch

    return float(torch.tensor(0.5 * 8192 / (8192 + n), dtype=torch.float32))


def kept_write(kept: Path, path: Any) -> Path:
    """Where the file an emulated run wrote at `path` lies in the overlay that `memdiff record
    --keep-writes kept` kept: its upper layer holds each write under its absolute path
    (docs/emulate.md, "Your files"), as the run's file calls saw it (absolute, not resolved)."""
    return kept / "upper" / os.path.abspath(os.fsdecode(path)).lstrip(os.sep)


def weights_and_activations(path: Path, activation: int, parameter: int = 100 * 2**20,
                            forward: Optional[List[Dict[str, Any]]] = None) -> Path:
    """A run with `parameter` bytes of weights made in __init__ and `activation` bytes made in
    forward (at `forward`'s frames, by default model.py's own)."""
    init = py_frames("model.py:3:__init__", "train.py:4:<module>")
    fwd = forward or py_frames("model.py:10:forward", "train.py:5:<module>")
    trace = [alloc(1, parameter, init), alloc(2, activation, fwd)]
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[e for e in trace if e["size"]]]}, 4))
    return path
