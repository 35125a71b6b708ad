"""The fit's gate: a fit result (`memdiff fit --format json`) read back and judged against a baseline's.

`memdiff fit --baseline FIT.json` (gated), `memdiff gate FIT.json --baseline FIT.json` (gate_file) and
`memdiff gate --fit FIT.json` on a snapshot's baseline (stored_fit, check_fit) each compare the largest (or
fewest, for {nproc}) value per GPU with the baseline's: a G011 finding for each GPU that lost ground.
The search that finds the values is memdiff.predict.fit; this module only reads and judges its documents.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from memdiff.compare.findings import finding
from memdiff.errors import InputError, clip
from memdiff.model import Finding
from memdiff.predict.fit import NODES, NPROC
from memdiff.predict.fit_result import LARGEST, SCHEMA_VERSION, SMALLEST, FitResult


def is_fit_document(doc: Any) -> bool:
    """Whether a JSON document is a fit result (`memdiff fit --format json`)."""
    return isinstance(doc, dict) and doc.get("kind") == "fit" and "gpus" in doc


def read_fit(path: str) -> Dict[str, Any]:
    """A fit result written by `memdiff fit --format json`, schema-checked; InputError otherwise."""
    from memdiff.read.load import read_json
    from memdiff.read.schema import validate

    doc = read_json(path, "a fit result")
    if not is_fit_document(doc):
        raise InputError(path, "is not a fit result (`memdiff fit ... --format json` writes one)")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise InputError(path, f"fit schema_version {clip(str(doc.get('schema_version')))} is not one this memdiff "
                               f"reads ({SCHEMA_VERSION})")
    return validate(path, doc, "fit")


def judge(values: Dict[str, Optional[int]], knob: str, baseline: Dict[str, Any], path: str,
          missing_fails: bool = False) -> List[Finding]:
    """A G011 finding for each GPU whose largest value fell below the baseline's (`values`: the fit's,
    by GPU). A GPU only the baseline has is not compared, unless `missing_fails` (a snapshot's gate:
    a fit that left a GPU out must not pass for it); one only the fit has never is."""
    if baseline["knob"] != knob:
        raise InputError(path, f"the baseline fits {{{clip(baseline['knob'])}}} and this fit {{{knob}}}: they cannot "
                               "be compared")
    fewer = baseline.get("direction", LARGEST) == SMALLEST  # {nproc}, {nodes}: more needed is the loss
    unit = "processes" if knob == NPROC else knob if knob == NODES else f"{{{knob}}}"
    what = (f"the fewest {unit} on which every rank's emulated run trains" if fewer
            else "the largest value whose emulated run trains")
    out = []
    for g in baseline["gpus"]:
        key = g["gpu"]
        if key not in values:
            if missing_fails and g["value"] is not None:
                out.append(finding("G011", gpu=key, knob=knob, old=f"{g['value']:,}", new="not fitted",
                                   what=what, baseline=path))
            continue
        old, new = g["value"], values[key]
        if old is not None and (new is None or (new > old if fewer else new < old)):
            out.append(finding("G011", gpu=key, knob=knob, old=f"{old:,}",
                               new="nothing" if new is None else f"{new:,}", what=what, baseline=path))
    return out


def gated(result: FitResult, baseline: Dict[str, Any], baseline_path: str) -> FitResult:
    """The result with its baseline's check (`read_fit`'s document): findings and verdict."""
    result.findings = judge({g.gpu: g.value for g in result.gpus}, result.knob, baseline, baseline_path)
    result.baseline = baseline_path
    result.passed = not result.findings
    return result


def value_lines(doc: Dict[str, Any]) -> List[str]:
    """One line per GPU of a fit document: `h100 batch 48`."""
    return [f"{g['gpu']} {doc['knob']} {'nothing' if g['value'] is None else format(g['value'], ',')}"
            for g in doc["gpus"]]


def stored_fit(path: str) -> Dict[str, Any]:
    """What a baseline keeps of the fit result at `path` (`memdiff baseline --fit`): the knob, the
    --max-memory share and the largest value per GPU."""
    doc = read_fit(path)
    return {"knob": doc["knob"], "direction": doc.get("direction", LARGEST), "max_memory": doc["max_memory"],
            "source": path, "gpus": [{"gpu": g["gpu"], "value": g["value"]} for g in doc["gpus"]]}


def check_fit(stored: Dict[str, Any], baseline_path: str, run: str) -> Tuple[List[Finding], List[str]]:
    """The fit result `run` against the fit values a snapshot's baseline holds (`memdiff gate --fit`):
    the G011 findings, and one line per GPU of the baseline (`PASS  fit: h100 batch 1,976 -> 1,984`).

    A fit under another --max-memory share answers another question: InputError, as another knob is."""
    doc = read_fit(run)
    if doc["max_memory"] != stored["max_memory"]:
        raise InputError(run, f"fits within {doc['max_memory']:g} of each GPU and the baseline {baseline_path}'s "
                              f"values within {stored['max_memory']:g}: they cannot be compared")
    values = {g["gpu"]: g["value"] for g in doc["gpus"]}
    found = judge(values, doc["knob"], stored, baseline_path, missing_fails=True)
    dropped = {f.data["gpu"] for f in found}
    lines = []
    for g in stored["gpus"]:
        head = values.get(g["gpu"])
        new = "not fitted" if g["gpu"] not in values else "nothing" if head is None else f"{head:,}"
        old = "nothing" if g["value"] is None else f"{g['value']:,}"
        lines.append(f"{'FAIL' if g['gpu'] in dropped else 'PASS'}  fit: {g['gpu']} {stored['knob']} {old} -> {new}")
    return found, lines


@dataclass
class FitGate:
    """`memdiff gate FIT.json --baseline FIT.json`: a stored fit result against the baseline's."""

    run: str
    baseline: str
    values: List[str]  # one line per GPU of the run: `h100 batch 48`
    findings: List[Finding]
    passed: bool

    @property
    def verdict_line(self) -> str:
        """The verdict as every format says it: `PASS  fit FIT.json against BASELINE.json`."""
        return f"{'PASS' if self.passed else 'FAIL'}  fit {self.run} against {self.baseline}"

    def to_dict(self) -> Dict[str, Any]:
        """The JSON document (gate's list entry for a fit)."""
        return {"run": self.run, "baseline": self.baseline, "verdict": "pass" if self.passed else "fail",
                "values": self.values, "findings": [f.to_dict() for f in self.findings]}


def gate_file(run: str, baseline_path: str) -> FitGate:
    """Gate the fit result `run` against the fit result `baseline_path`."""
    doc, baseline = read_fit(run), read_fit(baseline_path)
    found = judge({g["gpu"]: g["value"] for g in doc["gpus"]}, doc["knob"], baseline, baseline_path)
    return FitGate(run, baseline_path, value_lines(doc), found, not found)


def fit_file(path: str) -> bool:
    """Whether `path` is a JSON file holding a fit result (so `memdiff gate` gates it as one)."""
    import json

    if not path.endswith(".json") or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except OSError:
        return False
    try:
        return is_fit_document(json.loads(head))
    except ValueError:  # longer than the head read, or not JSON: read whole only if it names itself a fit
        return '"kind": "fit"' in head and is_fit_document(_whole(path))


def _whole(path: str) -> Any:
    from memdiff.read.load import read_json

    return read_json(path, "a fit result")
