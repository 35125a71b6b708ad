"""Patterns of public training scripts (nanoGPT, the PyTorch examples' DDP tutorials, minGPT),
each written here as a few lines of our own and run unmodified under `memdiff record --emulate
h100`, as a new user runs their script: it finishes with exit 0, prints what the script prints on a
GPU where that does not depend on the model's values, and the snapshot holds what the GPU would."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest
from conftest import read_back

torch = pytest.importorskip("torch")


def _emulate(tmp_path, source, *args, name="train.py"):
    """`memdiff record --emulate h100 -o run.pickle -- python NAME ARGS` of a script written from `source`."""
    script = tmp_path / name
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script), *args],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def _snapshot(tmp_path):
    with open(tmp_path / "run.pickle", "rb") as f:
        return pickle.load(f)


# nanoGPT's pattern: the compiled model returns (logits, loss); the loop logs `loss.item()` and an
# evaluation averages `loss.item()` over a few batches in a CPU tensor.
COMPILED_LOSS = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x, y):
        logits = self.body(x)
        return logits, F.cross_entropy(logits, y)


model = torch.compile(Net().cuda())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(16, 32, device="cuda")
y = torch.randint(0, 8, (16,), device="cuda")
for step in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step, repr(loss.item()), f"{loss.item():.4f}", tuple(logits.shape))
with torch.no_grad():
    losses = torch.zeros(4)
    for k in range(4):
        losses[k] = model(x, y)[1].item()
print("eval", repr(losses.mean().item()))
"""


@pytest.mark.slow
def test_a_compiled_models_loss_reads_back_as_every_unknown_value_does(tmp_path):
    """The loss a compiled graph computes is written by Triton kernels the emulator does not run:
    it has no value, and reads back as every model-computed value does (the stand-ins of
    docs/emulate.md: one number a read, each lower than the last, two reads a step). It used to keep the
    uninitialised host memory of the buffer Inductor made for it (-1.9e+32 one run, -9e-09 the next)."""
    done = _emulate(tmp_path, COMPILED_LOSS)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = re.findall(r"^step (\d) (\S+) (\S+) (\(.*\))$", done.stdout, re.MULTILINE)
    assert steps == [(str(i), repr(read_back(2 * i)), f"{read_back(2 * i + 1):.4f}", "(16, 8)") for i in range(3)], \
        done.stdout
    # the evaluation's four losses kept in a host tensor, as nanoGPT's estimate_loss keeps them: their mean
    mean = torch.tensor([read_back(n) for n in range(6, 10)]).mean().item()
    assert f"eval {mean!r}" in done.stdout.splitlines()
    assert "Inductor's memory plan" in done.stderr  # the compiled route ran, not the eager fallback


