"""`memdiff record --emulate h100` against the real ResNet-50 window of ../shared/cuda-truth
(torchvision ResNet-50, 100 classes, batch 64, 224x224, SGD with momentum, three steps on an H100,
torch 2.11.0+cu130, cuDNN convolutions with benchmark off), recorded by that folder's families.py,
which runs here unmodified with our torchvision stand-in (tests/data/standins) on its path."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
from conftest import kept_write, missing_shared

ROOT = Path(__file__).resolve().parent.parent
TRUTH = ROOT.parent / "shared" / "cuda-truth"
STANDINS = ROOT / "tests" / "data" / "standins"
NAME = "resnet50-sgdm"


@pytest.fixture(scope="module")
def truth() -> Path:
    """The real windows' folder; skips (or fails, under MEMDIFF_REQUIRE_SHARED=1) when absent."""
    if not (TRUTH / f"{NAME}.facts.json").is_file():
        missing_shared(f"the real CUDA windows are not at {TRUTH} (they live in ../shared beside the project)")
    return TRUTH


@pytest.fixture(scope="module")
def facts(truth: Path) -> Dict[str, Any]:
    return json.loads((truth / f"{NAME}.facts.json").read_text())


def resnet50(num_classes: int) -> Any:
    """The stand-in's ResNet-50, loaded from its file (a `torchvision` on this process's path would
    make transformers, imported by other tests, take it for the real one)."""
    spec = importlib.util.spec_from_file_location("standin_torchvision_models", STANDINS / "torchvision" / "models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.resnet50(num_classes=num_classes)


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_stand_in_is_the_real_runs_network(torch, facts):
    # families.py counts parameters and buffers (BatchNorm's running statistics and counters):
    # the same bytes, and the same trainable bytes, are the same layers at the same widths.
    with torch.device("meta"):
        net = resnet50(num_classes=100)
    assert nbytes(list(net.parameters()) + list(net.buffers())) == facts["weights_bytes"]
    assert nbytes(p for p in net.parameters() if p.requires_grad) == facts["trainable_bytes"]


# -- cuDNN's workspaces, call by call ---------------------------------------------------------

OPS = {"at::native::raw_cudnn_convolution_forward_out": "fwd",
       "at::native::raw_cudnn_convolution_backward_input_out": "data",
       "at::native::raw_cudnn_convolution_backward_weight_out": "filter",
       "at::native::cudnn_convolution(": "fwd",
       "at::native::cudnn_convolution_backward_input(": "data",
       "at::native::cudnn_convolution_backward_weight(": "filter"}


def real_workspaces(path: Path) -> List[Tuple[str, int]]:
    """Each cuDNN operation of the real window in order, with the workspace run_conv_plan asked for
    (0 when it asked none): an operation's output, then the allocations under run_conv_plan."""
    with gzip.open(path) as f:
        trace = pickle.load(f)["device_traces"][0]
    calls: List[List[Any]] = []
    for event in trace:
        if event["action"] != "alloc":
            continue
        names = [frame["name"] for frame in event["frames"]]
        op = next((OPS[n] for name in names for n in OPS if name.startswith(n)), None)
        if op is None:
            continue
        if any(name.startswith("at::native::run_conv_plan") for name in names):
            assert calls[-1][0] == op and calls[-1][1] == 0  # one workspace per operation
            calls[-1][1] = event["size"]
        else:
            calls.append([op, 0])
    return [(op, size) for op, size in calls]


def emulated_calls(torch, steps: int) -> List[Tuple[str, Any, Any, Any, List[int], List[int], List[int], int]]:
    """The cuDNN operations of the same training steps in order, with their tensors, from the stand-in
    run on the meta device: (op, x, w, y, stride, padding, dilation, groups) of the forward geometry."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: List[Any] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if name == "aten::convolution":
                calls.append(("fwd", args[0], args[1], out, *args[3:6], args[8]))
            elif name == "aten::convolution_backward":
                for i, op in ((0, "data"), (1, "filter")):
                    if args[10][i]:
                        calls.append((op, args[1], args[2], args[0], *args[4:7], args[9]))
            return out

    with torch.device("meta"):
        net = resnet50(num_classes=100)
    with Log():
        for _ in range(steps):
            images = torch.randn(64, 3, 224, 224, device="meta")
            labels = torch.zeros(64, dtype=torch.long, device="meta")
            torch.nn.functional.cross_entropy(net(images), labels).backward()
    return calls


def test_each_convolution_asks_the_workspace_the_real_h100_run_asked(torch, truth):
    from memdiff.recording.emulate import conv

    real = real_workspaces(truth / f"{NAME}.pickle.gz")
    calls = emulated_calls(torch, 3)
    assert [op for op, _ in real] == [call[0] for call in calls]  # 53 forwards, 52 data and 53 filter per step
    h100 = SimpleNamespace(gpu=SimpleNamespace(major=9, minor=0))
    asked = [conv.workspace(h100, *call) for call in calls]
    assert asked == [size for _, size in real]
    # The same shapes with TF32 off run other engines, which no real run here shows: the estimates.
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        estimated = [conv.workspace(h100, *call) for call in calls]
    finally:
        torch.backends.cudnn.allow_tf32 = old
    assert estimated != asked and all(size >= 0 for size in estimated)


def test_vits_patch_embedding_asks_the_workspace_the_real_h100_run_asked(torch, truth):
    # The other convolution of ../shared/cuda-truth: ViT-Base's 16x16 patch embedding (batch 32), whose
    # images need no gradient, so each step runs a forward and a filter gradient.
    from memdiff.recording.emulate import conv

    real = real_workspaces(truth / "vit-base.pickle.gz")
    x, w = torch.empty(32, 3, 224, 224, device="meta"), torch.empty(768, 3, 16, 16, device="meta")
    y = torch.empty(32, 768, 14, 14, device="meta")
    h100 = SimpleNamespace(gpu=SimpleNamespace(major=9, minor=0))
    asked = [(op, conv.workspace(h100, op, x, w, y, [16, 16], [0, 0], [1, 1], 1)) for op in ("fwd", "filter")]
    assert real == asked * 3


@pytest.mark.parametrize("searching", [False, True])
def test_cudnn_benchmark_searches_at_a_shapes_first_convolution_only(torch, searching):
    # torch.backends.cudnn.benchmark: the first call of a shape runs cuDNN's find, which holds a
    # workspace of its own while it times the plans (Conv_v8.cpp's get_plans_from_find), then the
    # chosen plan runs with its workspace; later calls reuse the plan. Without it, no search.
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    old = torch.backends.cudnn.benchmark
    requests = []
    try:
        with emulating(Emulator(gpu("h100"))):
            torch.backends.cudnn.benchmark = searching
            conv = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False).cuda()
            x = torch.randn(8, 16, 32, 32, device="cuda")
            for _ in range(2):
                before = torch.cuda.memory_stats()["allocation.all.allocated"]
                conv(x)
                requests.append(torch.cuda.memory_stats()["allocation.all.allocated"] - before)
    finally:
        torch.backends.cudnn.benchmark = old
    # the output and the workspace, and the find's workspace at the first call under benchmark
    assert requests == ([3, 2] if searching else [2, 2])


def test_batch_norm_in_evaluation_saves_nothing_on_the_gpu_as_cudnn_does(torch):
    # cuDNN's batch norm (PyTorch's route on a GPU for this input) keeps no mean and deviation in
    # evaluation: the output is its only allocation. Training keeps both, for the backward.
    from memdiff.recording.emulate.gpus import gpu
    from memdiff.recording.emulate.runtime import Emulator
    from memdiff.recording.emulate.session import emulating

    with emulating(Emulator(gpu("h100"))):
        bn = torch.nn.BatchNorm2d(64).cuda()
        x = torch.randn(8, 64, 32, 32, device="cuda")
        output = x.numel() * 4
        before = torch.cuda.memory_allocated()
        y = bn.eval()(x)
        assert torch.cuda.memory_allocated() - before == output
        del y
        y = bn.train()(x.requires_grad_())
        assert torch.cuda.memory_allocated() - before == output + 2 * 512  # 64 floats each, in 512-byte blocks
        assert type(y.grad_fn).__name__ == "CudnnBatchNormBackward0"


# -- the whole run ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulated(tmp_path_factory, torch, truth) -> Path:
    pytest.importorskip("transformers")  # families.py imports it for every family
    folder = tmp_path_factory.mktemp("resnet")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": os.pathsep.join([str(STANDINS), str(ROOT)])}
    # the script's facts file is its own write: in the run's overlay, kept in folder/writes
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(folder / f"{NAME}.rec.pickle"), "--keep-writes", str(folder / "writes"), "--",
                           sys.executable, str(truth / "families.py"),
                           str(folder), NAME], env=env, capture_output=True, text=True, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_the_emulated_resnet50_has_the_real_h100_windows_memory(emulated, truth, facts):
    from memdiff import api

    real = api.summarize(truth / f"{NAME}.pickle.gz").devices[0]
    emu = api.summarize(emulated / f"{NAME}.pickle").devices[0]  # the script's own _dump_snapshot
    own = json.loads(kept_write(emulated / "writes", emulated / f"{NAME}.facts.json").read_text())
    assert abs(emu.peak_bytes / real.peak_bytes - 1) <= 0.005, (emu.peak_bytes, real.peak_bytes)
    assert abs(own["cuda_max_allocated_bytes"] / facts["cuda_max_allocated_bytes"] - 1) <= 0.005, \
        (own["cuda_max_allocated_bytes"], facts["cuda_max_allocated_bytes"])
    assert abs(emu.reserved_peak_bytes / real.reserved_peak_bytes - 1) <= 0.02, \
        (emu.reserved_peak_bytes, real.reserved_peak_bytes)
    assert emu.phase_at_peak == real.phase_at_peak
    for category in set(real.categories) | set(emu.categories):
        assert abs(emu.categories.get(category, 0) - real.categories.get(category, 0)) <= 2**20, category
    for fact in ("weights_bytes", "trainable_bytes", "optimizer_state_bytes"):
        assert own[fact] == facts[fact], fact
    # Batch norm runs cuDNN's kernels, as the real stacks name them, with the same allocations.
    for op in ("cudnn_batch_norm", "cudnn_batch_norm_backward"):
        real_sizes = allocations_in(truth / f"{NAME}.pickle.gz", op)
        assert real_sizes and allocations_in(emulated / f"{NAME}.pickle", op) == real_sizes, op


def allocations_in(path: Path, op: str) -> List[int]:
    """The sizes of a snapshot's allocations made inside aten op `op`, in order."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    frame = f"at::_ops::{op}::call"
    return [event["size"] for event in trace
            if event["action"] == "alloc" and any(fr["name"].startswith(frame) for fr in event["frames"])]
