"""Findings: one catalogue of stable codes (memdiff/compare/findings.py), its generated page, `memdiff rule`,
the gate's choice of findings, and the codes the real snapshots emit, pinned."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Dict, List

import pytest
import test_schemas
from conftest import ROOT, cli

from memdiff.analyse.classify import load_rules
from memdiff.analyse.peak import peak_report, source_findings
from memdiff.compare.findings import (
    BY_CODE,
    CATALOGUE,
    DEFAULT_FAIL_ON,
    FAMILIES,
    OUTSIDE,
    SEVERITY_WORDS,
    docs_page,
    rule_section,
)
from memdiff.read.inputs import read_summary
from memdiff.report.build import Run, Settings, compare

CUDA = ROOT / "tests" / "data" / "cuda"
validate = test_schemas.validate
MiB = 2**20


# --- the catalogue and its page --------------------------------------------------------------

def test_every_code_is_stable_in_shape_and_documented():
    codes = [c.code for c in CATALOGUE]
    assert len(codes) == len(set(codes)) and len({c.name for c in CATALOGUE}) == len(codes)
    for c in CATALOGUE:
        assert re.fullmatch(r"[A-Z][0-9]{3}", c.code) and c.code[0] in FAMILIES, c.code
        assert re.fullmatch(r"[a-z0-9-]+", c.name) and c.severity in SEVERITY_WORDS, c.code
        assert c.means and c.why and c.fix, c.code
        # The example is the line every text surface prints: severity, code, sentence.
        assert c.example_output.startswith(f"{SEVERITY_WORDS[c.severity]}: {c.code} "), c.code
    assert set(DEFAULT_FAIL_ON) <= set(codes)


def test_every_code_is_raised_by_the_code_and_nothing_else_is():
    """Each code is made by a stage (`finding("K004", ...)`), and no stage makes one the catalogue lacks."""
    source = "\n".join(p.read_text() for p in (ROOT / "memdiff").rglob("*.py"))
    raised = {code for first in re.findall(r'\bfinding\(([^,]+),', source)
              for code in re.findall(r'"([A-Z][0-9]{3})"', first)}
    assert raised == set(BY_CODE), (sorted(set(BY_CODE) - raised), sorted(raised - set(BY_CODE)))


def test_the_committed_page_is_the_generated_one():
    assert (ROOT / "docs" / "findings.md").read_text() == docs_page()
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_findings.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    page = docs_page()
    for c in CATALOGUE:  # one section per code, in the fixed shape
        section = page[page.index(f"## {c.code} {c.name}\n"):]
        heads = [line for line in section.splitlines() if line.startswith("### ")][:4]
        assert heads == ["### What it means", "### Why it matters", "### Example", "### What to do"], c.code


def test_memdiff_rule_prints_a_section_the_list_and_the_page(capsys):
    code, out, _ = cli(capsys, "rule", "k004")
    assert code == 0 and out == rule_section(BY_CODE["K004"])
    assert "Fails the gate by default." in out and "memdiff peak tests/data/cuda/gpt2-log-tensor.pickle.gz" in out
    code, out, _ = cli(capsys, "rule", "--all")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == [c.code for c in CATALOGUE]
    assert "K004  error    kept-grows-per-step  (fails by default)" in out
    code, out, _ = cli(capsys, "rule", "--all", "--markdown")
    assert code == 0 and out == docs_page()
    code, out, _ = cli(capsys, "rule", "P")  # a family letter: its codes
    assert code == 0 and out.count("\n## ") == sum(c.code.startswith("P") for c in CATALOGUE) - 1
    code, out, err = cli(capsys, "rule", "Z999")
    assert code == 2 and out == ""
    assert err == "memdiff: rule: 'Z999' is no finding code (`memdiff rule --all` lists them)\n"
    code, _, err = cli(capsys, "rule")
    assert code == 2 and "give a finding code" in err


# --- the examples in the page are what memdiff prints on the real snapshots ------------------

REAL_EXAMPLES = [c.code for c in CATALOGUE if c.example_command.startswith("memdiff")]


@pytest.mark.parametrize("code", REAL_EXAMPLES)
def test_each_real_example_prints_what_the_page_says(code, request, tmp_path, monkeypatch, capsys):
    c = BY_CODE[code]
    if OUTSIDE in c.example_command:
        request.getfixturevalue("shared")  # a public run's snapshot: skips (fails in CI) without ../shared
    monkeypatch.chdir(ROOT)
    command, expected = c.example_command, c.example_output
    # A command that writes a file (`-o NAME`) writes it under tmp_path, never in the checkout; the line names the
    # file as written.
    for written in re.findall(r"-o (\S+)", command):
        command = command.replace(written, str(tmp_path / written))
        expected = expected.replace(written, str(tmp_path / written))
    out = ""
    for part in command.split(" && "):
        words = part.split()
        assert words[0] == "memdiff"
        out = cli(capsys, *words[1:])[1]
    assert expected in out.splitlines(), (code, [line for line in out.splitlines() if f" {code} " in line])


# --- the codes each real snapshot and pair emits, pinned ---------------------------------------

# memdiff peak: the codes of each real snapshot (../shared/snapshots, tests/data/cuda).
PINNED_RUNS: Dict[str, List[str]] = {
    "bert-4gpu.pickle": ["C001", "K001"],
    "cs336-ctx128-fwd-fp32.pickle": ["C001"],
    "cs336-ctx128-fwd-mixed.pickle": ["C001"],
    "cs336-medium-ctx128-infer.pickle": ["C001"],
    "cs336-medium-ctx128-train.pickle": ["C001", "T002"],
    "cs336-medium-ctx256-train.pickle": ["C001", "T002"],
    "cs336-windows.pickle": ["C001", "T002"],
    "diffusion-segments-list.pickle": ["C001", "T015"],
    "empty-trace.pickle": ["C001", "T015"],
    "linear-grad.pickle": ["K001"],
    "linear-nograd.pickle": ["K001"],
    "opt13b-oom-legacy.pickle": [],
    "tinyllama-lora-fwdbwd.pickle": ["C001"],
    "gpt2-base.pickle.gz": ["C001"],
    "gpt2-keep-weights.pickle.gz": ["C001", "K001", "K004"],
    "gpt2-log-tensor.pickle.gz": ["C001", "K001", "K004"],
    "gpt2-oom.pickle.gz": ["A002", "C001"],
    "gpt2-retain-graph.pickle.gz": ["C001"],
    "gpt2-warm.pickle.gz": ["C001"],
}

# memdiff BASE HEAD under the default rule: the codes shown and judged, and the verdict.
S, C = "shared:", "cuda:"
PINNED_PAIRS = [
    (S + "cs336-medium-ctx128-train.pickle", S + "cs336-medium-ctx256-train.pickle", ["G002", "P001"], False),
    (S + "cs336-medium-ctx128-train.pickle", S + "cs336-medium-ctx128-infer.pickle", ["P001", "P002", "T003"],
     False),
    (S + "cs336-ctx128-fwd-fp32.pickle", S + "cs336-ctx128-fwd-mixed.pickle", ["G002"], False),
    (S + "cs336-ctx128-fwd-fp32.pickle", S + "cs336-medium-ctx128-train.pickle", ["P001", "T003", "T007", "T008"],
     True),
    (S + "linear-nograd.pickle", S + "linear-grad.pickle", ["G002", "K002"], False),
    (S + "cs336-medium-ctx128-infer.pickle", S + "linear-grad.pickle", ["G002", "K002", "K003", "T007", "T008"],
     False),
    (S + "diffusion-segments-list.pickle", S + "linear-grad.pickle", ["G002", "K002", "K003", "T005", "T006", "T015"],
     False),
    (S + "opt13b-oom-legacy.pickle", S + "linear-grad.pickle", ["K002", "K003", "T006", "T010"], False),
    (C + "gpt2-base.pickle.gz", C + "gpt2-base-again.pickle.gz", [], True),
    (C + "gpt2-base.pickle.gz", C + "gpt2-log-tensor.pickle.gz", ["G002", "K002", "K004"], False),
    (C + "gpt2-base.pickle.gz", C + "gpt2-keep-weights.pickle.gz", ["G002", "K002", "K004"], False),
    (C + "gpt2-base.pickle.gz", C + "gpt2-oom.pickle.gz", ["A002", "G002", "P001", "T007", "T010"], False),
    (C + "gpt2-base.pickle.gz", C + "gpt2-retain-graph.pickle.gz", ["G002", "P001"], False),
    (C + "gpt2-base.pickle.gz", C + "gpt2-warm.pickle.gz", [], True),
]


@pytest.fixture(scope="module")
def read(shared):
    rules, cache = load_rules(), {}

    def summary(name: str):
        path = shared / name[len(S):] if name.startswith(S) else CUDA / name[len(C):] if name.startswith(C) else (
            CUDA / name if name.endswith(".gz") else shared / name)
        if path not in cache:
            cache[path] = read_summary(str(path), rules)
        return cache[path]
    return summary


def test_the_codes_of_each_real_snapshot_are_pinned(read):
    got = {}
    for name in PINNED_RUNS:
        s = read(name)
        found = source_findings(s) + [f for p in peak_report(name, s, 10) for f in p.findings]
        got[name] = sorted({f.code for f in found})
    assert got == PINNED_RUNS


@pytest.mark.parametrize("base, head, codes, passed", PINNED_PAIRS, ids=lambda v: v if isinstance(v, str) else "")
def test_the_codes_of_each_real_pair_are_pinned(read, base, head, codes, passed):
    report = compare([Run(read(base))], [Run(read(head))], Settings())
    assert (sorted({f.code for f in report.findings + report.notes}), report.passed) == (codes, passed)


# --- the gate: fail on a finding, ignore one ---------------------------------------------------

def test_the_gate_fails_on_kept_memory_growing_step_over_step_whatever_the_peak(tmp_path, capsys, shared):
    head = CUDA / "gpt2-log-tensor.pickle.gz"
    stored = tmp_path / "b.json"
    # A baseline whose peak rule allows anything: only the finding can fail the run.
    assert cli(capsys, "baseline", CUDA / "gpt2-base.pickle.gz", "-o", stored, "--fail-over-pct", "1000")[0] == 0
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored)
    assert code == 1 and "PASS  device 0 peak" in out
    assert ("FAIL  finding K004 kept-grows-per-step: device 0: memory kept from earlier steps grows step over "
            "step: the steps after the first peak at 7.31 GiB, 9.85 GiB; 2.54 GiB live at the peak was allocated "
            "by earlier steps (fails on K004: default)") in out
    # Ignored, it is neither shown nor failing; the rule says so.
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored, "--ignore", "K004")
    assert code == 0 and "K004" not in out.replace("K004 is ignored (--ignore)", "")
    assert "findings K003, A002, P002 fail (default); K004 is ignored (--ignore)" in out
    # JSON records each rule and the failing finding.
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored, "--format", "json", "--fail-on", "K002")
    doc = json.loads(out)[0]
    assert code == 1 and doc["verdict"] == "fail"
    assert {(r["code"], r["action"], r["source"]) for r in doc["finding_rules"]} == {
        ("K003", "fail", "default"), ("K004", "fail", "default"), ("A002", "fail", "default"),
        ("P002", "fail", "default"), ("K002", "fail", "--fail-on")}
    assert [(c["code"], c["device"], c["source"]) for c in doc["finding_checks"]] == [
        ("K002", 0, "--fail-on"), ("K004", 0, "default")]
    assert [f["code"] for f in doc["findings"]] == ["K004", "K002"]  # the error first, as every output shows them
    assert doc["findings"][0]["data"]["step_peaks_bytes"] == [7_845_166_096, 10_575_326_232]


def test_a_baseline_and_a_rules_file_keep_the_choice_and_flags_come_last(tmp_path, capsys, shared):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx128-infer.pickle"
    stored = tmp_path / "b.json"
    assert cli(capsys, "baseline", base, "-o", stored, "--fail-on", "p001", "--ignore", "T")[0] == 0
    assert json.loads(stored.read_text())["thresholds"]["findings"] == {
        "fail-on": ["P001"], "ignore": ["T001", "T002", "T003", "T004", "T005", "T006", "T007", "T008", "T009",
                                        "T010", "T011", "T012", "T013", "T014", "T015"]}
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored)
    assert code == 1 and "FAIL  finding P001 peaks-in-different-phases" in out and "(fails on P001: baseline)" in out
    assert not re.search(r"^(warning|note): T", out, re.M)
    rules = tmp_path / "rules.json"
    # The inference run stopped training (P002, failing by default): a rules file can let both go.
    rules.write_text(json.dumps({"rules": [], "findings": {"ignore": ["P001", "P002"]}}))
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored, "--rules", rules)
    assert code == 0 and f"P002, P001 are ignored ({rules})" in out
    code, out, _ = cli(capsys, "gate", head, "--baseline", stored, "--rules", rules, "--fail-on", "P001")
    assert code == 1 and "(fails on P001: --fail-on)" in out
    rules.write_text(json.dumps({"rules": [], "findings": {"ignore": ["Q1"]}}))
    code, _, err = cli(capsys, "gate", head, "--baseline", stored, "--rules", rules)
    assert code == 2 and "findings.ignore" in err
    code, _, err = cli(capsys, base, head, "--fail-on", "K999")
    assert code == 2 and err == "memdiff: --fail-on: 'K999' is no finding code (`memdiff rule --all` lists them)\n"


def test_an_oom_in_the_head_run_fails_the_diff_by_default(capsys):
    code, out, _ = cli(capsys, CUDA / "gpt2-base.pickle.gz", CUDA / "gpt2-oom.pickle.gz", "--fail-over-pct", "1e6")
    assert code == 1 and "PASS  device 0 peak" in out
    assert ("FAIL  finding A002 out-of-memory: head: device 0: OOM at event 229: asked for 768.00 MiB with 666.19 MiB "
            "free on the device (fails on A002: default)") in out


def _warnings(out: str) -> List[str]:
    return [line for line in out.splitlines() if re.match(r"(warning|error|note): [A-Z]\d{3} ", line)]


def test_a_gate_warns_of_the_trace_as_the_diff_of_the_same_two_runs(tmp_path, capsys):
    # Both record 3 steps (their .facts.json, written by the capture): gradient accumulation doubles
    # the events of each step (8,291 -> 18,096), not the work recorded; the OOM run stops in step 0,
    # recorded by a torch that writes trace.device_free (T007). A baseline kept neither the steps nor
    # the keys: the gate warned of the first pair's events and never of the second's keys.
    facts = {name: json.loads((CUDA / f"{name}.pickle.facts.json").read_text())["steps"]
             for name in ("gpt2-sgd", "gpt2-accum2", "gpt2-base")}
    assert facts == {"gpt2-sgd": 3, "gpt2-accum2": 3, "gpt2-base": 3}
    for base, head, t010 in (("gpt2-sgd", "gpt2-accum2", None),
                             ("gpt2-base", "gpt2-oom", "warning: T010 device 0: event counts differ 43.1x "
                                                       "(9,922 -> 230 events, 3 -> 1 steps): the runs may not record "
                                                       "the same work")):
        b, h, stored = CUDA / f"{base}.pickle.gz", CUDA / f"{head}.pickle.gz", tmp_path / f"{base}.json"
        _, said, _ = cli(capsys, b, h)
        assert cli(capsys, "baseline", b, "-o", stored)[0] == 0
        _, gated, _ = cli(capsys, "gate", h, "--baseline", stored)
        assert [w for w in _warnings(said) if "T010" in w] == [w for w in _warnings(gated) if "T010" in w] == \
            ([t010] if t010 else [])
        trace_codes = [[w.split()[1] for w in _warnings(out) if w.split()[1].startswith("T")] for out in (said, gated)]
        assert trace_codes[0] == trace_codes[1] == (["T007", "T010"] if t010 else [])
    # A baseline made before baselines kept their step count: the warning says the steps are unknown.
    old = tmp_path / "old.json"
    doc = json.loads((tmp_path / "gpt2-sgd.json").read_text())
    del doc["devices"][0]["step_count"]
    old.write_text(json.dumps(doc))
    _, gated, _ = cli(capsys, "gate", CUDA / "gpt2-accum2.pickle.gz", "--baseline", old)
    assert [w for w in _warnings(gated) if "T010" in w] == [
        "warning: T010 device 0: event counts differ 2.2x (8,291 -> 18,096 events, steps unknown: the baseline was "
        "made by an earlier memdiff, which kept no step count; `memdiff baseline` again stores it): the runs may not "
        "record the same work"]


def test_a_gate_fails_on_kept_memory_growing_step_over_step_as_the_diff_of_the_same_two_runs(tmp_path, capsys):
    # Both runs keep something of every step, so each grows step over step (gpt2-keep-weights: a copy of
    # the weights; gpt2-log-tensor: the loss as a tensor, 7.31 GiB then 9.85 GiB). The diff of the two says
    # K002 and passes; the gate against keep-weights' baseline, which kept no step peaks, failed on K004.
    base, head = CUDA / "gpt2-keep-weights.pickle.gz", CUDA / "gpt2-log-tensor.pickle.gz"
    stored, old = tmp_path / "kw.json", tmp_path / "old.json"
    code, said, _ = cli(capsys, base, head, "--fail-over-pct", "1000")
    assert code == 0 and [w.split()[1] for w in _warnings(said)] == ["K002"]
    assert cli(capsys, "baseline", base, "-o", stored, "--fail-over-pct", "1000")[0] == 0
    doc = json.loads(stored.read_text())
    assert len(doc["devices"][0]["step_peaks"]) == 2  # steps 1 and 2 (step 0 builds AdamW's state)
    code, gated, _ = cli(capsys, "gate", head, "--baseline", stored)
    assert code == 0 and [w.split()[1] for w in _warnings(gated)] == [w.split()[1] for w in _warnings(said)]
    # A baseline made before it kept step peaks: the failure says what is unknown.
    del doc["devices"][0]["step_peaks"]
    old.write_text(json.dumps(doc))
    code, gated, _ = cli(capsys, "gate", head, "--baseline", old)
    assert code == 1 and "7.31 GiB, 9.85 GiB; 2.54 GiB live at the peak was allocated by earlier steps; whether " \
        "the baseline's run grew too is unknown: it was made by an earlier memdiff, which kept no step peaks " \
        "(`memdiff baseline` again stores them)" in gated


def test_every_format_shows_the_findings_in_the_reports_one_order(tmp_path, capsys, monkeypatch):
    # gpt2-oom ran out of memory in step 0's forward (A002, an error) after 230 events (T010), with
    # another torch's keys (T007) and its peak in the forward, not the backward (P001). Markdown grouped
    # them by severity and the other formats kept the order they were found in: A002 came first there
    # and last elsewhere. The report holds one order (severity, code, device) and every format shows it.
    base, head, page = CUDA / "gpt2-base.pickle.gz", CUDA / "gpt2-oom.pickle.gz", tmp_path / "r.html"
    order = ["A002", "P001", "T007", "T010"]
    finding_line = re.compile(r"^(?:error|warning|note): ([A-Z]\d{3}) ")
    _, text, _ = cli(capsys, base, head, "--html", page)
    before_devices = text.split("\ndevice 0:")[0]
    assert [m.group(1) for m in map(finding_line.match, before_devices.splitlines()) if m] == order
    _, markdown, _ = cli(capsys, base, head, "--format", "markdown")
    assert re.findall(r"^> `([A-Z]\d{3})`", markdown, re.M) == order
    _, out, _ = cli(capsys, base, head, "--format", "json")
    doc = json.loads(out)
    # the JSON's findings are every finding shown, the judge's G002 (the page's verdict note) among them
    assert [f["code"] for f in doc["findings"]] == ["A002", "G002", *order[1:]]
    judged = [f"device {f['device']}: {f['message']}" for f in doc["findings"] if f["code"] == "G002"]
    assert judged == doc["notes"]
    warned = [f for f in doc["findings"] if f["severity"] != "error"]  # why the runs may not compare: the same order
    assert len(doc["warnings"]) == len(warned) and all(w.endswith(f["message"]) for w, f in zip(doc["warnings"], warned))
    # The page shows the verdict and its notes (G002) first, then the findings; each code's documentation
    # at its foot follows the page.
    html = page.read_text()
    shown = re.findall(r'<p class="(?:error|warning|muted)"><a class="mono" href="#rule-[a-z0-9]+">([A-Z]\d{3})</a>',
                       html.split('id="toolbar"')[0])
    assert shown == ["G002", *order]
    assert re.findall(r'<details id="rule-([a-z0-9]+)"', html) == [c.lower() for c in ["G002", *order]]
    monkeypatch.setenv("RUNNER_TEMP", str(tmp_path))
    for name in ("GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT", "GITHUB_EVENT_PATH"):
        monkeypatch.delenv(name, raising=False)
    _, annotated, _ = cli(capsys, base, head, "--github")
    assert re.findall(r"^::(?:error|warning) title=memdiff ([A-Z]\d{3}) ", annotated, re.M) == order


def test_the_peak_report_shows_its_findings_in_the_reports_one_order(tmp_path, capsys):
    # gpt2-keep-weights keeps a copy of its weights each step: its kept memory (K001, a note) grows step
    # over step (K004, an error). `memdiff peak` showed them in the order found, K001 first, where the
    # diff, the gate and every other report put the error first (severity, then code).
    run, page = CUDA / "gpt2-keep-weights.pickle.gz", tmp_path / "p.html"
    order = ["K004", "C001", "K001"]  # the error, then the notes by code
    _, text, _ = cli(capsys, "peak", run, "--top", "1", "--html", page)
    assert re.findall(r"^(?:error|warning|note): ([A-Z]\d{3}) ", text, re.M) == order
    shown = re.findall(r'<p class="(?:error|warning|muted)"><a class="mono" href="#rule-[a-z0-9]+">([A-Z]\d{3})</a>',
                       page.read_text())
    assert shown == order
    _, out, _ = cli(capsys, "peak", run, "--top", "1", "--format", "json")
    assert [f["code"] for f in json.loads(out)["findings"]] == order


def test_every_surface_shows_the_code(tmp_path, capsys, shared):
    base, head = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    page = tmp_path / "r.html"
    code, out, _ = cli(capsys, base, head, "--format", "markdown", "--html", page)
    assert "> `P001` device 0: the peaks are in different phases" in out
    assert "`G002` device 0: peak grew by 1.95 GiB" in out
    html = page.read_text()
    assert '<a class="mono" href="#rule-p001">P001</a> device 0: the peaks are in different phases' in html
    assert '<details id="rule-p001" open><summary><strong>P001 peaks-in-different-phases</strong>' in html
    assert html.count('id="rule-') == 2  # P001 and G002: the codes shown, each documented once



# The scenario suite's pairs (captured on CPU by tests/scenarios/train.py): the changes teams make,
# and the codes each pair and run emits under the default rule.
SCENARIO_PAIRS = [
    ("gpt2-base", "gpt2-batch2x", ["G002"], False),
    ("gpt2-log-item", "gpt2-log-tensor", ["K002", "K004"], False),  # a loss kept as a tensor: fails by K004
    ("gpt2-eval-no-grad", "gpt2-eval-grad", ["G002", "K002", "K003"], False),  # eval without no_grad: K003
    ("gpt2-base", "gpt2-eval-grad", ["G002", "K002", "K003"], False),
    ("lstm-base", "lstm-keep-weights", ["K002", "K004"], False),  # weight copies kept each step: K004
    # The changes that keep nothing read as no finding, and pass: no code fires for them.
    ("gpt2-base", "gpt2-checkpoint", [], True),
    ("gpt2-checkpoint", "gpt2-base", [], True),
    ("gpt2-base", "gpt2-accum", [], True),
    ("gpt2-base", "gpt2-autocast", [], True),
    ("gpt2-base", "gpt2-sgd", [], True),
    ("gpt2-base", "gpt2-debug", [], True),
]
# Every run is recorded after its model and optimizer were built: its weights, updated in place by the steps,
# are parameter by the order of those updates, not by a stack of their own (C001).
SCENARIO_RUNS = {"gpt2-base": ["C001"], "gpt2-batch2x": ["C001"], "gpt2-eval-no-grad": ["C001"],
                 "gpt2-eval-grad": ["C001", "K001"], "gpt2-log-item": ["C001", "K001"],
                 "gpt2-log-tensor": ["C001", "K001", "K004"], "lstm-base": ["C001"],
                 "lstm-keep-weights": ["C001", "K001", "K004"], "gpt2-checkpoint": ["C001"], "gpt2-accum": ["C001"],
                 "gpt2-autocast": ["C001"], "gpt2-sgd": ["C001"], "gpt2-debug": ["C001"]}


@pytest.mark.slow  # the scenario suite's captures
def test_the_codes_of_the_scenario_pairs_are_pinned(scenarios):
    paths = scenarios(*SCENARIO_RUNS)
    rules = load_rules()
    runs = {name: read_summary(str(path), rules) for name, path in paths.items()}
    got = {name: sorted({f.code for f in source_findings(s) + [f for p in peak_report(name, s, 10)
                                                                 for f in p.findings]})
           for name, s in runs.items()}
    assert got == SCENARIO_RUNS
    for base, head, codes, passed in SCENARIO_PAIRS:
        report = compare([Run(runs[base])], [Run(runs[head])], Settings())
        got_pair = (sorted({f.code for f in report.findings + report.notes}), report.passed)
        assert got_pair == (codes, passed), (base, head)


def test_the_json_of_every_command_carries_its_findings(validate, capsys, tmp_path):
    code, out, _ = cli(capsys, "peak", CUDA / "gpt2-oom.pickle.gz", "--format", "json")
    doc = json.loads(out)
    validate("summary", doc)
    assert [(f["code"], f["device"], f["data"]["requested_bytes"]) for f in doc["findings"] if f["code"] == "A002"] \
        == [("A002", 0, 768 * MiB)]
    code, out, _ = cli(capsys, CUDA / "gpt2-base.pickle.gz", CUDA / "gpt2-oom.pickle.gz", "--format", "json")
    doc = json.loads(out)
    validate("diff", doc)
    assert code == 1 and [(f["code"], f["run"]) for f in doc["findings"] if f["severity"] == "error"] == [
        ("A002", "head"), ("G002", None)]
    assert doc["finding_checks"][0]["code"] == "A002"
    code, out, _ = cli(capsys, "whatif", CUDA / "gpt2-base.pickle.gz", "--format", "json")
    doc = json.loads(out)
    validate("whatif", doc)
    assert [f["code"] for f in doc["findings"]] == ["W006"]
