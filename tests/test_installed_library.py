"""A library installed outside a `site-packages` folder (`pip install --target DIR` put on PYTHONPATH, a
pex's unpacked wheels) is a library by pip's own mark, the `<name>-<version>.dist-info` beside its
package: its frames show the package path and the rules written for it apply (issue 58, docs/emulate.md).

The truth is pip's layout (what `pip install --target` writes: the package and its dist-info side by
side) and diffusers' `EMAModel.to`, whose copies are an EMA of the weights (`other`)."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT, alloc

from memdiff import api
from memdiff.read import installed
from memdiff.read.installed import InstalledLibraries

# diffusers' EMAModel, cut to its constructor and to() (diffusers/training_utils.py)
TRAINING_UTILS = '''import torch


class EMAModel:
    """Exponential Moving Average of models weights"""

    def __init__(self, parameters, decay=0.9999):
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay

    def to(self, device=None, dtype=None):
        self.shadow_params = [p.to(device=device, dtype=dtype) for p in self.shadow_params]
'''
TO_LINE, COPY_LINE = 11, 12  # def to / its list comprehension above


def _install(folder, dist_info=True):
    """diffusers laid out as `pip install --target folder` lays it out; its dist-info only with `dist_info`."""
    (folder / "diffusers").mkdir(parents=True)
    (folder / "diffusers" / "__init__.py").write_text("")
    (folder / "diffusers" / "training_utils.py").write_text(TRAINING_UTILS)
    if dist_info:
        (folder / "diffusers-0.36.0.dist-info").mkdir()
        (folder / "diffusers-0.36.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: diffusers\nVersion: 0.36.0\n")
    return folder / "diffusers" / "training_utils.py"


def _ema_to_snapshot(write_snapshot, lib: str):
    # train_unconditional.py: ema_model.to(accelerator.device) from the script, each copy made by
    # Tensor.to in EMAModel.to; the script's own frames as `memdiff record` writes them (relative:
    # it was started as `python train_unconditional.py`)
    frames = [{"filename": "??", "line": 0, "name": "at::_ops::_to_copy::call(at::Tensor const&, ...)"},
              {"filename": lib, "line": COPY_LINE, "name": "<listcomp>"},
              {"filename": lib, "line": TO_LINE, "name": "to"},
              {"filename": "train_unconditional.py", "line": 431, "name": "main"},
              {"filename": "train_unconditional.py", "line": 702, "name": "<module>"}]
    copies = [4 * 128 * 3 * 3 * 3, 4 * 128, 4 * 256 * 128 * 3 * 3]  # fp32 copies of three of a UNet's weights
    trace = [alloc(0x100000 * (i + 1), size, frames) for i, size in enumerate(copies)]
    device = api.summarize(write_snapshot({"segments": [], "device_traces": [trace]})).devices[0]
    return device, sum(copies)


def test_a_target_install_is_a_library_shown_by_its_package_path(tmp_path, write_snapshot):
    lib = _install(tmp_path / "pylib")
    device, copies = _ema_to_snapshot(write_snapshot, str(lib))
    assert device.categories == {"other": copies}
    (group,) = device.groups
    assert [f"{f.file}:{f.line}" for f in group.frames[1:3]] == [f"diffusers/training_utils.py:{COPY_LINE}",
                                                                f"diffusers/training_utils.py:{TO_LINE}"]


def test_the_same_files_without_a_dist_info_are_the_users_code(tmp_path, write_snapshot):
    lib = _install(tmp_path / "pylib", dist_info=False)
    device, copies = _ema_to_snapshot(write_snapshot, str(lib))
    (group,) = device.groups
    assert group.frames[1].file == "training_utils.py"  # cut to the user's common root, as before
    assert "other" not in device.categories


def test_a_file_not_on_this_machine_reads_as_it_always_did(tmp_path, write_snapshot):
    lib = _install(tmp_path / "pylib")
    lib.unlink()  # the dist-info is there; the frame's file is not (a snapshot read elsewhere)
    device, copies = _ema_to_snapshot(write_snapshot, str(lib))
    (group,) = device.groups
    assert group.frames[1].file == "training_utils.py"
    assert "other" not in device.categories


def test_an_ema_class_of_such_a_library_is_read_from_its_file(tmp_path, write_snapshot, monkeypatch):
    # no rule names this library's file: the EMA is known by its class, read from the file, which is
    # neither in the current folder nor under sys.path (the folder was on the recorded run's PYTHONPATH)
    (tmp_path / "pylib" / "averaging").mkdir(parents=True)
    (tmp_path / "pylib" / "averaging-1.2.0.dist-info").mkdir()
    lib = tmp_path / "pylib" / "averaging" / "core.py"
    lib.write_text(TRAINING_UTILS.replace("EMAModel", "ExponentialMovingAverage"))
    monkeypatch.chdir(tmp_path)
    device, copies = _ema_to_snapshot(write_snapshot, str(lib))
    assert device.categories == {"other": copies}
    assert device.groups[0].frames[1].file == "averaging/core.py"


def test_pips_marks_and_what_is_not_one(tmp_path):
    site = tmp_path / "deps"
    for package, mark, top_level in (("sklearn", "scikit_learn-1.5.0.dist-info", "sklearn\n"),
                                     ("jinja2", "Jinja2-3.1.4.dist-info", None),
                                     ("old", "old-1.0-py3.11.egg-info", None)):
        (site / package).mkdir(parents=True)
        (site / package / "base.py").write_text("")
        (site / mark).mkdir()
        if top_level:
            (site / mark / "top_level.txt").write_text(top_level)
    (site / "google" / "protobuf").mkdir(parents=True)  # protobuf 6's wheel: no top_level.txt, its RECORD
    (site / "google" / "protobuf" / "message.py").write_text("")
    (site / "protobuf-6.33.6.dist-info").mkdir()
    (site / "protobuf-6.33.6.dist-info" / "RECORD").write_text(
        "google/protobuf/__init__.py,sha256=mlMxrBwdiqMpuO1ZwsBLtXJAjVpO7dXMN8bIWbMbBcA,346\n"
        "google/protobuf/message.py,sha256=uJ5gbmT2Qk1wbMa0OETq4T3aRQA4AUQbhkPQhG4kxlM,15029\n"
        "protobuf-6.33.6.dist-info/RECORD,,\n")
    (site / "six.py").write_text("")  # a one-module distribution
    (site / "six-1.16.0.dist-info").mkdir()
    project = tmp_path / "proj"  # `pip install -e .` leaves `proj.egg-info`, no version: the user's own code
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "train.py").write_text("")
    (project / "proj.egg-info").mkdir()
    (site / "notes").mkdir()
    (site / "notes" / "x.py").write_text("")  # beside distributions, but of none of them
    libraries = InstalledLibraries()
    assert libraries.package_path(str(site / "sklearn" / "base.py")) == "sklearn/base.py"  # by top_level.txt
    assert libraries.package_path(str(site / "jinja2" / "base.py")) == "jinja2/base.py"  # Jinja2, by its name
    assert libraries.package_path(str(site / "google" / "protobuf" / "message.py")) == "google/protobuf/message.py"
    assert libraries.package_path(str(site / "old" / "base.py")) == "old/base.py"
    assert libraries.package_path(str(site / "six.py")) == "six.py"
    assert libraries.package_path(str(project / "proj" / "train.py")) is None
    assert libraries.package_path(str(site / "notes" / "x.py")) is None


def test_a_snapshot_naming_endless_files_is_asked_about_a_bounded_number(tmp_path, monkeypatch):
    lib = _install(tmp_path / "pylib")
    monkeypatch.setattr(installed, "MAX_FILES", 3)
    monkeypatch.setattr(installed, "MAX_FOLDERS", 64)
    looked = []
    libraries = InstalledLibraries()
    real = libraries._look_up
    monkeypatch.setattr(libraries, "_look_up", lambda path: looked.append(path) or real(path))
    for i in range(1_000):
        libraries.package_path(f"{tmp_path}/pylib/diffusers/m{i}.py")
    assert libraries.package_path(str(lib)) is None  # past the budget: read as before
    assert len(looked) == 3
    monkeypatch.setattr(installed, "MAX_ENTRIES_IN_ALL", 1)  # a folder of endless names: listed in part
    assert InstalledLibraries().package_path(str(lib)) is None


def _wheel(folder):
    """A wheel of the cut-down diffusers above, as a build backend writes one."""
    files = {"diffusers/__init__.py": "", "diffusers/training_utils.py": TRAINING_UTILS,
             "diffusers-0.36.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: diffusers\nVersion: 0.36.0\n",
             "diffusers-0.36.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("diffusers-0.36.0.dist-info/RECORD,,")
    path = folder / "diffusers-0.36.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("diffusers-0.36.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


SCRIPT = '''import json
import torch
from torch import nn
from diffusers.training_utils import EMAModel

model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10))
ema = EMAModel(model.parameters())  # on the host, then moved by its own to(), as train_unconditional.py does
model.to("cuda")
ema.to("cuda")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    nn.functional.cross_entropy(model(torch.randn(16, 256, device="cuda")),
                                torch.randint(0, 10, (16,), device="cuda")).backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        torch._foreach_lerp_(ema.shadow_params, [p.detach() for p in model.parameters()], 1e-3)
print("facts", json.dumps({"parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
'''


@pytest.mark.slow
def test_an_emulated_run_with_a_target_install_reads_its_ema_as_other(torch, tmp_path):
    # pip's own --target layout, from a wheel, then the script recorded under the emulator as issue 58's was
    target = tmp_path / "pylib"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--target", str(target), str(_wheel(tmp_path))], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (target / "diffusers-0.36.0.dist-info" / "RECORD").is_file() and not list(tmp_path.rglob("site-packages"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", "run.pickle", "--",
                           sys.executable, "train.py"], cwd=work, capture_output=True, text=True, timeout=300,
                          env={**env, "PYTHONPATH": f"{target}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr[-3000:]
    facts = next(s for s in done.stdout.splitlines() if s.startswith("facts "))
    weights = int(facts.split('"parameter_bytes": ')[1].rstrip("}"))
    device = api.summarize(work / "run.pickle").devices[0]
    assert device.categories["other"] == weights  # the EMA: one copy of the weights
    assert device.categories["parameter"] == weights
    ema = [g for g in device.groups if g.category == "other"]
    assert {f.file for g in ema for f in g.frames if f.file.endswith("training_utils.py")} == \
        {"diffusers/training_utils.py"}
