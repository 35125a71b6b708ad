"""Megatron-core under the emulator: a small GPT of Megatron's own modules, trained two steps by its
schedule, its DistributedDataParallel and its optimizer (tests/scenarios/megatron_train.py): one rank
of a torchrun job run alone (the last stage of a two-stage pipeline; rank 0 of tensor parallel 2 x
data parallel 2 with the distributed optimizer; rank 0 of expert parallel 2), each held to what its
own model counts.

The truth is each rank's parameter count N, counted on its model by the scenario, and how Megatron
lays out its training state in bf16 with `grad_reduce_in_fp32` (megatron-core 0.16.1, read):

- the model's bf16 weights, 2N bytes; with the distributed optimizer they move into the flat bf16
  parameter buffer of Megatron's DistributedDataParallel (param_data), the same 2N;
- the flat fp32 gradient buffer every weight's `main_grad` is a view of (grad_data), 4N;
- the optimizer's fp32 master copy of the weights, 4N; with the distributed optimizer only this
  rank's shard of the buffer, 4N / dp;
- Adam's two fp32 moments of the master weights, 8N (8N / dp sharded);
- the optimizer's one-element fp32 `found_inf` flag, 4 bytes, made in its `__init__`.

Megatron's DistributedDataParallel makes its gradient buffer and its parameter buffer in one
function (`_ParamAndGradBuffer.__init__`), the gradient buffer at its last allocating line: memdiff
reads it as `gradient`, each buffer's N elements (`buffered`, counted on Megatron's buffers) in fp32.

megatron-core is found in the folder MEMDIFF_MEGATRON_LIBS names (.ci/run installs 0.16.1 there);
without it the tests skip, or fail where CI requires its capture dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
from conftest import ROOT, missing_capture_dependency

# Slow (the fast loop, -m "not slow", leaves it out): each run is an emulated Megatron job.
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scenarios" / "megatron_train.py"
LIBS = "MEMDIFF_MEGATRON_LIBS"
BF16, FP32 = 2, 4
FOUND_INF = 4  # the mixed-precision optimizer's found_inf, torch.tensor([0.0], device="cuda")


def _libraries() -> str:
    folder = os.environ.get(LIBS)
    if not folder or not (Path(folder) / "megatron" / "core").is_dir():
        missing_capture_dependency(f"megatron-core is not set up: {LIBS} names no folder holding it (.ci/run "
                                   "installs it)")
    return str(folder)


@pytest.fixture(scope="module")
def record(torch, tmp_path_factory):
    """Rank `rank` of a torchrun job of `ranks` ranks with these flags, emulated on an H100 alone, once
    per module: (its facts, its device summary)."""
    libs = _libraries()
    from memdiff import api

    runs: Dict[Tuple[str, ...], tuple] = {}

    def run(ranks: int, rank: int, *flags: str):
        key = (str(ranks), str(rank), *flags)
        if key not in runs:
            folder = tmp_path_factory.mktemp("megatron")
            env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
            done = subprocess.run(
                [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks", str(rank),
                 "--", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                 str(SCRIPT), *flags],
                cwd=folder, capture_output=True, text=True, timeout=600,
                env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                     "PYTHONPATH": os.pathsep.join((str(ROOT), libs))})
            assert done.returncode == 0, done.stderr[-3000:]
            facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
            assert facts["rank"] == rank
            runs[key] = facts, api.summarize(folder / "runs" / f"rank{rank}.pickle").devices[0]
        return runs[key]

    return run


def test_a_pipeline_stage_holds_its_weights_their_fp32_gradients_and_master_copy_and_adams_moments(record):
    # the last of two stages: its layers, the final norm and the output layer, as its model counts them
    facts, device = record(2, 1, "--pp", "2")
    n = facts["numel"]
    assert facts["buffered"] == n  # Megatron pads nothing for this model: its buffers are N elements
    # the fp32 gradient buffer, and the gradient of one microbatch's received activation, which the
    # backward makes for the stage before and its next backward frees
    seq, micro_batch, hidden = facts["activation"]
    assert device.categories["gradient"] == FP32 * facts["buffered"] + seq * micro_batch * hidden * BF16
    assert device.categories["parameter"] == BF16 * n + FP32 * n + FOUND_INF
    assert device.categories["optimizer_state"] == 2 * FP32 * n


def test_the_distributed_optimizer_shards_the_master_weights_and_adams_moments_over_data_parallel_ranks(record):
    # four ranks: tensor parallel 2, so data parallel 2; rank 0 holds its tensor-parallel shard of
    # every layer, and of those the distributed optimizer's shard over the two data-parallel ranks
    facts, device = record(4, 0, "--tp", "2", "--distributed-optimizer")
    n, dp = facts["numel"], facts["dp"]
    assert dp == 2 and facts["buffered"] == n and n % dp == 0
    # the bf16 parameter buffer whole and the master weights' shard; the fp32 gradient buffer whole,
    # made by the same function after the parameter buffer
    assert device.categories["parameter"] == BF16 * n + FP32 * n // dp + FOUND_INF
    assert device.categories["gradient"] == FP32 * facts["buffered"]
    assert device.categories["optimizer_state"] == 2 * FP32 * n // dp


def test_an_expert_parallel_rank_holds_its_own_experts_and_the_dense_layers(record):
    # four experts a layer over two expert-parallel ranks: rank 0's model holds two of them (and the
    # attention, norms and embeddings whole); its tokens reach them by all-to-all from the router's
    # choices. Megatron steps the experts' weights with an optimizer of their own: two found_inf flags
    facts, device = record(2, 0, "--ep", "2", "--experts", "4")
    n = facts["numel"]
    assert facts["buffered"] == n
    assert device.categories["parameter"] == BF16 * n + FP32 * n + 2 * FOUND_INF
    assert device.categories["gradient"] == FP32 * facts["buffered"]  # the experts' buffer and the dense one
    assert device.categories["optimizer_state"] == 2 * FP32 * n


def test_a_pipeline_stage_keeps_what_it_receives_as_communication(record):
    # the last stage's input for each microbatch in flight comes from the stage before into a buffer
    # of the activations' shape (seq x micro-batch x hidden, bf16) that Megatron's p2p makes
    facts, device = record(2, 1, "--pp", "2")
    seq, micro_batch, hidden = facts["activation"]
    received = device.categories["communication"]
    assert received > 0 and received % (seq * micro_batch * hidden * BF16) == 0
    assert "other" not in device.categories
