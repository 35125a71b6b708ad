"""A small CUDA training loop whose memory grows with its batch: an MLP of WIDTH x WIDTH layers trained
with Adam, for `memdiff fit` (tests/test_fit.py, docs/fit.md).

    python tests/scenarios/fit_mlp.py --batch-size 64 --width 8192 --layers 4 --seq 128
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--seq", type=int, default=1, help="tokens per sample: each layer's activations scale by it")
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--fail", action="store_true", help="raise an error that is not out of memory")
parser.add_argument("--catch-oom", action="store_true",
                    help="catch torch.OutOfMemoryError and exit 0, as a script's own batch-size finder does")
args = parser.parse_args()

if args.fail:
    raise ValueError("the data set is missing")


def train() -> None:
    """Build the model and train it for --steps steps."""
    model = nn.Sequential(*[layer for _ in range(args.layers)
                            for layer in (nn.Linear(args.width, args.width), nn.ReLU())]).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, args.seq, args.width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


try:
    train()
except torch.OutOfMemoryError:
    if not args.catch_oom:
        raise
    print(f"out of memory at batch {args.batch_size}: skipped")
else:
    print(f"trained {args.steps} steps at batch {args.batch_size}")
