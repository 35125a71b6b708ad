"""CUDA's reduction kernel's own buffers (memdiff/recording/emulate/reductions.py): the staging buffer
and semaphores a global reduce takes inside sum, mean, norms and the like, held to the sizes real
H100 traces show for the shapes the models ran (torch 2.11)."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import pytest
from conftest import ROOT

torch = pytest.importorskip("torch")

from memdiff.recording.emulate import reductions  # noqa: E402
from memdiff.recording.emulate.gpus import gpu  # noqa: E402

CUDA = ROOT / "tests" / "data" / "cuda"
TRUTH = ROOT.parent / "shared" / "cuda-truth"


def _real_reduce_buffers(path: Path) -> Set[Tuple[int, int]]:
    """(staging buffer, semaphores) of every global reduce in a real trace: the two allocations
    gpu_reduce_kernel makes in a row, named by its frame."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"
              and any("gpu_reduce_kernel" in frame["name"] for frame in e["frames"])]
    return {(allocs[i]["size"], allocs[i + 1]["size"]) for i in range(0, len(allocs), 2)}


def _planned(x: Any, dims: List[int]) -> Tuple[int, int]:
    """What the emulator plans for x.sum(dims) on an H100: (buffer, semaphores)."""
    rule = reductions.table()["sum_dim_IntList"]
    found = reductions.plan(rule, x, [x.sum(dims)], dims, False, gpu("h100"))
    assert len(found.pieces) == 1 and found.cast == 0 and found.accumulation == 0
    return found.pieces[0].buffer, found.pieces[0].semaphores


def _tokens(batch: int, seq: int, width: int, dtype: Any = torch.float32) -> Tuple[Any, List[int]]:
    """A (batch, sequence, width) gradient summed over its tokens: a bias or norm weight's gradient."""
    return torch.empty(batch, seq, width, dtype=dtype, device="meta"), [0, 1]


def _patches() -> Tuple[Any, List[int]]:
    """ViT's patch embedding's bias gradient: convolution_backward sums grad_output over all dims but
    the channels; the gradient comes back through flatten(2).transpose(1, 2), channels fastest."""
    return torch.empty(32, 14, 14, 768, device="meta").permute(0, 3, 1, 2), [0, 2, 3]


# Every reduction that global-reduces in each real window, from the facts of the model run: batch and
# sequence (tokens), the widths of its layers.
MODELS = {
    "gpt2-base": (CUDA / "gpt2-base.pickle.gz", lambda: [_tokens(4, 512, w) for w in (768, 2304, 3072)]),
    "bert-base": (TRUTH / "bert-base.pickle.gz", lambda: [_tokens(8, 384, w) for w in (768, 3072)]),
    "vit-base": (TRUTH / "vit-base.pickle.gz", lambda: [_tokens(32, 197, w) for w in (768, 3072)] + [_patches()]),
    "t5-base": (TRUTH / "t5-base.pickle.gz", lambda: [_tokens(8, 384, 512), _tokens(8, 128, 512)]),
    "llama-base": (TRUTH / "llama-base.pickle.gz", lambda: [_tokens(4, 512, 1024)]),
    "llama1b-bf16": (TRUTH / "llama1b-bf16.pickle.gz", lambda: [_tokens(2, 2048, 2048, torch.bfloat16)]),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_global_reduce_buffers_of_the_gradient_sums_are_the_real_h100_traces(name):
    path, reduced = MODELS[name]
    if not path.is_file():
        pytest.skip(f"{path} not found (the cuda-truth windows live in ../shared beside the project)")
    assert {_planned(x, dims) for x, dims in reduced()} == _real_reduce_buffers(path)


def test_a_reduction_over_the_fastest_dim_needs_no_global_reduce():
    # RMSNorm's mean over the hidden size (Llama): one warp row per output, no staging buffer; the
    # real llama-base trace has no gpu_reduce_kernel allocation under mean.
    x = torch.empty(4, 512, 1024, device="meta")
    found = reductions.plan(reductions.table()["mean_dim"], x, [x.mean(-1, keepdim=True)], [-1], True, gpu("h100"))
    assert [p.buffer for p in found.pieces] == [0]


def test_a_reduction_past_2_gib_runs_in_32_bit_pieces_each_with_its_own_buffers():
    # with_32bit_indexing: 4 GiB of fp32 summed into 64 outputs runs as two halves of 2 GiB, each
    # launch with its own staging buffer; in bf16 (4 GiB) the output cannot hold the fp32 running
    # sums between the halves, so one accumulator per output is made for the whole op.
    rule = reductions.table()["sum_dim_IntList"]
    x = torch.empty(2**24, 64, device="meta")
    found = reductions.plan(rule, x, [x.sum(0)], [0], False, gpu("h100"))
    assert len(found.pieces) == 2 and all(p.buffer > 0 for p in found.pieces) and found.accumulation == 0
    y = torch.empty(2**25, 64, dtype=torch.bfloat16, device="meta")
    low = reductions.plan(rule, y, [y.sum(0)], [0], False, gpu("h100"))
    assert len(low.pieces) == 2 and low.accumulation == 64 * 4
    z = torch.empty(2**23, 64, device="meta")  # just under 2 GiB: one launch
    assert len(reductions.plan(rule, z, [z.sum(0)], [0], False, gpu("h100")).pieces) == 1


LINEAR = """
import torch
layer = torch.nn.Linear(768, 768).cuda()
x = torch.randn(3072, 768, device="cuda", requires_grad=True)
torch.cuda.memory._record_memory_history()
layer(x).square().sum().backward()  # a dense gradient, as a loss gives
torch.cuda.memory._dump_snapshot("run.pickle")
"""


def test_the_bias_gradients_staging_buffer_is_allocated_and_freed_inside_the_sum(tmp_path):
    (tmp_path / "train.py").write_text(LINEAR)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "rec.pickle"), "--", sys.executable, "train.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "run.pickle", "rb") as f:
        trace: List[Dict[str, Any]] = pickle.load(f)["device_traces"][0]
    events = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    # bert-base's real trace for the same (3072 tokens, 768) bias gradient: output, buffer,
    # semaphores, then the semaphores and the buffer given back.
    start = events.index(("alloc", 18874368))
    assert events[start - 1] == ("alloc", 3072)
    assert events[start:start + 4] == [("alloc", 18874368), ("alloc", 24), ("free_requested", 24),
                                       ("free_requested", 18874368)]
    staging = next(e for e in trace if e["action"] == "alloc" and e["size"] == 18874368)
    names = [frame["name"] for frame in staging["frames"]]
    assert "at::_ops::sum_dim_IntList::call" in names
    assert "torch::autograd::generated::AddmmBackward0::apply" in names
