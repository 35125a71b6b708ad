"""index_put_ with accumulate=True under `memdiff record --emulate` (scratch.py index_put_accumulate):
the backward of advanced indexing (`x[idx]`) sorts its indices inside the op (cuda/Indexing.cu
index_put_with_sort_kernel), and the emulated snapshot holds the same buffers as the GPU's."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import SHARED, missing_shared

pytest.importorskip("torch")

SCRIPT = """
import sys
import torch

rows, width, batch, length, grad = (int(a) for a in sys.argv[2:7])
table = torch.randn(rows, width, device="cuda", requires_grad=True)
ids = torch.randint(0, rows, (batch, length), device="cuda")
torch.cuda.memory._record_memory_history()
picked = table[ids]
if grad:  # a contiguous gradient, as a loss's backward gives
    picked.backward(torch.ones_like(picked))
else:  # sum's backward: an expanded gradient, which the kernel copies
    picked.sum().backward()
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def _emulated(tmp_path: Path, *shape: int) -> List[Dict[str, Any]]:
    script = tmp_path / "pick.py"
    script.write_text(SCRIPT)
    own = tmp_path / "own.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script), str(own),
                           *map(str, shape)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(own, "rb") as f:
        return list(pickle.load(f)["device_traces"][0])


def _inside(trace: List[Dict[str, Any]], op: str) -> List[int]:
    """Sizes of the allocations made inside `op` (its frame in the stack), in order."""
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(f"at::_ops::{op}::" in frame["name"] for frame in e["frames"])]


def test_the_index_backward_sorts_as_the_real_h100_trace_shows(tmp_path):
    """cs336-medium-ctx128-train (a real H100 trace) runs the backward of an embedding lookup by
    indexing, a 10,000 x 1,024 fp32 table at 4 x 128 ids: index_backward makes the zeros
    (`new_zeros`, 40,960,000 B) and runs `_index_put_impl_` into them, which allocates, as
    index_put_with_sort_kernel does: remainder and stride product of the 512 ids (4,096 B each, the
    first freed at once), sorted_indices, orig_indices, arange (4,096 B each) and cub's single-tile
    sort's 1 B of temporary storage. No copy of the zeros."""
    real_path = SHARED / "cs336-medium-ctx128-train.pickle"
    if not real_path.is_file():
        missing_shared(f"{real_path} not found (the real snapshots live in ../shared beside the project)")
    with open(real_path, "rb") as f:
        real = pickle.load(f)["device_traces"][0]
    real_sizes = _inside(real, "_index_put_impl_")
    assert real_sizes  # the real trace holds the op
    first = real_sizes[:6]

    trace = _emulated(tmp_path, 10000, 1024, 4, 128, 1)
    assert _inside(trace, "index_put") == first
    table = 10000 * 1024 * 4
    # one table-sized block in the backward (the zeros the gradient is written into), beside the table
    assert sum(1 for e in trace if e["action"] == "alloc" and e["size"] == table) == 2


def test_a_sort_past_one_tile_and_an_expanded_gradient(tmp_path):
    """5,000 ids (2 x 2,500) into a 1,000 x 64 fp32 table, the gradient from `sum` (expanded):
    index_put_with_sort_kernel allocates the ids' remainder and stride product (5,000 x 8 B =
    40,000 B each), the value's contiguous copy (5,000 x 64 x 4 B = 1,280,000 B), sorted_indices,
    orig_indices and arange (40,000 B each), then cub's radix sort's temporary storage, which holds
    at least the keys' and values' alternate buffers (2 x 40,000 B): past one tile (256 threads x 9
    items of 8 B) cub sorts in passes through them."""
    n = 5000
    sizes = _inside(_emulated(tmp_path, 1000, 64, 2, 2500, 0), "index_put")
    assert sizes[:-1] == [8 * n, 8 * n, n * 64 * 4, 8 * n, 8 * n, 8 * n]
    temp = sizes[-1]
    assert 16 * n <= temp < 16 * n + 16 * 1024
