"""The emulator: the caching allocator's model against real CUDA traces, and `memdiff record --emulate`
against real H100 runs of the same script (tests/data/cuda: the truth was captured on the GPU)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest

from memdiff.emulate.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    round_size,
)

ROOT = Path(__file__).resolve().parent.parent
CUDA = ROOT / "tests" / "data" / "cuda"
SHARED = ROOT.parent / "shared" / "snapshots"
MiB = 1 << 20


def _load(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def _replay(snapshot, real_addresses: bool):
    """Feed a trace recorded from an empty allocator to the model; its segment events and allocator."""
    trace = snapshot["device_traces"][0]
    model = CachingAllocator(80 << 30)
    if real_addresses:  # the driver's addresses decide best-fit ties between equal free blocks
        segment_addresses = iter([e["addr"] for e in trace if e["action"] == "segment_alloc"])
        model._take_addresses = lambda size: next(segment_addresses)
    events = []
    model.trace = lambda action, addr, size, stream, ctx: events.append((action, addr, size))
    live, moved = {}, 0
    for e in trace:
        if e["action"] == "alloc":
            block = model.malloc(e["size"], e["stream"])
            moved += block.address != e["addr"]
            live[e["addr"]] = block
        elif e["action"] == "free_completed":
            model.free(live.pop(e["addr"]))
    return model, events, moved


def _from_empty():
    paths = [CUDA / "ddp" / "rank0.pickle.gz", CUDA / "ddp" / "rank1.pickle.gz"]
    if (SHARED / "linear-grad.pickle").exists():
        paths.append(SHARED / "linear-grad.pickle")
    elif os.environ.get("MEMDIFF_REQUIRE_SHARED"):
        pytest.fail("../shared/snapshots is missing")
    return paths


@pytest.mark.parametrize("path", _from_empty(), ids=lambda p: p.name)
def test_the_allocator_model_makes_the_real_allocators_segments(path):
    # Traces recorded from a fresh process (no block older than the trace): every segment the
    # real allocator asked the driver for, in order and size, and with the driver's addresses
    # every allocation at the address the GPU gave it.
    snapshot = _load(path)
    real = [(e["action"], e["size"]) for e in snapshot["device_traces"][0] if e["action"].startswith("segment")]
    model, events, _ = _replay(snapshot, real_addresses=False)
    assert [(a, s) for a, _, s in events if a.startswith("segment")] == real
    assert model.reserved == sum(s["total_size"] for s in snapshot["segments"])
    model, _, moved = _replay(snapshot, real_addresses=True)
    assert moved == 0
    assert model.allocated == sum(s["allocated_size"] for s in snapshot["segments"])


def test_rounding_pools_and_splitting_follow_the_allocators_rules():
    a = CachingAllocator(1 << 30)
    small = a.malloc(100)  # 512 B block in a 2 MiB small segment
    assert (small.size, small.segment.size, small.segment.small) == (512, SMALL_BUFFER, True)
    big = a.malloc(12 * MiB + 1)  # 10 MiB and over: its own segment, rounded to 2 MiB
    assert big.segment.size == 14 * MiB and big.size == 12 * MiB + 512
    mid = a.malloc(5 * MiB)  # under 10 MiB, and the 2 MiB left beside `big` is too small: a 20 MiB segment
    assert (mid.size, mid.segment.size) == (5 * MiB, LARGE_BUFFER)
    tail = a.malloc(14 * MiB + 600 * 1024)  # best fit: the 15 MiB left of the 20 MiB segment; 424 KiB left, unsplit
    assert tail.segment is mid.segment and tail.size == 15 * MiB
    assert a.allocated == 512 + 5 * MiB + 12 * MiB + 512 + 15 * MiB
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER + 14 * MiB
    a.free(mid)
    a.free(tail)  # merges with its free neighbour: the 20 MiB segment is one free block again
    assert [b.size for b in a.blocks(mid.segment)] == [LARGE_BUFFER]
    a.empty_cache()  # only segments without allocated blocks go back
    assert a.reserved == SMALL_BUFFER + 14 * MiB
    assert a.memory_stats()["reserved_bytes.all.peak"] == SMALL_BUFFER + LARGE_BUFFER + 14 * MiB


def test_a_full_device_frees_its_cache_then_says_out_of_memory():
    a = CachingAllocator(64 * MiB)
    events = []
    a.trace = lambda action, addr, size, stream, ctx: events.append(action)
    first = a.malloc(40 * MiB)
    a.free(first)  # cached: 40 MiB reserved, nothing allocated
    second = a.malloc(50 * MiB)  # does not fit beside the cache: the cache goes back, then it fits
    assert "segment_free" in events and second.segment.size == 50 * MiB
    assert a.counters["num_alloc_retries"] == 1
    with pytest.raises(OutOfMemory):
        a.malloc(20 * MiB)
    assert events[-1] == "oom" and a.counters["num_ooms"] == 1


def test_allocator_settings_are_read_from_pytorch_cuda_alloc_conf():
    config = AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4")
    assert config.expandable_segments and config.max_split_size == 128 * MiB
    assert round_size(1200 * 1024, config) == 1280 * 1024  # 1 MiB..2 MiB in quarters
    with pytest.raises(ValueError, match="not emulated"):
        AllocatorConfig.parse("some_new_knob:3")
    grows = CachingAllocator(1 << 30, AllocatorConfig.parse("expandable_segments:True"))
    events = []
    grows.trace = lambda action, addr, size, stream, ctx: events.append((action, size))
    one, two = grows.malloc(30 * MiB), grows.malloc(30 * MiB)
    assert one.segment is two.segment and one.segment.expandable
    # One segment that grows by 20 MiB pages: 40 MiB for the first, 20 MiB more beside its 10 MiB free end.
    assert [e for e in events if e[0] == "segment_map"] == [("segment_map", 40 * MiB), ("segment_map", 20 * MiB)]
    assert grows.reserved == 60 * MiB


# -- the emulated run against the real GPU's -----------------------------------------------------------

torch = pytest.importorskip("torch") if not os.environ.get("MEMDIFF_REQUIRE_TORCH") else __import__("torch")
sys.path.insert(0, str(CUDA))
from capture import GPT2, RUNS  # noqa: E402  (the arguments the real runs were captured with)

# The real runs the emulator is held to (each emulated in about 15 s of CPU): fp32 with the
# memory-efficient attention, bf16 and fp16 weights with cuDNN's, optimizers with and without
# state, accumulation, checkpointing.
HELD = ["gpt2-base", "gpt2-bf16", "gpt2-sgd", "gpt2-adafactor", "gpt2-checkpoint", "gpt2-fused"]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("emulated")
    made = {}

    def run(name):
        if name not in made:
            out = folder / f"{name}.pickle"
            env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT)}
            done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out),
                                   "--", sys.executable, str(ROOT / "tests/scenarios/train.py"), *GPT2, *RUNS[name],
                                   "--out", str(folder / f"{name}-own.pickle")],
                                  env=env, capture_output=True, text=True, cwd=folder)
            assert done.returncode == 0, done.stderr[-3000:]
            made[name] = folder / f"{name}-own.pickle"  # the script's own recording, as on the GPU
        return made[name]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", HELD)
def test_the_emulated_h100_run_has_the_real_h100_runs_peak(emulated, name):
    from memdiff import api

    real = api.summarize(CUDA / f"{name}.pickle.gz").devices[0]
    emu = api.summarize(emulated(name)).devices[0]
    assert abs(emu.peak_bytes / real.peak_bytes - 1) <= 0.01, (name, emu.peak_bytes, real.peak_bytes)
    assert abs(emu.reserved_peak_bytes / real.reserved_peak_bytes - 1) <= 0.05
    assert emu.phase_at_peak == real.phase_at_peak
    # The categories at the peak: the real snapshot's, byte for byte where the bytes are the model's.
    assert set(emu.categories) == set(real.categories)
    for category in ("parameter", "optimizer_state", "gradient", "workspace"):
        assert emu.categories.get(category, 0) == real.categories.get(category, 0), category


@pytest.mark.slow
def test_the_emulated_snapshot_diffs_as_no_change_against_the_real_one(emulated):
    done = subprocess.run([sys.executable, "-m", "memdiff", str(CUDA / "gpt2-base.pickle.gz"),
                           str(emulated("gpt2-base"))], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 B, +0.0%" in done.stdout


SCRIPT = """
import torch
assert torch.cuda.is_available()
print(torch.cuda.get_device_name(0))
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(model.parameters())
torch.cuda.memory._record_memory_history(max_entries=100000)
x = torch.randn(64, 256, device="cuda")
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
print("loss", loss.item(), "kept", torch.nonzero(x).shape[0])
print("max", torch.cuda.max_memory_allocated())
torch.cuda.memory._dump_snapshot("own.pickle")
{extra}
"""


def _record(tmp_path, extra="", gpu="h100"):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{extra}", extra))
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", gpu, "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.slow
def test_a_plain_cuda_script_runs_unmodified_and_its_own_dump_is_the_emulated_snapshot(tmp_path):
    done = _record(tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "NVIDIA H100 80GB HBM3"
    assert out[1] == "loss 0.0 kept 16384"  # values read back are zeros; a value-sized op keeps every element
    own = _load(tmp_path / "own.pickle")
    assert own["emulated"]["gpu"] == "NVIDIA H100 80GB HBM3"
    # The weights: 2 x (256 x 1024 + 1024) + ... floats, each block rounded to 512 bytes, as the GPU's.
    weights = [b for s in own["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["requested_size"] for b in weights) >= 4 * (2 * 256 * 1024 + 1024 + 256)
    assert all(b["size"] % 512 == 0 for b in weights)
    # torch.cuda.max_memory_allocated() counts blocks as the allocator rounds them: at least the
    # blocks still live at the dump, and at least the peak of the sizes asked for that memdiff reads.
    from memdiff import api

    max_allocated = int(out[2].split()[1])
    assert max_allocated >= sum(b["size"] for b in weights)
    assert 0 < api.summarize(tmp_path / "own.pickle").devices[0].peak_bytes <= max_allocated
    peak = subprocess.run([sys.executable, "-m", "memdiff", "peak", str(tmp_path / "run.pickle")],
                          capture_output=True, text=True)
    assert peak.returncode == 0, peak.stderr


@pytest.mark.slow
def test_an_op_without_a_meta_kernel_is_one_line_naming_it_and_the_script_line(tmp_path):
    extra = ("@torch.library.custom_op('memdifftest::double', mutates_args=())\n"
             "def double(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
             "double(x)\n")
    done = _record(tmp_path, extra)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memdiff: memdifftest::double: has no meta kernel") and "train.py:18" in last
    assert "Traceback" not in done.stderr
    assert (tmp_path / "run.pickle").exists()  # what ran until then is kept


@pytest.mark.slow
def test_compile_runs_eagerly_and_says_so_in_the_snapshot(tmp_path):
    done = _record(tmp_path, "torch.compile(model)(x).sum().backward()\n")
    assert done.returncode == 0, done.stderr
    assert "torch.compile runs eagerly" in done.stderr
    notes = _load(tmp_path / "run.pickle")["emulated"]["notes"]
    assert any("torch.compile runs eagerly" in n for n in notes)


def test_an_unknown_gpu_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h900", "-o", "x.pickle", "--",
                           "python", "train.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "no GPU named 'h900'" in done.stderr and "h100" in done.stderr


def test_gpus_and_kernel_rules_are_data():
    from memdiff.emulate.gpus import gpu, kernels, names

    assert {"h100", "h200", "a100", "l4"} <= set(names())
    assert gpu("H100").total_memory > gpu("L4").total_memory
    rules = kernels()
    assert set(rules["sdpa"]) == {"cudnn", "flash", "efficient", "math"}
    assert json.dumps(rules)  # plain data, no code


@pytest.mark.slow
def test_the_gate_refuses_an_emulated_run_against_a_recorded_baseline_unless_told(emulated, tmp_path):
    baseline = tmp_path / "gpt2.json"
    made = subprocess.run([sys.executable, "-m", "memdiff", "baseline", str(CUDA / "gpt2-base.pickle.gz"), "-o",
                           str(baseline)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    run = str(emulated("gpt2-base"))
    refused = subprocess.run([sys.executable, "-m", "memdiff", "gate", run, "--baseline", str(baseline)],
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert "the baseline was recorded and the run was emulated NVIDIA H100 80GB HBM3" in refused.stderr
    allowed = subprocess.run([sys.executable, "-m", "memdiff", "gate", run, "--baseline", str(baseline),
                              "--mixed-routes"], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stdout[-2000:]
    assert "base was recorded and head emulated NVIDIA H100 80GB HBM3" in allowed.stdout
    # An emulated baseline records its route: an emulated run gates against it without the flag.
    own = tmp_path / "emulated.json"
    subprocess.run([sys.executable, "-m", "memdiff", "baseline", run, "-o", str(own)], check=True, capture_output=True)
    assert json.loads(own.read_text())["source"]["emulated"]["gpu"] == "NVIDIA H100 80GB HBM3"
    same = subprocess.run([sys.executable, "-m", "memdiff", "gate", run, "--baseline", str(own)],
                          capture_output=True, text=True)
    assert same.returncode == 0, same.stdout[-2000:]


@pytest.mark.slow
def test_the_pytest_plugin_gates_a_cuda_test_on_the_emulated_gpu(pytester, torch):
    # A team's CUDA test, unchanged, on a CI runner without a GPU: its memory is the H100's.
    pytester.makepyfile(test_cuda=textwrap.dedent("""
        import pytest
        import torch

        @pytest.mark.memdiff(emulate="h100", limit="1GiB")
        def test_step():
            assert torch.cuda.is_available()
            model = torch.nn.Linear(1024, 1024).cuda()
            model(torch.randn(512, 1024, device="cuda")).sum().backward()
            assert torch.cuda.max_memory_allocated() > 4 * 1024 * 1024

        @pytest.mark.memdiff(emulate="h100", limit="1MiB")
        def test_over():
            torch.empty(1 << 20, device="cuda")
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "device 0 peak 4.00 MiB" in out and "over the limit of 1.00 MiB" in out
    bad = pytester.makepyfile(test_bad=textwrap.dedent("""
        import pytest

        @pytest.mark.memdiff(emulate="h900", limit="1GiB")
        def test_step():
            pass
    """))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", str(bad))
    assert result.ret == 2 and "emulate: no GPU named 'h900'" in result.stdout.str()


