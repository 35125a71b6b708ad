"""`memdiff record --emulate GPU -o DIR/ -- torchrun ...`: every rank of a launched job runs on the
emulated GPU, with process groups that do no communication (docs/emulate.md), held to real H100
snapshots of the same DDP job (tests/data/cuda/ddp)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

# Slow (the fast loop, -m "not slow", leaves it out): every test runs emulated processes.
pytestmark = pytest.mark.slow

REAL = ROOT / "tests" / "data" / "cuda" / "ddp"
DDP_GPT2 = ROOT / "tests" / "data" / "cuda" / "ddp_gpt2.py"

# A rank's training and collectives, on a GPU the script believes it has. Its one Linear holds
# 1024 * 1024 + 1024 floats (4,198,400 bytes): DDP's gradient bucket is as big.
COLLECTIVES = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist

    backend = sys.argv[1]
    if backend:
        dist.init_process_group(backend)
    else:
        dist.init_process_group()
    print("rank", dist.get_rank(), "of", dist.get_world_size(), "backend", dist.get_backend())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    slots = [torch.empty(4, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(slots, t)
    count = torch.full((1,), 3, device="cuda")
    dist.all_reduce(count)
    gathered = [torch.zeros(1, dtype=torch.long, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.full((1,), 7, device="cuda"))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    print("sum", count.item(), "gathered", [g.item() for g in gathered], "done", work.is_completed())
    dist.destroy_process_group()
""")

BUCKET = (1024 * 1024 + 1024) * 4


def _memdiff(cwd: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
                                            "PYTHONPATH": str(ROOT), **(env or {})})


def _torchrun(*args: str) -> list:
    # --standalone: a rendezvous on a free port of this machine
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


@pytest.mark.parametrize("backend", ["nccl", "gloo", ""])
def test_a_rank_trains_ddp_and_its_collectives_return_on_the_emulated_gpu(torch, tmp_path, backend):
    # A CPU build has no NCCL, and gloo moves no meta tensor: every backend is a group that does
    # no communication, run here as rank 1 of 2 with nobody else there.
    (tmp_path / "ranks.py").write_text(COLLECTIVES)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "run.pickle", "--", "python", "ranks.py", backend,
                    env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "1"})  # never connected to: there is no rendezvous
    assert done.returncode == 0, done.stderr[-3000:]
    # The script sees the backend it asked for (a CUDA job's default is nccl).
    assert f"rank 1 of 2 backend {backend or 'nccl'}" in done.stdout
    # Known small values follow the group's rule that every rank holds what this one holds.
    assert "sum 6 gathered [7, 7] done True" in done.stdout
    from memdiff import api

    summary = api.summarize(tmp_path / "run.pickle").devices[0]
    # The reducer's bucket is GPU memory, and reads as a GPU's does: communication.
    assert summary.categories.get("communication", 0) >= BUCKET, summary.categories
    assert summary.categories.get("parameter") == BUCKET


def test_torchrun_under_emulate_writes_each_ranks_emulated_snapshot_and_the_manifest(torch, tmp_path):
    (tmp_path / "ranks.py").write_text(COLLECTIVES)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", *_torchrun("ranks.py", "nccl"))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["memdiff-job.json", "rank0.pickle", "rank1.pickle"]
    manifest = json.loads((runs / "memdiff-job.json").read_text())
    assert manifest["world_size"] == 2 and manifest["exit_status"] == 0
    assert [(r["rank"], r["state"], r["at"]) for r in manifest["ranks"]] == [
        (0, "written", "destroy_process_group"), (1, "written", "destroy_process_group")]
    for rank in (0, 1):
        snapshot = pickle.loads((runs / f"rank{rank}.pickle").read_bytes())
        assert snapshot["emulated"]["gpu"] == "NVIDIA H100 80GB HBM3"
        assert any(e["action"] == "alloc" for e in snapshot["device_traces"][0])
    ranks = _memdiff(tmp_path, "ranks", "runs/")
    assert ranks.returncode == 0, ranks.stderr


def test_an_op_the_emulator_cannot_run_in_a_rank_is_one_line_and_exit_2(torch, tmp_path):
    (tmp_path / "refused.py").write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist

        torch.library.define("mine::kernel", "(Tensor x) -> Tensor")
        torch.library.impl("mine::kernel", "cpu", lambda x: x.clone())
        dist.init_process_group("nccl")
        x = torch.ones(4, device="cuda")
        if dist.get_rank() == 0:
            torch.ops.mine.kernel(x)
        dist.barrier()  # rank 1 waits here until torchrun ends it
    """))
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", *_torchrun("refused.py"))
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "no fake (meta) implementation" in line]
    # One line from rank 0 (torchrun puts its own [rank0]: before it), naming the op and the script's line.
    assert len(said) == 1 and "memdiff: rank 0: mine::kernel: a custom op" in said[0], done.stderr[-3000:]
    assert "called at refused.py:10" in said[0]
    manifest = json.loads((tmp_path / "runs" / "memdiff-job.json").read_text())
    assert "mine::kernel" in manifest["ranks"][0]["refused"] and "refused" not in manifest["ranks"][1]
    assert manifest["ranks"][0]["state"] == "written"  # what ran up to the op


FSDP2 = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
""")


