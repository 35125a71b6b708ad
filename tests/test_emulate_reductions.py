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


# -- the other kernels' own buffers (scratch.py), held to the real traces' sequences ---------------

def _real_runs(path: Path, native: str) -> List[List[Tuple[str, int]]]:
    """The (action, size) of each run of allocations and frees made inside the native function
    `native` (consecutive in the trace), in trace order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    runs: List[List[Tuple[str, int]]] = []
    last = -10
    for i, e in enumerate(trace):
        if e["action"] in ("alloc", "free_requested") and any(native in fr["name"] for fr in e["frames"]):
            if i - last > 3:
                runs.append([])
            runs[-1].append((e["action"], e["size"]))
            last = i
    return runs


def _steps_as_events(steps: List[Any]) -> List[Tuple[str, int]]:
    sizes: Dict[str, int] = {}
    events = []
    for step in steps:
        if step[0] == "alloc":
            sizes[step[1]] = step[2]
            events.append(("alloc", step[2]))
        else:
            events.append(("free_requested", sizes[step[1]]))
    return events


def test_the_token_embeddings_backward_sorts_and_sums_per_segment_as_gpt2_batch8_did():
    # GPT-2 at batch 8 x 512: 4,096 token ids (past 3,072: the sorted path, two-pass kernel)
    from memdiff.recording.emulate import scratch

    grad = torch.empty(8, 512, 768, device="meta")
    ids = torch.empty(8, 512, dtype=torch.long, device="meta")
    steps = scratch.embedding_dense_backward((grad, ids, 50257, -1, False), {}, None, gpu("h100"))
    real = _real_runs(CUDA / "gpt2-batch8.pickle.gz", "embedding_dense_backward")[1]
    output = ("alloc", 50257 * 768 * 4)  # the gradient itself, which the meta kernel makes
    assert _steps_as_events(steps) == [e for e in real if e != output]


def test_t5s_position_bias_backward_takes_the_fused_atomic_kernel_as_the_real_run_did():
    from memdiff.recording.emulate import scratch

    path = TRUTH / "t5-base.pickle.gz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    real = _real_runs(path, "embedding_dense_backward")
    for length in (128, 384):  # the decoder's and the encoder's tables: (q, k) buckets of 8 heads
        grad = torch.empty(8, length, length, device="meta").permute(1, 2, 0)  # comes back permuted
        buckets = torch.empty(length, length, dtype=torch.long, device="meta")
        steps = scratch.embedding_dense_backward((grad, buckets, 32, -1, False), {}, None, gpu("h100"))
        planned = _steps_as_events(steps)
        sort = planned.index(("alloc", scratch.cub_radix_sort_pairs(length * length)))
        output = ("alloc", 32 * 8 * 4)
        runs = [[e for e in run if e != output] for run in real]
        same = [run for run in runs if len(run) == len(planned)
                and run[:sort] + run[sort + 2:] == planned[:sort] + planned[sort + 2:]]
        assert same, (length, planned)
        # cub's sort storage is an estimate: within 1% of the real run's
        assert abs(planned[sort][1] / same[0][sort][1] - 1) < 0.01


def test_clip_grad_norms_foreach_norm_buffer_is_gpt2_clips():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from memdiff.recording.emulate import scratch

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config())
    grads = [p for p in model.parameters()]
    steps = scratch.foreach_norm((grads, 2.0), {}, None, gpu("h100"))
    real = _real_runs(CUDA / "gpt2-clip.pickle.gz", "foreach_tensor_norm_cuda_internal")
    buffers = {size for run in real for action, size in run if action == "alloc" and size > 4}
    assert {step[2] for step in steps if step[0] == "alloc"} == buffers == {348688}


def test_softmax_backward_makes_grad_times_output_as_t5s_math_attention_did():
    from memdiff.recording.emulate import scratch

    path = TRUTH / "t5-base.pickle.gz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    real = {size for run in _real_runs(path, "softmax_backward_cuda_out") for action, size in run
            if action == "alloc"}
    planned = set()
    for length in (384, 128):  # the encoder's and the decoder's self-attention scores
        scores = torch.empty(8, 8, length, length, device="meta")
        planned |= {step[2] for step in scratch.softmax_backward((scores, scores, -1, torch.float32), {}, None,
                                                                 gpu("h100")) if step[0] == "alloc"}
    assert planned <= real
