"""Are the runs one loop, and which allocation of each run is which of the reference run's: lined up
one for one when their stack sequences are equal, else anchored on allocations of equal stack and
size and matched by stack between the anchors."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from memdiff.analyse.sameloop import loop_difference
from memdiff.errors import InputError
from memdiff.predict.forecast.course import Course, DeviceCourse


@dataclass
class Alignment:
    """For each run (in knob order), the index of its allocation matching each of the reference
    run's allocations, or -1 where it has none."""

    matched: List[np.ndarray]
    aligned_pct: float  # the least share of the reference's allocations lined up in any run
    exact: bool  # every run records the same allocations in the same order
    same: List[bool]  # per run: it records the reference's allocations in the same order
    # The least share of another run's own allocations lined up with the reference's: a run that
    # records much more (a training step beside an inference run) is not the same loop either.
    covered_pct: float = 100.0


def check_one_loop(courses: Sequence[Course]) -> None:
    """InputError naming what differs when the runs are not one loop (sameloop.loop_difference):
    devices, steps, a training step beside none, or the weights."""
    first = courses[0]
    for c in courses[1:]:
        why = loop_difference(c.summary, first.summary, first.file)
        if why is not None:
            raise InputError(c.file, f"not the same loop as {first.file}: {why}")


def align(courses: Sequence[DeviceCourse], ref: int) -> Alignment:
    """Each run's allocations matched to those of `courses[ref]` by their stack sequence."""
    names: Dict[str, int] = {}
    seqs: List[np.ndarray] = []
    for c in courses:
        codes = np.array([names.setdefault(sig, len(names)) for sig, _ in c.stacks], dtype=np.int64)
        seqs.append(codes[c.stack] if len(c.stack) else c.stack)
    n = len(seqs[ref])
    same = [len(s) == n and bool(np.array_equal(s, seqs[ref])) for s in seqs]
    if all(same):
        return Alignment([np.arange(n, dtype=np.int64) for _ in seqs], 100.0, True, same)
    matched = []
    least = covered = 100.0
    for k, s in enumerate(seqs):
        if same[k]:
            matched.append(np.arange(n, dtype=np.int64))
            continue
        m = _align_pair(seqs[ref], courses[ref].size, s, courses[k].size)
        matched.append(m)
        lined = float((m >= 0).sum())
        least = min(least, 100.0 * lined / max(n, 1))
        covered = min(covered, 100.0 * lined / max(len(s), 1))
    return Alignment(matched, least, False, same, covered)


def _share(pct: float) -> str:
    """A share in words, rounded down so that only a whole match reads 100%."""
    return f"{math.floor(pct * 10) / 10:.1f}%"


def _lined_up(alignment: Alignment) -> str:
    """How much of each side lines up by stack, in words that never contradict themselves."""
    ours = ("every allocation of the largest run lines up by stack in every run" if alignment.aligned_pct >= 100
            else f"{_share(alignment.aligned_pct)} of the largest run's allocations line up by stack in every run")
    theirs = ("" if alignment.covered_pct >= 100 else
              f", and {_share(alignment.covered_pct)} of each other run's (the rest is not replayed)")
    return ours + theirs


def _align_pair(ref_stack: np.ndarray, ref_size: np.ndarray, stack: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The index in a run of each reference allocation, or -1: first anchored on allocations of
    equal stack and size (weights, gradients, optimizer state: they do not change with the knob),
    then, between anchors, by stack alone (one for one when both sides have the same stacks)."""
    tokens: Dict[Tuple[int, int], int] = {}
    a = [tokens.setdefault(t, len(tokens)) for t in zip(ref_stack.tolist(), ref_size.tolist())]
    b = [tokens.setdefault(t, len(tokens)) for t in zip(stack.tolist(), size.tolist())]
    m = np.full(len(a), -1, dtype=np.int64)
    ia = ib = 0
    for xa, xb, length in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        ga, gb = ref_stack[ia:xa], stack[ib:xb]
        if len(ga) and len(gb):
            if len(ga) == len(gb) and np.array_equal(ga, gb):
                m[ia:xa] = np.arange(ib, xb)
            else:
                for ya, yb, size_ in difflib.SequenceMatcher(None, ga.tolist(), gb.tolist(),
                                                             autojunk=False).get_matching_blocks():
                    m[ia + ya:ia + ya + size_] = np.arange(ib + yb, ib + yb + size_)
        m[xa:xa + length] = np.arange(xb, xb + length)
        ia, ib = xa + length, xb + length
    return m
