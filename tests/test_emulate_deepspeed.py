"""DeepSpeed's ZeRO under the emulator: rank 0 of a 2-rank `deepspeed` job run alone
(tests/scenarios/deepspeed_train.py), its categories held to counts by hand.

The truth is the model's parameter count and DeepSpeed's own partitioning, never memdiff's answer.
With N parameters on W ranks, each rank owns a partition of P = N / W elements (ZeRO 3: each
parameter split into W parts, rounded up), b elements make a reduce bucket, and in bf16 with
torch's AdamW:

- ZeRO 1 and 2 keep the bf16 weights whole (2N bytes) and an fp32 master partition (4P), the
  Adam moments of the partition (2 x 4P), and in the backward a bf16 gradient partition (2P) and
  the reduce bucket (2b); the step casts the partition to the fp32 gradient the update reads (4P).
- ZeRO 3 keeps only the bf16 partition (2P) and the fp32 one (4P); each module's forward gathers
  its full weights (2N in all, unsharded_parameter); the bucket (2b) and the gradient partitions
  (2P) are held for the run.
- offload_optimizer puts the master weights, the moments and the update (DeepSpeedCPUAdam, offload's
  default) on the CPU: under ZeRO 2 the device keeps the bf16 weights (2N) and a staging buffer of the
  largest parameter's gradient; under ZeRO 3 its bf16 partition (2P), the gathered weights (2N) and the
  reduce bucket (2b), the gradient partitions going to the CPU.
- DeepSpeed's own default optimizer, FusedAdam (`"type": "Adam"` without torch_adam), keeps the same
  two fp32 moments of the partition (2 x 4P) and, beside them, its one-int no-op flag; its CUDA kernel
  updates in place (csrc/adam/multi_tensor_adam.cu), so its step allocates nothing else.

DeepSpeed is found in the folder MEMDIFF_DEEPSPEED_LIBS names (.ci/run installs 0.19.8 there);
without it the tests skip, or fail where CI requires its capture dependencies. The runs have no C++
compiler (CC and CXX name `false`): DeepSpeed builds none of its ops under the emulator.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import ROOT, missing_capture_dependency

# Slow (the fast loop, -m "not slow", leaves it out): each run is an emulated DeepSpeed job.
pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "scenarios" / "deepspeed_train.py"
LIBS = "MEMDIFF_DEEPSPEED_LIBS"
# Scalars counted with the buffers: Adam's step counts beside the moments, and ZeRO 3's one-byte
# overflow flag (the ZeRO optimizer's own state).
SCALARS = 64
BF16, FP32 = 2, 4
# What every run is given: DeepSpeed's libraries, one thread, and no C++ compiler (a build fails at once).
NO_COMPILER = {"OMP_NUM_THREADS": "1", "CC": "false", "CXX": "false"}


def _env(libs: str) -> Dict[str, str]:
    return {**os.environ, **NO_COMPILER, "PYTHONPATH": os.pathsep.join((str(ROOT), libs))}


def _libraries() -> str:
    folder = os.environ.get(LIBS)
    if not folder or not (Path(folder) / "deepspeed").is_dir():
        missing_capture_dependency(f"DeepSpeed is not set up: {LIBS} names no folder holding it (.ci/run installs it)")
    return str(folder)


@pytest.fixture(scope="module")
def record(torch, tmp_path_factory):
    """Rank 0 of the job with these flags, emulated on an H100 once per module: (facts, device summary,
    the snapshot's path)."""
    libs = _libraries()
    from memdiff import api

    runs: Dict[Tuple[str, ...], tuple] = {}

    def run(*flags: str):
        if flags not in runs:
            folder = tmp_path_factory.mktemp("deepspeed")
            done = subprocess.run(
                [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks", "0", "--",
                 "deepspeed", "--num_gpus", "2", str(SCRIPT), *flags],
                cwd=folder, capture_output=True, text=True, timeout=600, env=_env(libs))
            assert done.returncode == 0, done.stderr[-3000:]
            facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
            snapshot = folder / "runs" / "rank0.pickle"
            runs[flags] = facts, api.summarize(snapshot).devices[0], snapshot
        return runs[flags]

    return run


def _phase_peaks(device) -> Dict[str, Dict[str, int]]:
    """The categories at each phase's peak in the last step."""
    last = max(p.step for p in device.phase_peaks)
    return {p.phase: p.categories for p in device.phase_peaks if p.step == last}


def _partition(facts) -> int:
    """This rank's elements: ZeRO 1 and 2 split the flat group evenly (this model needs no padding),
    ZeRO 3 each parameter, rounded up."""
    world = facts["world_size"]
    return sum(-(-n // world) for n in facts["numels"])


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero_1_and_2_hold_whole_bf16_weights_and_a_partition_of_the_rest(record, stage):
    facts, device, _ = record("--stage", stage)
    n, p, b = sum(facts["numels"]), _partition(facts), facts["bucket"]
    assert sum(facts["numels"]) % (2 * facts["world_size"]) == 0  # no padding in the partition
    peaks = _phase_peaks(device)
    forward, backward, optimizer = peaks["forward"], peaks["backward"], peaks["optimizer"]
    assert forward["parameter"] == BF16 * n + FP32 * p
    assert 0 <= forward["optimizer_state"] - 2 * FP32 * p < SCALARS
    assert "gradient" not in forward
    # the bf16 gradient partition and the reduce bucket the .grad tensors are views into
    assert backward["gradient"] == BF16 * p + BF16 * b
    # the fp32 gradient partition the update reads; when the step's peak is the cast that makes
    # it, the bf16 partition and its flat copy are live beside it
    assert optimizer["gradient"] in (FP32 * p, FP32 * p + 2 * BF16 * p)
    assert optimizer["parameter"] == BF16 * n + FP32 * p
    assert device.phase_at_peak == "optimizer"


def test_zero_3_gathers_full_weights_as_unsharded_parameters(record):
    facts, device, _ = record("--stage", "3")
    n, p, b = sum(facts["numels"]), _partition(facts), facts["bucket"]
    peaks = _phase_peaks(device)
    forward, optimizer = peaks["forward"], peaks["optimizer"]
    assert forward["parameter"] == BF16 * p + FP32 * p
    # every module's weights stay gathered from its forward to its backward (stage3_max_reuse_distance)
    assert forward["unsharded_parameter"] == BF16 * n
    assert forward["gradient"] == BF16 * p + BF16 * b  # the gradient partitions and the bucket, held for the run
    assert 0 <= forward["optimizer_state"] - 2 * FP32 * p < SCALARS
    # with the fp32 gradient partition, and its bf16 flat copy when the peak is the cast
    assert optimizer["gradient"] in (BF16 * p + BF16 * b + FP32 * p, BF16 * p + BF16 * b + FP32 * p + BF16 * p)
    assert "unsharded_parameter" not in optimizer


def test_zero_2_with_offload_keeps_only_bf16_weights_and_a_staging_buffer(record):
    # "type": "Adam" with offload is DeepSpeedCPUAdam, a C++ extension DeepSpeed built as the script
    # ran (3 min 24 s on 2 cores) before the emulator gave its op builder a stand-in
    facts, device, _ = record("--stage", "2", "--offload", "--optimizer", "adam")
    n = sum(facts["numels"])
    # two steps, though the update runs on the CPU: engine.step is the optimizer step
    assert len(device.steps) == 2
    forward = _phase_peaks(device)["forward"]
    assert forward["parameter"] == BF16 * n
    assert forward["gradient"] == BF16 * max(facts["numels"])
    assert "optimizer_state" not in device.categories


def test_zero_3_with_offload_keeps_its_bf16_partition_the_gathered_weights_and_the_bucket(record):
    # a bucket larger than any parameter, so the bucket (2b) is not the largest gradient (2 x 512 x 512)
    facts, device, _ = record("--stage", "3", "--offload", "--optimizer", "adam", "--bucket", str(1 << 19))
    n, p, b = sum(facts["numels"]), _partition(facts), facts["bucket"]
    assert len(device.steps) == 2
    forward = _phase_peaks(device)["forward"]
    assert forward["parameter"] == BF16 * p  # the fp32 master partition is on the CPU
    assert forward["unsharded_parameter"] == BF16 * n
    # the reduce bucket; the gradient partitions are on the CPU (the update reads them there)
    assert forward["gradient"] == BF16 * b
    assert "optimizer_state" not in device.categories


def _allocated_in(snapshot: Path, file: str, function: str) -> List[int]:
    """The sizes the snapshot's trace allocated with `function` of DeepSpeed's `file` on the stack."""
    with open(snapshot, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    return [e["size"] for e in trace if e["action"] == "alloc"
            and any(fr["filename"].endswith(file) and fr["name"] == function for fr in e["frames"])]


def test_deepspeeds_default_fused_adam_holds_two_moments_of_the_partition_and_its_step_allocates_nothing(record):
    # "type": "Adam" is FusedAdam, whose CUDA extension DeepSpeed builds as the script runs: refused
    # in one line before the emulator gave its op builder a stand-in
    facts, device, snapshot = record("--stage", "2", "--optimizer", "adam")
    n, p = sum(facts["numels"]), _partition(facts)
    forward = _phase_peaks(device)["forward"]
    assert forward["parameter"] == BF16 * n + FP32 * p  # its no-op flag is no weight
    assert 0 <= forward["optimizer_state"] - 2 * FP32 * p < SCALARS  # torch's AdamW's state (above)
    # in two steps FusedAdam's step makes only exp_avg and exp_avg_sq, once (zeros_like of the fp32
    # partition): the kernel updates in place; its __init__ makes the int32 no-op flag
    file = "deepspeed/ops/adam/fused_adam.py"
    assert _allocated_in(snapshot, file, "step") == [FP32 * p, FP32 * p]
    assert _allocated_in(snapshot, file, "__init__") == [4]


# FusedLamb and FusedLion stepping one fp32 Linear(256, 256) on the emulated GPU, without the engine:
# the bytes each step leaves allocated and its peak above what was allocated before it.
FUSED_STEPS = """
    import torch
    from torch import nn
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    with emulating(Emulator(gpu("h100"))):
        from deepspeed.ops.lamb import FusedLamb
        from deepspeed.ops.lion import FusedLion
        for name, kind in (("lamb", FusedLamb), ("lion", FusedLion)):
            model = nn.Linear(256, 256).cuda()
            optimizer = kind(model.parameters(), lr=1e-3)
            for step in range(2):
                model(torch.randn(8, 256, device="cuda")).sum().backward()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                optimizer.step()
                print(name, step, torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before)
"""


def test_fused_lamb_and_lion_keep_their_moments_and_lamb_its_kernels_norm_buffers(tmp_path):
    libs = _libraries()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FUSED_STEPS)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_env(libs))
    assert done.returncode == 0, done.stderr[-3000:]
    said = {tuple(line.split()[:2]): tuple(int(v) for v in line.split()[2:]) for line in done.stdout.splitlines()}
    weight, bias = FP32 * 256 * 256, FP32 * 256  # both whole 512-byte blocks
    # FusedLion: one moment a parameter (exp_avg), made on the first step; its kernel updates in place
    assert said[("lion", "0")] == (weight + bias, weight + bias)
    assert said[("lion", "1")] == (0, 0)
    # FusedLamb: two moments a parameter, and per parameter its kernel (fused_lamb_cuda.cpp) makes two
    # 512-element fp32 norm buffers, freed as it returns, and a one-element coefficient FusedLamb keeps
    # until its next step (a 512-byte block each): the peak is at the bias's update, the weight's
    # coefficient kept
    buffers, coefficient = 2 * FP32 * 512, 512
    assert said[("lamb", "0")] == (2 * (weight + bias) + 2 * coefficient,
                                   2 * (weight + bias) + coefficient + buffers + coefficient)
    # the next step drops the last step's two coefficients first: at the bias's update the weight's new
    # coefficient and the bias's stand where those two stood
    assert said[("lamb", "1")] == (0, buffers)


# DeepSpeed's host optimizers stepping one host parameter beside torch's, three steps of the same
# gradients, under the emulator (their op builders load the stand-ins, nothing is built): the
# largest difference of the parameters after each pair, for fp32 parameters and states.
HOST_STEPS = """
    import torch
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    def apart(make_deepspeeds, make_torchs):
        torch.manual_seed(0)
        start, grads = torch.randn(64, 33), [torch.randn(64, 33) for _ in range(3)]
        ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        deepspeeds, torchs = make_deepspeeds([ours]), make_torchs([theirs])
        for grad in grads:
            ours.grad, theirs.grad = grad.clone(), grad.clone()
            deepspeeds.step()
            torchs.step()
        return (ours - theirs).abs().max().item(), (ours - start).abs().max().item()

    with emulating(Emulator(gpu("h100"))):
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion

        print("adamw", *apart(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1),
                              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)))
        print("adam", *apart(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1, adamw_mode=False),
                             lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)))
        print("adagrad", *apart(lambda p: DeepSpeedCPUAdagrad(p, lr=1e-2, weight_decay=0.1),
                                lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=0.1)))
        # torch has no Lion: its first step from zero momentum moves each weight by lr against the
        # gradient's sign, after the decay, and keeps (1 - beta2) g as the momentum
        weight = torch.nn.Parameter(torch.randn(64, 33))
        before, weight.grad = weight.detach().clone(), torch.randn(64, 33)
        lion = DeepSpeedCPULion([weight], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
        lion.step()
        by_hand = before * (1 - 1e-2 * 0.1) - 1e-2 * weight.grad.sign()
        print("lion", (weight - by_hand).abs().max().item(),
              (lion.state[weight]["exp_avg"] - 0.01 * weight.grad).abs().max().item())
        # ZenFlow's overlapped optimizer process asks the same op for functions the stand-in has not
        from deepspeed.ops.op_builder import CPUAdamBuilder
        try:
            CPUAdamBuilder().load().zenflow_adam_ctrl_size()
        except Exception as error:
            print("zenflow", type(error).__name__, str(error).count(chr(10)))
"""


def test_deepspeeds_host_optimizers_update_as_torchs_do(tmp_path):
    libs = _libraries()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(HOST_STEPS)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_env(libs))
    assert done.returncode == 0, done.stderr[-3000:]
    said = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    # refused in one line (exit 2 in a recorded run), not an AttributeError from deep in DeepSpeed
    assert said.pop("zenflow") == ["EmulationError", "0"]
    said = {name: [float(v) for v in values] for name, values in said.items()}
    # DeepSpeedCPUAdam (AdamW, decoupled decay; and Adam, the decay added to the gradient) and
    # DeepSpeedCPUAdagrad end where torch's optimizers end, to fp32's rounding, having moved
    for name in ("adamw", "adam", "adagrad"):
        difference, moved = said[name]
        assert difference < 1e-6 and moved > 1e-2, (name, difference, moved)
    assert said["lion"][0] < 1e-6 and said["lion"][1] < 1e-6
