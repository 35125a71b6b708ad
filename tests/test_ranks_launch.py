"""What `memdiff record --ranks` runs, read without running a job: the ranks `--ranks auto` picks from the
layout torch's own DeviceMesh, groups, DTensors and pipeline stages make on rank 0 (a fake process group
of 8 ranks, in one process), and the job an `accelerate launch` command describes (docs/jobs.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Slow (the fast loop, -m "not slow", leaves it out): each test runs a process that imports torch.
pytestmark = pytest.mark.slow

# Rank 0 of a job of 8 building torchtitan's 3-D layout (pp, dp, tp of 2 each), with the emulator's
# new_group and the layout's own patches in force: torch makes the groups, memdiff only writes them.
LAYOUT = textwrap.dedent("""
    import json
    import sys
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memdiff.recording.emulate import distributed, layout, swap
    from memdiff.recording.pick import pick, read_layout

    new_group = distributed._new_group(c10d.new_group)
    with swap.environment({layout.LAYOUT: sys.argv[1]}), layout.recorded(), \\
            swap.replaced([(module, "new_group", new_group) for module in (dist, c10d, device_mesh)]):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        distribute_tensor(torch.randn(6, 4), mesh["dp"], [Shard(0)])  # 3 rows each
        # a tensor-parallel layer over dp (2 rows each) run on a batch of 1: sharding propagation weighs
        # placements no tensor takes (its output sharded on that batch of 1); only made tensors count
        parallelize_module(torch.nn.Linear(4, 4), mesh["dp"], ColwiseParallel())(torch.randn(1, 4))
        distribute_tensor(torch.randn(5, 4), mesh["tp"], [Shard(0)])  # 3 rows, then 2
        for stage in (0, 2):  # an interleaved schedule's stages on rank 0's place of pp
            PipelineStage(torch.nn.Linear(4, 4), stage, 4, torch.device("cpu"), group=mesh["pp"].get_group())
        dist.new_subgroups(group_size=4)  # groups of ranks 0-3 and 4-7
        dist.new_group([5, 6, 7])  # a group of its own, without rank 0
        dist.destroy_process_group()
    picked, notes = pick(read_layout(sys.argv[1]), 8)
    print(json.dumps({"picked": {p.rank: p.why for p in picked}, "notes": notes}))
""")


def test_auto_picks_one_rank_per_role_of_a_3d_mesh_with_pipeline_stages_and_subgroups(torch, tmp_path):
    (tmp_path / "layout.py").write_text(LAYOUT)
    done = subprocess.run([sys.executable, "layout.py", str(tmp_path / "layout.json")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    picked = {int(rank): why for rank, why in said["picked"].items()}
    # By hand, rank = 4 pp + 2 dp + tp: rank 0 (stages 0 and 2); rank 1, the last along tp, whose 5 rows
    # split unevenly; rank 4, the last along pp (nothing sharded over it) and the first of stages 1 and 3;
    # rank 3, the last of the subgroup 0-3; rank 5, the first of a group without rank 0; rank 7, the last.
    # dp (ranks 0, 2) adds none: its 6 rows and its layer's 4 split evenly.
    assert sorted(picked) == [0, 1, 3, 4, 5, 7]
    assert "pipeline stages 0, 2 of 4" in picked[0] and "pipeline stages 1, 3 of 4" in picked[4]
    assert "mesh dimension tp" in picked[1] and "uneven (a tensor of shape [5, 4] sharded on its dim 0 over 2" \
        in picked[1]
    assert "mesh dimension pp" in picked[4] and "not known" in picked[4]
    assert "group of ranks 0-3" in picked[3] and "group of ranks 5-7" in picked[5]
    assert [n.split(":")[0] for n in said["notes"]] == ["mesh dimension dp (size 2, ranks 0, 2 with rank 0)"]


def test_an_accelerate_command_of_two_machines_is_read_as_accelerate_counts_its_processes(tmp_path):
    pytest.importorskip("accelerate")
    code = textwrap.dedent("""
        import json, sys
        from memdiff.recording.launch import rank_env
        from memdiff.recording.launch_accelerate import read_accelerate

        launch = read_accelerate(sys.argv[1:])
        print(json.dumps({"nodes": launch.nnodes, "per_node": launch.nproc_per_node, "target": launch.target[1:],
                          "precision": launch.env.get("ACCELERATE_MIXED_PRECISION"),
                          "rank11": rank_env(launch, 11, [11], 29500)}))
    """)
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "16", "--num_machines", "2",
               "--machine_rank", "0", "--main_process_ip", "10.0.0.1", "--mixed_precision", "bf16", "train.py",
               "--lr", "1e-4"]
    done = subprocess.run([sys.executable, "-c", code, *command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent),
                                            "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout)
    # --num_processes counts both machines' processes: 8 a machine, torchrun's node-major ranks
    assert (read["nodes"], read["per_node"], read["precision"]) == (2, 8, "bf16")
    assert read["target"] == ["-u", "train.py", "--lr", "1e-4"]
    assert {k: read["rank11"][k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")} == \
        {"RANK": "11", "LOCAL_RANK": "3", "GROUP_RANK": "1", "WORLD_SIZE": "16"}
