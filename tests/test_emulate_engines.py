"""PyTorch's own parallel engines as large jobs run them, under `memdiff record --emulate` (issue 59, item 2):
pipeline parallelism (torch.distributed.pipelining), HSDP (FSDP2 over a replicate x shard mesh),
FSDP1 (FullyShardedDataParallel), tensor + sequence parallelism, context parallelism and expert
parallelism for a mixture of experts. Each held to what the model's shapes say a rank holds: its
stage's weights and the microbatches each schedule keeps in flight, its shard of the weights, the
activations of its part of the sequence, its experts and the tokens routed to them."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest
from conftest import ROOT

# Slow (the fast loop, -m "not slow", leaves it out): every test runs emulated processes.
pytestmark = pytest.mark.slow

PIPELINE = ROOT / "tests" / "scenarios" / "pipeline_train.py"
# pipeline_train.py's defaults: 4 blocks of width 64 on 2 ranks, a batch of 4096 rows in 8 microbatches.
WIDTH, BATCH, MICROBATCHES, STAGES, BLOCKS = 64, 4096, 8, 2, 4
ROWS = BATCH // MICROBATCHES
BLOCK_WEIGHTS = (WIDTH * 2 * WIDTH + 2 * WIDTH + 2 * WIDTH * WIDTH + WIDTH) * 4  # two Linears, fp32
# What one block keeps for its backward per microbatch: Linear(w, 2w)'s output and GELU's output
# (rows x 2w each), and the block's output x + down(...) (rows x w), the next block's input or the
# stage's output, which the stage keeps until that microbatch's backward.
BLOCK_SAVED = (2 * ROWS * 2 * WIDTH + ROWS * WIDTH) * 4


def _record(cwd: Path, output: str, *args: str, env=None, flags=()) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o OUTPUT FLAGS -- ARGS` on a node that says nothing of its GPUs."""
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", output, *flags,
                           "--", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})})


def _pipeline(cwd: Path, schedule: str, *flags: str) -> Path:
    """The two ranks' snapshots of pipeline_train.py under `schedule`, run by torchrun."""
    done = _record(cwd, f"{schedule}/", sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(STAGES), str(PIPELINE), "--schedule", schedule, *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / schedule


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """The three schedules' jobs, each stage's shapes inferred by torch and sent down the pipeline."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("pipeline")
    return {"gpipe": _pipeline(folder, "gpipe"), "1f1b": _pipeline(folder, "1f1b"),
            "interleaved": _pipeline(folder, "interleaved")}


def _device(folder: Path, rank: int):
    from memdiff import api

    return api.summarize(folder / f"rank{rank}.pickle").devices[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_each_pipeline_rank_holds_its_stages_weights_and_their_gradients(schedules, schedule):
    # 4 blocks over 2 ranks: one stage of 2 blocks each (GPipe, 1F1B), or two stages of 1 block
    # each (interleaved: stages r and r + 2). Either way a rank's weights are 2 blocks', to the byte,
    # and AdamW's two moments are twice that (the whole model's would be twice as much again).
    for rank in range(STAGES):
        categories = _device(schedules[schedule], rank).categories
        assert categories["parameter"] == BLOCKS // STAGES * BLOCK_WEIGHTS, (schedule, rank)
        assert categories["optimizer_state"] >= 2 * BLOCKS // STAGES * BLOCK_WEIGHTS, (schedule, rank)


def test_gpipe_holds_every_microbatch_and_1f1b_only_the_stages_in_flight(schedules):
    # Stage 0 of 2. GPipe runs all 8 forwards before the first backward: at its peak (the first
    # backward) the activations of all 8 microbatches are live. 1F1B runs num_stages - stage = 2
    # forwards, then one backward per forward: 2 microbatches' activations, and at most the output
    # of one more that a finished send still holds. The ratio is the microbatch multiple, 8 / 2.
    per_microbatch = BLOCKS // STAGES * BLOCK_SAVED
    gpipe, one_f_one_b = (_device(schedules[s], 0) for s in ("gpipe", "1f1b"))
    assert gpipe.categories["activation"] == MICROBATCHES * per_microbatch
    stage_output = ROWS * WIDTH * 4
    assert STAGES * per_microbatch <= one_f_one_b.categories["activation"] <= STAGES * per_microbatch + stage_output
    # The receive buffers of the gradients stage 1 sends back: one per microbatch, made before the
    # first step by either schedule, and the only communication memory of stage 0.
    for device in (gpipe, one_f_one_b):
        assert device.categories["communication"] == MICROBATCHES * ROWS * WIDTH * 4


def test_a_pipeline_rank_run_alone_is_refused_in_one_line_naming_the_rank_it_needs(tmp_path):
    # Rank 1 of 2 alone: its stage learns its input's shape from what rank 0 sends (recv_object_list),
    # which no one sends here. Torch would fail unpickling 0 bytes; memdiff says why, in one line.
    done = _record(tmp_path, "run.pickle", "python", str(PIPELINE), "--schedule", "gpipe",
                   env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memdiff: recv_object_list: from rank 0, which does not run with this rank"), last
    assert "called at pipeline_train.py:" in last and last.endswith("run rank 0 too, here"), last
    assert "Traceback" not in done.stderr and "EOFError" not in done.stderr
    assert (tmp_path / "run.pickle").exists()  # what ran until then is kept


# Four Linear(1024, 1024) trained two AdamW steps, sharded by the engine ENGINE names; the script prints
# the bytes of its rank's parameters as torch holds them.
SHARDED = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    if "ENGINE" == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = lambda p: p.to_local()
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        dist.init_process_group("nccl")
        wrap = lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, torch.nn.Linear)
        model = FullyShardedDataParallel(model, auto_wrap_policy=wrap, device_id=torch.cuda.current_device())
        local = lambda p: p
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    print("local", sum(local(p).numel() * local(p).element_size() for p in model.parameters()))
    dist.destroy_process_group()
""")
WEIGHTS = 4 * (1024 * 1024 + 1024) * 4  # the four Linears whole, fp32


