"""Many GPUs on one runner: under `memdiff record --emulate`, a process sees the GPUs its job would
have (a launcher's LOCAL_WORLD_SIZE, or `--gpus N`), each with its own allocator, and each rank's
snapshot records the GPU it ran on, as a real rank's does (docs/emulate.md)."""

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

# A Linear(1024, 1024)'s weight and bias in fp32: what a model of two of them holds per copy.
LINEAR = (1024 * 1024 + 1024) * 4


def _memdiff(cwd: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                            **(env or {})})


def _load(path: Path) -> dict:
    return pickle.loads(path.read_bytes())


def _used(snapshot: dict) -> set:
    """The GPUs a snapshot's trace and segments put memory on."""
    return {i for i, trace in enumerate(snapshot["device_traces"]) if trace} | \
        {segment["device"] for segment in snapshot["segments"]}


def test_a_process_sees_the_gpus_it_is_given_and_each_tensor_stays_on_its_own(torch, tmp_path):
    import memdiff

    seen = {}
    with memdiff.record(str(tmp_path / "run.pickle"), emulate="h100", gpus=2):
        seen["count"] = torch.cuda.device_count()
        a = torch.ones(1024, 1024, device="cuda")  # the current GPU: 0
        torch.cuda.set_device(1)
        seen["current"] = torch.cuda.current_device()
        b = torch.ones(1024, 1024, device="cuda")  # now 1
        c = a.to("cuda:1")  # a copy on GPU 1; `a` stays on 0
        d = b.cuda(0)
        with torch.cuda.device(0):
            e = torch.empty(256, device="cuda")
            seen["inside"] = torch.cuda.current_device()
        seen["after"] = torch.cuda.current_device()
        f = torch.zeros(8, device=torch.device("cuda", 1)) + 1  # an op runs where its inputs are
        seen["devices"] = [str(t.device) for t in (a, b, c, d, e, f)]
        seen["indices"] = [t.get_device() for t in (a, b, c, d)]
        seen["same"] = b.cuda() is b  # already there: no copy
        seen["allocated"] = [torch.cuda.memory_allocated(i) for i in range(2)]
        seen["by_name"] = torch.cuda.max_memory_allocated("cuda:1")
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:2")
        del a, b, c, d, e, f
    assert seen["count"] == 2 and seen["current"] == 1 and (seen["inside"], seen["after"]) == (0, 1)
    assert seen["devices"] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0", "cuda:0", "cuda:1"]
    assert seen["indices"] == [0, 1, 1, 0] and seen["same"]
    square, vector = 1024 * 1024 * 4, 256 * 4
    # GPU 0: a, d, e (a 1 KiB block); GPU 1: b, c and the 8 floats of f (a 512-byte block; the zeros
    # it was made from are freed)
    assert seen["allocated"] == [2 * square + vector, 2 * square + 512]
    assert seen["by_name"] >= 2 * square
    snapshot = _load(tmp_path / "run.pickle")
    assert len(snapshot["device_traces"]) == 2
    for index in (0, 1):
        sizes = [e["size"] for e in snapshot["device_traces"][index] if e["action"] == "alloc"]
        assert sizes.count(square) == 2, (index, sizes)
        assert {s["device"] for s in snapshot["segments"] if s["address"]} >= {0, 1}


def test_a_model_split_over_two_gpus_sends_the_gradient_back_to_the_first(torch, tmp_path):
    import memdiff

    with memdiff.record(str(tmp_path / "run.pickle"), emulate="h100", gpus=2):
        first = torch.nn.Linear(1024, 1024).to("cuda:0")
        second = torch.nn.Linear(1024, 1024).to("cuda:1")
        hidden = first(torch.randn(64, 1024, device="cuda:0")).to("cuda:1")
        second(hidden).sum().backward()
        grads = [str(first.weight.grad.device), str(second.weight.grad.device)]
    assert grads == ["cuda:0", "cuda:1"]
    traces = _load(tmp_path / "run.pickle")["device_traces"]
    activation = 64 * 1024 * 4
    # The copy's backward copies the activation's gradient from GPU 1 to GPU 0, whose weight gradient
    # is made there: each GPU makes its own layer's 4 MiB weight gradient.
    backward0 = [e for e in traces[0] if e["action"] == "alloc" and
                 any("ToCopyBackward0" in f["name"] for f in e["frames"])]
    assert [e["size"] for e in backward0] == [activation]
    for trace in traces:
        assert any(e["action"] == "alloc" and e["size"] == 1024 * 1024 * 4 and
                   any("AddmmBackward0" in f["name"] for f in e["frames"]) for e in trace)


