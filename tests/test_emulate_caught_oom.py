"""An out-of-memory error the script catches under `memdiff record --emulate` leaves nothing allocated
once the script drops its references, as `torch.cuda.memory_allocated()` reads on a GPU (issue 58):
raised in the forward, in the backward (autograd's engine) or in a foreach optimizer step. A failed
backward used to leave its queued nodes, and the graph behind them, in the calling thread's autograd
queue until that thread's next backward (failed_backward.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

CAUGHT = """
import gc, json, sys
import torch

MiB = 1 << 20
total = torch.cuda.get_device_properties(0).total_memory
layer = torch.nn.Linear(8, 8, device="cuda")  # cuBLAS's workspaces, kept for the process's life
layer(torch.randn(4, 8, device="cuda")).sum().backward()
del layer
gc.collect()
before = torch.cuda.memory_allocated()


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8192, 8192)  # 256 MiB each
        self.b = torch.nn.Linear(8192, 8192)

    def forward(self, x):
        return (self.a(x) + self.b(x)).sum()


def train(rows, where):
    with torch.device("cuda"):
        model = TwoBranches()
    where["weights"] = sum(p.nbytes for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(rows, 8192, device="cuda", requires_grad=True)
    where["phase"] = "forward"
    loss = model(x)
    where["phase"] = "backward"
    loss.backward()
    where["phase"] = "step"
    optimizer.step()
    where["phase"] = "done"


out = {}
# each limit lets the step run up to the phase it is named for (the model's activations, its two
# branches' gradients, AdamW's states)
for case, rows, limit in (("forward", 16384, 1300), ("backward", 4096, 1100), ("step", 16, 1400)):
    torch.cuda.set_per_process_memory_fraction(limit * MiB / total)
    where = {}
    try:
        train(rows, where)
    except torch.OutOfMemoryError:
        pass
    gc.collect()
    out[case] = [where["phase"], torch.cuda.memory_allocated() - before]
torch.cuda.set_per_process_memory_fraction(1100 * MiB / total)
try:
    train(4096, where)
except torch.OutOfMemoryError as exc:
    kept = exc  # its traceback's frames hold the model, the input and the graph, on a GPU too
gc.collect()
out["kept"] = [where["phase"], torch.cuda.memory_allocated() - before, where["weights"]]
del kept
gc.collect()
out["dropped"] = torch.cuda.memory_allocated() - before
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
def test_a_caught_out_of_memory_error_leaves_nothing_allocated_once_the_model_is_dropped(tmp_path: Path):
    script = tmp_path / "caught.py"
    script.write_text(CAUGHT)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o",
                           str(tmp_path / "run.pickle"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    # Each error was raised where it was meant to be, and once the script let go of everything the
    # allocator holds what it held before the model was built. Before, the backward's case left
    # 402,686,464 B (a branch's weight and input) until the next backward.
    assert out["forward"] == ["forward", 0]
    assert out["backward"] == ["backward", 0]
    assert out["step"] == ["step", 0]
    # What the script's own references keep (the exception's traceback) stays allocated until it goes.
    phase, held, weights = out["kept"]
    assert phase == "backward" and held >= weights
    assert out["dropped"] == 0
