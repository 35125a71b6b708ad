"""The edit every what-if rule makes to a run's allocations, and the rule's shape (ChangeRule).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from memdiff.errors import InputError
from memdiff.predict.forecast.course import DeviceCourse
from memdiff.predict.whatif.run import Run


class CannotApply(Exception):
    """A change the run cannot show: its message is the one line said instead of a guess."""


@dataclass
class Edit:
    """Sizes and lifetimes of the run's allocations as a change leaves them, and what it adds."""

    start: np.ndarray
    end: np.ndarray
    size: np.ndarray
    added_start: List[int] = field(default_factory=list)
    added_end: List[int] = field(default_factory=list)
    added_size: List[int] = field(default_factory=list)
    added_category: List[str] = field(default_factory=list)
    assumptions: List[str] = field(default_factory=list)

    def add(self, start: int, end: int, size: int, category: str) -> None:
        """An allocation the change makes, live after events start .. end - 1."""
        if size > 0 and end > start:
            self.added_start.append(start)
            self.added_end.append(end)
            self.added_size.append(size)
            self.added_category.append(category)


def changed_course(run: Run, edit: Edit) -> Tuple[DeviceCourse, np.ndarray]:
    """The run's course as the edit leaves it (added allocations appended), and its sizes."""
    c = run.course
    names = list(c.categories)
    for name in edit.added_category:
        if name not in names:
            names.append(name)
    codes = [names.index(n) for n in edit.added_category]
    k = len(edit.added_size)
    course = DeviceCourse(
        device=c.device, events=c.events,
        start=np.concatenate([edit.start, np.array(edit.added_start, dtype=np.int64)]),
        end=np.concatenate([edit.end, np.array(edit.added_end, dtype=np.int64)]),
        size=np.concatenate([edit.size, np.array(edit.added_size, dtype=np.int64)]),
        stack=np.concatenate([c.stack, np.zeros(k, dtype=np.int64)]),
        category=np.concatenate([c.category, np.array(codes, dtype=np.int64)]),
        stacks=c.stacks, categories=names,
        before=np.concatenate([c.before & (edit.start == c.start), np.zeros(k, dtype=bool)]))
    return course, course.size


def closest(word: str, choices: Sequence[str]) -> str:
    """` (did you mean X?)` for the choice nearest `word`, else the choices."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.4)
    return f" (did you mean {near[0]}?)" if near else f" (one of: {', '.join(choices)})"


@dataclass(frozen=True)
class ChangeRule:
    """One kind of change that `--change` names: how its value is checked, and how it edits a run.

    `apply(run, edit, value)` changes `edit` in place, or raises CannotApply with the one line
    said instead of a guess. `excludes`: the changes it cannot be combined with, and why."""

    name: str
    check: Callable[[Optional[str]], None]
    apply: Callable[[Run, Edit, Optional[str]], None]
    excludes: Tuple[Tuple[str, str], ...] = ()


def one_of(name: str, choices: Sequence[str]) -> Callable[[Optional[str]], None]:
    """The value check of a change that takes one of `choices` (InputError naming the nearest)."""
    def check(value: Optional[str]) -> None:
        if value is None:
            raise InputError("--change", f"{name} needs a value: {name}={choices[0]} (one of: {', '.join(choices)})")
        if value not in choices:
            raise InputError("--change", f"{name}={value}: unknown value{closest(value, choices)}")
    return check
