"""Patterns of public training scripts (torchtitan, Hugging Face's Trainer with its options, litgpt's
Fabric loop) that failed or drifted under `memdiff record --emulate`, each as a small scenario of our
own: the script exits 0, its data-independent output is the unemulated run's, and the snapshot holds
what the model holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_back

ROOT = Path(__file__).resolve().parent.parent


def _emulate(tmp_path: Path, source: str, name: str = "train.py") -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o run.pickle -- python NAME` of a script written from `source`."""
    script = tmp_path / name
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


# A compiled loss over a batch whose ids and labels the emulator knows (Hugging Face's Trainer with
# torch_compile=True), with position ids made inside the compiled function on the GPU by name.
COMPILED = """
import torch
import torch.nn.functional as F

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(100, 64)
        self.pos = torch.nn.Embedding(16, 64)
        self.head = torch.nn.Linear(64, 100)

    def forward(self, ids, labels):
        positions = torch.arange(ids.shape[1], device="cuda")
        logits = self.head(self.tok(ids) + self.pos(positions))
        return F.cross_entropy(logits.view(-1, 100), labels.view(-1))

model = Tiny().cuda()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
step = torch.compile(model)
for i in range(3):
    ids = torch.arange(64, device="cuda").view(4, 16) % 100
    loss = step(ids, ids)
    loss.backward()
    print("step", i, loss.device, tuple(loss.shape), loss.requires_grad)
    print("value", loss.item(), f"{loss:.4f}")
print("weights", weights, "max", torch.cuda.max_memory_allocated())
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("torch")
    tmp_path = tmp_path_factory.mktemp("compiled")
    done = _emulate(tmp_path, COMPILED)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path, done.stdout.splitlines()


@pytest.mark.slow
def test_a_tensor_a_compiled_function_makes_on_the_gpu_by_name_meets_the_scripts_tensors(compiled):
    # `torch.arange(n, device="cuda")` inside the compiled forward was a fake on `cuda` while Dynamo
    # traced the script's tensors on the meta device: "Tensor device mismatch" and exit 1
    tmp_path, out = compiled
    unemulated = subprocess.run([sys.executable, "-c", COMPILED.replace('device="cuda"', 'device="cpu"')
                                 .replace(".cuda()", "")], capture_output=True, text=True)
    assert unemulated.returncode == 0, unemulated.stderr[-3000:]
    emulated_steps = [line.replace("cuda:0", "DEVICE") for line in out if line.startswith("step")]
    cpu_steps = [line.replace("cpu", "DEVICE") for line in unemulated.stdout.splitlines() if line.startswith("step")]
    assert emulated_steps == cpu_steps == [f"step {i} DEVICE () True" for i in range(3)]


@pytest.mark.slow
def test_a_compiled_loss_over_known_ids_reads_the_stand_in_every_run(compiled):
    # Inductor's buffers are `empty_strided` that no dispatched op writes; their values were the
    # host's uninitialised memory (a loss of 1.16e+27 one step, -59.2 the next)
    from memdiff import api

    tmp_path, out = compiled
    # the read-back stand-ins (docs/emulate.md): one number a read, each lower than the last, two a step
    assert [line for line in out if line.startswith("value")] == \
        [f"value {read_back(2 * i)!r} {read_back(2 * i + 1):.4f}" for i in range(3)]
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    weights, max_allocated = int(out[-1].split()[1]), int(out[-1].split()[3])
    assert device.categories["parameter"] == weights
    # the script's own max_memory_allocated() counts the allocator's rounded blocks of the same trace
    assert device.peak_bytes <= max_allocated <= device.peak_bytes * 1.05 + (1 << 20)


# The CUDA build's versions, which a CPU build of torch reports as absent.
VERSIONS = """
import os
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainingArguments

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
dist.init_process_group("nccl", rank=0, world_size=1)
model = DistributedDataParallel(torch.nn.Linear(64, 64).cuda(), device_ids=[0])
model.register_comm_hook(None, bf16_compress_hook)  # checks torch.cuda.nccl.version() >= (2, 10)
model(torch.randn(8, 64, device="cuda")).sum().backward()
args = TrainingArguments(output_dir="out", tf32=True, report_to="none")  # refused without CUDA >= 11
print("tf32", args.tf32, "cuda", torch.version.cuda is not None, "cudnn", torch.backends.cudnn.is_available(),
      "cudnn version", isinstance(torch.backends.cudnn.version(), int))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_tf32_and_ddps_bf16_hook_find_the_cuda_build_of_torch(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    done = _emulate(tmp_path, VERSIONS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "tf32 True cuda True cudnn True cudnn version True"
    from memdiff import api

    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["parameter"] == 4 * (64 * 64 + 64)


def test_the_cuda_builds_versions_are_the_cpu_builds_again_after_the_emulator(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch answers for itself")
    import memdiff

    with memdiff.record(str(tmp_path / "run.pickle"), emulate="h100"):
        inside = (torch.version.cuda, torch.backends.cudnn.is_available(), torch.cuda.nccl.version())
        torch.zeros(4, device="cuda")
    assert inside[0] is not None and inside[1] and inside[2] >= (2, 10)
    assert torch.version.cuda is None and not torch.backends.cudnn.is_available()


def test_a_cuda_graph_pool_is_refused_in_one_line(tmp_path):
    # torchtitan's default CUDA-graph wrapper asks for a pool before capturing: torch's CPU build
    # answered with a traceback ("Tried to instantiate dummy base class _graph_pool_handle")
    done = _emulate(tmp_path, "import torch\nx = torch.ones(4, device='cuda')\npool = torch.cuda.graph_pool_handle()\n")
    assert done.returncode == 2
    said = [line for line in done.stderr.splitlines() if line.strip() and "wrote" not in line]
    assert len(said) == 1 and said[0].startswith("memdiff: CUDA graphs") and "train.py:3" in said[0], done.stderr


# FlexAttention as torchtitan runs it: a causal block mask, flex_attention compiled with Inductor
# options (which the emulator runs eagerly), or called eagerly.
FLEX = """
import sys
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, S, D = 2, 4, 1024, 64

def causal(b, h, q, kv):
    return q >= kv

mask = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cuda")
attend = torch.compile(flex_attention, options={"max_autotune": False}) if sys.argv[1] == "compiled" else flex_attention
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
out = attend(q, k, v, block_mask=mask)
out.sum().backward()
print(tuple(out.shape), out.dtype, tuple(q.grad.shape), tuple(k.grad.shape), tuple(v.grad.shape))
print("above", torch.cuda.max_memory_allocated() - before)
"""


def _flex(tmp_path: Path, how: str) -> list:
    script = tmp_path / "flex.py"
    script.write_text(FLEX)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / f"{how}.pickle"), "--", "python", str(script), how],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.slow
def test_flex_attention_compiled_holds_no_scores_and_eager_holds_them(tmp_path):
    # flex_attention reached the emulator's dispatch mode whole, with no rule for it: torchtitan's
    # Llama 3 stopped at its first attention
    pytest.importorskip("torch.nn.attention.flex_attention")
    B, H, S, D, bf16 = 2, 4, 1024, 64, 2
    shapes = f"({B}, {H}, {S}, {D}) torch.bfloat16" + f" ({B}, {H}, {S}, {D})" * 3
    compiled, eager = _flex(tmp_path, "compiled"), _flex(tmp_path, "eager")
    assert compiled[0] == eager[0] == shapes
    scores = B * H * S * S * 4  # one float32 score matrix
    # Inductor's fused kernels: the output, logsumexp and row maxima, then the three gradients
    outputs = B * H * S * D * bf16 + 2 * B * H * S * 4
    gradients = 3 * B * H * S * D * bf16
    above_compiled, above_eager = int(compiled[1].split()[1]), int(eager[1].split()[1])
    assert outputs + gradients <= above_compiled < outputs + gradients + (1 << 20)
    # torch's dense implementation, which a GPU runs eagerly, holds the scores
    assert above_eager > 2 * scores


# The same attention inside a compiled module: with Inductor options or dynamic shapes (which the
# emulator runs eagerly), or planned by Inductor (Dynamo traces flex_attention on the meta device).
# On the GPU Inductor fuses the flex_attention inside it.
FLEX_MODULE = """
import sys
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, S, D = 2, 4, 1024, 64

def causal(b, h, q, kv):
    return q >= kv

class Attention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return flex_attention(q, k, v, block_mask=mask)

mask = create_block_mask(causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cuda")
how = {"options": {"options": {"max_autotune": False}}, "dynamic": {"dynamic": True}, "default": {}}
if sys.argv[1] == "method":  # torchtitan's `transformer_block.compile(...)`
    attend = Attention()
    attend.compile()
else:
    attend = torch.compile(Attention(), **how[sys.argv[1]])
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
out = attend(q, k, v, mask)
out.sum().backward()
print(tuple(out.shape), out.dtype, tuple(q.grad.shape), tuple(k.grad.shape), tuple(v.grad.shape))
print("above", torch.cuda.max_memory_allocated() - before)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["options", "dynamic", "default", "method"])
def test_flex_attention_in_a_module_compiled_with_options_holds_no_scores(tmp_path, how):
    # a module compiled with Inductor options was not marked compiled: its flex_attention was taken
    # for an eager call and held the dense float32 scores (2 x 4 x 1024 x 1024 x 4 bytes, 32 MiB);
    # compiled without options, Dynamo's trace stopped at flex_attention's device check ("only
    # supported on CUDA, CPU, HPU, or MPS devices": the meta device), exit 1
    pytest.importorskip("torch.nn.attention.flex_attention")
    script = tmp_path / "flex_module.py"
    script.write_text(FLEX_MODULE)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script), how],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    B, H, S, D, bf16 = 2, 4, 1024, 64, 2
    assert out[0] == f"({B}, {H}, {S}, {D}) torch.bfloat16" + f" ({B}, {H}, {S}, {D})" * 3
    outputs = B * H * S * D * bf16 + 2 * B * H * S * 4  # output, logsumexp, row maxima
    gradients = 3 * B * H * S * D * bf16
    assert outputs + gradients <= int(out[1].split()[1]) < outputs + gradients + (1 << 20)


# A checkpoint of an FSDP2 model (torchtitan's `--checkpoint.enable`): its state dict's DTensors
# saved by torch.distributed.checkpoint and torch.save.
FSDP2_SAVE = """
import os, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128)).cuda()
fully_shard(model)
model(torch.randn(8, 256, device="cuda")).sum().backward()
dcp.save({"model": model.state_dict()}, checkpoint_id="dcp")
torch.save(model.state_dict(), "sd.pt")
print("saved", os.path.exists("dcp"), os.path.exists("sd.pt"))
dist.destroy_process_group()
"""


def _one_rank(tmp_path, script):
    """`memdiff record --emulate h100` of a one-rank torch.distributed script, as torchrun would start it."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)


