"""`memdiff whatif --emulate GPU -o DIR/ -- python train.py ARGS`: each change made inside the emulator to
the unmodified script and the script re-run, so that each row is a run, not a prediction.

Each run is one of `memdiff fit`'s (recording.fitrun: `memdiff record --emulate` in a process forked from
a server that has imported torch), with the change's parts handed to the emulator
(recording/emulate/changes); the run without a change is the baseline every row's saving is measured
against. `accumulate=K` is the script's own flag: the command carries `{accumulate}` where its value
goes (1 in every other run). Every snapshot and log is kept in DIR/ (baseline.pickle, CHANGE.pickle).
"""

from __future__ import annotations

import multiprocessing
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from memdiff.analyse.classify import Rule
from memdiff.atomic import make_folder
from memdiff.compare.findings import finding
from memdiff.compare.observe import where_text
from memdiff.errors import InputError
from memdiff.inert import scrubbed
from memdiff.predict.fit import _target
from memdiff.predict.whatif.engine import (
    Change,
    ChangePrediction,
    DeviceWhatIf,
    WhatIf,
    every_change,
    fits_words,
    headline,
    parse_change,
)
from memdiff.recording.fitrun import OOM, checked, child, finished, stop
from memdiff.units import format_bytes

KNOB = "accumulate"  # the placeholder `accumulate=K` fills in the command
BASELINE = "baseline"


@dataclass
class _Running:
    index: int
    change: Optional[Change]
    process: Any
    conn: Any
    snapshot: str
    log: str


