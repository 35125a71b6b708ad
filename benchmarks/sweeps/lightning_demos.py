"""Lightning's own demo models, each fit by Lightning's Trainer on one GPU for three steps (issue 58's
trainers that ship inside packages; docs/emulate.md, Sweeps):

    memdiff record --emulate h100 -o /tmp/demo.pickle -- python benchmarks/sweeps/lightning_demos.py transformer

`boring` is BoringModel with its BoringDataModule, as Lightning's own tests use them; `transformer` and
`lstm` are LightningTransformer and LightningLSTM, whose `prepare_data` reads WikiText-2 from
`data/wikitext-2.txt` under the working folder and downloads it there when it is missing (give the
file on a machine without the network: any text does, the batches here are random tokens). Prints
the steps trained, the weights' bytes and `torch.cuda.max_memory_allocated()`, and fails unless the
peak holds at least the weights.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.demos.lstm import LightningLSTM
from torch.utils.data import DataLoader, TensorDataset

STEPS = 3
VOCAB = 1000


def _tokens(length: int) -> DataLoader:
    """Batches of 8 random token sequences, each target its input shifted by one."""
    tokens = torch.randint(0, VOCAB, (64, length + 1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", choices=["boring", "transformer", "lstm"])
    demo = parser.parse_args().demo
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model: pl.LightningModule
    if demo == "boring":
        model = BoringModel()
        trainer.fit(model, datamodule=BoringDataModule())
    else:
        model = LightningTransformer(vocab_size=VOCAB) if demo == "transformer" else LightningLSTM(vocab_size=VOCAB)
        trainer.fit(model, _tokens(35 if demo == "transformer" else 20))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated()
    print(f"{demo}: trained {trainer.global_step} steps; weights {weights} B; max_memory_allocated {peak} B")
    if trainer.global_step != STEPS or peak < weights:
        raise SystemExit(f"{demo}: expected {STEPS} steps and a peak of at least the weights")


if __name__ == "__main__":
    main()
