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
- offload_optimizer puts the master weights, the moments and the update on the CPU: the device
  keeps the bf16 weights (2N) and a staging buffer of the largest parameter's gradient.

DeepSpeed is found in the folder MEMDIFF_DEEPSPEED_LIBS names (.ci/run installs 0.19.8 there);
without it the tests skip, or fail where CI requires its capture dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

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


def _libraries() -> str:
    folder = os.environ.get(LIBS)
    if not folder or not (Path(folder) / "deepspeed").is_dir():
        missing_capture_dependency(f"DeepSpeed is not set up: {LIBS} names no folder holding it (.ci/run installs it)")
    return str(folder)


@pytest.fixture(scope="module")
def record(torch, tmp_path_factory):
    """Rank 0 of the job with these flags, emulated on an H100 once per module: (facts, device summary)."""
    libs = _libraries()
    from memdiff import api

    runs: Dict[Tuple[str, ...], tuple] = {}

    def run(*flags: str):
        if flags not in runs:
            folder = tmp_path_factory.mktemp("deepspeed")
            done = subprocess.run(
                [sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "runs/", "--ranks", "0", "--",
                 "deepspeed", "--num_gpus", "2", str(SCRIPT), *flags],
                cwd=folder, capture_output=True, text=True, timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), libs))})
            assert done.returncode == 0, done.stderr[-3000:]
            facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
            runs[flags] = facts, api.summarize(folder / "runs" / "rank0.pickle").devices[0]
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
    facts, device = record("--stage", stage)
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
    facts, device = record("--stage", "3")
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
    facts, device = record("--stage", "2", "--offload")
    n = sum(facts["numels"])
    # two steps, though the update runs on the CPU: engine.step is the optimizer step
    assert len(device.steps) == 2
    forward = _phase_peaks(device)["forward"]
    assert forward["parameter"] == BF16 * n
    assert forward["gradient"] == BF16 * max(facts["numels"])
    assert "optimizer_state" not in device.categories
