"""An EMA of the weights (diffusers' EMAModel, timm's ModelEmaV2, a loop's own), kept across steps and
updated in place after each optimizer step, reads `other`: no weight the training uses, no optimizer
state, no batch. The truth is the model's own parameter bytes (the EMA holds one copy of them) and,
on CPU captures, PyTorch's profiler's label for the copies (`unknown`, memdiff's `other`)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
from conftest import ROOT, alloc, py_frames

from memdiff import api

SCRIPT = ROOT / "tests" / "scenarios" / "ema_loop.py"


def _record(tmp_path, *flags: str):
    """(the scenario's facts, its device summary, its allocations) for `memdiff record [flags] -- ema_loop.py`."""
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", *flags[:-1], "-o", "run.pickle", "--",
                           sys.executable, str(SCRIPT), "--made-by", flags[-1]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
    with open(tmp_path / "run.pickle", "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    return facts, api.summarize(tmp_path / "run.pickle").devices[0], [e for e in trace if e["action"] == "alloc"]


@pytest.mark.parametrize("made_by, flags", [("to", ("--emulate", "h100")), ("init", ())],
                         ids=["moved-to-the-device-emulated", "cloned-on-cpu"])
def test_an_ema_copy_of_the_weights_is_other_not_a_batch_or_a_weight(torch, tmp_path, made_by, flags):
    facts, device, allocations = _record(tmp_path, *flags, made_by)
    assert facts["ema_bytes"] == facts["parameter_bytes"]
    assert device.categories["other"] == facts["ema_bytes"]
    assert device.categories["parameter"] == facts["parameter_bytes"]
    if not flags:  # the CPU route carries PyTorch's own label on each allocation: its EMA copies are unknown
        copies = {e.get("category") for e in allocations if "<listcomp>" in e["frames"][1]["name"]}
        assert copies == {"unknown"}


def test_diffusers_ema_model_moved_to_the_device_from_the_script_is_other(write_snapshot):
    # diffusers' train_unconditional.py: EMAModel(model.parameters()) on the host, then
    # ema_model.to(accelerator.device) from the script: each copy made by Tensor.to in EMAModel.to
    lib = "/venv/lib/python3.12/site-packages/diffusers/training_utils.py"
    frames = [{"filename": "??", "line": 0, "name": "at::_ops::_to_copy::call(at::Tensor const&, ...)"},
              {"filename": "??", "line": 0, "name": "at::_ops::to_dtype_layout::call(at::Tensor const&, ...)"},
              *py_frames(f"{lib}:526:<listcomp>", f"{lib}:525:to", "train_unconditional.py:431:main",
                         "train_unconditional.py:702:<module>")]
    copies = [4 * 128 * 3 * 3 * 3, 4 * 128, 4 * 256 * 128 * 3 * 3]  # fp32 copies of three of a UNet's weights
    trace = [alloc(0x100000 * (i + 1), size, frames) for i, size in enumerate(copies)]
    device = api.summarize(write_snapshot({"segments": [], "device_traces": [trace]})).devices[0]
    assert device.categories == {"other": sum(copies)}
