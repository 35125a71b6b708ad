"""Which backend PyTorch's scaled_dot_product_attention picks on a GPU, from a call's facts: the
rule table per torch version (kernels.json, `sdpa_select`) and PyTorch's selection order. Plain
Python, no torch: the emulator reads a call's facts off its tensors (sdpa.facts), the what-if off
the allocations a recorded call made (predict/whatif/attention.py).

The table holds each backend's checks from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
and sdp_utils_cpp.h as conditions over the call's facts: a backend is taken when none of its
checks rejects the call, trying them in PyTorch's priority order for the GPU.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

from memdiff.recording.emulate.gpus import kernels


class Condition:
    """A condition from kernels.json: comparisons, `and`/`or`/`not`, `x if c else y` and arithmetic
    over the call's facts; no calls, no attributes."""

    ALLOWED = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.Compare, ast.Eq,
               ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.BinOp, ast.Add, ast.Sub,
               ast.Mult, ast.Mod, ast.FloorDiv, ast.IfExp, ast.Constant, ast.Name, ast.Load, ast.Tuple)

    def __init__(self, text: str) -> None:
        self.text = text
        tree = ast.parse(text, mode="eval")
        for node in ast.walk(tree):
            if not isinstance(node, self.ALLOWED):
                raise ValueError(f"kernels.json: {text!r} is not a condition")
        self.code = compile(tree, "<kernels.json>", "eval")

    def __call__(self, facts: Dict[str, Any]) -> Any:
        return eval(self.code, {"__builtins__": {}}, facts)


def _version(text: str) -> Tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@lru_cache(maxsize=None)
def table(running: str) -> Tuple[str, Dict[str, Any]]:
    """The rule table for torch `running` (a `torch.__version__`): its own, else the newest known
    version before it (the oldest known one before them all); and that version's name."""
    versions = {name: rules for name, rules in kernels()["sdpa_select"].items() if not name.startswith("_")}
    wanted = _version(running)
    known = sorted(versions, key=_version)
    earlier = [name for name in known if _version(name) <= wanted]
    name = earlier[-1] if earlier else known[0]
    rules = versions[name]
    compiled = {
        "let": [(key, Condition(text)) for key, text in rules["let"]],
        "priority": [(Condition(when), order) for when, order in rules["priority"]],
        "backends": {backend: [(rule["check"], Condition(rule["rejects"])) for rule in checks]
                     for backend, checks in rules["backends"].items()},
    }
    return name, compiled


def exact(running: str) -> bool:
    """Whether the table has torch `running`'s own rules."""
    return _version(table(running)[0]) == _version(running)


def select(rules: Dict[str, Any], known: Dict[str, Any]) -> Tuple[Optional[str], Dict[str, str]]:
    """The backend PyTorch's select_sdp_backend returns for these facts (None: no backend takes the
    call, PyTorch's 'No available kernel'), and for each backend tried first that was passed over,
    the check that rejected it."""
    values = dict(known)
    for key, condition in rules["let"]:
        values[key] = condition(values)
    order: List[str] = next(backends for when, backends in rules["priority"] if when(values))
    rejected: Dict[str, str] = {}
    for backend in order:
        failed = next((check for check, rejects in rules["backends"][backend] if rejects(values)), None)
        if failed is None:
            return backend, rejected
        rejected[backend] = failed
    return None, rejected
