"""Launched jobs under `memdiff record --emulate GPU -o DIR/`: every rank is accounted for, object
collectives carry rank 0's objects, a GPU's no-ops are no-ops, and values read back follow one policy
(docs/emulate.md). The jobs are the patterns of public training scripts: torchrun, torch.multiprocessing
.spawn, Lightning's own launcher with `devices=2`, Hogwild (pytorch/examples' mnist_hogwild with
`--cuda`), a PSNR from `.item()` (pytorch/examples' super_resolution)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import missing_capture_dependency, read_back
from test_record_ranks import free_port, torchrun

from memdiff.analyse.classify import load_rules
from memdiff.read.inputs import read_summary

# Slow (the fast loop, -m "not slow", leaves it out): every test runs emulated processes.
pytestmark = pytest.mark.slow


def _emulated(cwd: Path, output: str, *command: str, ranks: str = "") -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o OUTPUT [--ranks RANKS] -- COMMAND`, on a node that says nothing
    of its GPUs."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}
    some = ["--ranks", ranks] if ranks else []
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", output, *some, "--",
                           *command], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "memdiff-job.json").read_text())


# Each object collective, and a size then a buffer, as a rank of a job does them. Run under torchrun
# with gloo on the CPU, torch itself moves the objects: what it prints is what a receiving rank gets.
OBJECTS = textwrap.dedent("""
    import os
    import sys
    import torch
    import torch.distributed as dist


    def print(*words):  # one write per line: the ranks share stdout
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())


    backend, device = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    objects = [{"epoch": 3, "files": ["x" * 70000]}, "best.pt"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    print(rank, "broadcast", objects[0]["epoch"], len(objects[0]["files"][0]), objects[1])
    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "name": "r" * (rank + 1)})
    print(rank, "all_gather", everyone)
    at_root = [None] * world if rank == 0 else None
    dist.gather_object(("from", rank), at_root, dst=0)
    print(rank, "gather", at_root)
    mine = [None]
    dist.scatter_object_list(mine, [f"shard{r}" for r in range(world)] if rank == 0 else None, src=0)
    print(rank, "scatter", mine)
    size = torch.tensor([7 if rank == 0 else 0], device=device)
    dist.broadcast(size, 0)
    payload = torch.arange(7, dtype=torch.uint8, device=device) if rank == 0 else \\
        torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, 0)
    print(rank, "size then buffer", size.item(), payload.tolist())
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def real_objects(tmp_path_factory):
    """What torch's own gloo gives each rank of the job, on the CPU."""
    pytest.importorskip("torch")
    tmp_path = tmp_path_factory.mktemp("real")
    (tmp_path / "objects.py").write_text(OBJECTS)
    done = subprocess.run(torchrun("objects.py", "gloo", "cpu"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(done.stdout.splitlines())


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_object_collectives_give_each_rank_what_torch_gives_it(real_objects, tmp_path, backend):
    # Rank 1 used to unpickle its own None (or ask the host for 139,781,262,008,016 bytes: the sizes
    # were `torch.empty` on the host); NCCL's object collectives run on the GPU, gloo's on the host.
    (tmp_path / "objects.py").write_text(OBJECTS)
    done = _emulated(tmp_path, "runs/", *torchrun("objects.py", backend, "cuda"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == real_objects
    assert "1 broadcast 3 70000 best.pt" in real_objects  # rank 0's object, 70,000 characters and all
    assert [r["state"] for r in _manifest(tmp_path / "runs")["ranks"]] == ["written", "written"]
    assert not (tmp_path / "runs" / ".collectives").exists()  # what the ranks exchanged is gone with the job


# torch.multiprocessing.spawn's ranks (no RANK in their environment), one GPU each, as the PyTorch
# DDP tutorial starts them; rank 1 fails after its collectives.
SPAWNED = textwrap.dedent("""
    import os
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def run(rank, world, port):
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.cuda.set_device(rank)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64).cuda(), device_ids=[rank])
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        settings = [{"lr": 0.1} if rank == 0 else None]
        dist.broadcast_object_list(settings, src=0)
        os.write(1, f"rank {rank} sees {torch.cuda.device_count()} GPUs, got {settings[0]}\\n".encode())
        if rank == 1:
            raise ValueError("the data of rank 1 is missing")
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(run, args=(2, int(sys.argv[1])), nprocs=2)
""")


def test_a_spawned_rank_that_dies_is_named_with_its_error_and_fails_the_job(torch, tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    done = _emulated(tmp_path, "runs/", sys.executable, "spawned.py", str(free_port()))
    assert done.returncode == 1, done.stderr[-3000:]
    # each spawned process sees the two GPUs of the job it is a rank of, and is named by its rank
    assert sorted(done.stdout.splitlines()) == [f"rank {r} sees 2 GPUs, got {{'lr': 0.1}}" for r in (0, 1)]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.glob("*.pickle")) == ["rank0.pickle", "rank1.pickle"]
    line = next(n for n, text in enumerate(SPAWNED.splitlines(), 1) if "raise ValueError" in text)
    died = f"ValueError: the data of rank 1 is missing (at {script}:{line})"
    assert f"memdiff: rank 1 of 2 died: {died}" in done.stderr
    assert [r.get("died") for r in _manifest(runs)["ranks"]] == [None, died]



# A script recorded to one file that spawns its workers itself, each saving a checkpoint over one the
# user has (pytorch/examples' Hogwild and DDP tutorials are run this way with `-o run.pickle`).
SPAWNS_AND_SAVES = textwrap.dedent("""
    import os
    import torch
    import torch.multiprocessing as mp


    def work(index):
        x = torch.ones(1 << 20, device="cuda")
        torch.save({"x": x}, f"ckpt{index}.pt")
        with open(os.devnull, "w") as quiet:
            quiet.write("worker log")
        os.write(1, f"worker {index} on {x.device}\\n".encode())


    if __name__ == "__main__":
        mp.spawn(work, nprocs=2)
""")


def test_processes_a_script_recorded_to_one_file_spawns_are_emulated_and_never_touch_the_users_files(
        torch, tmp_path):
    (tmp_path / "spawns.py").write_text(SPAWNS_AND_SAVES)
    for index in (0, 1):
        (tmp_path / f"ckpt{index}.pt").write_bytes(b"the user's checkpoint")
    done = _emulated(tmp_path, "run.pickle", sys.executable, "spawns.py")
    assert done.returncode == 0, done.stderr[-3000:]
    # each spawned process ran on the emulated GPU (the machine's torch has no CUDA), saved into the
    # run's overlay, and the user's checkpoints are as they were
    assert sorted(done.stdout.splitlines()) == ["worker 0 on cuda:0", "worker 1 on cuda:0"]
    assert [(tmp_path / f"ckpt{i}.pt").read_bytes() for i in (0, 1)] == [b"the user's checkpoint"] * 2
    for index in (0, 1):
        assert f"changed ckpt{index}.pt (4.00 MiB, 4,194,304 bytes of tensor data" in done.stderr
    assert "/dev/null" not in done.stderr  # a device is no user's file
    # the one file holds the script's own process: the user is told the workers' memory is elsewhere
    assert "the script started 2 processes that used the emulated GPU" in done.stderr
    assert "record with -o DIR/ for a snapshot of each" in done.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".memdiff-writes-")]


LIGHTNING = textwrap.dedent("""
    import os

    import torch
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(32, 4)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        data = DataLoader(TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,))), batch_size=8)
        trainer = L.Trainer(accelerator="gpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), data)
        line = f"rank {trainer.global_rank} of {trainer.world_size} steps {trainer.global_step}\\n"
        os.write(1, line.encode())  # one write: the ranks share stdout
""")


def test_lightning_ddp_on_two_gpus_under_its_own_launcher_records_both_ranks(torch, tmp_path):
    # Lightning re-runs the script for rank 1 with LOCAL_RANK, NODE_RANK and WORLD_SIZE, never RANK.
    # It used to refuse `devices=2` on a node of one GPU; with --gpus 2, rank 1 died in
    # broadcast_object_list, and memdiff wrote one pid....pickle and exited 0.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(LIGHTNING)
    done = _emulated(tmp_path, "runs/", sys.executable, "train.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == \
        ["rank 0 of 2 steps 2", "rank 1 of 2 steps 2"]
    manifest = _manifest(tmp_path / "runs")
    assert manifest["world_size"] == 2
    assert [(r["rank"], r["state"], r["file"]) for r in manifest["ranks"]] == \
        [(0, "written", "rank0.pickle"), (1, "written", "rank1.pickle")]
    # Lightning runs training_step and backward in the closure inside `Optimizer.step#SGD.step`'s
    # scope: each step still reads forward, backward, optimizer, and the Linear(32, 4)'s 528 bytes
    # are the weights and their gradient, no optimizer state (plain SGD keeps none).
    for rank in ("rank0.pickle", "rank1.pickle"):
        d = read_summary(str(tmp_path / "runs" / rank), load_rules()).devices[0]
        assert [[p.phase for p in s.phases] for s in d.steps] == [["forward", "backward", "optimizer"]] * 2
        assert (d.categories["parameter"], d.categories["gradient"]) == (528, 528)
        assert not {c for c in d.categories if c.startswith("optimizer")}


# A job Lightning's launcher starts from inside the script: 2 nodes of 4 GPUs, DDP. Each rank says, at the
# start of training, what Lightning made of it and of its environment, and how many processes it started.
LIGHTNING_NODES = textwrap.dedent("""
    import os

    import torch
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset


    class Says(L.Callback):
        def on_train_start(self, trainer, module):
            env = " ".join(f"{k}={os.environ.get(k)}" for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"))
            os.write(1, (f"rank {trainer.global_rank} of {trainer.world_size} node {trainer.node_rank} local "
                         f"{trainer.local_rank} device {torch.cuda.current_device()} started "
                         f"{len(trainer.strategy.launcher.procs)} {env} parent {os.getppid()}\\n").encode())


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        data = DataLoader(TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,))), batch_size=8)
        trainer = L.Trainer(accelerator="gpu", devices=4, num_nodes=2, strategy="ddp", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[Says()])
        trainer.fit(Tiny(), data)
""")


def test_named_ranks_of_a_job_lightnings_own_launcher_starts_run_alone_as_lightning_starts_them(torch, tmp_path):
    # `python train.py` whose Trainer(devices=4, num_nodes=2) starts its own ranks: --ranks was refused
    # ("runs some ranks of a torchrun, accelerate or DeepSpeed job"), the job's size being in the script.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(LIGHTNING_NODES)
    done = _emulated(tmp_path, "runs/", sys.executable, "train.py", ranks="0,5")
    assert done.returncode == 0, done.stderr[-3000:]
    said = sorted(line.split(" parent ") for line in done.stdout.splitlines() if line.startswith("rank"))
    # Lightning's own view: global rank NODE_RANK x 4 + LOCAL_RANK of 8, on its local GPU, started from
    # outside (its launcher started no process), with the environment Lightning's launcher gives a rank
    assert [rank for rank, _ in said] == [
        "rank 0 of 8 node 0 local 0 device 0 started 0 LOCAL_RANK=0 NODE_RANK=0 WORLD_SIZE=8 RANK=None",
        "rank 5 of 8 node 1 local 1 device 1 started 0 LOCAL_RANK=1 NODE_RANK=1 WORLD_SIZE=8 RANK=None"]
    # both started by memdiff (one parent), neither by the other
    assert len({parent for _, parent in said}) == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["memdiff-job.json", "rank0.pickle",
                                                                     "rank5.pickle"]
    manifest = _manifest(tmp_path / "runs")
    assert (manifest["world_size"], manifest["emulated_ranks"]) == (8, [0, 5])
    assert [(r["rank"], r["state"]) for r in manifest["ranks"]] == \
        [(r, "written" if r in (0, 5) else "not emulated") for r in range(8)]
    # DDP replicates the model: each rank holds all of its parameters and their gradients
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in ("rank0.pickle", "rank5.pickle"):
        d = read_summary(str(tmp_path / "runs" / rank), load_rules()).devices[0]
        assert (d.categories["parameter"], d.categories["gradient"]) == (weights, weights)
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert ranks.returncode == 0, ranks.stderr
    assert "2 ranks of 8 ranks emulated, each alone (record --ranks 0,5): the others were not run" in ranks.stderr


# A Trainer whose launcher starts the script's second local rank itself, recorded as one script.
LIGHTNING_TWO = textwrap.dedent("""
    import os

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        os.write(1, f"pid {os.getpid()}\\n".encode())
        data = DataLoader(TensorDataset(torch.randn(32, 32), torch.randint(0, 4, (32,))), batch_size=8)
        trainer = L.Trainer(accelerator="gpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), data)
        os.write(1, f"done rank {trainer.global_rank}\\n".encode())
""")


def test_a_script_whose_lightning_launcher_starts_its_ranks_ends_with_all_of_them(torch, tmp_path):
    # `-o FILE -- python train.py` with Trainer(devices=2): the script is rank 0 and its launcher starts
    # rank 1. Emulated collectives wait for no one, so rank 0 ended first, the run ended, and rank 1,
    # waiting for rank 0's broadcasts, lost its emulated GPU ("not recording process ...") and
    # outlived memdiff (and fit). On GPUs the ranks end together; here too.
    try:
        import lightning  # noqa: F401
    except ImportError:
        missing_capture_dependency("lightning is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(LIGHTNING_TWO)
    done = _emulated(tmp_path, "run.pickle", sys.executable, "train.py")
    pids = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("pid ")]
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(line for line in done.stdout.splitlines() if line.startswith("done")) == \
            ["done rank 0", "done rank 1"], done.stdout
        assert "the script started 1 process that used the emulated GPU (rank1)" in done.stderr
        assert "not recording process" not in done.stderr
        assert len(pids) == 2
        for pid in pids:  # none outlived the run
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# pytorch/examples' mnist_hogwild with --cuda: the model's memory shared, workers started by spawn.
HOGWILD = textwrap.dedent("""
    import os

    import torch
    import torch.multiprocessing as mp
    import torch.nn.functional as F


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 8, 5)
            self.fc = torch.nn.Linear(8 * 12 * 12, 10)

        def forward(self, x):
            return F.log_softmax(self.fc(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1)), dim=1)


    def train(rank, model, device):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        for _ in range(2):
            data, target = torch.randn(16, 1, 28, 28).to(device), torch.randint(0, 10, (16,)).to(device)
            opt.zero_grad()
            F.nll_loss(model(data), target).backward()
            opt.step()
        weight = next(model.parameters())
        os.write(1, f"worker {rank} {weight.device} {weight.is_shared()}\\n".encode())  # one write per line


    if __name__ == "__main__":
        device = torch.device("cuda")
        mp.set_start_method("spawn", force=True)
        model = Net().to(device)
        model.share_memory()
        workers = [mp.Process(target=train, args=(rank, model, device)) for rank in range(2)]
        for p in workers:
            p.start()
        for p in workers:
            p.join()
        print("exit codes", [p.exitcode for p in workers], flush=True)
""")


def test_hogwild_shares_the_models_gpu_memory_and_its_workers_train(torch, tmp_path):
    # `share_memory_()` of a CUDA tensor is a no-op (CUDA IPC shares it): it raised
    # "_share_fd_: only available on CPU" here, at `model.share_memory()`.
    (tmp_path / "hogwild.py").write_text(HOGWILD)
    done = _emulated(tmp_path, "runs/", sys.executable, "hogwild.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == ["exit codes [0, 0]", "worker 0 cuda:0 True", "worker 1 cuda:0 True"]
    assert len(list((tmp_path / "runs").glob("pid*.pickle"))) == 3  # the parent's and each worker's


# A worker handed a tensor on the second GPU and a tensor the script made on the meta device (its
# model's plan, built under torch.device("meta")), by spawn.
SENT = textwrap.dedent("""
    import os
    import sys

    import torch
    import torch.multiprocessing as mp


    def worker(weight, plan):
        os.write(1, f"weight {weight.device} {tuple(weight.shape)}\\n".encode())
        os.write(1, f"plan {plan.device} {tuple(plan.shape)} {plan.requires_grad}\\n".encode())


    if __name__ == "__main__":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"  # a node of two GPUs (no GPU used yet)
        mp.set_start_method("spawn", force=True)
        with torch.device("meta"):
            plan = torch.nn.Linear(8, 2).weight
        p = mp.Process(target=worker, args=(torch.ones(3, 4, device=sys.argv[1]), plan))
        p.start()
        p.join()
        print("exit code", p.exitcode, flush=True)
""")


def test_a_worker_receives_a_gpu_tensor_on_its_gpu_and_the_scripts_meta_tensor_on_meta(torch, tmp_path):
    # torch sends a CUDA tensor as an IPC handle, opened on the sender's GPU, and a meta tensor as a meta
    # tensor. The emulated GPU's tensors are meta tensors underneath: the worker got the model as meta
    # tensors (`worker 0 meta`), the script's own meta tensor's rule taking them for its.
    (tmp_path / "sent.py").write_text(SENT)
    done = _emulated(tmp_path, "runs/", sys.executable, "sent.py", "cuda:1")
    assert done.returncode == 0, done.stderr[-3000:]
    # The meta tensor as torch itself sends it, unemulated (the CPU tensor beside it).
    plain = subprocess.run([sys.executable, "sent.py", "cpu"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.splitlines() == ["weight cpu (3, 4)", "plan meta (2, 8) True", "exit code 0"]
    assert done.stdout.splitlines() == ["weight cuda:1 (3, 4)", *plain.stdout.splitlines()[1:]]


# pytorch/examples' super_resolution: the PSNR of each epoch from the loss read back, a guard that the
# loss is finite, the best loss kept; and what uninitialised device memory reads as.
PSNR = textwrap.dedent("""
    import math
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 1, 3, padding=1)).cuda()
    criterion = torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 1, 32, 32, device="cuda"), torch.randn(4, 1, 32, 32, device="cuda")
    best = float("inf")
    for epoch in range(2):
        loss = criterion(model(x), y)
        if not torch.isfinite(loss):
            raise SystemExit("the loss is not finite")
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            psnr = 10 * math.log10(1 / criterion(model(x), y).item())
        best = min(best, loss.item())
        print(f"epoch {epoch} loss {loss.item():.4f} psnr {psnr!r} best {best!r}")
    print("uninitialised", torch.empty(3, dtype=torch.long, device="cuda").tolist(),
          torch.empty((), device="cuda").item(), "labels", torch.arange(4, device="cuda").argmax().item())
""")


def test_metrics_from_values_read_back_compute_as_on_a_gpu(torch, tmp_path):
    # `1 / mse.item()` raised ZeroDivisionError: values read back were 0.0. An unknown single float takes
    # the next number of docs/emulate.md's falling sequence when made (two an epoch: the training loss,
    # then the PSNR's loss), so the best and the printed loss are the training loss's one number;
    # uninitialised memory reads as zeros, known values as they are.
    (tmp_path / "train.py").write_text(PSNR)
    done = _emulated(tmp_path, "run.pickle", sys.executable, "train.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"epoch {e} loss {read_back(2 * e):.4f} psnr {10 * math.log10(1 / read_back(2 * e + 1))!r} "
        f"best {read_back(2 * e)!r}" for e in (0, 1)] + ["uninitialised [0, 0, 0] 0.0 labels 3"]
    # the best loss improved, as a real run's does in its first epochs, and printed as a real one is
    assert read_back(2) < read_back(0) and done.stdout.startswith("epoch 0 loss 0.5000 psnr 3.0108301336")


def test_a_save_gated_on_a_lower_validation_loss_runs_where_a_real_run_saves(torch, tmp_path):
    # llama2.c's and nanoGPT's train.py save `ckpt.pt` when the evaluation's loss is below the best so
    # far, never at iteration 0 (tests/scenarios/save_best.py, their loop in miniature). Every unknown
    # float read back the same number: the step-0 evaluation set the best, the later ones only equalled
    # it, and the save (torch.save of the state dicts) never ran under the emulator. Each read is now
    # lower than the last: the evaluations improve, as on the CPU, and the save runs into the overlay.
    script = Path(__file__).resolve().parent / "scenarios" / "save_best.py"
    real = subprocess.run([sys.executable, str(script), "--device", "cpu", "--out", "real"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert real.returncode == 0, real.stderr[-3000:]
    facts = json.loads(real.stdout.splitlines()[-1].split(" ", 1)[1])
    assert facts["saved_at"] == [2, 4]  # PyTorch's own run: its loss falls, it saves at each later evaluation
    saved = torch.load(tmp_path / "real" / "ckpt.pt")
    tensors = [t for part in (saved["model"], *saved["optimizer"]["state"].values()) for t in part.values()]
    stored = sum(t.untyped_storage().nbytes() for t in tensors) + saved["best_val_loss"].untyped_storage().nbytes()
    assert stored == facts["checkpoint_tensor_bytes"] == 3 * facts["weights_bytes"] + 8 * 4

    done = _emulated(tmp_path, "run.pickle", sys.executable, str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    emulated = json.loads(done.stdout.splitlines()[-1].split(" ", 1)[1])
    assert emulated == facts
    assert done.stdout.count("saved ckpt.pt") == 2
    # the save ran: memdiff names the file with the tensor bytes the real run wrote, and the user's
    # folder holds none of it
    assert f"created out/ckpt.pt (1.13 MiB, {stored:,} bytes of tensor data, not written" in done.stderr
    assert not (tmp_path / "out").exists()


# ultralytics' select_device("0,1"): CUDA_VISIBLE_DEVICES set by the script, then the GPUs counted.
VISIBLE = textwrap.dedent("""
    import os
    import torch

    print(torch.cuda.device_count())
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        raise ValueError("Invalid CUDA 'device=0,1' requested")
    x = torch.ones(1, device="cuda:1")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # too late: CUDA counted its devices at its first use
    print(torch.cuda.device_count(), x.device)
""")


def test_the_devices_a_script_makes_visible_before_using_a_gpu_are_the_ones_it_has(torch, tmp_path):
    (tmp_path / "train.py").write_text(VISIBLE)
    done = _emulated(tmp_path, "run.pickle", sys.executable, "train.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["1", "2 cuda:1"]


# A command that trains, then evaluates, each a job of two ranks under torchrun (a shell script many
# repositories ship): the evaluation's rank 0 is not the training's, and neither snapshot is lost.
PHASE = textwrap.dedent("""
    import os
    import sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    mib = 8 if sys.argv[1] == "train" else 2
    kept = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    os.write(1, f"{sys.argv[1]} rank {dist.get_rank()} {torch.cuda.max_memory_allocated() >> 20} MiB\\n".encode())
    dist.destroy_process_group()
""")


def test_two_jobs_of_one_command_each_keep_their_ranks_snapshots(torch, tmp_path):
    from memdiff.read.load import decode

    (tmp_path / "phase.py").write_text(PHASE)
    jobs = " && ".join(" ".join(torchrun("phase.py", phase)) for phase in ("train", "eval"))
    done = _emulated(tmp_path, "runs/", "sh", "-c", jobs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.splitlines()) == sorted(f"{phase} rank {r} {mib} MiB" for phase, mib in
                                                      (("train", 8), ("eval", 2)) for r in (0, 1))
    assert "the command ran 2 jobs with the same ranks; each job's snapshots are in a folder of its own: " \
           "runs/, runs/job2/" in done.stderr
    runs = tmp_path / "runs"
    # each job's ranks in its folder, each with the memory its own phase allocated (PyTorch's own trace)
    for folder, mib in ((runs, 8), (runs / "job2", 2)):
        assert sorted(p.name for p in folder.glob("*.pickle")) == ["rank0.pickle", "rank1.pickle"]
        for rank in (0, 1):
            snapshot = decode(str(folder / f"rank{rank}.pickle"))[0]
            sizes = [e["size"] for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
            assert mib << 20 in sizes and max(sizes) == mib << 20
        assert _manifest(folder)["world_size"] == 2
        assert not [p for p in folder.iterdir() if p.name.endswith(".claim")]
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/job2/"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr


# Each rank says what torchrun told it and what the job's collectives gave it, and keeps (rank + 1) MiB
# on its GPU, so that its snapshot says which rank it is.
ALONE = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kept = torch.empty((rank + 1) << 20, dtype=torch.uint8, device="cuda")
    settings = [{"lr": 0.1, "from": rank} if rank == 0 else None]
    dist.broadcast_object_list(settings, src=0)
    names = [None] * world
    dist.all_gather_object(names, f"r{rank}")
    os.write(1, (f"rank {rank} of {world} local {os.environ['LOCAL_RANK']} of {os.environ['LOCAL_WORLD_SIZE']} "
                 f"node {os.environ['GROUP_RANK']} device {torch.cuda.current_device()} got {settings[0]} "
                 f"names {names[0]} {names[rank]} {names[-1]}\\n").encode())
    dist.destroy_process_group()
""")


def test_named_ranks_of_a_large_torchrun_job_each_run_alone_as_torchrun_would_start_them(torch, tmp_path):
    (tmp_path / "alone.py").write_text(ALONE)
    launch = ["torchrun", "--nnodes", "8", "--nproc_per_node=8", "alone.py"]
    done = _emulated(tmp_path, "runs/", *launch, ranks="0,62-63")
    assert done.returncode == 0, done.stderr[-3000:]
    # torchrun's environment for ranks 0, 62 and 63 of 8 nodes of 8; the object rank 0 broadcast reaches
    # the others (it ran); a rank that did not run is taken to send what the receiving rank does
    assert sorted(done.stdout.splitlines()) == [
        "rank 0 of 64 local 0 of 8 node 0 device 0 got {'lr': 0.1, 'from': 0} names r0 r0 r63",
        "rank 62 of 64 local 6 of 8 node 7 device 6 got {'lr': 0.1, 'from': 0} names r0 r62 r63",
        "rank 63 of 64 local 7 of 8 node 7 device 7 got {'lr': 0.1, 'from': 0} names r0 r63 r63"]
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.glob("*.pickle")) == ["rank0.pickle", "rank62.pickle", "rank63.pickle"]
    manifest = _manifest(runs)
    assert manifest["world_size"] == 64 and manifest["emulated_ranks"] == [0, 62, 63]
    states = {r["rank"]: r["state"] for r in manifest["ranks"]}
    assert [states[r] for r in (0, 62, 63)] == ["written"] * 3
    assert {states[r] for r in range(1, 62)} == {"not emulated"}
    assert "wrote 3 snapshots of a job of 64 ranks (ranks 0, 62-63, each run alone) to runs/" in done.stderr
    # each file is its rank's: the (rank + 1) MiB it kept, on its own GPU
    from memdiff.read.load import decode

    for rank in (0, 62, 63):
        snapshot = decode(str(runs / f"rank{rank}.pickle"))[0]
        kept = [(device, e["size"]) for device, trace in enumerate(snapshot["device_traces"]) for e in trace
                if e["action"] == "alloc" and e["size"] == (rank + 1) << 20]
        assert kept == [(rank % 8, (rank + 1) << 20)]
    # read like a whole job: no rank is missing, and the reader is told the others were not run
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert ranks.returncode == 0, ranks.stderr
    assert "3 ranks of 64 ranks emulated, each alone (record --ranks 0,62-63): the others were not run" \
        in ranks.stderr
    # without rank 0, rank 63 hears from no one: the broadcast leaves its own list, the gather its own name
    alone = _emulated(tmp_path, "runs/", *launch, ranks="63")
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert alone.stdout.splitlines() == ["rank 63 of 64 local 7 of 8 node 7 device 7 got None names r63 r63 r63"]
    assert "runs/: rank0.pickle, rank62.pickle not from this run" in alone.stderr
    # the first run's files left in the folder are not read as this job's
    ranks = subprocess.run([sys.executable, "-m", "memdiff", "ranks", "runs/", "--format", "json"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr
    assert [r["rank"] for r in json.loads(ranks.stdout)["ranks"]] == [63]


# A plain script of one process: it trains without starting any ranks.
PLAIN = textwrap.dedent("""
    import torch

    model = torch.nn.Linear(8, 8).cuda()
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
""")


def test_ranks_that_name_no_rank_of_the_job_or_no_job_are_one_line_exit_2(torch, tmp_path):
    (tmp_path / "alone.py").write_text(ALONE)
    (tmp_path / "plain.py").write_text(PLAIN)
    for ranks, launch, said in (
            ("8", ["torchrun", "--nproc-per-node", "8", "alone.py"], "the job has 8 ranks (1 node(s) of 8): no rank 8"),
            ("0,x", ["torchrun", "alone.py"], "is no list of ranks"),
            ("0", ["torchrun", "--nnodes", "1:4", "alone.py"], "torchrun's --nnodes 1:4 is no fixed count"),
            ("0", ["srun", "alone.py"], "other launchers (`srun`) are not read yet"),
            # run until its first optimizer step, which no script that launches ranks takes before it does
            ("0", [sys.executable, "plain.py"], "plain.py` stepped an optimizer before a Lightning launcher started "
                                                "its ranks")):
        done = _emulated(tmp_path, "runs/", *launch, ranks=ranks)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*.pickle"))


def test_a_script_that_fails_before_its_launcher_starts_ranks_shows_its_error_and_runs_no_rank(tmp_path):
    (tmp_path / "fails.py").write_text("import sys\nprint('no data in data/')\nsys.exit(3)\n")
    done = _emulated(tmp_path, "runs/", sys.executable, "fails.py", ranks="0,5")
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert lines[0] == "no data in data/"  # what the script said, kept back while it ran: it failed
    assert lines[-1].endswith("fails.py` failed before a Lightning launcher started its ranks: no rank was run")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == []


def test_a_rank_run_alone_allocates_byte_for_byte_as_in_the_whole_job(torch, tmp_path):
    # FSDP2 (tests/scenarios/fsdp_train.py) on two ranks: rank 1 of the whole job, and rank 1 alone
    # (--ranks 1), make the same allocations and frees in the same order, to the byte.
    from memdiff.read.load import decode

    script = str(Path(__file__).parent / "scenarios" / "fsdp_train.py")
    launch = ["torchrun", "--nproc-per-node", "2", script, "--cuda"]
    whole = _emulated(tmp_path, "whole/", *launch)
    assert whole.returncode == 0, whole.stderr[-3000:]
    alone = _emulated(tmp_path, "alone/", *launch, ranks="1")
    assert alone.returncode == 0, alone.stderr[-3000:]
    traces = []
    for folder in ("whole", "alone"):
        snapshot = decode(str(tmp_path / folder / "rank1.pickle"))[0]
        traces.append([(e["action"], e["size"], e["stream"]) for trace in snapshot["device_traces"] for e in trace])
    assert len(traces[0]) > 100 and traces[0] == traces[1]


# Workers a script starts itself and never checks (pytorch/examples' mnist_hogwild joins them and
# moves on): one of them fails.
UNCHECKED = textwrap.dedent("""
    import torch
    import torch.multiprocessing as mp


    def work(index):
        x = torch.ones(1 << 20, device="cuda")
        if index == 1:
            raise ValueError(f"worker {index} found no data")


    if __name__ == "__main__":
        workers = [mp.get_context("spawn").Process(target=work, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        print("done")
""")


def test_a_worker_process_that_died_is_named_and_fails_the_job_though_the_script_ignores_it(torch, tmp_path):
    (tmp_path / "unchecked.py").write_text(UNCHECKED)
    done = _emulated(tmp_path, "runs/", sys.executable, "unchecked.py")
    assert done.stdout.splitlines() == ["done"]
    assert done.returncode == 1, done.stderr[-3000:]
    # multiprocessing prints the worker's traceback and ends it with exit status 1; memdiff names it
    assert "ValueError: worker 1 found no data" in done.stderr
    said = [s for s in done.stderr.splitlines() if s.startswith("memdiff: process ") and " died: " in s]
    assert len(said) == 1 and "spawn_main" in said[0] and said[0].endswith("died: exit status 1"), done.stderr[-3000:]


# Collectives batched under torch's coalescing manager, as Megatron-core's distributed optimizer
# gathers its buckets' weights (all_gather_into_tensor) and reduce-scatters their gradients: torch runs
# each batch as one coalesced op, which torch 2.13 gives no meta kernel.
COALESCED = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    world = dist.get_world_size()
    shards = [torch.ones(256, device="cuda") for _ in range(2)]
    gathered = [torch.empty(256 * world, device="cuda") for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as batch:
        for out, shard in zip(gathered, shards):
            dist.all_gather_into_tensor(out, shard)
    batch.wait()
    total = gathered[1].sum().item()
    reduced = [torch.empty(128, device="cuda") for _ in range(2)]
    with dist._coalescing_manager():
        for out, whole in zip(reduced, gathered):
            dist.reduce_scatter_tensor(out, whole)
    counts = [torch.ones(4, device="cuda") for _ in range(2)]
    with dist._coalescing_manager():
        for count in counts:
            dist.all_reduce(count)
    os.write(1, f"gathered {total} summed {counts[1].tolist()}\\n".encode())
    dist.destroy_process_group()
""")


def test_collectives_coalesced_as_megatrons_distributed_optimizer_batches_them_run(torch, tmp_path):
    (tmp_path / "coalesced.py").write_text(COALESCED)
    done = _emulated(tmp_path, "runs/", *torchrun("coalesced.py"), ranks="0")
    assert done.returncode == 0, done.stderr[-3000:]
    # every rank's shard of ones gathered; the counts summed over the two ranks
    assert done.stdout.splitlines() == ["gathered 512.0 summed [2.0, 2.0, 2.0, 2.0]"]


# FSDP1 wraps a module built on the CPU and moves it to its device_id by `param.data = param.to(device)`.
FSDP1_FROM_THE_CPU = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    # set_data on its own: the Parameter object, its attributes and requires_grad stay; its storage moves
    weight = torch.nn.Parameter(torch.randn(8, 8))
    weight.tag = "kept"
    same = weight
    weight.data = weight.to("cuda")
    print("moved", same is weight, weight.is_cuda, weight.requires_grad, weight.tag, tuple(weight.shape), flush=True)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 10))
    numel = sum(p.numel() for p in model.parameters())
    model = FullyShardedDataParallel(model, device_id=torch.cuda.current_device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(16, 1000, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    print("numel", numel, dist.get_world_size(), flush=True)
""")


def test_fsdp1_wraps_a_module_built_on_the_cpu_and_shards_it(torch, tmp_path):
    # A host tensor cannot take a meta tensor as its .data: FSDP1 stopped at its first move to device_id
    # ("variable and tensor have incompatible tensor type"), and so did Lightning's strategy="fsdp".
    (tmp_path / "train.py").write_text(FSDP1_FROM_THE_CPU)
    done = _emulated(tmp_path, "runs/", *torchrun("train.py"), ranks="1")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()
             if line.startswith(("moved", "numel"))}
    assert lines["moved"] == ["True", "True", "True", "kept", "(8,", "8)"]
    numel, world = int(lines["numel"][0]), int(lines["numel"][1])
    d = read_summary(str(tmp_path / "runs" / "rank1.pickle"), load_rules()).devices[0]
    # rank 1's shard of the one flat parameter, padded to the world size (the 8 x 8 weight moved by hand is a
    # `.to("cuda")` of the script's own, which reads as its input, as on a GPU)
    shard = math.ceil(numel / world) * 4
    assert d.categories["parameter"] == shard
    assert d.categories["optimizer_state"] >= 2 * shard  # AdamW's two moments of the shard (and its steps)
