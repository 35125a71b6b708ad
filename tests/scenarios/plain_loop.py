"""A plain PyTorch training loop with no memdiff in it: `python plain_loop.py STEPS`."""

import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(int(sys.argv[1])):
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
