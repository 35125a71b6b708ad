"""`optimizer=NAME`: the torch.optim optimizer the script builds built as NAME instead, with the same
parameters (or parameter groups) and learning rate; `step=single|foreach|fused`: built with its
update in that form (`foreach=False`, `foreach=True`, `fused=True`), its other arguments as the
script gave them; also what the script's own optimizer is."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

# NAME -> (torch.optim class, keyword arguments beside params and lr)
OPTIMIZERS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "sgd": ("SGD", {}), "sgd-momentum": ("SGD", {"momentum": 0.9}), "adam": ("Adam", {}), "adamw": ("AdamW", {}),
    "adamw-amsgrad": ("AdamW", {"amsgrad": True}), "adagrad": ("Adagrad", {}), "rmsprop": ("RMSprop", {}),
    "adafactor": ("Adafactor", {})}

# step=FORM -> the keyword arguments torch.optim's optimizers take for it
FORMS: Dict[str, Dict[str, bool]] = {"single": {"foreach": False}, "foreach": {"foreach": True},
                                     "fused": {"fused": True}}


def _named(cls: Any, arguments: Dict[str, Any]) -> str:
    """The `--change optimizer=` name of an optimizer built as `cls(**arguments)` (its class's, lower case,
    when the grammar has none)."""
    name = cls.__name__
    if name == "SGD":
        return "sgd-momentum" if arguments.get("momentum") else "sgd"
    if name == "AdamW" and arguments.get("amsgrad"):
        return "adamw-amsgrad"
    return name.lower()


def _arguments(cls: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError:
        return dict(kwargs)
    out = dict(bound.arguments)
    out.pop("self", None)
    return out


def _built(cls: Any) -> Any:
    """`cls` with an __init__ that does nothing, under `cls`'s own names (torch's step scope reads them)."""
    return type(cls.__name__, (cls,), {"__init__": lambda self, *args, **kwargs: None,
                                       "__qualname__": cls.__qualname__, "__module__": cls.__module__})


def watch(session: Any) -> None:
    """Note the first torch.optim optimizer the script builds (`seen["optimizer"]`), building it as
    `session.seen["optimizer="]`'s NAME when that change is asked (install)."""
    import torch

    base = torch.optim.Optimizer
    building: List[bool] = []  # the replacement being built: its own __new__ passes

    def new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if building or not cls.__module__.startswith("torch.optim"):
            return object.__new__(cls)
        arguments = _arguments(cls, args, kwargs)
        session.seen.setdefault("optimizer", _named(cls, arguments))
        wanted: Optional[str] = session.seen.get("optimizer=")
        form: Optional[str] = session.seen.get("step=")
        if wanted is None and form is None:
            return object.__new__(cls)
        forms = {} if form is None else dict(FORMS[form])
        if wanted is None:
            maker, given, extra = cls, {k: v for k, v in arguments.items() if k not in ("foreach", "fused")}, forms
        else:
            name, extra = OPTIMIZERS[wanted]
            maker, given, extra = getattr(torch.optim, name), {k: arguments[k] for k in ("lr",) if k in arguments}, \
                {**extra, **forms}
        params = given.pop("params", args[0] if args else None)
        building.append(True)
        try:
            made = maker(params, **given, **extra)
        finally:
            building.pop()
        for change in ("optimizer", "step"):
            session.pending.pop(change, None)
        shown = [*given, *(f"{k}={v}" for k, v in extra.items())]
        session.notes.append(f"{maker.__name__}({', '.join(shown)}) built where the script builds "
                             f"{cls.__name__}, with its parameters")
        if isinstance(made, cls):
            # Python calls __init__ again, with the script's arguments, on what __new__ returns when it is an
            # instance of `cls` (AdamW is an Adam; amsgrad's AdamW an AdamW): a subclass of the same name
            # whose __init__ does nothing keeps the optimizer as built.
            made.__class__ = _built(type(made))
        return made

    session.patch(base, "__new__", staticmethod(new))


def install(session: Any, value: str) -> None:
    """Build the script's optimizer as `value` (watch does it)."""
    session.seen["optimizer="] = value
    session.pending["optimizer"] = "the script builds no torch.optim optimizer"


def install_step(session: Any, value: str) -> None:
    """Build the script's optimizer with its update in the `value` form (watch does it)."""
    session.seen["step="] = value
    session.pending["step"] = "the script builds no torch.optim optimizer"