# The DDP tutorials' pattern: a Trainer that resumes from `snapshot.pt` when it is there (loaded to
# the rank's GPU), wraps the model in DDP with `device_ids`, trains past DDP's 10th iteration (where
# its Logger samples runtime statistics) and saves a snapshot every epoch on rank 0. The device
# and backend are the script's own choice, so the same script runs on the CPU without emulation.
DDP_SNAPSHOTS = """
import os
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

cuda = torch.cuda.is_available()
rank = int(os.environ["LOCAL_RANK"])
if cuda:
    torch.cuda.set_device(rank)
dist.init_process_group(backend="nccl" if cuda else "gloo")
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
model = torch.nn.Linear(256, 16).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
epochs_run = 0
if os.path.exists("snapshot.pt"):
    snapshot = torch.load("snapshot.pt", map_location=device)
    model.load_state_dict(snapshot["MODEL_STATE"])
    epochs_run = snapshot["EPOCHS_RUN"]
    print(f"Resuming training from snapshot at Epoch {epochs_run}")
ddp = DDP(model, device_ids=[rank] if cuda else None)
data = TensorDataset(torch.rand(192, 256), torch.rand(192, 16))
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data), pin_memory=cuda)
for epoch in range(epochs_run, int(sys.argv[1])):
    loader.sampler.set_epoch(epoch)
    print(f"Epoch {epoch} | Batchsize: {len(next(iter(loader))[0])} | Steps: {len(loader)}")
    for source, targets in loader:
        optimizer.zero_grad()
        F.mse_loss(ddp(source.to(device)), targets.to(device)).backward()
        optimizer.step()
    if rank == 0:
        torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epoch}, "snapshot.pt")
        print(f"Epoch {epoch} | Training snapshot saved at snapshot.pt")
dist.destroy_process_group()
"""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_ddp_trainer_resumes_from_the_users_snapshot_and_prints_what_the_cpu_run_prints(tmp_path):
    """One rank of the DDP tutorials' Trainer, run first on the CPU without emulation (it trains two
    epochs and leaves snapshot.pt), then under emulation and on the CPU again: both resume from that
    file and print the same lines; the emulated run leaves the file as it was, prints nothing a GPU
    run would not (DDP's Logger found no timer for the meta device: "Time stats are currently only
    collected for CPU and CUDA devices" on every rank), and its parameter is the model's bytes."""
    script = tmp_path / "multinode.py"
    script.write_text(DDP_SNAPSHOTS)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}

    def cpu(epochs):
        done = subprocess.run([sys.executable, str(script), epochs], capture_output=True, text=True, cwd=tmp_path,
                              env={**env, "MASTER_PORT": str(_free_port())})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    first = cpu("2")
    assert "Epoch 1 | Training snapshot saved at snapshot.pt" in first
    saved = (tmp_path / "snapshot.pt").read_bytes()
    emulated = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                               str(tmp_path / "run.pickle"), "--", "python", str(script), "3"],
                              capture_output=True, text=True, cwd=tmp_path, env={**env, "MASTER_PORT": "1"})
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert (tmp_path / "snapshot.pt").read_bytes() == saved
    assert emulated.stdout == cpu("3")
    assert emulated.stdout.startswith("Resuming training from snapshot at Epoch 1\nEpoch 1 | Batchsize: 16 | Steps: 12")
    assert "Time stats" not in emulated.stderr
    from memdiff import api

    categories = api.summarize(tmp_path / "run.pickle").devices[0].categories
    assert categories["parameter"] == (256 * 16 + 16) * 4


# FSDP2's own example's pattern (and torchtitan's): the model is built on the meta device, sharded,
# materialised on the GPU with `to_empty` and initialised there by `reset_parameters()`, whose
# `nn.Linear` draws kaiming_uniform_ into each DTensor shard.
FSDP2_META_INIT = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dist.init_process_group("nccl")
torch.cuda.set_device(0)
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
model.to_empty(device="cuda")
for layer in model:
    layer.reset_parameters()
print("sharded", all(isinstance(p, DTensor) for p in model.parameters()),
      sorted({str(p.to_local().device) for p in model.parameters()}))
opt = torch.optim.AdamW(model.parameters())
for step in range(2):
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
print("done", step)
dist.destroy_process_group()
"""


def test_an_fsdp2_model_made_on_the_meta_device_is_initialised_on_the_gpu_and_trains(tmp_path):
    """`reset_parameters()` of a sharded `nn.Linear` failed in DTensor's sharding propagation: the
    fake `uniform_` it runs there has no path on a CPU build of torch. Now it trains, and each rank
    holds half the parameters and AdamW's two moments of them (facts of the model)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    script = tmp_path / "fsdp.py"
    script.write_text(FSDP2_META_INIT)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["sharded True ['cuda:0']", "done 1"]
    from memdiff import api

    categories = api.summarize(tmp_path / "run.pickle").devices[0].categories
    shard = 3 * (512 * 512 + 512) * 4 // 2
    assert categories["parameter"] == shard
    assert categories["optimizer_state"] == 2 * shard


# Warnings torch raises for the caller's line: a sparse adjacency matrix built as the GAT example
# builds its graph, a loss whose target broadcasts, and a tensor copy-constructed from a tensor.
WARNS = """
import torch
import torch.nn.functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
edges = torch.tensor([[0, 1, 2], [1, 2, 0]])
adjacency = torch.sparse_coo_tensor(edges, torch.ones(3), (3, 3), dtype=torch.int64)
x = torch.randn(4, 3, device=device)
loss = F.mse_loss(x, torch.randn(4, 1, device=device))
copied = torch.tensor(x)
print("done", tuple(adjacency.shape), tuple(loss.shape), tuple(copied.shape))
"""


