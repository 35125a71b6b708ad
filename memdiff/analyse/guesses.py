"""Which categories memdiff inferred rather than read from the stack an allocation was made with.

Memory live before the trace has no allocation in it (docs/categories.md, Memory older than the
trace): its category is an inference from what the trace does show, never the reading of its own
stack. The one definition of that, for every output that says a category is a guess: C001 of a
peak (analyse/peak.py), W016 of a what-if's change and of its buy-back (predict/whatif).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memdiff.analyse.classify import OTHER
from memdiff.read.frames import (
    FREED_PREFIX,
    GUESS_PARAMETER,
    GUESSED_LABELS,
    NO_STACK_BEFORE_TRACE,
    NO_STACK_GUESSED,
    UPDATED_PREFIX,
)
from memdiff.units import format_bytes

# The inferences, as every output names them.
BY_LIFETIME = "by its lifetime"  # live before the trace and never freed, nothing else known: weights
BY_UPDATES = "by the order of its in-place updates"  # CPU: a weight the optimizer step updates last
BY_SIZE = "by its size"  # further copies of the gradients' sizes (state), a BLAS workspace's size
BY_FREE = "by the stack that freed it"  # CUDA: the free the trace saw stands in for the allocation's stack
BY_UPDATE = "by the stack that updated it in place"  # CPU: an optimizer's or a backward's in-place update

# Categories that claim nothing: no rule matched (other), or memdiff says it cannot tell (untracked).
UNTRACKED = "untracked"
CLAIMS_NOTHING = frozenset((OTHER, UNTRACKED))

# A site memdiff writes for memory with no stack at all -> (the category the built-in rules infer for it, how).
# A rule of the user's own that names the site and gives another category decides: no guess of memdiff's.
_NO_STACK: Dict[str, Tuple[str, str]] = {
    **{label: (guess, BY_LIFETIME if label == NO_STACK_GUESSED else BY_SIZE)
       for guess, label in GUESSED_LABELS.items()},
    # CPU captures: a tensor updated in place that no update tells is state (a weight the step updates last,
    # a buffer a forward updates), never freed: a weight (docs/categories.md).
    NO_STACK_BEFORE_TRACE: (GUESS_PARAMETER, BY_UPDATES),
}


def inference(site: str, category: str) -> Optional[str]:
    """How memdiff inferred `category` for memory whose site is `site` (BY_LIFETIME, BY_UPDATES, BY_SIZE,
    BY_FREE, BY_UPDATE); None when the category was read from the allocation's own stack, or claims nothing.

    A freed or updated stack counts whoever's rule read it: the rule reads that stack, not the
    allocation's."""
    if category in CLAIMS_NOTHING:
        return None
    if site.startswith(FREED_PREFIX):
        return BY_FREE
    if site.startswith(UPDATED_PREFIX):
        return BY_UPDATE
    said = _NO_STACK.get(site)
    return said[1] if said is not None and said[0] == category else None


@dataclass(frozen=True)
class GuessedPart:
    """Bytes of one category inferred one way (`inference`, one of the BY_ names' words)."""

    category: str
    inference: str
    bytes: int


def largest_first(parts: Sequence[GuessedPart]) -> List[GuessedPart]:
    """The parts, the largest first (then by category and inference: a stable order for every output)."""
    return sorted(parts, key=lambda p: (-p.bytes, p.category, p.inference))


def guessed_text(parts: Sequence[GuessedPart], amounts: bool = True) -> str:
    """`optimizer_state (3.15 GiB, by the stack that freed it), parameter (1.58 GiB, by its lifetime)`, the
    largest first; without `amounts`, `optimizer_state by the stack that freed it and parameter by its lifetime`."""
    if amounts:
        return ", ".join(f"{p.category} ({format_bytes(p.bytes)}, {p.inference})" for p in largest_first(parts))
    return " and ".join(f"{p.category} {p.inference}" for p in largest_first(parts))


def guessed_data(parts: Sequence[GuessedPart]) -> List[Dict[str, Any]]:
    """The parts as a finding's data and the JSON carry them: [{category, inference, bytes}], the largest first."""
    return [asdict(p) for p in largest_first(parts)]
