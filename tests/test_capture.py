"""Capture on CPU with the example workload, and memdiff's categories against PyTorch's own."""

from __future__ import annotations

import builtins
import re
import subprocess
import sys
from collections import Counter
from typing import Dict

import pytest
from tabulate import tabulate

from memdiff.capture import CaptureError, record
from memdiff.classify import load_rules
from memdiff.inputs import read_summary
from memdiff.load import decode

# PyTorch's profiler categories in memdiff's terms (the mapping).
PYTORCH_TO_MEMDIFF = {"temporary": "autograd", "autograd_detail": "autograd", "unknown": "other", None: "other"}


def record_example(path, *flags: str) -> subprocess.CompletedProcess:
    """`memdiff record` of the example GPT on CPU, in a fresh process as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "memdiff", "record", "-o", str(path), "--", "python", "-m", "memdiff.examples.gpt",
         "--device", "cpu", "--steps", "2", "--batch", "8", "--seq", "128", *flags],
        capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def captured(torch, tmp_path_factory):
    """The example GPT recorded on CPU, without and with activation checkpointing."""
    folder = tmp_path_factory.mktemp("capture")
    out = {}
    for ckpt in (False, True):
        out[ckpt] = str(folder / f"gpt-ckpt{int(ckpt)}.pickle")
        record_example(out[ckpt], *(["--checkpoint"] if ckpt else []))
    return out


def pytorch_categories_at(path: str, peak_index: int) -> Dict[str, int]:
    """Bytes per PyTorch category among allocations live after event `peak_index`."""
    live = {}
    for e in decode(path)[0]["device_traces"][0][: peak_index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    totals: Counter = Counter()
    for e in live.values():
        cat = e.get("category")
        totals[PYTORCH_TO_MEMDIFF.get(cat, cat)] += e["size"]
    return dict(totals)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "activation-checkpointing"])
def test_categories_agree_with_pytorch(captured, ckpt):
    summary = read_summary(captured[ckpt], load_rules())
    assert summary.source.generation == "profiler"
    d = summary.devices[0]
    theirs = pytorch_categories_at(captured[ckpt], d.peak_event_index)
    assert sum(theirs.values()) == d.peak_bytes  # the same live set, so the comparison is fair
    names = sorted(set(theirs) | set(d.categories))
    agreement = sum(min(theirs.get(c, 0), d.categories.get(c, 0)) for c in names) / d.peak_bytes
    print(f"\nagreement with PyTorch's categories ({'with' if ckpt else 'without'} checkpointing): {agreement:.1%}")
    print(tabulate([[c, theirs.get(c, 0), d.categories.get(c, 0)] for c in names],
                   headers=["category", "pytorch bytes", "memdiff bytes"]))
    assert agreement >= 0.85


def test_checkpointing_lowers_the_peak_and_activations(captured):
    rules = load_rules()
    plain, ckpt = (read_summary(captured[k], rules).devices[0] for k in (False, True))
    assert ckpt.peak_bytes < plain.peak_bytes
    assert ckpt.categories["activation"] < plain.categories["activation"]
    assert ckpt.categories["optimizer_state"] == plain.categories["optimizer_state"]


def test_record_writes_the_snapshot_even_when_the_block_raises(torch, tmp_path):
    path = tmp_path / "oom.pickle"
    with pytest.raises(RuntimeError, match="simulated OOM"):
        with record(str(path)):
            x = torch.ones(1024, 1024)
            raise RuntimeError("simulated OOM")
    assert read_summary(str(path), load_rules()).devices[0].peak_bytes >= x.numel() * 4


def test_record_without_torch_says_how_to_install_it(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(CaptureError, match=r"pip install 'memdiff\[torch\]'"):
        with record(str(tmp_path / "x.pickle")):
            pass


def test_record_on_a_torch_without_the_private_api_names_the_version(torch, monkeypatch, tmp_path):
    from torch.cuda import _memory_viz

    monkeypatch.delattr(_memory_viz, "_profile_to_snapshot")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CaptureError, match=re.escape(f"torch {torch.__version__} lacks torch.cuda._memory_viz._profile_to_snapshot")):
        with record(str(tmp_path / "x.pickle")):
            pass
    assert not (tmp_path / "x.pickle").exists()


def test_memdiff_record_runs_a_script_with_its_arguments(torch, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text("import sys, torch\nkeep = torch.zeros(int(sys.argv[1]))\nprint('ran', sys.argv[1:])\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", str(tmp_path / "t.pickle"), "--",
                           "python", str(script), "4096"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ran ['4096']" in done.stdout
    assert f"wrote {tmp_path / 't.pickle'}" in done.stderr
    d = read_summary(str(tmp_path / "t.pickle"), load_rules()).devices[0]
    assert d.peak_bytes >= 4096 * 4


def test_memdiff_record_passes_on_the_scripts_failure(torch, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\nx = torch.ones(10)\nraise SystemExit(7)\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", str(tmp_path / "f.pickle"), "--",
                           "python", str(script)], capture_output=True, text=True)
    assert done.returncode == 7
    assert (tmp_path / "f.pickle").exists()