def _warning_lines(stderr):
    """(file:line, category) of each warning, the file without its folder."""
    found = (re.match(r"^(?:\S*[/\\])?([^/\\\s]+:\d+): (\w*Warning):", line) for line in stderr.splitlines())
    return [m.groups() for m in found if m]


def test_warnings_name_the_scripts_line_as_without_emulation(tmp_path):
    """Each warning names the script's line that called torch, as the same script run without
    emulation does; it named the emulator's own line (`modes.py:214: UserWarning`)."""
    emulated = _emulate(tmp_path, WARNS)
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    plain = subprocess.run([sys.executable, str(tmp_path / "train.py")], capture_output=True, text=True, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    expected = _warning_lines(plain.stderr)
    assert [where for where, _ in expected] == ["train.py:7", "train.py:9", "train.py:10"]
    assert _warning_lines(emulated.stderr) == expected
    assert emulated.stdout == plain.stdout


# A checkpointer that makes a folder per save, as the FSDP2 example's does (`checkpoints/<time>/`),
# and finds the latest one at start; beside it, a folder the run makes for a host-only file.
FOLDERS = """
import json
import os
import pathlib
import torch

root = "checkpoints/dtensor_api"
found = sorted(os.listdir(root)) if os.path.isdir(root) else []
print("resuming from", found[-1] if found else None)
model = torch.nn.Linear(8, 8).cuda()
folder = f"{root}/{len(found) + 1000}"
os.makedirs(folder, exist_ok=True)
torch.save(model.state_dict(), f"{folder}/model_state_dict.pt")
print("saved", os.path.isdir(folder))
pathlib.Path("logs/run").mkdir(parents=True)
with open("logs/run/config.json", "w") as f:
    json.dump({"width": 8}, f)
os.makedirs("kept/sub")
torch.save(model.state_dict(), "kept/sub/model.pt")
"""


def test_folders_made_for_checkpoints_are_not_left_for_the_next_run(tmp_path):
    """Left in the user's tree, the folder of a checkpoint made the next run of the FSDP2 example
    resume from it and fail to load `model_state_dict.pt`. The run sees its folders and files while
    it runs (its overlay); when it ends, none of them is in the user's tree, so a second run starts
    afresh as the first did, and a folder the user had keeps what it held."""
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("the user's")
    for _ in range(2):  # the second run finds nothing of the first's
        done = _emulate(tmp_path, FOLDERS)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == ["resuming from None", "saved True"], done.stdout
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "run.pickle", "train.py"]
        assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]
        assert (tmp_path / "kept" / "notes.txt").read_text() == "the user's"


# nanoGPT's default: a compiled model called under `torch.autocast("cuda", dtype=torch.bfloat16)`.
COMPILED_AUTOCAST = """
import sys
import torch
import torch.nn as nn

mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256)).cuda()
if sys.argv[1] == "compile":
    mlp = torch.compile(mlp)
x = torch.randn(8, 128, 256, device="cuda")
for step in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = mlp(x)
    out.float().pow(2).mean().backward()
    print(step, out.dtype, tuple(out.shape))
"""


@pytest.mark.slow
def test_a_model_compiled_under_autocast_computes_in_the_autocast_dtype(tmp_path):
    """CUDA's autocast casts as a compiled graph is traced; on the meta device it did not, and the
    compiled products ran in float32 (nanoGPT's compiled peak 2.37 GiB, its eager one 1.64 GiB).
    By the model's shapes: the hidden activation (8 x 128 x 1024) is a bfloat16 buffer, 2 MiB,
    and no float32 one (4 MiB) is made, eagerly or compiled; both print the same."""
    hidden = 8 * 128 * 1024
    runs = {}
    for route in ("eager", "compile"):
        done = _emulate(tmp_path, COMPILED_AUTOCAST, route)
        assert done.returncode == 0, done.stderr[-3000:]
        sizes = {e["size"] for e in _snapshot(tmp_path)["device_traces"][0] if e["action"] == "alloc"}
        assert hidden * 2 in sizes, route
        assert hidden * 4 not in sizes, route
        runs[route] = done.stdout
    assert runs["compile"] == runs["eager"]
    assert runs["eager"].splitlines()[0] == "0 torch.float32 (8, 128, 256)"  # layer_norm runs in float32
