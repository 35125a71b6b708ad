"""A plain loop that keeps its best validation loss on the device: `python best_on_device.py [--device
cuda|cpu] [--epochs N] [--patience P] [--plateau]`.

A small regression model (y = the sum of 8 inputs) trains with SGD, four batches an epoch. After each
epoch its validation loss, a device tensor, is compared with the best so far, kept as a device tensor
too (`best = torch.tensor(float("inf"), device=...)`): `if val < best: best = val; torch.save(...)`,
else one more epoch without improvement, and the loop stops after P of them. A GPU's run, its loss
falling, improves at every epoch, saves at each and never stops early; the same script with
`--device cpu` is that run. With `--plateau` the validation loss also steps
`ReduceLROnPlateau(optimizer, patience=0)` (its default relative threshold, 1e-4) after each epoch: a
GPU's run, its loss falling by more than that, keeps its learning rate.

Prints `facts {JSON}`: the epochs run, the epochs it saved at, the epoch it stopped at (null: it did
not), whether the best as read back equals the last loss saved (two reads of one tensor), and with
`--plateau` the learning rate after each epoch.
"""

import argparse
import json
import os

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--out", default="out")
    parser.add_argument("--plateau", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 8, device=args.device)
    y = x.sum(1, keepdim=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    os.makedirs(args.out, exist_ok=True)
    best = torch.tensor(float("inf"), device=args.device)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0) if args.plateau else None
    best_read, saved, stopped, waited, rates = None, [], None, 0, []
    for epoch in range(args.epochs):
        for i in range(4):
            loss = nn.functional.mse_loss(model(x[16 * i:16 * (i + 1)]), y[16 * i:16 * (i + 1)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            val = nn.functional.mse_loss(model(x), y)
        if plateau is not None:
            plateau.step(val)
            rates.append(optimizer.param_groups[0]["lr"])
        if val < best:
            best, waited = val, 0
            best_read = val.item()
            torch.save(model.state_dict(), os.path.join(args.out, "best.pt"))
            saved.append(epoch)
        else:
            waited += 1
            if waited >= args.patience:
                stopped = epoch
                break
    print("facts " + json.dumps({"epochs_run": epoch + 1, "saved_at": saved, "stopped_at": stopped,
                                 "best_reads_as_saved": best.item() == best_read,
                                 **({"rates": rates} if plateau is not None else {})}))


if __name__ == "__main__":
    main()