@pytest.mark.slow
def test_an_fsdp2_models_checkpoint_is_said_with_its_shards_bytes(tmp_path):
    # torch 2.13's DTensor names its device mesh among its inner tensors: the save stopped with
    # "'DeviceMesh' object has no attribute 'layout'" (exit 1), torchtitan's first checkpoint too
    script = tmp_path / "save.py"
    script.write_text(FSDP2_SAVE)
    done = _one_rank(tmp_path, script)
    assert done.returncode == 0, done.stderr[-3000:]
    # torch.distributed.checkpoint cannot write emulated tensors: nothing but its folder (every rank's
    # writer makes it first); torch.save writes its stand-in
    assert done.stdout.splitlines() == ["saved True True"]
    weights = 4 * (256 * 512 + 512 + 512 * 128 + 128)  # one rank holds every shard
    said = done.stderr.split("torch.distributed.checkpoint.save to dcp not written")[1].splitlines()[0]
    assert f"{weights:,} bytes of tensor data" in said
    assert f"created sd.pt ({weights / 1024:.2f} KiB, {weights:,} bytes of tensor data" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pickle", "save.py"]


# Fabric's and torchtitan's save of an FSDP2 job: the state dicts copied to the host
# (`cpu_offload=True`), then saved by torch.distributed.checkpoint, whose coordinator (rank 0) checks
# that the ranks' plans together cover every tensor.
FSDP2_OFFLOADED_SAVE = """
import os, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(8, 1024, device="cuda")).sum().backward()
opt.step()
model_state, opt_state = get_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))
dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id="ckpt")
print("saved", sorted(os.listdir("ckpt")))
"""


