"""`memdiff record --emulate GPU -o DIR/ --ranks auto -- torchrun ...`: rank 0 runs first, the layout its
script builds (a device mesh, its groups, the DTensors sharded over them, pipeline stages) names one rank
per role, and only those run (docs/jobs.md, "Picking the ranks"). The jobs are small public patterns:
FSDP2 over a mesh dimension with an embedding table sharded over the other (torchtitan's 2-D layout),
a pipeline of torch.distributed.pipelining stages, and a DDP script of several nodes that builds no
mesh, whose nodes' first ranks keep a node-local cache (picked by their place in their node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Slow (the fast loop, -m "not slow", leaves it out): every test runs emulated processes.
pytestmark = pytest.mark.slow


def _auto(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o runs/ --ranks auto -- COMMAND`, on a node that says nothing of its
    GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks",
                           "auto", "--", *command], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**env, "OMP_NUM_THREADS": "1"})


def _started(done: subprocess.CompletedProcess) -> list:
    """The ranks whose process ran the script: each prints `rank R` once, as its last line."""
    return sorted(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("rank "))


def _said(done: subprocess.CompletedProcess) -> dict:
    """Each rank `--ranks auto` picked, with the reason it gave on stderr."""
    lines = [line.split("--ranks auto: rank ", 1)[1] for line in done.stderr.splitlines()
             if "--ranks auto: rank " in line]
    return {int(rank): why for rank, why in (line.split(": ", 1) for line in lines)}


# torchtitan's 2-D layout, small: a mesh of 2 (dp) by 4 (tp); the model's weights sharded by FSDP2 over
# dp (128 and 64 rows over 2 ranks: even), an embedding table of 10 rows sharded over tp (3, 3, 3, 1);
# its data from a DataLoader's spawned worker.
MESH = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor


    def main():
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
        table = distribute_tensor(torch.randn(10, 64, device="cuda"), mesh["tp"], [Shard(0)])
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters())
        # batches from a spawned worker: a process of its own that imports torch (and is no rank 0)
        data = torch.utils.data.DataLoader(torch.randn(16, 64), batch_size=8, num_workers=1,
                                           multiprocessing_context="spawn")
        for batch in data:
            model(batch.cuda()).sum().backward()
            opt.step()
            opt.zero_grad()
        os.write(1, f"rank {dist.get_rank()} holds {table.to_local().shape[0]} rows\\n".encode())
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
""")


def test_a_2x4_mesh_job_runs_rank_0_the_last_rank_and_the_last_of_its_uneven_dimension(torch, tmp_path):
    (tmp_path / "mesh.py").write_text(MESH)
    done = _auto(tmp_path, "torchrun", "--nproc-per-node", "8", "mesh.py")
    assert done.returncode == 0, done.stderr[-3000:]
    # By hand: rank 0; rank 7, the last; along tp (ranks 0-3 with rank 0) rank 3, whose 1 row of the table
    # is not the 3 of the others; along dp (ranks 0, 4) nothing: FSDP2's shards are even there.
    assert _said(done).keys() == {0, 3, 7}
    assert "its shards are uneven (a tensor of shape [10, 64] sharded on its dim 0 over 4 ranks)" in _said(done)[3]
    assert "mesh dimension dp (size 2, ranks 0, 4 with rank 0): every tensor sharded over it divides evenly" \
        in done.stderr
    # only the picked ranks' processes ran the script: 3 of 8, each holding its own shard of the table
    assert done.stdout.splitlines().count("rank 3 holds 1 rows") == 1 and _started(done) == [0, 3, 7]
    # The last rank, picked in every job, ran beside rank 0 while rank 0 read the layout (two cores take
    # one rank's time for both); what it printed is shown once that run ended, before rank 3 ran.
    assert "the last rank, 7, ran beside rank 0 (every job's picks hold it); what it printed:" in done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("rank ")] == ["0", "7", "3"]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.glob("*.pickle")) == ["rank0.pickle", "rank3.pickle", "rank7.pickle"]
    assert not (runs / ".layout.json").exists()
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    assert manifest["world_size"] == 8 and manifest["emulated_ranks"] == [0, 3, 7]
    assert [p["rank"] for p in manifest["picked_ranks"]] == [0, 3, 7]
    assert manifest["picked_ranks"][1]["why"] == _said(done)[3]
    assert [r["state"] for r in manifest["ranks"]] == ["written", *["not emulated"] * 2, "written",
                                                       *["not emulated"] * 3, "written"]
    # read like a whole job, the others marked as not run
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/", "--format", "json"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr
    assert [r["rank"] for r in json.loads(ranks.stdout)["ranks"]] == [0, 3, 7]
    assert "3 ranks of 8 ranks emulated, each alone (record --ranks auto picked 0,3,7, one per role" in ranks.stderr


