"""cuDNN's RNNs under `memdiff record --emulate`: scripts of our own (an LSTM language model, a GRU,
a bidirectional batch-first LSTM) trained two steps run as on a GPU: one flat weight buffer made
at `.cuda()` holding the module's parameters, the forward's reserve kept into the backward, and
no trace of the per-step path a CPU build of torch takes without cuDNN."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent

LSTM_LM = """
import torch, torch.nn as nn

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        self.rnn = nn.LSTM(128, 256, 2, dropout=0.2)
        self.head = nn.Linear(256, 1000)

    def forward(self, x, h):
        out, h = self.rnn(self.emb(x), h)
        return self.head(out), h

model = LM().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
h = (torch.zeros(2, 20, 256, device="cuda"), torch.zeros(2, 20, 256, device="cuda"))
for step in range(2):
    x = torch.randint(0, 1000, (35, 20), device="cuda")
    y = torch.randint(0, 1000, (35, 20), device="cuda")
    h = tuple(t.detach() for t in h)
    logits, h = model(x, h)
    loss = nn.functional.cross_entropy(logits.view(-1, 1000), y.view(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
"""

GRU = """
import torch, torch.nn as nn

rnn = nn.GRU(64, 128, 1).cuda()
head = nn.Linear(128, 10).cuda()
opt = torch.optim.Adam(list(rnn.parameters()) + list(head.parameters()))
for step in range(2):
    x = torch.randn(50, 16, 64, device="cuda")
    out, h = rnn(x)
    loss = head(h[-1]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BILSTM = """
import torch, torch.nn as nn

rnn = nn.LSTM(32, 96, 2, batch_first=True, bidirectional=True).cuda()
head = nn.Linear(192, 5).cuda()
opt = torch.optim.AdamW(list(rnn.parameters()) + list(head.parameters()))
for step in range(2):
    x = torch.randn(8, 40, 32, device="cuda")
    out, _ = rnn(x)
    assert out.shape == (8, 40, 192)
    loss = head(out).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# name: (script, the RNN module as the script builds it, sequence length, batch, dropout in training)
CASES: Dict[str, Any] = {
    "lstm-lm": (LSTM_LM, lambda: torch.nn.LSTM(128, 256, 2, dropout=0.2), 35, 20, True),
    "gru": (GRU, lambda: torch.nn.GRU(64, 128, 1), 50, 16, False),
    "bilstm-batch-first": (BILSTM, lambda: torch.nn.LSTM(32, 96, 2, batch_first=True, bidirectional=True),
                           40, 8, False),
}


def _emulate(tmp_path: Path, source: str) -> Dict[str, Any]:
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "run.pickle"
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100", "-o", str(out), "--",
                           "python", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with open(out, "rb") as f:
        return pickle.load(f)


def _native(event: Dict[str, Any]) -> List[str]:
    return [f["name"] for f in event["frames"] if not f["filename"]]


def _under(event: Dict[str, Any], op: str) -> bool:
    return f"at::_ops::{op}::call" in _native(event)


def _miopen_reserve(module: Any, steps: int, batch: int, dropout: bool) -> int:
    """The reserve docs/emulate.md says the emulator gives (MIOpen's GetReserveSize), from the module's shape."""
    scale = {"LSTM": 6, "GRU": 4}[module.mode]
    n, h, layers, e = steps * batch, module.hidden_size, module.num_layers, 4
    units = (scale + 1 if module.mode == "LSTM" else 2 * scale) * layers * n * h * e
    if dropout:
        units += (layers - 1) * n * h * (e + 1)
    return units * (2 if module.bidirectional else 1)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_rnn_training_runs_on_cudnns_route_with_one_flat_weight_buffer_and_the_reserve_kept_for_the_backward(
        tmp_path, case):
    source, build, steps, batch, dropout = CASES[case]
    snapshot = _emulate(tmp_path, source)
    trace = snapshot["device_traces"][0]
    module = build()
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    # One flat weight buffer, made by flatten_parameters at .cuda(), of the module's parameter bytes,
    # kept through the training (the parameters are views of it); the copies .cuda() made of each
    # weight are freed before the first forward.
    flat = [i for i, e in enumerate(trace) if e["action"] == "alloc" and _under(e, "_cudnn_rnn_flatten_weight")]
    assert [trace[i]["size"] for i in flat] == [param_bytes]
    last_backward = max(i for i, e in enumerate(trace) if e["action"] == "alloc" and _under(e, "_cudnn_rnn_backward"))
    assert not [e for e in trace[flat[0]:last_backward] if e["action"] == "free_requested"
                and e["addr"] == trace[flat[0]]["addr"]]
    first_forward = min(i for i, e in enumerate(trace) if e["action"] == "alloc" and _under(e, "_cudnn_rnn"))
    sizes = {p.numel() * p.element_size() for p in module.parameters()}
    copies = {e["addr"] for e in trace[:flat[0]] if e["action"] == "alloc" and _under(e, "_to_copy")
              and e["size"] in sizes}
    freed = {e["addr"] for e in trace[flat[0]:first_forward] if e["action"] == "free_requested"}
    assert copies and copies <= freed

    # The forward runs cuDNN's kernel, never the CPU build's per-step cells.
    assert not [e for e in trace if e["action"] == "alloc" and
                any(re.search(r"::(lstm_cell|gru_cell|sigmoid|tanh)", n) for n in _native(e))]

    # The reserve: made by each training forward, freed by the backward that reads it, before the next step.
    reserve = _miopen_reserve(module, steps, batch, dropout)
    made = [i for i, e in enumerate(trace) if e["action"] == "alloc" and _under(e, "_cudnn_rnn")
            and e["size"] == reserve]
    assert len(made) == 2
    for step, i in enumerate(made):
        addr = trace[i]["addr"]
        freed = next(j for j in range(i + 1, len(trace)) if trace[j]["action"] == "free_requested"
                     and trace[j]["addr"] == addr)
        backward = [j for j in range(i, freed) if trace[j]["action"] == "alloc"
                    and _under(trace[j], "_cudnn_rnn_backward")]
        assert backward, "the reserve was freed before the backward ran"
        if step == 0:
            assert freed < made[1]


def test_docs_mark_the_rnn_sizes_that_are_estimates():
    """kernels.json's rnn sizes say which are estimates; docs/emulate.md says so to users."""
    rules = json.loads((ROOT / "memdiff/recording/emulate/kernels.json").read_text())["rnn"]
    assert "ESTIMATES" in rules["_comment"] and rules["calibrated"] == ""
    docs = (ROOT / "docs/emulate.md").read_text()
    section = docs[docs.index("## cuDNN RNNs"):]
    section = section[:section.index("\n## ", 3)]
    for what in ("reserve", "workspace", "dropout state"):
        line = next(line for line in section.splitlines() if line.startswith("|") and f"{what}" in line.lower())
        assert "estimate" in line.lower(), line
    assert "exact" in next(line for line in section.splitlines() if "flat weight" in line.lower()).lower()
