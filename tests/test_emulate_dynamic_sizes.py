"""Ops whose output size depends on data, under `memdiff record --emulate`: a torch.library custom op
whose fake implementation asks `get_ctx().new_dynamic_size()` (PyTorch's documented pattern, and
torchvision's `nms`) follows the data-dependent policy of docs/emulate.md, and a torchvision
detection model trains a step."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
from conftest import required_or_skip

pytest.importorskip("torch")


def _emulate(tmp_path: Path, source: str) -> Tuple[subprocess.CompletedProcess, Dict[str, Any]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "run.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out), "--",
                           sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out, "rb") as f:
        return done, pickle.load(f)


KEEP_POSITIVE = """
    import torch


    @torch.library.custom_op("mylib::keep_positive", mutates_args=())
    def keep_positive(x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > 0).flatten()


    @keep_positive.register_fake
    def _(x):
        count = torch.library.get_ctx().new_dynamic_size()  # how many depends on the data
        return x.new_empty(count, dtype=torch.long)


    scores = torch.nn.Parameter(torch.randn(5000, device="cuda")).detach()  # a weight's numbers: no values
    kept = keep_positive(scores)
    labels = torch.arange(5000, device="cuda") % 4 - 1  # known values: 2,500 of them positive
    known = keep_positive(labels.float())
    print("sizes", tuple(kept.shape), tuple(known.shape), known[:3].tolist())
"""


@pytest.mark.slow
def test_a_custom_op_with_a_data_dependent_size_follows_the_policy(tmp_path: Path):
    """PyTorch runs such a fake on meta tensors only to raise (a 90-line traceback from torchvision's
    nms before). Known values run the op's CPU kernel: 2,500 positives of 5,000, the first at 2, 3, 6;
    values the model computed take every element: 5,000 indices, 40,000 B on the emulated GPU."""
    done, snapshot = _emulate(tmp_path, KEEP_POSITIVE)
    assert "sizes (5000,) (2500,) [2, 3, 6]" in done.stdout
    made = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"
            and any("keep_positive" in f["name"] for f in e["frames"])]
    assert made == [5000 * 8, 2500 * 8]


def _torchvision_imports() -> bool:
    # torchvision's PyPI build does not import beside torch's CPU build (its ops are missing): a
    # RuntimeError, which importorskip would not catch
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 (any failure to import means: not here)
        return False
    return True


FASTER_RCNN = """
    import torch
    import torchvision

    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=3, min_size=128, max_size=160).cuda()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = [torch.rand(3, 120, 160, device="cuda") for _ in range(2)]
    boxes = torch.tensor([[10.0, 20.0, 60.0, 90.0], [30.0, 30.0, 100.0, 110.0]], device="cuda")
    targets = [{"boxes": boxes, "labels": torch.tensor([1, 2], device="cuda")} for _ in range(2)]
    losses = model(images, targets)
    sum(losses.values()).backward()
    opt.step()
    print("losses", " ".join(sorted(losses)))
    print("parameters", sum(p.numel() * p.element_size() for p in model.parameters()))
"""


@pytest.mark.slow
def test_a_torchvision_detection_model_trains_a_step(tmp_path: Path):
    """Faster R-CNN's RPN and box heads run nms (batched_nms) and roi_align at every step: one
    training step of fasterrcnn_mobilenet_v3_large_fpn finishes (before: exit 1 with torchvision's
    meta-kernel traceback), its losses are torchvision's four, and the SGD momentum buffers the step
    made hold the model's parameters again, to the byte (75,839,016 B with 3 classes)."""
    if not _torchvision_imports():
        # .ci/run installs torchvision in its CUDA-build lane and runs this test there, where it must run
        required_or_skip("MEMDIFF_REQUIRE_TORCHVISION", "torchvision's PyPI build imports only beside torch's CUDA "
                                                        "build (CI runs this test in its CUDA-build lane)")
    done, snapshot = _emulate(tmp_path, FASTER_RCNN)
    lines = done.stdout.splitlines()
    assert lines[0] == "losses loss_box_reg loss_classifier loss_objectness loss_rpn_box_reg"
    parameters = int(lines[1].split()[1])
    momentum = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"
                and any(f["filename"].endswith("optim/sgd.py") for f in e["frames"])]
    assert sum(momentum) == parameters