@pytest.mark.slow
def test_the_gpu_count_is_gpus_else_the_launchers_processes_per_node_else_one(torch, tmp_path):
    (tmp_path / "count.py").write_text("import torch\nprint('count', torch.cuda.device_count())\n"
                                       "torch.ones(1, device='cuda')\n")
    cases = [((), {}, 1), ((), {"LOCAL_WORLD_SIZE": "4"}, 4), (("--gpus", "2"), {"LOCAL_WORLD_SIZE": "4"}, 2)]
    for flags, env, count in cases:
        done = _memdiff(tmp_path, "record", "--emulate", "h100", *flags, "-o", "run.pickle", "--", "python",
                        "count.py", env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"count {count}\n" in done.stdout
        assert len(_load(tmp_path / "run.pickle")["device_traces"]) == count
    done = _memdiff(tmp_path, "record", "--gpus", "2", "-o", "run.pickle", "--", "python", "count.py")
    assert done.returncode == 2 and done.stderr.startswith("memdiff: --gpus:"), done.stderr


DDP = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() < world:  # as training scripts check before they start
        sys.exit(f"this job needs {world} GPUs, the node has {torch.cuda.device_count()}")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        out = model(torch.randn(32, 1024))  # a host batch: DDP copies it to its device
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    line = (f"rank {dist.get_rank()} on {torch.cuda.current_device()} {out.device} {next(model.parameters()).device} "
            f"other GPU {torch.cuda.max_memory_allocated(1 - local_rank)}\\n")
    os.write(1, line.encode())  # one write: the ranks share stdout, and print's pieces interleave
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ddp_with_device_ids_puts_each_torchrun_rank_on_its_own_gpu(torch, tmp_path):
    (tmp_path / "ddp.py").write_text(DDP)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", sys.executable, "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "ddp.py")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} on {rank} cuda:{rank} cuda:{rank} other GPU 0\n" in done.stdout, done.stdout
        snapshot = _load(tmp_path / "runs" / f"rank{rank}.pickle")
        # As a real rank on cuda:1 writes it: one trace per GPU of the node, its own holding the events.
        assert len(snapshot["device_traces"]) == 2 and _used(snapshot) == {rank}
    ranks = _memdiff(tmp_path, "ranks", "runs/", "--format", "json")
    assert ranks.returncode == 0, ranks.stderr
    rows = json.loads(ranks.stdout)["ranks"]
    assert [(r["rank"], r["device"]) for r in rows] == [(0, 0), (1, 1)]
    assert rows[0]["peak_bytes"] == rows[1]["peak_bytes"]  # the same work on each rank
    from memdiff import api

    for rank in (0, 1):
        device = api.summarize(tmp_path / "runs" / f"rank{rank}.pickle").devices[0]
        assert device.device == rank
        assert device.categories["parameter"] == 2 * LINEAR
        assert device.categories["optimizer_state"] == 2 * 2 * LINEAR  # AdamW's two moments


SPAWN = textwrap.dedent("""
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel


    def train(rank, world, port):
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = DistributedDataParallel(torch.nn.Linear(1024, 1024).cuda(), device_ids=[rank])
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        # one write, so the two ranks' lines cannot interleave in the pipe they share (print writes each piece)
        sys.stdout.write(f"rank {rank} on {next(model.parameters()).device}\\n")
        sys.stdout.flush()
        dist.destroy_process_group()


    if __name__ == "__main__":
        world = torch.cuda.device_count()
        mp.spawn(train, args=(world, sys.argv[1]), nprocs=world)
""")


@pytest.mark.slow
def test_ranks_spawned_by_the_script_each_take_one_of_the_gpus_given(torch, tmp_path):
    (tmp_path / "spawn.py").write_text(SPAWN)
    # the port is never listened on: the emulated process group has no rendezvous
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "--gpus", "2", "-o", "runs/", "--", "python",
                    "spawn.py", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 on cuda:0" in done.stdout and "rank 1 on cuda:1" in done.stdout
    # each spawned process is named by the rank it gave init_process_group; the parent allocated nothing
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.pickle")) == ["rank0.pickle", "rank1.pickle"]
    assert [tuple(_used(_load(tmp_path / "runs" / f"rank{r}.pickle"))) for r in (0, 1)] == [(0,), (1,)]


