"""`MemdiffCallback` for Lightning (the `lightning` package).

    from memdiff.recording.integrations.lightning import MemdiffCallback
    trainer = lightning.Trainer(max_steps=100, callbacks=[MemdiffCallback(steps="2:4")])

Every rank records optimizer steps 2 and 3 into `default_root_dir/memdiff/rank{RANK}.pickle` beside
the job's manifest, and each logging interval's peaks go to the module's loggers
(docs/integrations.md).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from lightning.pytorch import Callback

from memdiff.recording.capture import DEFAULT_WINDOW, StepWindow
from memdiff.recording.integrations.monitor import Monitor, checked_options


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


class MemdiffCallback(Callback):
    """Record a window of optimizer steps on every rank and log each interval's peak memory.

    `steps`: the window, `"START:STOP"` counted in optimizer steps from 0 with STOP left out
    (Lightning's `trainer.global_step` after a step is that step's STOP): recording starts once
    START optimizer steps have run and is written once STOP have; with `accumulate_grad_batches`
    a step is all its batches. `dirpath`: the job folder (default `default_root_dir/memdiff`).
    `log_peaks`: every `log_every_n_steps` optimizer steps, log the interval's peaks through the
    module's loggers (`logger.log_metrics`) and start a new interval.
    """

    def __init__(self, steps: "str | StepWindow" = DEFAULT_WINDOW, dirpath: Optional[str] = None,
                 log_peaks: bool = True, max_entries: int = 1_000_000, stacks: str = "all") -> None:
        self.steps = checked_options(steps, stacks)
        self.dirpath, self.log_peaks = dirpath, log_peaks
        self.max_entries, self.stacks = max_entries, stacks
        self.monitor: Optional[Monitor] = None
        self.logged_at = -1  # the optimizer step whose interval was logged last

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the rank's monitor: a window that starts at step 0 starts recording now."""
        folder = self.dirpath or os.path.join(trainer.default_root_dir, "memdiff")
        self.monitor = Monitor(folder, self.steps, rank=trainer.global_rank, world_size=trainer.world_size,
                               warn=_warn, max_entries=self.max_entries, stacks=self.stacks)
        self.monitor.begin(trainer.global_step)
        self.logged_at = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After a batch: when it ended an optimizer step, start or write the window, and log an
        interval that closes here."""
        if self.monitor is None:
            return
        step = trainer.global_step
        self.monitor.step_done(step)
        if self.log_peaks and step != self.logged_at and step % max(trainer.log_every_n_steps, 1) == 0:
            self.logged_at = step
            figures = self.monitor.peaks()
            for logger in pl_module.loggers:
                logger.log_metrics(figures, step=step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write a window cut short by the end of training, and the rank's status."""
        if self.monitor is not None:
            self.monitor.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed (an out-of-memory error, say): write what the window holds so far."""
        if self.monitor is not None:
            self.monitor.end(f"{type(exception).__name__}")