@pytest.mark.slow
def test_a_rank_alone_saves_its_own_shards_with_torch_distributed_checkpoint(tmp_path):
    # rank 0 of 2, its peer not run: the coordinator got rank 0's plan in every slot, so dedup handed
    # half of rank 0's shards to the copy and the check that the shards cover each tensor failed the
    # save ("Failed to validate global plan: ... invalid fill", exit 1), where a GPU's rank 0 writes them
    (tmp_path / "save.py").write_text(FSDP2_OFFLOADED_SAVE)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/",
                           "--ranks", "0", "--keep-writes", "kept", "--", "torchrun", "--nproc-per-node", "2",
                           "save.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved ['.metadata', '__0_0.distcp']" in done.stdout
    assert "1 of the job's 2 ranks not run" in done.stderr
    # rank 0's shards: half the rows of each weight and bias, and of AdamW's two states of each
    shards = 3 * 4 * (1024 * 1024 + 1024) * 2 // 2
    kept = tmp_path / "kept" / "upper" / str(tmp_path.resolve()).lstrip("/")  # --keep-writes: the overlay's tree
    written = (kept / "ckpt" / "__0_0.distcp").stat().st_size
    assert shards <= written < shards + 64 * 1024, (written, shards)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "runs", "save.py"]


# torchtitan's `--compile.enable`: each block compiled by `Module.compile`, then sharded by FSDP2,
# whose hooks (all-gather before the forward, reshard after) Dynamo does not trace.
FSDP2_COMPILED_BLOCKS = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                              for _ in range(3)]).cuda()
for block in model:
    block.compile()
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for step in range(2):
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
print("done", step)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_blocks_compiled_by_module_compile_train(tmp_path):
    # FSDP2's all-gather ran inside the compiled call with the emulator's modes off: "Could not run
    # 'aten::empty.memory_format' with arguments from the 'CUDA' backend" (exit 1)
    script = tmp_path / "blocks.py"
    script.write_text(FSDP2_COMPILED_BLOCKS)
    done = _one_rank(tmp_path, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["done 1"]
    assert "torch.compile ran Inductor's memory plan" in done.stderr
    from memdiff import api

    categories = api.summarize(tmp_path / "run.pickle").devices[0].categories
    assert categories["parameter"] == 3 * (256 * 256 + 256) * 4


@pytest.mark.slow
def test_a_compiled_function_on_the_second_gpu_is_planned_by_inductor_and_stays_there(tmp_path):
    # rank 1 of a torchrun job builds its block mask on `cuda:1` inside a compiled function; Inductor,
    # which plans every graph on `cuda:0`, failed on the mix and the graph ran eagerly (noted); and
    # the wrapper's `set_device(0)` put its buffers, and the process's current GPU, on cuda:0
    from memdiff import api

    source = ("import torch\ntorch.cuda.set_device(1)\n\n@torch.compile\ndef f(x):\n"
              "    return x + torch.arange(x.shape[0], device='cuda:1')\n\n"
              "y = f(torch.randn(8, device='cuda:1'))\n"
              "print(tuple(y.shape), y.device, torch.cuda.current_device())\n")
    script = tmp_path / "rank1.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "--gpus", "2", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "(8,) cuda:1 1"
    assert "ran Inductor's memory plan" in done.stderr and "could not plan" not in done.stderr, done.stderr
    assert [d.device for d in api.summarize(tmp_path / "run.pickle").devices] == [1]


# The Trainer's gradient_checkpointing=True with torch_compile=True, as our own loop: Inductor's
# wrapper saves and replays the generator's state around the checkpointed attention's dropout.
CHECKPOINTED = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_head=4, n_embd=128, n_positions=256)).cuda()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
model.gradient_checkpointing_enable()
model.train()
step = torch.compile(model)
for i in range(2):
    ids = torch.randint(0, 1000, (4, 128), device="cuda")
    loss = step(input_ids=ids, labels=ids).loss
    loss.backward()
    print("step", i, tuple(loss.shape), loss.requires_grad, f"{loss.item():.4f}")
