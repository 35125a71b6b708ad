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
# into a dict, one deep-copies the model; both update in place after each optimizer step. A frozen
# teacher deep-copied by a class of the same file is a weight the training uses (its forward runs),
# and stays `parameter`. Prints the parameter bytes of one copy of the model (numel x element size).
EMA_IN_TRAIN_PY = """
import copy
import json

import torch
from torch import nn


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


class Distiller:
    def __init__(self, model):
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    ema, model_ema, distiller = EMA(model), ModelEMA(model), Distiller(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        x = torch.randn(16, 256, device="cuda")
        with torch.no_grad():
            target = distiller.teacher(x).softmax(-1)
        nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        model_ema.update(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print("facts", json.dumps({"model_bytes": weights}))


main()
"""


def test_an_ema_class_in_the_training_script_reads_other_and_a_teacher_parameter(tmp_path, monkeypatch):
    # They read `parameter` before: a trace names the constructor `__init__` only, never its class, and
    # no rule but a file named for EMA (ema.py, model_ema.py) told an EMA's copies from the weights.
    (tmp_path / "train.py").write_text(EMA_IN_TRAIN_PY)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", "--",
                           sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(next(s for s in done.stdout.splitlines() if s.startswith("facts "))[len("facts "):])
    # 256 x 512 + 512 + 512 x 10 + 10 weights of 4 bytes: the model's own sum, checked by hand
    assert facts["model_bytes"] == (256 * 512 + 512 + 512 * 10 + 10) * 4
    monkeypatch.chdir(tmp_path)  # the class is read from train.py, found where the script ran
    device = api.summarize(tmp_path / "run.pickle").devices[0]
    assert device.categories["other"] == 2 * facts["model_bytes"]  # the clones and the deep copy
    assert device.categories["parameter"] == 2 * facts["model_bytes"]  # the model and the teacher
