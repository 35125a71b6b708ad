"""`zero-grad=none|zeros`: gradients freed after each step, or kept (zeroed) from the first.
"""

from __future__ import annotations

import numpy as np

from memdiff.analyse.lifetimes import BACKWARD, OPTIMIZER
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit, one_of
from memdiff.predict.whatif.run import Run, step_index

ZERO_GRAD = ("none", "zeros")


def apply_zero_grad(run: Run, edit: Edit, value: str) -> None:
    """Free the gradients after each step (`none`) or keep them, zeroed, from the first (`zeros`)."""
    c = run.course
    grads = np.flatnonzero(run.of("gradient"))
    if not len(grads):
        raise CannotApply("the run shows no gradients (category gradient)")
    freed = c.end[grads] < c.events
    step_of = step_index(run, c.start)
    if value == "zeros":
        if not freed.any():
            if len(run.steps) <= 1:
                raise CannotApply("the run records one step and its gradients outlive it: whether zero_grad "
                                  "frees them shows only in the next step, which the trace does not hold")
            raise CannotApply("the run already keeps its gradients (zero_grad(set_to_none=False))")
        first = int(step_of[grads].min())
        # A gradient the backward frees is an earlier sum of a weight used twice (a tied embedding):
        # the backward's next contribution replaced it, as it does however zero_grad runs.
        replaced = np.array([run.end_run[k] < len(run.spans) and run.spans[run.end_run[k]].phase == BACKWARD
                             for k in grads.tolist()], dtype=bool)
        for k, gone in zip(grads.tolist(), replaced.tolist()):
            if step_of[k] != first:
                edit.size[k] = 0
            elif not gone:
                edit.end[k] = c.events
        edit.assumptions.append("the first step's gradients are kept and zeroed in place from then on")
        return
    if freed.all():
        raise CannotApply("the run already frees its gradients (zero_grad(set_to_none=True))")
    if len(run.steps) <= 1:
        raise CannotApply("the run records one step and its gradients outlive it: whether zero_grad "
                          "frees them shows only in the next step, which the trace does not hold")
    # Zeroed in place, a gradient lives on between steps: as new versions made by zero_() in the
    # optimizer step (the profiler's record), or as one allocation outliving its step (CUDA's).
    # Set to None, neither exists: a gradient lives from its backward to its step's zero_grad.
    zeroed = grads[run.phase[grads] == OPTIMIZER]
    edit.size[zeroed] = 0
    windows = []  # per step: (first gradient made in its backward, end of its last optimizer run)
    made = grads[run.phase[grads] == BACKWARD]
    for s in run.steps:
        back = [p for p in s.phases if p.phase == BACKWARD]
        opt = [p for p in s.phases if p.phase == OPTIMIZER]
        if not back or not opt:
            continue
        mine = made[(c.start[made] >= back[0].start_event) & (c.start[made] <= back[-1].end_event)]
        first = int(c.start[mine].min()) if len(mine) else back[0].start_event
        windows.append((first, opt[-1].end_event + 1))
    for k in made.tolist():
        start, end = int(c.start[k]), int(c.end[k])
        pieces = [(max(start, w0), min(end, w1)) for w0, w1 in windows if min(end, w1) > max(start, w0)]
        if len(pieces) == 1 and pieces[0] == (start, end):
            continue
        size = int(edit.size[k])
        edit.size[k] = 0
        for p0, p1 in pieces:
            edit.add(p0, p1, size, "gradient")
    edit.assumptions.append("gradients live from the backward that makes them to their step's zero_grad; a "
                            "gradient kept across steps is made again from the first gradient of each backward")


RULE = ChangeRule("zero-grad", one_of("zero-grad", ZERO_GRAD),
                  lambda run, edit, value: apply_zero_grad(run, edit, str(value)))
