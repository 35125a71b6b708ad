"""`memdiff record [--emulate GPU] -o DIR/`: the hook each process gets survives the ways scripts import
torch (a `find_spec` probe first, as every Hugging Face script's `is_torch_available` does, a lazy
loader, an import on a thread), and a process that ran without it is told with its cause."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Slow (the fast loop, -m "not slow", leaves it out): every test runs recorded or emulated processes.
pytestmark = pytest.mark.slow

MIB4 = 4 << 20  # torch.ones(1 << 20) in float32: what each script below keeps on the device

# What each script does before its own `import torch`; then it keeps 4 MiB on the emulated GPU.
PROBES = {
    "find_spec": """
        import importlib, importlib.util
        assert importlib.util.find_spec("torch") is not None  # a probe: torch is not imported by it
        assert importlib.util.find_spec("torch") is not None
        torch = importlib.import_module("torch")
    """,
    "transformers": """
        import transformers
        from transformers.utils import is_torch_available
        assert is_torch_available()
    """,
    "lazy loader on a thread": """
        import importlib.util, sys, threading

        def lazily():
            spec = importlib.util.find_spec("torch")
            spec.loader = importlib.util.LazyLoader(spec.loader)
            module = importlib.util.module_from_spec(spec)
            sys.modules["torch"] = module
            spec.loader.exec_module(module)
            module.float32  # its first attribute runs torch's module, here, on this thread
        thread = threading.Thread(target=lazily)
        thread.start()
        thread.join()
    """,
}
KEEP = """
import torch
kept = torch.ones(1 << 20, device="cuda")
print(kept.device)
"""


def record(cwd: Path, *command: str, emulate: bool = True, env=None) -> subprocess.CompletedProcess:
    flags = ["--emulate", "h100"] if emulate else []
    return subprocess.run([sys.executable, "-m", "memdiff", "record", *flags, "-o", "runs/", "--", *command],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def torchrun(script: Path) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(script)]


def allocations(path: Path) -> list:
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["emulated"]["key"] == "h100"  # the rank ran on the emulated GPU, not on the CPU
    return [e["size"] for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]


@pytest.mark.parametrize("probe", ["find_spec", "transformers"])
def test_every_rank_that_probes_for_torch_first_is_emulated_and_recorded(torch, tmp_path, probe):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROBES[probe]) + KEEP)
    done = record(tmp_path, *torchrun(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("cuda:0") == 2
    for rank in (0, 1):
        assert allocations(tmp_path / "runs" / f"rank{rank}.pickle") == [MIB4]
    assert "memdiff: wrote 2 snapshots of a job of 2 ranks" in done.stderr


def test_torch_run_lazily_on_a_thread_is_recorded_once_on_the_emulated_gpu(torch, tmp_path):
    script = tmp_path / "train.py"
    # After the lazy import on a thread, more imports: none starts a second recording.
    script.write_text(textwrap.dedent(PROBES["lazy loader on a thread"])
                      + "import importlib, importlib.util\nimportlib.util.find_spec('torch')\n"
                        "importlib.import_module('torch')\n" + KEEP)
    done = record(tmp_path, sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    # The main thread runs the script: the emulator's modes (per thread, in torch) are on there.
    assert done.stdout == "cuda:0\n"
    [written] = (tmp_path / "runs").iterdir()
    assert allocations(written) == [MIB4]


def test_a_job_that_never_imports_torch_is_told_so_rank_by_rank(torch, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no torch here')\n")
    done = record(tmp_path, *torchrun(script))
    assert done.returncode == 2, done.stderr
    for rank in (0, 1):
        assert f"memdiff: rank {rank} of 2 has no snapshot: it never imported torch\n" in done.stderr
    assert "?" not in done.stderr


CLEARS = """
import os, subprocess, sys
env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
subprocess.run([sys.executable, "-c", "import torch; kept = torch.ones(1 << 20)"], env=env, check=True)
"""


def test_a_child_started_without_the_hook_is_named_with_its_cause(torch, tmp_path):
    script = tmp_path / "clears.py"
    script.write_text(CLEARS)
    done = record(tmp_path, sys.executable, str(script), emulate=False)
    assert done.returncode == 2, done.stderr
    assert not list((tmp_path / "runs").glob("*.pickle"))
    assert f"`{sys.executable} {script}`) never imported torch" in done.stderr
    assert (f"started `{sys.executable} -c import torch; kept = torch.ones(1 << 20)`: its PYTHONPATH does not "
            f"have memdiff's hook; nothing written to runs/") in done.stderr


def test_torch_imported_by_the_users_own_sitecustomize_is_emulated_and_recorded(torch, tmp_path):
    mine = tmp_path / "site"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import torch\n")  # runs after memdiff's, which chains it
    script = tmp_path / "train.py"
    script.write_text(KEEP)
    path = os.pathsep.join(p for p in (str(mine), os.environ.get("PYTHONPATH")) if p)
    done = record(tmp_path, sys.executable, str(script), env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "cuda:0\n"
    [written] = (tmp_path / "runs").iterdir()
    assert allocations(written) == [MIB4]


def test_a_rank_that_died_inside_memdiff_is_placed_at_the_users_own_line(tmp_path, monkeypatch):
    """A rank's `died (at FILE:LINE)` names the user's line that called into memdiff, not memdiff's own
    frame, even where memdiff is installed in place (an editable install is no site-packages)."""
    import importlib.util

    import memdiff

    monkeypatch.delenv("MEMDIFF_RECORD_DIR", raising=False)
    monkeypatch.setenv("MEMDIFF_PACKAGE_PARENT", str(Path(memdiff.__file__).parent.parent))
    spec = importlib.util.spec_from_file_location(
        "memdiff_rank_hook_under_test", Path(memdiff.__file__).parent / "recording" / "rank_hook" / "sitecustomize.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    try:
        memdiff.summarize(tmp_path / "missing.pickle")  # fails inside memdiff: no such file
    except Exception as exc:  # noqa: BLE001 - whatever memdiff raises, its line is what is checked
        line, here = hook._exception_line(exc, exc.__traceback__), exc.__traceback__.tb_lineno  # this test's call
    assert line.endswith(f"(at {__file__}:{here})"), line
