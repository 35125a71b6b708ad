"""Patterns of public training scripts (pytorch/examples' vision scripts, PEFT's and accelerate's
examples) that drifted under `memdiff record --emulate`, each as a small scenario of our own: the
script exits 0 and the emulated GPU holds what PyTorch's own rules say it holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _emulate(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """`memdiff record --emulate h100 -o run.pickle -- python train.py` of a script written from `source`."""
    script = tmp_path / "train.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", "python", str(script)],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ))


def _said(out: str) -> dict:
    """The `name value` lines a scenario prints, as integers."""
    return {k: int(v) for k, v in (line.split() for line in out.splitlines() if line.count(" ") == 1)}


# A style-transfer loop's checkpoint: every few steps the model goes to the host for torch.save and
# back to the GPU, while the step's loss is still named (it is reassigned only by the next step).
CHECKPOINT_TO_HOST = """
import torch

model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, bias=False), torch.nn.ReLU(),
                            torch.nn.Conv2d(32, 3, 3, bias=False)).cuda()
optimizer = torch.optim.Adam(model.parameters())
held = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in model.parameters())
for step in range(3):
    optimizer.zero_grad()
    if step == 2:
        print("after_zero_grad", torch.cuda.memory_allocated())
    loss = model(torch.randn(2, 3, 32, 32, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    if step == 0:
        before = torch.cuda.memory_allocated()
        model.eval().cpu()
        torch.save(model.state_dict(), "checkpoint.pt")
        print("freed", before - torch.cuda.memory_allocated())
        model.cuda().train()
        print("back", torch.cuda.memory_allocated() - before)
print("held", held)
print("same", int(all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"]))))
"""


# FSDP1 (accelerate's FSDP examples) moves a CPU-built module's buffers as `buffer.data = buffer.to(device)`,
# keeping the buffer objects; a BERT's position ids are a small buffer whose values the emulator keeps.
BUFFER_MOVED = """
import torch

embeddings = torch.nn.Module()
embeddings.register_buffer("position_ids", torch.arange(512).expand((1, -1)), persistent=False)
buffer = embeddings.position_ids
before = torch.cuda.memory_allocated()
with torch.no_grad():
    buffer.data = buffer.to(torch.device("cuda", 0))
print("buffer_added", torch.cuda.memory_allocated() - before)
print("buffer_same", int(embeddings.position_ids is buffer))
print("buffer_on_gpu", int(buffer.is_cuda))
print("buffer_first_ids", sum(buffer[0, :5].tolist()))
"""


@pytest.fixture(scope="module")
def said(tmp_path_factory):
    """The scenarios above, one after the other in one script (one start of torch and memdiff for all),
    under `memdiff record --emulate h100 -o run.pickle -- python train.py`."""
    tmp_path = tmp_path_factory.mktemp("patterns3")
    done = _emulate(tmp_path, CHECKPOINT_TO_HOST + BUFFER_MOVED)
    assert done.returncode == 0, done.stderr[-3000:]
    return _said(done.stdout)


@pytest.mark.slow
def test_moving_a_model_to_the_host_frees_its_weights_and_gradients_while_a_loss_is_named(said):
    # pytorch/examples' fast_neural_style: `transformer.eval().cpu()` for a checkpoint kept the weights
    # and gradients on the GPU while the step's graph lived (the swap left them in the tensor its
    # AccumulateGrad holds), and `.cuda()` added a second copy: 6.41 MiB twice over through the next
    # step's forward, where its peak is. A GPU's `param.data = moved` frees both at once.
    held = said["held"]  # the weights' bytes, each rounded to the allocator's 512-byte blocks
    assert said["freed"] == 2 * held  # the weights and their gradients
    assert said["back"] == 0  # both come back, nothing more
    assert said["same"] == 1  # the optimizer steps the module's weights, as on the GPU
    # after zero_grad: the weights, Adam's two moments and the last step's loss (one 512-byte block)
    assert said["after_zero_grad"] == 3 * held + 512


@pytest.mark.slow
def test_a_buffer_whose_values_are_kept_moves_to_the_gpu_in_place_with_them(said):
    # accelerate's fsdp_with_peak_mem_tracking.py: FSDP1's `buffer.data = buffer.to(device_id)` of BERT's
    # position ids was refused ("incompatible tensor type"): the exchange of the host tensor for the
    # GPU's was made for Parameters, and the values the emulator keeps of a small tensor hold a weak
    # reference to it, which torch's swap_tensors refuses
    assert said["buffer_same"] == said["buffer_on_gpu"] == 1  # the object kept, now on the GPU, as set_data does
    assert said["buffer_added"] == 512 * 8  # its 512 int64 ids, each 8 bytes (a multiple of 512 already)
    assert said["buffer_first_ids"] == 0 + 1 + 2 + 3 + 4  # the values it had on the host
