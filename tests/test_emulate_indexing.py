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


MASKED = """
import sys
import torch

x = torch.nn.Parameter(torch.randn(1000, 64, device="cuda"))  # a weight: no values
labels = torch.arange(1000, device="cuda") % 4  # made from known values, as a batch's labels are
torch.cuda.memory._record_memory_history()
kept = x[labels != 0]  # a mask whose values are known: 750 rows
scores = x.detach().sum(1)  # the model's arithmetic: no values
mask = scores > 0
picked = x[mask]
print("sizes", tuple(kept.shape), tuple(picked.shape), tuple(torch.nonzero(mask).shape),
      tuple(torch.masked_select(x, mask[:, None]).shape))
(kept.sum() + picked.sum()).backward()
torch.cuda.memory._dump_snapshot(sys.argv[1])
"""


def test_boolean_mask_indexing_runs_nonzero_inside_the_op_and_follows_its_sizes(tmp_path):
    """`x[mask]` was refused ("aten::index: PyTorch has no meta kernel") while nonzero and masked_select
    of the same mask ran. CUDA's index turns a mask into long indices by nonzero inside the op
    (expandTensors, native/IndexingUtils.h): its output (rows x 1 x 8 B) is allocated before the
    index's own output and freed after it. Sizes follow nonzero's policy: the true count for a known
    mask, every element for one the model computed. The backward's index_put expands the mask again."""
    script = tmp_path / "mask.py"
    script.write_text(MASKED)
    own = tmp_path / "own.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script), str(own)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sizes (750, 64) (1000, 64) (1000, 1) (64000,)" in done.stdout
    with open(own, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    inside = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")
              and any("at::_ops::index_Tensor::" in f["name"] for f in e["frames"])]
    # each forward index: nonzero's output, then the index's output (750 and 1,000 rows of 64 floats)
    outputs = [size for action, size in inside if action == "alloc" and size in (750 * 256, 1000 * 256)]
    assert outputs == [750 * 256, 1000 * 256]
    start = next(i for i, e in enumerate(trace) if any("at::_ops::index_Tensor::" in f["name"] for f in e["frames"]))
    events = [(e["action"], e["size"]) for e in trace[start:]]
    for rows in (750, 1000):
        nonzero_out, index_out = events.index(("alloc", rows * 8)), events.index(("alloc", rows * 256))
        assert nonzero_out < index_out < events.index(("free_completed", rows * 8), index_out)
    # the backward's two index_puts each index by nonzero of its mask again
    backward = [e for e in trace if e["action"] == "alloc"
                and any("IndexBackward0" in f["name"] for f in e["frames"])
                and any("at::_ops::nonzero::" in f["name"] for f in e["frames"])]
    assert sorted({e["size"] for e in backward} & {750 * 8, 1000 * 8}) == [750 * 8, 1000 * 8]
