"""A small GPT in plain PyTorch, trained with AdamW: the workload behind `memdiff demo` and the tests.

Flags reproduce what users meet: activation checkpointing (memory down) and the "abandoned
debug projections" bug (one extra Linear(n_embd, 4*n_embd) per layer, applied to every hidden
state and tied into the loss, so it costs parameters, optimizer state, activations and
backward buffers). Nothing is downloaded: the data are random tokens.

    python -m memdiff.examples.gpt --steps 2 --checkpoint
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class Config:
    """Model size and the two behaviours under test."""

    vocab_size: int = 2048
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    activation_checkpointing: bool = False
    debug_projections: bool = False


class SelfAttention(nn.Module):
    """Causal multi-head attention written out (matmul, mask, softmax) so its memory shows."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        mask = torch.tril(torch.ones(c.block_size, c.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, c.block_size, c.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    """Pre-norm transformer block; with debug projections, one more Linear whose output joins the loss."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = SelfAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(), nn.Linear(4 * c.n_embd, c.n_embd))
        self.debug = nn.Linear(c.n_embd, 4 * c.n_embd) if c.debug_projections else None

    def forward(self, x: torch.Tensor) -> tuple:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        # The bug: a projection someone added to inspect hidden states and never removed.
        probe = self.debug(x).pow(2).mean() if self.debug is not None else x.new_zeros(())
        return x, probe


class GPT(nn.Module):
    """Token and position embeddings, blocks, a language-model head."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        probes = []
        for block in self.blocks:
            if self.config.activation_checkpointing:
                x, probe = checkpoint(block, x, use_reentrant=False)
            else:
                x, probe = block(x)
            probes.append(probe)
        logits = self.head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + 1e-4 * torch.stack(probes).sum()


def train(c: Config, steps: int = 2, batch: int = 8, seq: int = 128, device: Optional[str] = None,
          seed: int = 0) -> List[float]:
    """Build the model and optimizer, then train `steps` steps on random tokens; returns the losses."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model = GPT(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, c.vocab_size, (batch, seq), device=dev)
        targets = torch.randint(0, c.vocab_size, (batch, seq), device=dev)
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def main(argv: Optional[List[str]] = None) -> None:
    """Command line for running the workload by hand or under `memdiff record`."""
    p = argparse.ArgumentParser(prog="python -m memdiff.examples.gpt", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block")
    p.add_argument("--debug-projections", action="store_true", help="add the abandoned debug projections")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    a = p.parse_args(argv)
    c = Config(n_layer=a.layers, n_embd=a.embd, block_size=max(256, a.seq),
               activation_checkpointing=a.checkpoint, debug_projections=a.debug_projections)
    for i, loss in enumerate(train(c, a.steps, a.batch, a.seq, a.device), 1):
        print(f"step {i}: loss {loss:.4f}")


if __name__ == "__main__":
    main()