@pytest.mark.parametrize("engine, world", [("hsdp", 4), ("fsdp1", 2)])
def test_a_sharded_rank_holds_its_shard_of_the_weights_and_of_adamws_state(torch, tmp_path, engine, world):
    # Rank 1 alone (its collectives move nothing). HSDP over 4 ranks, a 2 x 2 mesh: each shard group of
    # 2 splits the weights in two, and the 2 replicas hold the same halves; FSDP1 over 2 ranks wraps
    # each Linear in a flat parameter of which a rank keeps half. Either way a rank holds WEIGHTS / 2
    # (4,198,400 is even: no padding), and AdamW's two moments of it.
    (tmp_path / "sharded.py").write_text(SHARDED.replace("ENGINE", engine))
    done = _record(tmp_path, "run.pickle", "python", "sharded.py",
                   env={"RANK": "1", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(WEIGHTS // 2)  # what torch itself holds on the rank
    from memdiff import api

    categories = api.summarize(tmp_path / "run.pickle").devices[0].categories
    assert categories["parameter"] == WEIGHTS // 2
    assert categories["optimizer_state"] == 2 * WEIGHTS // 2


def _alone(tmp_path: Path, source: str) -> dict:
    """Rank 1 of 2 of `source`, run alone: its device's categories at the peak."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(source))
    done = _record(tmp_path, "run.pickle", "python", "rank.py",
                   env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    from memdiff import api

    return dict(api.summarize(tmp_path / "run.pickle").devices[0].categories)


# One pre-norm MLP block of width 256, its LayerNorm sequence parallel and its Linears tensor parallel
# (Megatron's layout): each rank gets 128 positions of a sequence of 256, all-gathered before `up`.
SEQUENCE_PARALLEL = """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))


    class Block(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.norm = torch.nn.LayerNorm(w)
            self.up = torch.nn.Linear(w, 4 * w)
            self.down = torch.nn.Linear(4 * w, w)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


    model = Block(256).cuda()
    parallelize_module(model, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 128, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
"""


def test_tensor_and_sequence_parallel_ranks_hold_their_shards_and_the_gathered_sequence(torch, tmp_path):
    # Column- and row-wise Linears keep half of each weight (and of up's bias); down's bias and the
    # LayerNorm's weights are whole (replicated). The activations at the peak, in the backward: up's and
    # GELU's outputs over the whole sequence of 2 x 128 but half of the 1024 features, the LayerNorm's
    # mean and rstd for this rank's 128 positions, and the loss.
    categories = _alone(tmp_path, SEQUENCE_PARALLEL)
    w, batch, local, world = 256, 4, 128, 2
    shards = (w * 4 * w // world + 4 * w // world + 4 * w * w // world + w + 2 * w) * 4
    assert categories["parameter"] == shards
    assert categories["optimizer_state"] == 2 * shards
    hidden = batch * world * local * (4 * w // world) * 4
    assert categories["activation"] == 2 * hidden + 2 * batch * local * 4 + 4


# Causal self-attention's QKV projection and scaled_dot_product_attention under context parallelism:
# torch shards the batch's sequence of 256 over the 2 ranks and runs ring attention on the shards.
CONTEXT_PARALLEL = """
    import os
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
    qkv = torch.nn.Linear(64, 3 * 64).cuda()
    opt = torch.optim.AdamW(qkv.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(2, 256, 64, device="cuda")
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            q, k, v = qkv(x).view(2, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
"""


def test_context_parallel_ranks_keep_the_activations_of_their_half_of_the_sequence(torch, tmp_path):
    # context_parallel wraps F.scaled_dot_product_attention; the emulated GPU's attention kernel must
    # still be chosen under that wrapper, for DTensor's ring attention to run it on the shards. The
    # weights are whole on every rank; the projection's output kept for the backward is this rank's
    # 128 positions of 256 (and the loss).
    categories = _alone(tmp_path, CONTEXT_PARALLEL)
    assert categories["parameter"] == (64 * 192 + 192) * 4
    assert categories["activation"] == 2 * (256 // 2) * 192 * 4 + 4


MOE = ROOT / "tests" / "scenarios" / "moe_ep_train.py"


def _moe(cwd: Path, output: str, world: int, experts: int, flags=()) -> dict:
    """moe_ep_train.py's experts sharded over `world` ranks, launched by torchrun: rank 0's facts."""
    done = _record(cwd, output, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(world), str(MOE), "--experts", str(experts), flags=flags)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("facts "))[6:])


def _dispatched(path: Path) -> List[int]:
    """The sizes of the buffers the rank's all-to-alls of tokens allocated on its GPU, in order."""
    with open(path, "rb") as f:
        trace = max(pickle.load(f)["device_traces"], key=len)  # rank r of a node runs on cuda:r
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any("::all_to_all_single::" in frame["name"] for frame in e["frames"])]


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """The whole job of 2 ranks (8 experts, 4 a rank), its values exchanged; and rank 0 of a job of 8 run
    alone, with 32 experts: 4 a rank too."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("moe")
    return {"job": (folder / "job", _moe(folder, "job/", 2, 8)),
            "alone": (folder / "alone", _moe(folder, "alone/", 8, 32, flags=("--ranks", "0")))}


def test_expert_parallel_ranks_hold_their_experts_and_receive_tokens_x_k_rows(expert_parallel):
    # Each rank routes its 256 tokens, 2 experts a token, balanced over the 8 experts: it sends 256 of
    # its 512 rows to each rank, and receives as many from each, its peer's real counts (the counts'
    # all-to-all, read back with .tolist(), sizes the tokens'). Every all-to-all of rows, the dispatch
    # and the combine in each layer's forward and their reverse in the backward, is then tokens x k
    # rows of width 64 in fp32: 2 steps x 2 layers x 4 of them.
    folder, facts = expert_parallel["job"]
    rows = facts["tokens"] * facts["top_k"]
    assert facts["received"] == [rows] * facts["layers"]
    assert facts["expert_bytes"] == facts["layers"] * 8 // 2 * 2 * 64 * 128 * 4  # 4 experts a layer, 2 weights each
    from memdiff import api

    for rank in range(2):
        categories = api.summarize(folder / f"rank{rank}.pickle").devices[0].categories
        assert categories["parameter"] == facts["shared_bytes"] + facts["expert_bytes"], rank
        assert categories["optimizer_state"] == 2 * categories["parameter"], rank
        assert _dispatched(folder / f"rank{rank}.pickle") == [rows * facts["dim"] * 4] * (2 * facts["layers"] * 4)


def test_an_expert_parallel_rank_alone_receives_what_it_sends_as_in_the_whole_job(expert_parallel):
    # Rank 0 of 8, run alone (--ranks 0): no peer runs, so each is taken to send it what it sends that
    # peer (balanced routing, ranks alike). With 4 experts a rank, as in the job of 2, it holds the same
    # experts and its all-to-alls move the same rows as rank 0 of the whole job; only the router (over
    # 32 experts, not 8) is larger.
    (job, whole), (alone, facts) = expert_parallel["job"], expert_parallel["alone"]
    assert facts["world"] == 8 and facts["expert_bytes"] == whole["expert_bytes"]
    assert facts["received"] == whole["received"]
    assert facts["shared_bytes"] - whole["shared_bytes"] == 2 * 64 * (32 - 8) * 4  # the two routers' weights
    from memdiff import api

    mine, theirs = (api.summarize(folder / "rank0.pickle").devices[0].categories for folder in (alone, job))
    assert mine["parameter"] == facts["shared_bytes"] + facts["expert_bytes"]
    assert mine["communication"] == theirs["communication"]
    assert _dispatched(alone / "rank0.pickle") == _dispatched(job / "rank0.pickle")
