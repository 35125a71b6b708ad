"""A training loop that saves its checkpoint only when the evaluation's loss improves, as llama2.c's
and nanoGPT's `train.py` do: `python save_best.py [--out DIR] [--iters N] [--eval-interval K]`.

A small language model (embedding, two linear layers, a head) trains on sequences that count up
from a random token (learnable: its loss falls) with AdamW and gradient accumulation (the
micro-batches' losses summed as Python floats, as llama2.c's `lossf`). Every `--eval-interval`
iterations `estimate_loss()` averages `--eval-iters` losses per split, kept as `.item()`s in a CPU
tensor, as nanoGPT's does; the checkpoint (`ckpt.pt`: the model's and optimizer's state dicts, the
iteration and the best loss) is written when the validation loss is below the best so far, never at
iteration 0. A GPU's run evaluates at 0, K, 2K, ... and, its loss falling, saves at each but the first.

Prints one line per evaluation (`step N: train loss ..., val loss ...`, then `saved ckpt.pt` when it
saves) and `facts {JSON}`: the checkpoint's tensor bytes (the model's weights and AdamW's two moments
per weight, float32, its step counts and the best loss) and the iterations it saved at.
"""

import argparse
import json
import os

import torch
from torch import nn


class TinyLM(nn.Module):
    """Token embedding, a two-layer MLP and a head over the vocabulary: a language model in miniature."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        logits = self.head(h + self.mlp(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--eval-interval", type=int, default=2)
    parser.add_argument("--eval-iters", type=int, default=3)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab, width, batch, seq = 512, 64, 4, 32
    model = TinyLM(vocab, width).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def get_batch() -> tuple:
        # each sequence counts up from a random token: learnable, so a real run's loss falls
        start = torch.randint(0, vocab, (batch, 1), device=args.device)
        ids = (start + torch.arange(seq + 1, device=args.device)) % vocab
        return ids[:, :-1], ids[:, 1:]

    @torch.no_grad()
    def estimate_loss() -> dict:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)  # on the host, as nanoGPT keeps them
            for k in range(args.eval_iters):
                losses[k] = model(*get_batch()).item()
            out[split] = losses.mean()
        model.train()
        return out

    os.makedirs(args.out, exist_ok=True)
    best_val_loss = 1e9
    saved = []
    for iter_num in range(args.iters + 1):
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                  "iter_num": iter_num, "best_val_loss": best_val_loss}
                    torch.save(checkpoint, os.path.join(args.out, "ckpt.pt"))
                    saved.append(iter_num)
                    print("saved ckpt.pt")
        if iter_num == args.iters:
            break
        lossf = 0.0
        for _ in range(args.accum):
            loss = model(*get_batch()) / args.accum
            loss.backward()
            lossf += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # the checkpoint's tensors: the weights, AdamW's two moments of each (their size) and its step
    # counts (host tensors), and the best loss (a 0-dim host tensor: the mean of estimate_loss's)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    best = best_val_loss.numel() * best_val_loss.element_size() if isinstance(best_val_loss, torch.Tensor) else 0
    print("facts " + json.dumps({"weights_bytes": weights, "checkpoint_tensor_bytes": 3 * weights + steps + best,
                                 "saved_at": saved}))


if __name__ == "__main__":
    main()