DATA_PARALLEL = textwrap.dedent("""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    model = torch.nn.DataParallel(model).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out = model(torch.randn(64, 1024))  # scattered from the host, 32 rows to each GPU
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    print("out", out.device, tuple(out.shape), "peaks", [torch.cuda.max_memory_allocated(i) for i in range(2)])
""")


@pytest.mark.slow
def test_data_parallel_replicates_scatters_and_gathers_over_two_emulated_gpus(torch, tmp_path):
    (tmp_path / "dp.py").write_text(DATA_PARALLEL)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "--gpus", "2", "-o", "run.pickle", "--", "python",
                    "dp.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "out cuda:0 (64, 1024)" in done.stdout
    snapshot = _load(tmp_path / "run.pickle")
    allocs = [[e["size"] for e in trace if e["action"] == "alloc"] for trace in snapshot["device_traces"]]
    weights = 2 * LINEAR
    half, whole = 32 * 1024 * 4, 64 * 1024 * 4
    # GPU 1 gets its replica of the weights in one flat copy (they fit one 10 MiB chunk of
    # broadcast_coalesced) at each forward, and its 32 rows of the batch
    assert allocs[1].count(weights) >= 2 and half in allocs[1]
    # GPU 0 holds the model, its own 32 rows, and the gathered 64-row output; GPU 1 never holds all 64
    assert half in allocs[0] and whole in allocs[0] and whole not in allocs[1]
    from memdiff import api

    devices = {d.device: d for d in api.summarize(tmp_path / "run.pickle").devices}
    assert sorted(devices) == [0, 1]
    assert devices[0].categories["parameter"] == weights
    assert devices[0].categories.get("gradient", 0) == weights  # the replicas' gradients, reduced onto GPU 0
    assert "parameter" not in devices[1].categories and "gradient" not in devices[1].categories
    peaks = [int(x) for x in done.stdout.split("peaks [")[1].split("]")[0].split(", ")]
    for index in (0, 1):  # the script's own allocator stats, per GPU, at or above each trace's peak
        assert devices[index].peak_bytes <= peaks[index] <= devices[index].peak_bytes * 1.05


FSDP = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if sys.argv[1] == "fsdp2":  # the mesh sets the rank's GPU from LOCAL_RANK, as on a GPU
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(f"cuda:{local_rank}")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        model = FullyShardedDataParallel(model, device_id=local_rank)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp"])
def test_fsdp_shards_each_torchrun_rank_on_its_own_gpu(torch, tmp_path, kind):
    (tmp_path / "fsdp.py").write_text(FSDP)
    done = _memdiff(tmp_path, "record", "--emulate", "h100", "-o", "runs/", "--", sys.executable, "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "fsdp.py", kind)
    assert done.returncode == 0, done.stderr[-3000:]
    from memdiff import api

    shard = 4 * LINEAR // 2  # four Linear(1024, 1024) halved between the two ranks
    for rank in (0, 1):
        assert _used(_load(tmp_path / "runs" / f"rank{rank}.pickle")) == {rank}
        device = api.summarize(tmp_path / "runs" / f"rank{rank}.pickle").devices[0]
        assert device.device == rank
        assert device.categories["optimizer_state"] == 2 * shard  # AdamW's two moments of this rank's shard


@pytest.mark.parametrize("value", ["²", "٢", "２"])
def test_a_gpu_count_in_the_environment_is_ascii_digits_or_not_taken(monkeypatch, value):
    # A launcher's LOCAL_WORLD_SIZE (or memdiff's own --gpus variable) that is no ASCII number is not a
    # count: str.isdigit() took "²", which int() then refused with a traceback in every rank, and int()
    # read "٢" as 2 GPUs. The count falls to what the script asked for, as with no variable at all.
    from memdiff.recording.emulate.devices import GPUS, SPAWNED, gpus_per_node

    for name in (GPUS, SPAWNED, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert gpus_per_node(asked=3) == 3
    monkeypatch.setenv(GPUS, value)
    assert gpus_per_node(asked=3) == 3
