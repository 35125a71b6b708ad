"""A regression bought back: the changes that bring a regressed head's peak back to its base's,
from the what-if's replay of every applicable change (`memdiff diff --whatif`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from memdiff.analyse.classify import Rule
from memdiff.compare.findings import finding
from memdiff.errors import InputError
from memdiff.inert import scrubbed
from memdiff.model import Finding
from memdiff.predict.forecast.course import read_course, structure
from memdiff.predict.whatif.engine import ChangePrediction, every_change, facts, guess_findings, on_a_guess, predict
from memdiff.predict.whatif.optimizer import run_optimizer
from memdiff.read.window import Window
from memdiff.units import format_bytes


@dataclass
class BuyBackTarget:
    """One device of a regressed head run: the peak to get back to, and the peak the rule passes."""

    device: int
    base_peak_bytes: int  # the base's (baseline's) peak on this device
    allowed_peak_bytes: int  # the highest head peak the peak rule passes (at least base_peak_bytes)
    base_name: str  # what names the base in words (`base`, `the baseline`)


@dataclass
class BuyBack:
    """One change that brings a regressed head's peak back to the base's (or within the rule),
    or, when none does, the one that saves most (enough False)."""

    device: int
    change: str
    predicted_peak_bytes: int
    predicted_peak_phase: Optional[str]
    delta_bytes: int  # against the head's own replayed peak
    target_bytes: int  # the base's peak
    enough: bool
    text: str
    guessed_bytes: int = 0  # what the change edited whose category memdiff guessed (W016); 0: none


@dataclass
class BuyBackPart:
    """What a regression's report says of the changes that buy it back (`--whatif`)."""

    items: List[BuyBack]
    notes: List[Finding]  # why a device has none, or why the what-if could not run (the catalogue's W codes)


def _buy_back_text(p: ChangePrediction, t: BuyBackTarget, head_phase: Optional[str], prefix: str) -> str:
    peak = int(p.predicted_peak_bytes or 0)
    where = f" in the {p.predicted_peak_phase}" if p.predicted_peak_phase else ""
    moved = (f", the peak moves to the {p.predicted_peak_phase}"
             if p.predicted_peak_phase and head_phase and p.predicted_peak_phase != head_phase else "")
    if peak <= t.base_peak_bytes:
        within = f"within {t.base_name}'s {format_bytes(t.base_peak_bytes)}"
    elif peak <= t.allowed_peak_bytes:
        within = (f"{format_bytes(peak - t.base_peak_bytes)} over {t.base_name}'s "
                  f"{format_bytes(t.base_peak_bytes)}, within the rule")
    else:
        within = (f"not enough: {format_bytes(peak - t.base_peak_bytes)} over {t.base_name}'s "
                  f"{format_bytes(t.base_peak_bytes)}")
    guess = f"; {on_a_guess(p.guessed_bytes, p.guessed_by)}, W016" if p.guessed_bytes else ""
    return (f"{prefix}{p.change}: {format_bytes(p.delta_bytes or 0, signed=True)}, peak {format_bytes(peak)}{where}"
            f"{moved} ({within}{guess})")


def buy_back(path: str, rules: Sequence[Rule], targets: Sequence[BuyBackTarget],
             window: Optional[Window] = None) -> BuyBackPart:
    """The changes that bring the regressed run at `path` back to its base's peak on each target
    device, from `memdiff whatif`'s replay of every applicable change: those whose predicted peak
    the peak rule passes, the smallest saving first; when none does, the one that saves most, said
    to be not enough. With `window`, that window of the run (as the diff read it). A run the
    what-if cannot read as a course (a summary, a damaged trace) is a note, never an error: the
    regression's verdict stands as judged."""
    if not targets:
        return BuyBackPart([], [finding("W002", why="the peak did not grow on any device")])
    try:
        course = read_course(path, 1, rules, window)
    except InputError as why:
        return BuyBackPart([], [finding("W001", why=str(why))])
    items: List[BuyBack] = []
    notes: List[Finding] = []
    prefix_each = len(targets) > 1
    for t in targets:
        c = course.devices.get(t.device)
        prefix = f"device {t.device}: " if prefix_each else ""
        if c is None:
            notes.append(finding("W001", t.device,
                                 why=f"the head's snapshot records no allocation on device {t.device}"))
            continue
        run = facts(c, *structure(course.summary, t.device))
        predictions = [p for p in (predict(run, ch, None)
                                   for ch in every_change(run_optimizer(run)[0]))
                       if p.applies and p.predicted_peak_bytes is not None]
        enough = sorted((p for p in predictions if int(p.predicted_peak_bytes or 0) <= t.allowed_peak_bytes),
                        key=lambda p: (-(p.delta_bytes or 0), p.change))
        if enough:
            chosen = enough
        else:
            saving = [p for p in predictions if (p.delta_bytes or 0) < 0]
            if not saving:
                notes.append(finding("W003", t.device))
                continue
            chosen = [min(saving, key=lambda p: (p.delta_bytes or 0, p.change))]
            notes.append(finding("W004", t.device, base_name=t.base_name, base_peak=format_bytes(t.base_peak_bytes),
                                 base_peak_bytes=t.base_peak_bytes))
        for p in chosen:
            items.append(BuyBack(device=t.device, change=p.change,
                                 predicted_peak_bytes=int(p.predicted_peak_bytes or 0),
                                 predicted_peak_phase=p.predicted_peak_phase, delta_bytes=int(p.delta_bytes or 0),
                                 target_bytes=t.base_peak_bytes, enough=bool(enough),
                                 text=_buy_back_text(p, t, run.base.phase, prefix), guessed_bytes=p.guessed_bytes))
        notes += guess_findings(t.device, chosen)
    notes.append(finding("W005"))
    return scrubbed(BuyBackPart(items, notes))