def test_fsdp2_shards_and_its_optimizer_state_is_the_shards(torch, tmp_path):
    # No real FSDP run yet: the truth is the model's own. FSDP2 picks its mesh's device from
    # torch's accelerator (cuda, emulated), and its DTensor parameters hold a shard each: AdamW's
    # two moments are the shard's size, not the whole weight's.
    (tmp_path / "fsdp.py").write_text(FSDP2)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "run.pickle", "--", "python", "fsdp.py",
                    env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    from memdiff import api

    categories = api.summarize(tmp_path / "run.pickle").devices[0].categories
    shard = BUCKET * 4 // 2  # four Linear(1024, 1024), halved between two ranks
    assert categories["parameter"] == shard
    assert categories["optimizer_state"] == 2 * shard


DTENSOR_INIT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (2,))
    weight = distribute_tensor(torch.empty(4096, 1024, device="cuda"), mesh, [Shard(0)])
    torch.nn.init.normal_(weight)
    local = weight.to_local()
    print(tuple(local.shape), local.device, torch.cuda.memory_allocated())
    dist.destroy_process_group()
""")


def test_a_random_init_of_a_sharded_weight_runs_on_the_emulated_gpu(torch, tmp_path):
    # The FSDP2 example's reset_parameters() after to_empty(device="cuda:N"): DTensor's first random
    # op copies the CUDA generator's state to the mesh's GPU inside nn.init.normal_, a torch function
    # whose body runs with the emulator's device mode off (it was refused as aten::_to_copy).
    (tmp_path / "init.py").write_text(DTENSOR_INIT)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "run.pickle", "--", "python", "init.py",
                    env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    *_, rows, cols, device, allocated = done.stdout.split()
    assert (rows, cols, device) == ("(2048,", "1024)", "cuda:0")
    shard = 2048 * 1024 * 4  # this rank's half of the weight; the generator's state is a few bytes
    assert shard <= int(allocated) < shard + 4096


@pytest.fixture(scope="module")
def emulated_ddp(tmp_path_factory):
    """The real DDP job of tests/data/cuda/ddp, run again on the emulated H100."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("ddp")
    done = _memdiff(folder, "record", "--emulate", "h100", "-o", "ddp/", "--", *_torchrun(str(DDP_GPT2)))
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "ddp"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_emulated_rank_has_the_real_h100_ranks_peak_and_categories(emulated_ddp, rank):
    from memdiff import api

    real = api.summarize(REAL / f"rank{rank}.pickle.gz").devices[0]
    emu = api.summarize(emulated_ddp / f"rank{rank}.pickle").devices[0]
    # The targets, as the single-process GPT-2 runs are held to them (test_emulate_gpt2.py).
    assert abs(emu.peak_bytes / real.peak_bytes - 1) <= 0.01, (rank, emu.peak_bytes, real.peak_bytes)
    assert abs(emu.reserved_peak_bytes / real.reserved_peak_bytes - 1) <= 0.05
    assert emu.phase_at_peak == real.phase_at_peak
    assert set(emu.categories) == set(real.categories)
    # DDP's buckets (communication), and the bytes that are the model's, byte for byte.
    for category in ("communication", "parameter", "optimizer_state", "workspace", "input"):
        assert emu.categories.get(category, 0) == real.categories.get(category, 0), category


def test_the_emulated_jobs_manifest_reads_as_the_real_ones(emulated_ddp):
    real = json.loads((REAL / "memdiff-job.json").read_text())
    emu = json.loads((emulated_ddp / "memdiff-job.json").read_text())
    assert (emu["world_size"], emu["exit_status"]) == (real["world_size"], real["exit_status"])
    assert [(r["rank"], r["state"], r["at"]) for r in emu["ranks"]] == \
        [(r["rank"], r["state"], r["at"]) for r in real["ranks"]]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_emulated_rank_diffs_as_no_change_against_the_real_rank(emulated_ddp, rank):
    done = _memdiff(ROOT, str(REAL / f"rank{rank}.pickle.gz"), str(emulated_ddp / f"rank{rank}.pickle"))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 B, +0.0%" in done.stdout
    # Every site holds the same bytes at the peak: DDP's buckets, the weights moved by .cuda(), all of them.
    rows = done.stdout[done.stdout.index("\nstatus "):].splitlines()[3:]
    assert not [row for row in rows if row.split()[:1] in (["NEW"], ["GONE"], ["GREW"], ["SHRANK"])], rows


def test_an_allocator_setting_the_emulator_lacks_is_one_line_before_any_rank_starts(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", *_torchrun("train.py"),
                    env={"PYTORCH_CUDA_ALLOC_CONF": "bogus:1"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["memdiff: PYTORCH_CUDA_ALLOC_CONF: PYTORCH_CUDA_ALLOC_CONF setting 'bogus' "
                                        "is not emulated"]
    assert not (tmp_path / "runs").exists()
