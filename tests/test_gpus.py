"""The emulated GPUs' memory figures are real ones: each total_memory and context_bytes in gpus.json
names where it comes from (a deviceQuery print, a real out-of-memory message, the project's own
H100 run) or says it is an estimate, the figures agree with the lines they quote, and an emulated
run that runs out of memory reports the capacity PyTorch reported on that GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from memdiff.units import format_bytes, parse_size

GPUS = json.loads((ROOT / "memdiff/recording/emulate/gpus.json").read_text())
TABLE = {key: entry for key, entry in GPUS.items() if not key.startswith("_")}
MESSAGES = {key: entry for key, entry in
            json.loads((ROOT / "tests/data/gpu_oom_messages.json").read_text()).items() if not key.startswith("_")}
GIB, MIB = 1 << 30, 1 << 20
# An out-of-memory message rounds each figure to two decimals of its unit: a context read off three
# of them (in use, allocated, reserved but unallocated) is good to 0.005 GiB + 0.005 GiB + 0.005 MiB.
CONTEXT_PRECISION = GIB // 100 + MIB // 100


def _amount(text: str) -> float:
    """'12.62 GiB', '7.55 MiB' or '582.00 KiB' in bytes."""
    value, unit = text.split()
    return float(value) * {"GiB": GIB, "MiB": MIB, "KiB": 1 << 10}[unit]


def _capacity(message: str) -> str:
    # torch 2.1 spelled it 'capacty'
    found = re.search(r"total capaci?ty of ([\d.]+ GiB)", message)
    assert found, message
    return found.group(1)


def _held_outside_the_allocator(quote: str) -> float:
    """What a real message says its process holds beyond PyTorch's allocator: in use less allocated
    less reserved-but-unallocated (the process's own 'this process has', else its one 'Process N has')."""
    amount = r"([\d.]+ [GMK]iB)"
    in_use = re.search(r"this process has " + amount, quote) or re.search(r"Process \d+ has " + amount, quote)
    allocated = re.search(r"allocated memory " + amount + " is allocated by PyTorch", quote)
    unallocated = re.search(amount + " is reserved by PyTorch but unallocated", quote)
    assert in_use and allocated and unallocated, quote
    return _amount(in_use.group(1)) - _amount(allocated.group(1)) - _amount(unallocated.group(1))


@pytest.mark.parametrize("key", sorted(TABLE))
def test_every_gpus_memory_figures_name_their_source_or_say_they_are_estimates(key):
    sources = TABLE[key]["source"]
    for figure in ("total_memory", "context_bytes"):
        source = sources[figure]
        if source.get("kind") == "estimate":
            assert source["note"].startswith("ESTIMATE"), (key, figure)
        elif source.get("kind") == "measured":
            assert "tests/data/cuda" in source["from"], (key, figure)
        else:
            assert source["url"].startswith("https://github.com/") and source["quote"], (key, figure)


@pytest.mark.parametrize("key", sorted(TABLE))
def test_each_gpus_figures_are_the_ones_its_sources_quote(key):
    entry, sources = TABLE[key], TABLE[key]["source"]
    total = sources["total_memory"]
    if total.get("kind") == "print":  # deviceQuery: "Total amount of global memory: N MBytes (B bytes)"
        assert f"({entry['total_memory']} bytes)" in total["quote"], key
    elif total.get("kind") == "bound":  # the message's two decimals hold the figure
        assert _capacity(total["quote"]) == format_bytes(entry["total_memory"]), key
    context = sources["context_bytes"]
    if context.get("kind") == "message":
        assert abs(_held_outside_the_allocator(context["quote"]) - entry["context_bytes"]) <= CONTEXT_PRECISION, key


def test_the_h100s_context_is_what_its_real_out_of_memory_left_unaccounted():
    # The real H100 run that ran out of memory (tests/data/cuda/gpt2-oom): PyTorch's snapshot holds the
    # segments it had reserved and the driver's free memory at the failed request.
    import gzip
    import pickle

    with gzip.open(ROOT / "tests/data/cuda/gpt2-oom.pickle.gz", "rb") as f:
        real = pickle.load(f)
    (oom,) = [e for e in real["device_traces"][0] if e["action"] == "oom"]
    reserved = sum(s["total_size"] for s in real["segments"])
    h100 = TABLE["h100"]
    assert h100["total_memory"] - reserved - oom["device_free"] == h100["context_bytes"]


def test_the_real_messages_are_of_gpus_the_emulator_has():
    assert MESSAGES and set(MESSAGES) <= set(TABLE)
    for key, real in MESSAGES.items():
        assert real["url"].startswith("https://github.com/") and "CUDA out of memory" in real["message"], key


@pytest.mark.parametrize("key", sorted(MESSAGES))
def test_an_emulated_run_out_of_memory_reports_the_real_gpus_total_capacity(key, tmp_path, torch):
    import memdiff

    real = _capacity(MESSAGES[key]["message"])
    total = TABLE[key]["total_memory"]
    with memdiff.record(str(tmp_path / "oom.pickle"), emulate=key):
        assert torch.cuda.get_device_properties(0).total_memory == total
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(total, dtype=torch.uint8, device="cuda")  # the whole GPU: more than the context leaves
    said = str(caught.value)
    assert f"total capacity of {real} of which" in said, (said, MESSAGES[key]["url"])
    assert f"(emulated {TABLE[key]['name']})" in said
    # PyTorch's sentences in PyTorch's order, the process's own memory among them: what its allocator
    # reserved and the CUDA context, which is all of the GPU but what is free (one process alone on it).
    size = r"([\d.]+ [KMG]?i?B)"
    found = re.search(rf"of which {size} is free\. Including non-PyTorch memory, this process has {size} memory "
                      rf"in use\. Of the allocated memory {size} is allocated by PyTorch, and {size} is reserved",
                      said)
    assert found, said
    free, held = parse_size(found.group(1)), parse_size(found.group(2))
    assert abs(total - free - held) <= 0.01 * 2**30


TINY = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    props = torch.cuda.get_device_properties(0)
    print("gpu", props.name, torch.cuda.get_device_capability(0), props.total_memory, props.multi_processor_count)
    model = torch.nn.Linear(256, 256).cuda().half()
    x = torch.randn(4, 8, 64, 32, device="cuda", dtype=torch.half, requires_grad=True)
    attention = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    (model(torch.randn(64, 256, device="cuda", dtype=torch.half)).sum() + attention.sum()).backward()
    print("peak", torch.cuda.max_memory_allocated())
""")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["a10g", "l40s", "rtx4090", "h100-nvl", "b200"])
def test_record_emulates_a_tiny_training_script_on_the_added_gpus(key, tmp_path, torch):
    (tmp_path / "tiny.py").write_text(TINY)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", key, "-o", "run.pickle", "--",
                           "python", "tiny.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    entry = TABLE[key]
    assert (f"gpu {entry['name']} ({entry['major']}, {entry['minor']}) {entry['total_memory']} "
            f"{entry['multi_processor_count']}") in done.stdout
    assert int(done.stdout.split("peak ")[1].split()[0]) > 0
    assert Path(tmp_path / "run.pickle").stat().st_size > 0
