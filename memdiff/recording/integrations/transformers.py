"""`MemdiffCallback` for the Hugging Face `Trainer` (and what runs on it, such as TRL's trainers).

    from memdiff.recording.integrations.transformers import MemdiffCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[MemdiffCallback(steps="2:4")])

Every rank records optimizer steps 2 and 3 into `output_dir/memdiff/rank{RANK}.pickle` beside the
job's manifest, and each logging interval's peaks go into the Trainer's logs (docs/integrations.md).
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging

from memdiff.recording.capture import DEFAULT_WINDOW, StepWindow
from memdiff.recording.integrations.monitor import Monitor, checked_options

logger = logging.get_logger(__name__)


class MemdiffCallback(TrainerCallback):
    """Record a window of optimizer steps on every rank and log each interval's peak memory.

    `steps`: the window, `"START:STOP"` counted in optimizer steps from 0 with STOP left out (the
    Trainer's `global_step` after a step is that step's STOP): recording starts once START steps
    have run and is written once STOP have. With gradient accumulation a step is an optimizer
    step, all its micro-batches. `output_dir`: the job folder (default `args.output_dir/memdiff`).
    `log_peaks`: add each logging interval's peaks to the Trainer's logs and start a new interval.
    """

    def __init__(self, steps: "str | StepWindow" = DEFAULT_WINDOW, output_dir: Optional[str] = None,
                 log_peaks: bool = True, max_entries: int = 1_000_000, stacks: str = "all") -> None:
        self.steps = checked_options(steps, stacks)
        self.output_dir, self.log_peaks = output_dir, log_peaks
        self.max_entries, self.stacks = max_entries, stacks
        self.monitor: Optional[Monitor] = None

    def _run_first(self) -> None:
        """Move this callback to the front of the Trainer's list.

        The Trainer calls its callbacks in order, reporting integrations (TensorBoard, W&B) before
        the ones passed in `callbacks=`, and hands each `on_log` the same dict: only a callback
        ahead of them can add keys they log. The Trainer offers no public way to place a callback,
        so the handler is found as the caller of this event; failing that, the peaks reach the
        console and `state.log_history` only."""
        frame: Optional[FrameType] = sys._getframe(1)
        for _ in range(4):
            if frame is None:
                return
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and self in handler.callbacks:
                handler.callbacks.remove(self)
                handler.callbacks.insert(0, self)
                return
            frame = frame.f_back

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Run ahead of the reporting callbacks (see _run_first)."""
        self._run_first()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the rank's monitor: a window that starts at step 0 starts recording now."""
        self._run_first()  # a callback added with trainer.add_callback() missed on_init_end
        folder = self.output_dir or os.path.join(args.output_dir, "memdiff")
        self.monitor = Monitor(folder, self.steps, rank=args.process_index, world_size=args.world_size,
                               warn=logger.warning, max_entries=self.max_entries, stacks=self.stacks)
        self.monitor.begin(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After an optimizer step (and its micro-batches): start or write the window."""
        if self.monitor is not None:
            self.monitor.step_done(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """Add the interval's peaks to the logs every later callback reports, and to log_history."""
        if self.monitor is None or not self.log_peaks or logs is None or "loss" not in logs:
            return  # evaluation logs and the closing train_runtime line are not training intervals
        figures = self.monitor.peaks()
        logs.update(figures)
        # Trainer.log stored a copy of the logs before calling the callbacks.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write a window cut short by the end of training, and the rank's status."""
        if self.monitor is not None:
            self.monitor.end()
