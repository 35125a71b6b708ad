"""`accumulate=K`: K micro-batches of 1/K the batch: what the forward and backward make scales by
1/K; from the second micro-batch on, the gradients of the earlier ones are held throughout.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD, FORWARD
from memdiff.errors import InputError
from memdiff.numbers import DIGITS
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit
from memdiff.predict.whatif.run import Run, step_index

MAX_ACCUMULATE = 1024


def apply_accumulate(run: Run, edit: Edit, value: str) -> None:
    """Split each step into `value` micro-batches."""
    k = int(value)
    c = run.course
    batch = run.of("activation", "temporary", "recomputed_activation", "autograd", "input") \
        & np.isin(run.phase, [FORWARD, BACKWARD]) & ~c.before
    edit.size[batch] = edit.size[batch] // k
    grads = np.flatnonzero(run.of("gradient") & (run.phase == BACKWARD))
    if not len(grads):
        raise CannotApply("the run shows no gradients made in the backward (category gradient) to accumulate")
    first_forward = {i: next((p.start_event for p in s.phases if p.phase == FORWARD), None)
                     for i, s in enumerate(run.steps)}
    step_of = step_index(run, c.start)
    for g in grads.tolist():
        f = first_forward.get(int(step_of[g]))
        if f is not None and c.start[g] > f:
            # The earlier micro-batches' gradient of this weight, held from the forward until the
            # backward adds the new one to it (both live at that moment).
            edit.add(f, int(c.start[g]) + 1, int(edit.size[g]), "gradient")
    edit.assumptions.append(
        f"{k} micro-batches of 1/{k} the batch: what the forward and backward make scales with the batch "
        f"(1/{k}; weight-sized temporaries of the backward do not, and are undercounted); the last micro-batch "
        "is replayed, the gradients of the earlier ones held from its forward on")


def check(value: Optional[str]) -> None:
    """The micro-batches per step: a whole number from 2 to MAX_ACCUMULATE."""
    if value is None or not DIGITS.fullmatch(value) or not 2 <= int(value) <= MAX_ACCUMULATE:
        raise InputError("--change", f"accumulate={value or ''}: give the micro-batches per step, "
                                     f"a whole number from 2 to {MAX_ACCUMULATE}")


RULE = ChangeRule("accumulate", check, lambda run, edit, value: apply_accumulate(run, edit, str(value)))
