"""`step=single|foreach|fused`: the optimizer's update run in another of torch.optim's three forms,
its temporaries replaced by that form's (the optimizer and its state unchanged).

torch.optim updates the weights one tensor at a time (`foreach=False`, `_single_tensor_adam`), over
the whole list at once (`foreach=True`, the default on CUDA: `_multi_tensor_adam`), or in one fused
kernel per list (`fused=True`: `_fused_adamw_`). What each form makes at once beside the state, from
the update code of torch.optim (torch 2.13, `adam.py`, `sgd.py`, `adagrad.py`, `rmsprop.py`):

- single-tensor: a few tensors of the largest parameter's size (Adam's denominator is `sqrt(v)`
  then a division: two at once; Adagrad's and RMSprop's `sqrt(state)`: one; SGD: none);
- foreach: one list of every parameter's size where the update makes one (`_foreach_sqrt` of Adam's,
  Adagrad's, RMSprop's state, then in place; SGD: none);
- fused: nothing (the kernels update in place); only Adam, AdamW, SGD and Adagrad have it.
"""

from __future__ import annotations

import re
from typing import Optional

from memdiff.analyse.lifetimes import OPTIMIZER
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit, one_of
from memdiff.predict.whatif.optimizer import TEMPORARIES, peak_event, run_optimizer, step_temporaries
from memdiff.predict.whatif.run import Run
from memdiff.units import format_bytes

FORMS = ("single", "foreach", "fused")

# torch's single-tensor update functions (`_single_tensor_adam`).
SINGLE_FRAME = re.compile(r"\b_single_tensor_\w")


def run_form(run: Run, name: Optional[str], form: str) -> str:
    """The run's update form: foreach or single-tensor as its stacks show (`form`, run_optimizer's),
    fused where an optimizer whose other forms make temporaries made none in any step."""
    if form == "foreach":
        return form
    c = run.course
    mine = set(c.origin[run.phase == OPTIMIZER].tolist()) if len(c.origin) else set()
    if any(SINGLE_FRAME.search(f.name) for o in mine for f in c.origins[o]):
        return "single"
    made = TEMPORARIES.get(name or "", {})
    if "fused" in made and min(made["single"], made["foreach"]) > 0 and not step_temporaries(run).any():
        return "fused"
    return form


def apply_step(run: Run, edit: Edit, value: str) -> None:
    """Replace the run's update temporaries with those of the `value` form."""
    name, _, grads, form = run_optimizer(run)
    if not any(s.phase == OPTIMIZER for s in run.spans) or grads <= 0:
        raise CannotApply("the run shows no optimizer step: no update to run in another form")
    if name not in TEMPORARIES:
        raise CannotApply("the run's optimizer is not one of torch.optim's whose update forms are known "
                          f"({', '.join(TEMPORARIES)})")
    now = run_form(run, name, form)
    if now == value:
        raise CannotApply(f"the run's {name} step is already {value}")
    if value not in TEMPORARIES[name]:
        raise CannotApply(f"torch.optim's {name} has no {value} step")
    edit.size[step_temporaries(run)] = 0
    params = run.of("parameter")
    largest = int(edit.size[params].max()) if params.any() else 0
    count = TEMPORARIES[name][value]
    unit = grads if value == "foreach" else largest
    for span in run.spans:
        if span.phase == OPTIMIZER:
            at = peak_event(run, span)
            edit.add(at, at + 1, count * unit, "optimizer_temporary")
    made = ("nothing beside the state" if count == 0 else
            f"{count} temporar{'ies' if count != 1 else 'y'} of the size of "
            + (f"every parameter at once ({format_bytes(grads)})" if value == "foreach"
               else f"the largest parameter ({format_bytes(largest)})"))
    edit.assumptions.append(f"the {name} update run {value} (the run's: {now}) makes {made}, at the moment the "
                            "run's update peaked, in place of the run's own update temporaries")


RULE = ChangeRule("step", one_of("step", FORMS), lambda run, edit, value: apply_step(run, edit, str(value)),
                  excludes=(("optimizer", "the optimizer change keeps the run's update form; give step= alone"),))