# A plain DDP script whose first local rank of every node builds a node-local cache of CACHE_BYTES on its
# GPU (tests/scenarios/node_cache_ddp.py): no mesh, no group but the world's, so rank 0's layout names no
# role but rank 0's and the last rank's; the node's first rank is picked by its place in its node.
NODE_CACHE = Path(__file__).parent / "scenarios" / "node_cache_ddp.py"
CACHE_BYTES = 40 << 20  # the scenario's own constant: a uint8 tensor of this many elements


def _held(done: subprocess.CompletedProcess) -> dict:
    """Each rank that ran, by torch's own rank: (its LOCAL_RANK from torchrun's environment, the cache's bytes)."""
    said = [line.split() for line in done.stdout.splitlines() if line.startswith("rank ")]
    return {int(words[1]): (int(words[3]), int(words[5])) for words in said}


def _peaks(cwd: Path) -> dict:
    """Each rank's peak, as `memdiff ranks runs/` reads the job."""
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/", "--format", "json"], cwd=cwd,
                           capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr
    return {r["rank"]: r["peak_bytes"] for r in json.loads(ranks.stdout)["ranks"]}


def test_a_job_of_two_nodes_of_two_runs_whole_and_the_second_nodes_first_rank_holds_its_cache(torch, tmp_path):
    done = _auto(tmp_path, "torchrun", "--nnodes", "2", "--nproc-per-node", "2", str(NODE_CACHE))
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0 and the last (3) by the layout; rank 2, LOCAL_RANK 0 of node 1, and rank 1, the first node's
    # last, by their places in their nodes: every rank of the job
    said = _said(done)
    assert said.keys() == {0, 1, 2, 3}
    assert said[2].startswith("the first local rank of the last node (LOCAL_RANK 0 of node 1), which runs what a "
                              "script does once per node")
    assert said[1].startswith("the last rank of the first node (LOCAL_RANK 1 of node 0)")
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert manifest["emulated_ranks"] == [0, 1, 2, 3] and manifest["picked_ranks"][2]["why"] == said[2]
    # torch's rank and torchrun's LOCAL_RANK, as each process read them: node-major, the caches on 0 and 2
    assert _held(done) == {0: (0, CACHE_BYTES), 1: (1, 0), 2: (0, CACHE_BYTES), 3: (1, 0)}
    peaks = _peaks(tmp_path)
    # DDP's ranks are alike but for the cache: rank 2 holds it over the last rank, to the byte
    assert peaks[2] - peaks[3] == CACHE_BYTES and peaks[0] == peaks[2] and peaks[1] == peaks[3]


def test_a_job_of_four_nodes_of_eight_runs_the_first_and_last_rank_of_the_first_and_last_node(torch, tmp_path):
    done = _auto(tmp_path, "torchrun", "--nnodes", "4", "--nproc-per-node", "8", str(NODE_CACHE))
    assert done.returncode == 0, done.stderr[-3000:]
    # the processes started grow with the roles, not with the 32 ranks: rank 0 and the last (31), and the
    # first node's last (7) and the last node's first (24) by their places in their nodes
    assert _started(done) == [0, 7, 24, 31] and _said(done).keys() == {0, 7, 24, 31}
    assert "(LOCAL_RANK 0 of node 3)" in _said(done)[24] and "(LOCAL_RANK 7 of node 0)" in _said(done)[7]
    assert ("the script built no device mesh, group or pipeline stage beyond the world's on rank 0: every rank but "
            "rank 0 has one role, run as rank 31, but for its place in its node") in done.stderr
    assert "wrote 4 snapshots of a job of 32 ranks (ranks 0, 7, 24, 31, each run alone)" in done.stderr
    assert _held(done) == {0: (0, CACHE_BYTES), 7: (7, 0), 24: (0, CACHE_BYTES), 31: (7, 0)}
    peaks = _peaks(tmp_path)
    assert peaks[24] - peaks[31] == CACHE_BYTES and peaks[24] == peaks[0] and peaks[7] == peaks[31]


# A script whose rank 0 stops before its first collective (a missing dataset); the others wait for it.
NO_DATA = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if dist.get_rank() == 0:
        raise SystemExit("no dataset at data/train.bin")
    config = [None]
    dist.broadcast_object_list(config, src=0)
