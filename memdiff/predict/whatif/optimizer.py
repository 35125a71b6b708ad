"""`optimizer=NAME`: the run's optimizer state scaled to NAME's tensors per parameter, its step
temporaries replaced by NAME's, in the run's form (single-tensor: a few of the largest
parameter's size; foreach: a few of every parameter's). Also what the run's optimizer is.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

import numpy as np

from memdiff.analyse.lifetimes import OPTIMIZER
from memdiff.model import PhaseSpan
from memdiff.predict.whatif.edit import CannotApply, ChangeRule, Edit, one_of
from memdiff.predict.whatif.run import SCALAR_BYTES, Run, peak_of_set
from memdiff.units import format_bytes

# Per optimizer: (state tensors per parameter, the update's temporaries in its single-tensor form).
# From each optimizer's update in torch.optim: Adam's denominator is sqrt(v) then a division
# (two tensors of the parameter's size at once); AMSGrad's max is taken in place; Adagrad's
# and RMSprop's std is sqrt(state) + eps in place (one); SGD updates in place (none);
# Adafactor's state is a row and a column per matrix (counted as none; a vector's full variance
# is small) and its update's one full-size tensor is the variance estimate row_var @ col_var.
OPTIMIZERS: Dict[str, Tuple[int, int]] = {
    "sgd": (0, 0), "sgd-momentum": (1, 0), "adam": (2, 2), "adamw": (2, 2), "adamw-amsgrad": (3, 2),
    "adagrad": (1, 1), "rmsprop": (1, 1), "adafactor": (0, 1)}

# The update's temporaries per form (step=): single-tensor as above, in units of the largest
# parameter; foreach in units of every parameter at once, where the multi-tensor update makes one
# list (`_foreach_sqrt` of Adam's, Adagrad's and RMSprop's state, then in place: torch 2.13's
# `_multi_tensor_adam` and its siblings); fused none (the kernels update in place), for the
# optimizers that have it (Adam, AdamW, SGD, Adagrad).
TEMPORARIES: Dict[str, Dict[str, int]] = {
    name: {"single": temps, "foreach": min(temps, 1),
           **({"fused": 0} if name in ("sgd", "sgd-momentum", "adam", "adamw", "adamw-amsgrad", "adagrad") else {})}
    for name, (_, temps) in OPTIMIZERS.items()}


# torch.optim's optimizers, by their class names lowercased (`torch.optim.RMSprop`: rmsprop), which
# are also the names of the files their update code lives in (Adafactor's: `_adafactor.py`).
TORCH_OPTIMIZERS = frozenset(("adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "asgd", "lbfgs",
                              "nadam", "radam", "rmsprop", "rprop", "sgd", "sparseadam", "sparse_adam"))


# The scope torch.optim opens around every step (`Optimizer.step#AdamW.step`): the class's name.
STEP_SCOPE = re.compile(r"^Optimizer\.step#(\w{1,64})\.step$")


# A frame of torch.optim's code (the file in CUDA frames, in the name of the profiler's:
# `torch/optim/adam.py(345): _single_tensor_adam`).
OPTIM_FILE = re.compile(r"(?:^|/)torch/optim/(\w{1,64})\.py\b")


# torch's multi-tensor update: its functions and the foreach ops they call (not a user's `my_foreach_`).
FOREACH_FRAME = re.compile(r"\b_multi_tensor_\w|\b_foreach_\w")


def run_optimizer(run: Run) -> Tuple[Optional[str], int, int, str]:
    """(the run's optimizer name or None, state tensors per parameter, trainable parameter bytes,
    the update's form: "single" or "foreach").

    The name comes from torch.optim's own record: the class its step scope names
    (`Optimizer.step#AdamW.step`), else the file of torch.optim whose code made the most bytes
    (`torch/optim/rmsprop.py`); the state's bytes per parameter tell SGD from SGD with momentum,
    AdamW from AMSGrad, and name an optimizer torch.optim does not (one state tensor a weight:
    SGD with momentum's memory). The user's files, functions and scopes are never read for it."""
    c = run.course
    state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
    stepped = any(s.phase == OPTIMIZER for s in run.spans)
    grads = _grad_bytes(run)
    if grads <= 0:
        return None, 0, 0, _update_form(run)
    per = int(round(_per_step_state(run, state) / grads))
    base = next((m.group(1).lower() for m in map(STEP_SCOPE.match, c.scopes) if m
                 and m.group(1).lower() in TORCH_OPTIMIZERS), None) or _optimizer_code(run)
    name: Optional[str]
    if base in ("adam", "adamw"):
        name = "adamw-amsgrad" if per == 3 else base
    elif base == "sgd":
        name = "sgd-momentum" if per >= 1 else "sgd"
    elif base is not None:
        name = base
    elif per == 1:
        name = "sgd-momentum"
    elif per == 0 and stepped:
        name = "sgd"
    else:
        name = None
    return name, per, grads, _update_form(run)


def _optimizer_code(run: Run) -> Optional[str]:
    """The torch.optim optimizer whose update code (its file in torch/optim) made the most bytes."""
    c = run.course
    if not c.origins or not len(c.origin):
        return None
    made = np.bincount(c.origin, weights=c.size.astype(np.float64), minlength=len(c.origins))
    held: Dict[str, float] = {}
    for o, frames in enumerate(c.origins):
        # The innermost frame in an optimizer's own file (not optimizer.py's wrappers around it).
        stems = (m.group(1).lstrip("_") for f in frames for m in [OPTIM_FILE.search(f"{f.file}:{f.name}")] if m)
        found = next((stem for stem in stems if stem in TORCH_OPTIMIZERS), None)
        if found is not None:
            held[found] = held.get(found, 0.0) + float(made[o])
    return max(held, key=lambda k: (held[k], k)) if held else None


def _update_form(run: Run) -> str:
    """"foreach" when the optimizer step ran torch's multi-tensor update (`_multi_tensor_adam`,
    `_foreach_sqrt` ops), else "single"."""
    c = run.course
    if not c.origins or not len(c.origin):
        return "single"
    mine = np.unique(c.origin[run.phase == OPTIMIZER]).tolist()
    return "foreach" if any(FOREACH_FRAME.search(f.name) for o in mine for f in c.origins[o]) else "single"


def _grad_bytes(run: Run) -> int:
    """Trainable parameter bytes: the most gradient bytes live at once (without gradients in the
    run, the parameters' when it holds optimizer state, else 0)."""
    c = run.course
    grads = np.flatnonzero(run.of("gradient"))
    if not len(grads):
        state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
        return 0 if not state.any() else peak_of_set(c, np.flatnonzero(run.of("parameter")))
    return peak_of_set(c, grads)


def _per_step_state(run: Run, state: np.ndarray) -> int:
    """Optimizer state bytes (one-element tensors aside) live at once: an in-place update makes
    a new version of each state tensor every step, so its allocations are not summed."""
    return peak_of_set(run.course, np.flatnonzero(state))


def apply_optimizer(run: Run, edit: Edit, value: str) -> None:
    """Replace the run's optimizer with `value`'s state and step temporaries."""
    c = run.course
    name, per, grads, form = run_optimizer(run)
    if not any(s.phase == OPTIMIZER for s in run.spans) or grads <= 0:
        raise CannotApply("the run shows no optimizer step (no optimizer state, no update's temporaries): "
                          "nothing to replace")
    if name == value or {name, value} == {"adam", "adamw"}:
        raise CannotApply(f"the run already uses {name}" + (" (Adam and AdamW keep the same memory)"
                                                             if name in ("adam", "adamw") else ""))
    want_state = OPTIMIZERS[value][0]
    want_temps = TEMPORARIES[value]["foreach" if form == "foreach" else "single"]
    # What an earlier rule (half-precision weights) did to the parameters, the new state and
    # temporaries follow.
    params_before = int(c.size[run.of("parameter")].sum())
    scale = int(edit.size[run.of("parameter")].sum()) / params_before if params_before else 1.0
    state = run.of("optimizer_state") & (c.size > SCALAR_BYTES)
    if per > 0 and state.any():
        edit.size[state] = (edit.size[state] * want_state) // per
    elif want_state:
        opt_runs = [s for s in run.spans if s.phase == OPTIMIZER]
        first = opt_runs[0]
        at = peak_event(run, first)
        edit.add(at, c.events, int(grads * scale) * want_state, "optimizer_state")
        edit.assumptions.append("the state is made in the first optimizer step, as torch.optim does, and never freed")
    edit.size[step_temporaries(run)] = 0
    params = run.of("parameter")
    largest = int(edit.size[params].max()) if params.any() else 0
    unit = int(grads * scale) if form == "foreach" else largest
    for span in run.spans:
        if span.phase == OPTIMIZER:
            edit.add(peak_event(run, span), peak_event(run, span) + 1, want_temps * unit, "optimizer_temporary")
    edit.assumptions.append(
        f"{value} keeps {want_state} state tensor{'s' if want_state != 1 else ''} per parameter "
        f"(the run's {_shown_optimizer(name)} keeps {per}); its update makes {want_temps} temporar"
        f"{'ies' if want_temps != 1 else 'y'} of the size of "
        + ("every parameter at once (foreach, as the run)" if form == "foreach"
           else "the largest parameter (single-tensor, as the run)")
        + f", at the moment the run's update peaked; trainable weights {format_bytes(grads)}")


def _shown_optimizer(name: Optional[str]) -> str:
    # torch's AdamW runs Adam's update code: the stacks name adam.py for both
    return {None: "optimizer", "adam": "Adam or AdamW"}.get(name, name or "optimizer")


def step_temporaries(run: Run) -> np.ndarray:
    """The update's temporaries: what is made and freed inside one optimizer phase run."""
    return (run.of("optimizer_temporary", "temporary", "autograd", "other", "activation") & (run.phase == OPTIMIZER)
            & (run.end_run == run.born_run))


def peak_event(run: Run, span: PhaseSpan) -> int:
    """The event of the run's highest memory within `span`."""
    totals = run.base.totals
    window = totals[span.start_event: span.end_event + 1]
    return span.start_event + (int(window.argmax()) if len(window) else 0)


RULE = ChangeRule("optimizer", one_of("optimizer", tuple(OPTIMIZERS)),
                  lambda run, edit, value: apply_optimizer(run, edit, str(value)))
