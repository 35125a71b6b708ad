"""Patterns of public training scripts met in the sixth pass over them (docs/emulate.md, "A sixth pass"),
each as a small scenario of our own under `memdiff record --emulate h100`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memdiff import api

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # each test starts `memdiff record` (a child running torch)


# An EMA of the weights kept by a class of the training script itself, as many repositories do (an
# `EMA` class in train.py, YOLOv5's `ModelEMA` in utils/torch_utils.py): one class clones each weight
# into a dict, one deep-copies the model; both update in place after each optimizer step. The model is
# a class of the same file whose constructor makes its weights on the device: an `__init__` of
# train.py too, and its weights stay `parameter`. Prints the bytes of one copy of the model's weights.
EMA_IN_TRAIN_PY = """
import copy
import json

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(256, 512, device="cuda") / 16)
        self.w2 = nn.Parameter(torch.randn(512, 10, device="cuda") / 16)

    def forward(self, x):
        return nn.functional.gelu(x @ self.w1) @ self.w2


class EMA:
    def __init__(self, model, decay=0.999):
        self.decay = decay
        self.shadow = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model):
        for name, p in model.named_parameters():
            self.shadow[name].lerp_(p, 1 - self.decay)


class ModelEMA:
    def __init__(self, model, decay=0.999):
        self.ema = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.ema.parameters(), model.parameters()):
            e.mul_(self.decay).add_(p, alpha=1 - self.decay)


def main():
    torch.manual_seed(0)
    model = Net()
    ema, model_ema = EMA(model), ModelEMA(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        x = torch.randn(16, 256, device="cuda")
        nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,), device="cuda")).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        model_ema.update(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print("facts", json.dumps({"model_bytes": weights}))


main()
"""


def test_an_ema_class_in_the_training_script_reads_other_and_a_teacher_parameter(tmp_path, monkeypatch):
    # They read `parameter` before, as the model's weights made by its own `__init__` in the same file:
    # a trace names the constructor `__init__` only, never its class, and no rule but a file named for
    # EMA (ema.py, model_ema.py) told an EMA's copies from the weights.
    (tmp_path / "train.py").write_text(EMA_IN_TRAIN_PY)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", "--",
                           sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
    assert facts["model_bytes"] == (256 * 512 + 512 * 10) * 4  # the model's own sum, checked by hand
    monkeypatch.chdir(tmp_path)  # the class is read from train.py, found where the script ran
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["other"] == 2 * facts["model_bytes"]  # the clones and the deep copy
    assert device.categories["parameter"] == facts["model_bytes"]  # Net's own __init__: its weights
