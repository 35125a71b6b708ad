"""Lightning's `EarlyStopping` and `ModelCheckpoint` on a validation loss logged as a device tensor:
`python early_stop.py [--accelerator cuda|cpu] [--epochs N] [--patience P] [--top-k K] [--monitor val_acc]`.

A small regression model (y = the sum of 8 inputs) trains with SGD; its validation loss, logged with
`self.log("val_loss", ...)`, falls at every epoch. Both callbacks compare it on the device:
`EarlyStopping(monitor="val_loss", patience=P)` stops after P validations without improvement
(`current - min_delta < best`, two tensors), and `ModelCheckpoint(monitor="val_loss", save_top_k=K)`
saves when the loss beats the K-th best kept. With `--monitor val_acc` both watch, with `mode="max"`,
an accuracy logged beside it, `((pred - y).abs() < 1).float().mean()` (the share of predictions within 1
of the target), which rises at every epoch. A GPU's run, its loss falling, trains every epoch and
saves at each; the same script with `--accelerator cpu` is that run.

Prints `facts {JSON}`: the epochs run, the epoch EarlyStopping stopped at (0: it did not), the epochs
a checkpoint was saved at, and the checkpoints kept as the best K.
"""

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn


class Regression(L.LightningModule):
    """Two linear layers learning the sum of their inputs: the loss falls from epoch to epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple, index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple, index: int) -> None:
        x, y = batch
        pred = self.net(x)
        self.log("val_loss", nn.functional.mse_loss(pred, y))
        self.log("val_acc", ((pred - y).abs() < 1).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Saves(L.Callback):
    """The epochs a checkpoint was saved at."""

    def __init__(self) -> None:
        self.epochs: list = []

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        self.epochs.append(trainer.current_epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--monitor", choices=["val_loss", "val_acc"], default="val_loss")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    mode = "max" if args.monitor == "val_acc" else "min"
    stop = EarlyStopping(monitor=args.monitor, mode=mode, patience=args.patience)
    best = ModelCheckpoint(dirpath="ckpts", monitor=args.monitor, mode=mode, save_top_k=args.top_k, filename="{epoch}")
    saves = Saves()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_epochs=args.epochs, callbacks=[stop, best, saves],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Regression(), data, data)
    print("facts " + json.dumps({"epochs_run": trainer.current_epoch, "stopped_epoch": stop.stopped_epoch,
                                 "saved_at": saves.epochs,
                                 "best_k": sorted(os.path.basename(path) for path in best.best_k_models)}))


if __name__ == "__main__":
    main()