FAMILIES = ["bert", "llama", "t5", "vit", "cnn"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("families")

    def run(name):
        out = folder / f"{name}.pickle"
        if not out.exists():
            done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                                   str(folder / f"{name}-record.pickle"), "--", sys.executable,
                                   str(ROOT / "tests/scenarios/train.py"), "--model", name, "--device", "cuda",
                                   "--batch", "4", "--seq", "128", "--out", str(out)],
                                  env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT)},
                                  capture_output=True, text=True, cwd=folder)
            assert done.returncode == 0, done.stderr[-3000:]
        return out, json.loads((folder / f"{name}.pickle.facts.json").read_text())
    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_other_families_run_unmodified_and_hold_what_the_model_holds(family, name):
    # No real GPU run of these yet (docs/emulate.md): the truth here is the model's own, read by the
    # script under emulation, where the tensors and the optimizer's state are what they are on a GPU.
    from memdiff import api

    path, facts = family(name)
    device = api.summarize(path).devices[0]
    assert device.categories["parameter"] == facts["parameter_bytes"]
    # foreach AdamW keeps its one-element step counters on the CPU, as on a GPU
    assert device.categories["optimizer_state"] == facts["state_bytes"] - facts["state_scalar_bytes"]
    # torch.cuda.max_memory_allocated(), asked by the script, counts the allocator's rounded blocks
    assert device.peak_bytes <= facts["cuda_max_allocated_bytes"] <= device.peak_bytes * 1.05 + (1 << 20)
    assert device.categories["workspace"] >= 32 << 20  # the forward's cuBLAS handle at least


