"""A plain torch.nn training loop that keeps an exponential moving average (EMA) of its weights, as
diffusers' `EMAModel` and timm's `ModelEmaV2` keep one: `python ema_loop.py [--made-by to|init|loop]`.

The EMA is a list of tensors the size of the model's weights, kept for the whole run and updated in
place after every `optimizer.step()` under `no_grad` (`lerp_` towards the weights, or `mul_` then
`add_`). Where its copy is made:

- `to`: diffusers' way (`train_unconditional.py`): the EMA is made on the host from the model's
  weights before they move, then its own `to(device)` moves the copies to the device;
- `init`: the copies are cloned from the weights on the device by the EMA's constructor;
- `loop`: the loop clones the weights after the first step.

Prints `facts {JSON}`: the model's parameter bytes (the EMA's bytes, one copy of them).
"""

import argparse
import json
from typing import Iterable, List

import torch
from torch import nn


class Ema:
    """An EMA of a model's weights, updated in place after each optimizer step."""

    def __init__(self, params: Iterable[torch.Tensor], decay: float = 0.999) -> None:
        self.decay = decay
        self.shadow: List[torch.Tensor] = [p.detach().clone() for p in params]

    def to(self, device: str) -> None:
        """Move the copies to `device` (a new tensor each, on another device)."""
        self.shadow = [s.to(device=device) for s in self.shadow]

    @torch.no_grad()
    def step(self, params: Iterable[torch.Tensor], foreach: bool) -> None:
        """shadow <- decay * shadow + (1 - decay) * weight, in place."""
        params = [p.detach() for p in params]
        if foreach:
            torch._foreach_lerp_(self.shadow, params, 1 - self.decay)
        else:
            for s, p in zip(self.shadow, params):
                s.mul_(self.decay).add_(p, alpha=1 - self.decay)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--made-by", choices=("to", "init", "loop"), default="to")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--foreach", action="store_true", help="update with _foreach_lerp_, not mul_ and add_")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    ema = None
    if args.made_by == "to":
        ema = Ema(model.parameters())  # on the host, before the model moves
        ema.to(args.device)
    model.to(args.device)
    if args.made_by == "init":
        ema = Ema(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        x = torch.randn(16, 256, device=args.device)
        y = torch.randint(0, 10, (16,), device=args.device)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if ema is None:
            with torch.no_grad():
                ema = Ema(model.parameters())
        else:
            ema.step(model.parameters(), args.foreach)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print("facts", json.dumps({"parameter_bytes": weights, "ema_bytes": sum(s.numel() * s.element_size()
                                                                             for s in ema.shadow)}))


if __name__ == "__main__":
    main()