print("weights", weights)
"""


@pytest.mark.slow
def test_a_compiled_checkpointed_model_saves_and_replays_the_generators_state(tmp_path):
    # run_and_save_rng_state reached the emulator's dispatch mode whole, with no rule for it
    pytest.importorskip("transformers")
    from memdiff import api

    done = _emulate(tmp_path, CHECKPOINTED)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[:2] == [f"step 0 () True {read_back(0):.4f}", f"step 1 () True {read_back(1):.4f}"]
    assert "ran Inductor's memory plan" in done.stderr and "could not plan" not in done.stderr
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["parameter"] == int(out[2].split()[1])


def test_a_cuda_extension_built_as_the_script_runs_is_refused_in_one_line(tmp_path):
    # A library's CUDA op built with torch.utils.cpp_extension.load as the script runs (apex's, DeepSpeed's
    # before the emulator answered its op builders); on a machine without the CUDA toolkit torch raises
    # "CUDA_HOME environment variable is not set" from cpp_extension, which reached the user as the
    # library's traceback, exit 1.
    (tmp_path / "fused_adam.cu").write_text("__global__ void step(float *p) { p[0] -= 1; }\n")
    done = _emulate(tmp_path, "import torch\nimport torch.utils.cpp_extension as ext\n"
                              "ext.CUDA_HOME = None  # no CUDA toolkit here, as on a CPU runner\n"
                              "ext.verify_ninja_availability = lambda: None  # with or without ninja\n"
                              "x = torch.ones(4, device='cuda')\n"
                              "fused = ext.load(name='fused_adam', sources=['fused_adam.cu'])\n")
    assert done.returncode == 2
    said = [line for line in done.stderr.splitlines() if line.strip() and "wrote" not in line]
    assert len(said) == 1 and said[0].startswith("memdiff: a CUDA extension built as the script runs"), done.stderr
    assert "train.py:6" in said[0] and "the library's PyTorch path" in said[0] and "CUDA_HOME" in said[0]


# A loss that folds each tile of logits with a Triton kernel of its own, launched directly
# (`kernel[grid](...)`), as trl's SFT loss does where Triton is installed: the kernel writes the row
# statistics it is given and reads the labels.
TRITON_LAUNCH = """
import torch
import triton
import triton.language as tl