def _slug(text: str) -> str:
    """A file name for a change (`checkpoint=0.5+weights=bf16`: checkpoint-0.5+weights-bf16)."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "-", text.replace("=", "-"))


def _command(command: Sequence[str], change: Optional[Change]) -> List[str]:
    value = next((v for n, v in change.parts if n == KNOB), None) if change is not None else None
    return [arg.replace("{" + KNOB + "}", value or "1") for arg in command]


def _checked(command: Sequence[str], changes: Sequence[Change]) -> None:
    """InputError for a change the emulator cannot make to this command, before anything runs."""
    has_knob = any("{" + KNOB + "}" in arg for arg in command)
    for change in changes:
        if any(n == KNOB for n, _ in change.parts) and not has_knob:
            raise InputError("--change", f"{change.text}: the script takes accumulation as its own flag: put "
                                         f"{{{KNOB}}} where its value goes (`-- python train.py --grad-accum "
                                         f"{{{KNOB}}}`); memdiff cannot split a script's batch itself")


class _Runner:
    """Runs up to `jobs` emulated runs at a time, each in a process forked from fit's server."""

    def __init__(self, gpu: str, command: Sequence[str], output: str, jobs: int, max_entries: int,
                 rules: Sequence[Rule]) -> None:
        self.gpu, self.command, self.output, self.jobs, self.max_entries = gpu, list(command), output, jobs, max_entries
        self.rules = list(rules)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "memdiff.recording.fitrun", "memdiff.recording.emulate.runtime"])

    def run(self, changes: Sequence[Optional[Change]]) -> List[Tuple[_Running, Dict[str, Any]]]:
        """Every run, each with what its process sent back, in the order given."""
        queue = list(changes)
        running: List[_Running] = []
        done: Dict[int, Tuple[_Running, Dict[str, Any]]] = {}
        try:
            while queue or running:
                while queue and len(running) < self.jobs:
                    running.append(self._start(len(changes) - len(queue), queue.pop(0)))
                for r, sent in finished(running):
                    running.remove(r)
                    done[r.index] = (r, self._checked(r, sent))
        finally:  # a failed run or Ctrl-C: the others write what they recorded, as fit's do
            stop([r.process for r in running])
        return [done[i] for i in range(len(changes))]

    def _start(self, index: int, change: Optional[Change]) -> _Running:
        name = BASELINE if change is None else _slug(change.text)
        snapshot, log = os.path.join(self.output, name + ".pickle"), os.path.join(self.output, name + ".log")
        parts = [p for p in change.parts if p[0] != KNOB] if change is not None else []
        ours, theirs = self.context.Pipe(duplex=False)
        process = self.context.Process(target=child, args=(theirs, self.gpu, _target(_command(self.command, change)),
                                                           snapshot, log, self.max_entries, self.rules, parts),
                                       daemon=False)  # a daemon may not start the script's DataLoader workers
        process.start()
        theirs.close()
        return _Running(index, change, process, ours, snapshot, log)

    def _checked(self, r: _Running, sent: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        where = "unchanged" if r.change is None else f"with {r.change.text}"
        sent = checked("whatif", where, sent, r.process.exitcode, r.log)
        if sent["status"] == OOM and r.change is None:
            raise InputError("whatif", f"the script runs out of memory on emulated {self.gpu} unchanged: "
                                       f"{sent['oom_message']} (its output: {r.log})")
        return sent


def _row(change: Change, sent: Dict[str, Any], base: Dict[str, Any], budget: Optional[int], gpu: str,
         snapshot: str) -> ChangePrediction:
    """One change's row: its run's peak against the baseline's, or why the change was not made."""
    unmade = sent.get("change_unmade")
    if unmade:
        return ChangePrediction(change=change.text, applies=False, reason=unmade, predicted_peak_bytes=None,
                                predicted_peak_phase=None, predicted_peak_step=None, delta_bytes=None,
                                delta_pct=None, fits_budget=None, phase_peaks={}, categories={}, assumptions=[],
                                line=finding("W014", change=change.text, why=unmade).message)
    peak, phase = int(sent["peak_bytes"] or 0), sent["phase"]
    delta = peak - int(base["peak_bytes"] or 0)
    pct = round(100.0 * delta / base["peak_bytes"], 2) if base["peak_bytes"] else 0.0
    oom = sent["status"] == OOM
    # What runs out is what the caching allocator holds: the run's reserved peak, as measured.
    fits = False if oom and budget is not None else None if budget is None else \
        int(sent["reserved_peak_bytes"] or peak) <= budget
    where = f"in {where_text(phase, None)}" if phase else "before the trace's first event"
    line = (f"{change.text}: re-run peak {format_bytes(peak)} ({format_bytes(delta, signed=True)}, {pct:+.1f}%), "
            f"{where}" + (f"; out of memory on emulated {gpu}" if oom else "")
            + ("" if fits is None else "; fits the budget" if fits else "; over the budget"))
    notes = list(sent.get("change_notes") or [])
    notes += [f"the script's {KNOB} flag given {v}" for n, v in change.parts if n == KNOB]
    notes += [f"ran out of memory: {sent['oom_message']}"] if oom else []
    notes += [f"snapshot {snapshot}"]
    return ChangePrediction(change=change.text, applies=True, reason=None, predicted_peak_bytes=peak,
                            predicted_peak_phase=phase, predicted_peak_step=sent["step"], delta_bytes=delta,
                            delta_pct=pct, fits_budget=fits, phase_peaks=dict(sent.get("phase_peaks") or {}),
                            categories=dict(sent.get("categories") or {}), assumptions=notes,
                            line=line, reserved_peak_bytes=sent["reserved_peak_bytes"], snapshot=snapshot,
                            fits_text=fits_words(budget, fits))


def rerun(command: Sequence[str], gpu: str, output: str, changes: Sequence[str], rules: Sequence[Rule],
          budget: Optional[int] = None, jobs: int = 2, max_entries: int = 1_000_000) -> WhatIf:
    """The WhatIf of `command` re-run on emulated `gpu` with each change (none: every one worth trying),
    against its run unchanged; every run's snapshot and output kept in `output`, its categories by `rules`."""
    command = list(command[1:] if command and command[0] == "--" else command)
    if not command:
        raise InputError("whatif", "nothing to run: give `-- python train.py ARGS`")
    parsed = [parse_change(t) for t in changes]
    _checked(command, parsed)
    _target(_command(command, None))  # a typo in the command fails before any run
    # A file, or a folder that cannot be made or written, is the user's mistake, said before any run.
    make_folder(output)
    runner = _Runner(gpu, command, output, jobs, max_entries, rules)
    if parsed:
        results = runner.run([None, *parsed])
        (base_run, base), rows = results[0], results[1:]
        asked = parsed
    else:  # the baseline first: which optimizer the script builds decides the changes worth trying
        base_run, base = runner.run([None])[0]
        asked = every_change((base.get("seen") or {}).get("optimizer"), any("{" + KNOB + "}" in a for a in command))
        rows = runner.run(list(asked))
    predictions = [_row(ch, sent, base, budget, gpu, r.snapshot) for ch, (r, sent) in zip(asked, rows)]
    if not parsed:
        applied = sorted((p for p in predictions if p.applies), key=lambda p: (p.delta_bytes or 0, p.change))
        predictions = applied + [p for p in predictions if not p.applies]
    seen = base.get("seen") or {}
    peak, phase, step = int(base["peak_bytes"] or 0), base["phase"], base["step"]
    device = DeviceWhatIf(device=0, base_peak_bytes=peak, base_peak_phase=phase, base_peak_step=step, blocks=[],
                          optimizer=seen.get("optimizer"), changes=predictions,
                          headline=headline(0, peak, phase, step, [], seen.get("optimizer"), predictions),
                          findings=[finding("W014", 0, change=p.change, why=p.reason or "")
                                    for p in predictions if not p.applies])
    return scrubbed(WhatIf(file=base_run.snapshot, budget_bytes=budget, asked=[c.text for c in parsed],
                           devices=[device], notes=[], rerun_on=gpu,
                           overhead_note=None if budget is None else "the budget is compared with each run's reserved "
                           "peak (what the caching allocator held: what runs out)"))