""")


def test_when_rank_0_fails_its_failure_is_what_is_shown_and_the_last_ranks_output_is_kept(torch, tmp_path):
    (tmp_path / "train.py").write_text(NO_DATA)
    done = _auto(tmp_path, "torchrun", "--nproc-per-node", "4", "train.py")
    assert done.returncode != 0
    assert "no dataset at data/train.bin" in done.stderr
    assert "memdiff: --ranks auto: rank 0 did not finish, so no other rank was picked" in done.stderr
    # Rank 3 ran beside it, and stopped at the broadcast rank 0 never made: its traceback is not shown but
    # kept, and the job's report says why it died.
    assert f"the last rank, 3, ran beside it and exited 1: what it printed is in {tmp_path / 'runs'}/.rank3.stdout " \
           "and .stderr" in done.stderr
    assert "Traceback" not in done.stderr
    assert "rank 3 of 4 died: RuntimeError: broadcast #g0.0: rank 0 ended without taking part in it" in done.stderr
    assert "rank 0 ended without taking part in it" in (tmp_path / "runs" / ".rank3.stderr").read_text()


# torchtitan's pipeline layout, small: a mesh of 2 (dp) by 3 (pp), each rank's stage of
# torch.distributed.pipelining built over its pp group with no example input (torch infers the shapes
# at the first step and sends them on, recv_object_list, as torchtitan's stages do) and sharded by
# FSDP2 over dp (64 rows over 2: even); two AdamW steps of Schedule1F1B over 4 microbatches.
PIPELINE = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (2, 3), mesh_dim_names=("dp", "pp"))
    stage_index = mesh["pp"].get_local_rank()
    part = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).cuda()
    fully_shard(part, mesh=mesh["dp"])
    stage = PipelineStage(part, stage_index, 3, torch.device("cuda"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, 4, loss_fn=lambda out, target: (out - target).square().mean())
    opt = torch.optim.AdamW(part.parameters())
    for _ in range(2):
        if stage_index == 0:
            schedule.step(torch.randn(8, 64, device="cuda"))
        elif stage_index == 2:
            schedule.step(target=torch.randn(8, 64, device="cuda"))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    os.write(1, f"rank {dist.get_rank()} stage {stage_index}\\n".encode())
    dist.destroy_process_group()
""")


def test_a_pipeline_runs_each_stage_and_its_ranks_equal_the_whole_jobs(torch, tmp_path):
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    done = _auto(tmp_path, "torchrun", "--nproc-per-node", "6", "pipeline.py")
    assert done.returncode == 0, done.stderr[-3000:]
    # By hand: rank 0 (stage 0); ranks 1 and 2, the first of stages 1 and 2 (2 also the last along pp,
    # ranks 0-2); rank 5, the last; along dp (ranks 0, 3) nothing: FSDP2's shards are even there.
    said = _said(done)
    assert said.keys() == {0, 1, 2, 5}
    assert "the first rank of pipeline stage 0 of 3" in said[0] and "the first rank of pipeline stage 2 of 3" in said[2]
    # Rank 0, with rank 5 beside it, cannot learn stage 1's shapes (its rank 1, and rank 5's rank 4, do not
    # run): both run again with the ranks picked, once more in all; the first run of rank 5 is not shown.
    assert "running rank 0 again, with the ranks picked: its pipeline stage hears its shapes from rank 1, which " \
           "did not run with it the first time" in done.stderr
    assert "its pipeline stage's shapes come from rank 1; memdiff runs this rank again with it" in done.stderr
    assert "run rank 1 too, here" not in done.stderr  # the refusal of a rank run alone is not said
    assert "what it printed" not in done.stderr and "Traceback" not in done.stderr
    assert _started(done) == [0, 1, 2, 5] and "rank 5 stage 2" in done.stdout.splitlines()
    # Rank 5's stages 0 and 1 (ranks 3 and 4) do not run: it hears what rank 1 sent rank 2, the pipeline
    # alike. Each rank run so holds what the same rank of the whole job holds, to the byte.
    whole = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "whole/", "--",
                            "torchrun", "--nproc-per-node", "6", "pipeline.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0, whole.stderr[-3000:]
    import memdiff

    for rank in (0, 1, 2, 5):
        alone = memdiff.summarize(tmp_path / "runs" / f"rank{rank}.pickle").devices[0]
        together = memdiff.summarize(tmp_path / "whole" / f"rank{rank}.pickle").devices[0]
        assert (alone.peak_bytes, alone.categories) == (together.peak_bytes, together.categories), rank