@triton.jit
def _fold(tile_ptr, stride, labels_ptr, row_max_ptr, target_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    z = tl.load(tile_ptr + row * stride + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    label = tl.load(labels_ptr + row)
    out = row_max_ptr + row
    tl.store(out, tl.maximum(tl.load(out), tl.max(z, axis=0)))
    tl.store(target_ptr + row, tl.sum(tl.where(cols == label, z, 0.0), axis=0))

hidden = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
head = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
labels = torch.arange(4096, device="cuda") % 1024
row_max = torch.full((4096,), float("-inf"), device="cuda")
target = torch.zeros(4096, device="cuda")
tile = hidden @ head.t()
before = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
_fold[(4096,)](tile, tile.stride(0), labels, row_max, target, 1024, BLOCK=1024)
print("launch", torch.cuda.memory_allocated() - before[0], torch.cuda.max_memory_allocated() - before[1])
print("labels", labels.max().item(), int(labels.sum()))
print("written", bool(torch.isinf(row_max).all()), bool((target == 0).all()))
"""


@pytest.mark.slow
def test_a_triton_kernel_launched_directly_allocates_nothing_and_forgets_what_it_writes(tmp_path):
    # trl's `sft` under emulation with Triton installed (as the CUDA build of torch installs it) stopped
    # at its loss's first launch: "a Triton kernel launched directly: not emulated ... libcuda.so"
    pytest.importorskip("triton")
    done = _emulate(tmp_path, TRITON_LAUNCH)
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    # a Triton kernel allocates nothing through torch's allocator: not even for a moment
    assert out["launch"] == "0 0"
    # the labels it only reads keep their values: 0..1023 four times over
    assert out["labels"] == f"1023 {4 * sum(range(1024))}"
    # what it wrote is no longer the -inf and zeros the script filled it with, as on a GPU
    assert out["written"] == "False False"


# A row softmax that runs in place through a Triton kernel tuned over three configs (as Liger's and
# unsloth's kernels are tuned), inside an autograd Function of a small training loop. Tuning clones the
# rows it overwrites (`restore_value`) around each config's benchmark.
TRITON_AUTOTUNE = """
import torch
import triton
import triton.language as tl

@triton.autotune(
    configs=[triton.Config({"BLOCK": 1024}, num_warps=4), triton.Config({"BLOCK": 1024}, num_warps=8),
             triton.Config({"BLOCK": 2048}, num_warps=8)],
    key=["n_cols"], restore_value=["x_ptr"])
@triton.jit
def _softmax_(x_ptr, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(x_ptr + row * stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(z - tl.max(z, axis=0))
    tl.store(x_ptr + row * stride + cols, e / tl.sum(e, axis=0), mask=mask)

class Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        probs = logits.detach().clone()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _softmax_[(probs.shape[0],)](probs, probs.stride(0), probs.shape[1])
        print("launch", torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        probs, = ctx.saved_tensors
        return probs * (grad - (grad * probs).sum(-1, keepdim=True))

model = torch.nn.Linear(256, 1000, device="cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(512, 256, device="cuda")
labels = torch.arange(512, device="cuda") % 1000
for step in range(3):
    probs = Softmax.apply(model(x))
    loss = -(probs.gather(1, labels[:, None]) + 1e-6).log().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("config", _softmax_.best_config.kwargs["BLOCK"], _softmax_.best_config.num_warps)
print("probs", probs.nbytes)
"""


@pytest.mark.slow
def test_an_autotuned_triton_kernel_is_tuned_without_benchmarks_and_allocates_as_on_the_gpu(tmp_path):
    # Liger's and unsloth's kernels under emulation with Triton installed stopped at their first call:
    # "Triton's own calls to the GPU (triton.autotune's benchmarks ...): not emulated ... libcuda.so"
    pytest.importorskip("triton")
    done = _emulate(tmp_path, TRITON_AUTOTUNE)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [line for line in done.stdout.splitlines() if line.startswith("launch ")]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if not line.startswith("launch "))
    probs = int(out["probs"])
    # Triton's CUDA driver zeroes a 256 MiB int32 buffer between timed runs to flush the L2 cache
    # (get_empty_cache_for_benchmark); each timed run clones the rows it overwrites (restore_value)
    flush = 256 * 1024 * 1024
    # the first call tunes (its key is new): the flush buffer and the clone at once, all freed after;
    # the later calls of the same key launch the tuned config and allocate nothing
    assert launches == [f"launch 0 {flush + probs}", "launch 0 0", "launch 0 0"]
    # the config Triton keeps when no timing tells them apart: the first one listed
    assert out["config"] == "1024 4"


def test_a_triton_kernels_written_parameters_are_read_from_its_source():
    # which tensors a launch leaves without values: those it stores through, however their pointers
    # are offset, a descriptor's own store, and whatever it passes on to a function of its own
    from memdiff.recording.emulate.triton_launch import written_parameters

    fold = TRITON_LAUNCH.split("@triton.jit\n", 1)[1].split("\n\n", 1)[0]
    params = ["tile_ptr", "stride", "labels_ptr", "row_max_ptr", "target_ptr", "n_cols", "BLOCK"]
    assert written_parameters(fold, params) == {"row_max_ptr", "target_ptr"}
    described = ("def k(x_ptr, y_ptr, n):\n"
                 "    desc = tl.make_tensor_descriptor(y_ptr, shape=[n], strides=[1], block_shape=[16])\n"
                 "    desc.store([0], tl.load(x_ptr + tl.arange(0, 16)))\n")
    written = written_parameters(described, ["x_ptr", "y_ptr", "n"])
    assert written is not None and "y_ptr" in written and "x_ptr" not in written  # n is no tensor: kept anyway
    helper = ("def k(a_ptr, b_ptr, n):\n    offs = tl.arange(0, 16)\n"
              "    _accumulate(b_ptr + offs, tl.load(a_ptr + offs))\n")
    assert written_parameters(helper, ["a_ptr", "b_ptr", "n"]) == {"a_ptr", "b_ptr"}
    assert written_parameters("not python (", ["a_ptr"]) is None


# Online log-sum-exp over chunks of a large logits matrix into small running statistics, each chunk's
# rows written through a slice of them (trl's chunked log-probability loss does so, in torch where
# Triton is not installed and in its Triton kernel where it is): the metric read back is finite.
THROUGH_SLICES = """
import math
import torch

logits = torch.randn(1024, 4096, device="cuda")
running_max = torch.full((1024,), float("-inf"), device="cuda")
sum_exp = torch.zeros(1024, device="cuda")
for start in range(0, 1024, 256):
    rows = slice(start, start + 256)
    new_max = torch.maximum(running_max[rows], logits[rows].amax(-1))
    sum_exp[rows].mul_(torch.exp(running_max[rows] - new_max)).add_(torch.exp(logits[rows] - new_max[:, None]).sum(-1))
    running_max[rows] = new_max
log_z = (running_max + sum_exp.log()).mean().item()
print("log_z", math.isnan(log_z), math.isinf(log_z))
print("zeros", bool((sum_exp == 0).any()))
"""


@pytest.mark.slow
def test_statistics_written_through_slices_lose_their_initial_values(tmp_path):
    # the emulator kept the -inf and zeros the statistics were filled with, as the writes went to
    # slices of them: log_z read -inf (trl's logged entropy read nan and its token accuracy 1)
    done = _emulate(tmp_path, THROUGH_SLICES)
    assert done.returncode == 0, done.stderr[-3000:]
    cpu = subprocess.run([sys.executable, "-c", THROUGH_SLICES.replace('device="cuda"', 'device="cpu"')],
                         capture_output=True, text=True)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert done.stdout.splitlines() == cpu.stdout.splitlines() == ["log_z False False", "zeros False"]