LOOPS = """
import json, sys
import torch
from torch.utils.checkpoint import checkpoint
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda()
x = torch.randn(32, 256, device="cuda", requires_grad=True)
checkpoint(m, x, use_reentrant=True).sum().backward()          # reentrant: recomputed in the backward
checkpoint(m, x, use_reentrant=False).sum().backward()
states = {}
for name, kw in {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}.items():
    opt = torch.optim.AdamW(m.parameters(), **kw)
    opt.step()
    states[name] = sorted(str(v.device) for s in opt.state.values() for v in s.values())
scaler = torch.amp.GradScaler("cuda")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = m(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
json.dump({"states": states, "scale": scaler.get_scale()}, sys.stdout)
"""


@pytest.mark.slow
def test_checkpointing_optimizer_paths_and_gradscaler_run_as_on_a_gpu(tmp_path):
    (tmp_path / "loops.py").write_text(LOOPS)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(tmp_path / "loops.py")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    # Where torch.optim keeps each path's state on a GPU: the step counters on the CPU but for fused.
    assert out["states"]["single"] == out["states"]["foreach"] == ["cpu"] * 4 + ["cuda:0"] * 8
    assert out["states"]["fused"] == ["cuda:0"] * 12
    # No inf or NaN on the emulated GPU: the scaler steps and keeps torch's default initial scale.
    assert out["scale"] == 65536.0


TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128))
weights = sum(p.numel() * p.element_size() for p in model.parameters())
count = len(list(model.parameters()))
data = [{"input_ids": torch.randint(0, 1000, (64,)), "labels": torch.randint(0, 1000, (64,))} for _ in range(8)]
args = TrainingArguments(output_dir="out", max_steps=2, per_device_train_batch_size=4, report_to=[],
                         save_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data).train()
print(args.device, weights, count)
"""


@pytest.mark.slow
def test_the_hugging_face_trainer_trains_on_the_emulated_gpu(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from memdiff import api

    (tmp_path / "trainer.py").write_text(TRAINER)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(tmp_path / "trainer.py")],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert done.returncode == 0, done.stderr[-3000:]
    device, weights, count = done.stdout.split()[-3:]
    assert device == "cuda:0"
    device_summary = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device_summary.categories["parameter"] == int(weights)  # GPT-2's tied head counted once, as on a GPU
    # The Trainer picks fused AdamW on CUDA: two moments per weight, and its fp32 step counters on
    # the device too (foreach and single-tensor AdamW keep those on the CPU).
    state = sum(g.bytes for g in device_summary.groups if g.site.startswith("adam.py:_init_group"))
    assert state == 2 * int(weights) + 4 * int(count)
