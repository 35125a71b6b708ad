"""A classifier loop that saves on a better test accuracy, as kuangliu/pytorch-cifar and pytorch/examples
do: `python best_accuracy.py [--device cuda|cpu] [--epochs N] [--metric count|topk|mean|masked] [--plateau]`.

A small MLP learns which of 4 clusters a point lies in, with SGD, 8 training batches an epoch. After
each epoch it tests on 4 batches and works out its accuracy in one of three ways:

- `count` (kuangliu's `main.py`, pytorch/examples mnist's `test()`): `_, predicted = outputs.max(1)`,
  `correct += predicted.eq(targets).sum().item()`, `acc = 100. * correct / total`;
- `topk` (pytorch/examples imagenet's `accuracy()`): `topk` of the outputs, `eq` with the targets
  expanded, `correct[:1].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size)`, averaged
  over the batches on the host;
- `mean`: `(predicted == targets).float().mean()`, a rate, averaged on the device;
- `masked`: a quarter of the test labels are padding (-100, as a causal LM's), and five token accuracies
  count only the rest, each with its own best and saves: `and` (trl's `mean_token_accuracy`:
  `((predicted == targets) & mask).sum()` over `mask.sum()`), `where` (`torch.where(mask, predicted ==
  targets, False).sum()`), `mul` (`((predicted == targets).float() * mask.float()).sum()`), `index`
  (`(predicted == targets)[mask].float().mean()`, averaged on the device) and `select`
  (`(predicted == targets).masked_select(mask).float().mean()`, averaged on the host).

Then `if acc > best_acc: save; best_acc = acc` (best_acc = 0 first). With `--plateau` the test loss steps
`ReduceLROnPlateau(optimizer, patience=0)` (its default relative threshold, 1e-4) once an epoch.

A GPU's run, its accuracy rising and its loss falling, saves at every epoch and keeps its learning
rate; the same script with `--device cpu` is that run.

Prints `facts {JSON}`: the epochs it saved at, and the learning rates after each epoch (with
`--plateau`); with `--metric masked`, the epochs each of the five accuracies saved at (`masked`).
"""

import argparse
import json
import os

import torch
from torch import nn


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple = (1,)) -> list:
    """pytorch/examples imagenet's `accuracy()`: the accuracy over the k top predictions, in percent."""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--metric", choices=["count", "topk", "mean", "masked"], default="count")
    parser.add_argument("--plateau", action="store_true")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    torch.manual_seed(0)
    centres = torch.randn(4, 16) * 0.6
    labels = torch.randint(0, 4, (384,))
    points = centres[labels] + torch.randn(384, 16)
    x, y = points.to(args.device), labels.to(args.device)
    padded = torch.where(torch.arange(384) % 4 == 3, -100, labels).to(args.device)  # ignore_index's
    train, test = range(0, 256, 32), range(256, 384, 32)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0) if args.plateau else None
    os.makedirs(args.out, exist_ok=True)
    best_acc, saved, rates = 0.0, [], []
    patterns = ("and", "where", "mul", "index", "select")
    best_masked, saved_masked = {p: 0.0 for p in patterns}, {p: [] for p in patterns}
    for epoch in range(args.epochs):
        model.train()
        for i in train:
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        correct, total, test_loss, tops, means = 0, 0, 0.0, [], []
        sums, kept, indexed, selected = {"and": 0, "where": 0, "mul": 0.0}, 0, [], []
        with torch.no_grad():
            for i in test:
                outputs, targets = model(x[i:i + 32]), y[i:i + 32]
                test_loss += nn.functional.cross_entropy(outputs, targets).item()
                if args.metric == "count":
                    _, predicted = outputs.max(1)
                    total += targets.size(0)
                    correct += predicted.eq(targets).sum().item()
                elif args.metric == "topk":
                    tops.append(accuracy(outputs, targets)[0].item())
                elif args.metric == "masked":
                    predicted, targets = outputs.argmax(1), padded[i:i + 32]
                    mask = targets != -100
                    kept += mask.sum().item()
                    sums["and"] += ((predicted == targets) & mask).sum().item()
                    sums["where"] += torch.where(mask, predicted == targets, False).sum().item()
                    sums["mul"] += ((predicted == targets).float() * mask.float()).sum().item()
                    indexed.append((predicted == targets)[mask].float().mean())
                    selected.append((predicted == targets).masked_select(mask).float().mean().item())
                else:
                    means.append((outputs.argmax(1) == targets).float().mean())
        if args.metric == "count":
            acc = 100. * correct / total
        elif args.metric == "topk":
            acc = sum(tops) / len(tops)
        elif args.metric == "masked":
            accs = {**{p: 100. * sums[p] / kept for p in sums}, "index": torch.stack(indexed).mean(),
                    "select": sum(selected) / len(selected)}
            for p in patterns:
                if accs[p] > best_masked[p]:
                    torch.save(model.state_dict(), os.path.join(args.out, f"ckpt-{p}.pth"))
                    best_masked[p] = accs[p]
                    saved_masked[p].append(epoch)
            acc = accs["and"]
        else:
            acc = torch.stack(means).mean()
        if acc > best_acc:
            torch.save(model.state_dict(), os.path.join(args.out, "ckpt.pth"))
            best_acc = acc
            saved.append(epoch)
        if plateau is not None:
            plateau.step(test_loss / len(test))
            rates.append(optimizer.param_groups[0]["lr"])
    facts = {"saved_at": saved, "rates": rates}
    if args.metric == "masked":
        facts["masked"] = saved_masked
    print("facts " + json.dumps(facts))


if __name__ == "__main__":
    main()
