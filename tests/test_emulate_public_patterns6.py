"""Patterns of public training scripts met in the seventh pass over them (docs/emulate.md, "A seventh
pass"), each as a small scenario of our own under `memdiff record --emulate h100`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memdiff.recording.launch import read_torchrun

torch = pytest.importorskip("torch")


def _record(tmp_path, script, *extra):
    (tmp_path / "train.py").write_text(script)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", *extra,
                           "--", sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _facts(stdout):
    return json.loads(next(s for s in stdout.splitlines() if s.startswith("facts "))[len("facts "):])


# A script that logs the GPU table and asks nvidia-smi for each GPU's name and memory, as
# modded-nanogpt's records print `nvidia-smi` into every log and many scripts query it. torch's own
# answers in the same process are the ground truth for what the command must say.
NVIDIA_SMI = """
import json, subprocess
import torch

table = subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, text=True, check=True).stdout
rows = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                      stdout=subprocess.PIPE, text=True, check=True).stdout.splitlines()
print("facts", json.dumps({
    "table_names_gpu": torch.cuda.get_device_name(0) in table,
    "rows": [[c.strip() for c in r.split(",")] for r in rows],
    "count": torch.cuda.device_count(),
    "name": torch.cuda.get_device_name(0),
    "total_mib": torch.cuda.get_device_properties(0).total_memory // 2**20,
}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_nvidia_smi_answers_for_the_emulated_gpus(tmp_path):
    # Before: FileNotFoundError: 'nvidia-smi' on a machine without NVIDIA's driver, where a GPU host answers.
    done = _record(tmp_path, NVIDIA_SMI, "--gpus", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert facts["table_names_gpu"]
    assert facts["count"] == 2
    assert facts["rows"] == [[str(i), facts["name"], str(facts["total_mib"])] for i in range(2)]
    assert not any(p.name.startswith("memdiff-smi-") for p in tmp_path.iterdir())  # nothing in the user's folder


# A library's own operator that shares aten's name `mm`: an FP8-style product of a bfloat16 input and
# float32 weights (modded-nanogpt's `nanogpt::mm` casts both itself), next to aten's own mm of the same
# two dtypes, which CUDA refuses. The output's bytes (numel x itemsize) are the ground truth.
CUSTOM_MM = """
import json
import torch


@torch.library.custom_op("pub7::mm", mutates_args=())
def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(torch.bfloat16)


@mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)


x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
w = torch.randn(512, 384, device="cuda")
x.float() @ w.t()  # cuBLAS's workspace made once, before the measure
before = torch.cuda.memory_allocated()
out = torch.ops.pub7.mm(x, w)
grew = torch.cuda.memory_allocated() - before
try:
    torch.mm(x, w.t())
    refused = ""
except RuntimeError as e:
    refused = str(e)
print("facts", json.dumps({"grew": grew, "out_bytes": out.numel() * out.element_size(),
                           "dtype": str(out.dtype), "shape": list(out.shape), "refused": refused}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_a_library_operator_named_mm_is_not_checked_as_atens(tmp_path):
    # Before: "expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float" on the
    # library's op, checked by its name alone as aten's mm.
    done = _record(tmp_path, CUSTOM_MM)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert facts["shape"] == [256, 512] and facts["dtype"] == "torch.bfloat16"
    assert facts["out_bytes"] == 256 * 512 * 2
    assert facts["grew"] == facts["out_bytes"]  # a multiple of the allocator's 512 B: no rounding
    # aten's own mm of the same operands is still refused, as by cuBLAS on the GPU
    assert facts["refused"] == "expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float"


@pytest.mark.parametrize("command, target", [
    # nanochat's speedrun.sh: `torchrun ... -m scripts.base_train -- --depth=24`; torchrun's parser drops
    # the `--` right after the module, and a `--` that ends its own options (checked with torchrun 2.13)
    (["-m", "scripts.base_train", "--", "--depth=24", "--fp8"], ["-m", "scripts.base_train", "--depth=24", "--fp8"]),
    (["--", "train.py", "--depth=3"], ["-u", "train.py", "--depth=3"]),
    # only the first: a later `--` is the script's own
    (["train.py", "--", "--a", "--", "b"], ["-u", "train.py", "--a", "--", "b"]),
    (["train.py", "--a", "--", "b"], ["-u", "train.py", "--a", "--", "b"]),
])
def test_ranks_of_a_torchrun_command_get_its_arguments_after_a_double_dash(command, target):
    launch = read_torchrun(["torchrun", "--standalone", "--nproc_per_node=8", *command])
    assert launch.world_size == 8
    assert launch.target == [sys.executable, *target]


# A model built under `with torch.device("meta")` whose constructor casts a table it computed
# (`.to(torch.bfloat16)`, nanochat's rotary cos/sin), then `to_empty(device="cuda")`: the cast stays on
# the meta device, and the GPU gets the module's tensors. Ground truth: numel x itemsize of each.
META_CAST = """
import json
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(1000, 128)
        t = torch.arange(64, dtype=torch.float32, device=self.wte.weight.device)
        table = torch.outer(t, t).cos().to(torch.bfloat16)
        self.register_buffer("cos", table, persistent=False)


with torch.device("meta"):
    net = Net()
built = (str(net.cos.device), str(net.cos.dtype))
net.to_empty(device="cuda")
print("facts", json.dumps({"built": built, "allocated": torch.cuda.memory_allocated(),
                           "device": str(net.wte.weight.device)}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_a_cast_of_the_scripts_meta_tensor_stays_on_the_meta_device(tmp_path):
    # Before: NotImplementedError "Cannot copy out of meta tensor; no data!" at the `.to(torch.bfloat16)`.
    done = _record(tmp_path, META_CAST)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert facts["built"] == ["meta", "torch.bfloat16"]
    assert facts["device"] == "cuda:0"
    # the embedding's 1000 x 128 x 4 B and the table's 64 x 64 x 2 B, each a multiple of 512 B
    assert facts["allocated"] == 1000 * 128 * 4 + 64 * 64 * 2


# A tokenizer's table of each token's length in bytes, saved to a file and loaded straight onto the GPU
# (`torch.load(..., map_location="cuda")`), then gathered by the batch's targets and summed into a count
# that a metric divides by, as nanochat's bits-per-byte evaluation does. The CPU's own gather and sum
# of the same table and ids is the ground truth; a table over the size the emulator keeps values for
# reads back as any count it does not know.
LOADED_TABLE = """
import json, math
import torch

g = torch.Generator().manual_seed(0)
table = torch.randint(1, 8, (4096,), generator=g)
torch.save({"bytes": table, "big": torch.ones(70000, dtype=torch.long)}, "table.pt")
ids = torch.randint(0, 4096, (8, 256), generator=g)
loaded = torch.load("table.pt", map_location="cuda")
y = torch.empty(8 * 256, dtype=torch.long, device="cuda")
y.copy_(ids.view(-1))
total = torch.tensor(0, dtype=torch.int64, device="cuda")
total += loaded["bytes"][y].sum()
count = total.item()
with open("table.pt", "rb") as f:  # nanochat's get_token_bytes loads from an open file
    again = torch.load(f, map_location="cuda")
print("facts", json.dumps({"count": count, "truth": int(table[ids.view(-1)].sum()),
                           "from_file": again["bytes"][y].sum().item(),
                           "device": str(loaded["bytes"].device),
                           "bpb_finite": count > 0 and math.isfinite(0.5 / (math.log(2) * count)),
                           "big_sum": loaded["big"].sum().item()}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_a_small_tensor_loaded_onto_the_device_keeps_its_values(tmp_path):
    # Before: the table had no values, its gathered sum read back 0, and nanochat's validation
    # (`if total_bytes == 0: return float("inf")`) printed `bpb: inf` where a GPU prints a number.
    done = _record(tmp_path, LOADED_TABLE)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert facts["device"] == "cuda:0"
    assert facts["count"] == facts["truth"] > 2048  # every id's length is 1 or more
    assert facts["from_file"] == facts["truth"]
    assert facts["bpb_finite"]
    assert facts["big_sum"] == 0  # 70,000 elements: over the values kept, a count read back as 0


# An FP8 product written into a buffer the caller made (`torch._scaled_mm(..., out=buf)`), as Inductor's
# wrapper code writes nanochat's FP8 layers. torch 2.13 has a meta kernel for the functional op only.
# Ground truth: an out= kernel writes into `buf` and allocates no output (64 x 16 x 2 B held before).
SCALED_MM_OUT = """
import json
import torch

a = torch.randn(64, 32, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(16, 32, device="cuda").to(torch.float8_e4m3fn).t()
one = torch.ones((), device="cuda")
made = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # cuBLAS's workspace once
buf = torch.empty(64, 16, device="cuda", dtype=torch.bfloat16)
before = torch.cuda.memory_allocated()
got = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=buf)
print("facts", json.dumps({"grew": torch.cuda.memory_allocated() - before, "same": got is buf, "ptr": buf.data_ptr(),
                           "shape": list(made.shape), "buf_bytes": buf.numel() * buf.element_size()}))
"""


@pytest.mark.slow  # starts `memdiff record` (a child running torch)
def test_an_out_overload_without_a_meta_kernel_writes_into_its_out(tmp_path):
    # Before: "aten::_scaled_mm: PyTorch has no meta kernel for it" (exit 2) at nanochat's first
    # compiled FP8 training step: torch 2.13 registers a meta kernel for `_scaled_mm.default` only.
    done = _record(tmp_path, SCALED_MM_OUT)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = _facts(done.stdout)
    assert facts["shape"] == [64, 16]
    assert facts["buf_bytes"] == 64 * 16 * 2
    assert facts["same"] and facts["grew"] == 0
