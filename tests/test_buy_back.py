"""`--whatif` on `memdiff BASE HEAD` and `memdiff gate`: a regression's report says which changes buy
it back, computed once (predict.whatif.buyback) and shown in every output. Figures come from the
hand-built loop of test_whatif.py (its peaks worked out by hand) and from the scenario suite's
GPT-2 with the batch doubled, against the same loop with each suggested change really made."""

from __future__ import annotations

import html
import json
from typing import Any, Dict, List

import pytest
import test_ranks
import test_schemas
import test_whatif
from test_inert import run

import memdiff
from memdiff.compare.findings import BY_CODE
from memdiff.compare.limits import Limit
from memdiff.errors import InputError
from memdiff.inert import md_text

# The fixture that validates against the schemas side by side (the gate's names the diff's).
validate = test_schemas.validate

# test_whatif.loop() by hand: the peak is in the backward of step 1, 6 W of weights and Adam state
# plus both blocks' saved tensors (A + O each) and one gradient (W).
BASE_PEAK = 13200


def peak_by_hand(a: int) -> int:
    return 6 * test_whatif.W + 2 * (a + test_whatif.O) + test_whatif.W


@pytest.fixture
def pair(write_snapshot, monkeypatch):
    """pair(k) -> (base, head): the loop, and the loop whose blocks save k times the activations."""
    def make(k: int):
        base = write_snapshot(test_whatif.loop(), "base.pickle")
        monkeypatch.setattr(test_whatif, "A", k * test_whatif.A)
        head = write_snapshot(test_whatif.loop(), f"head-{k}.pickle")
        monkeypatch.undo()
        return base, head
    return make


def as_json(*argv: object) -> Any:
    code, out, err = run(*argv, "--format", "json")
    assert code in (0, 1), err
    return json.loads(out)


def test_without_the_flag_or_a_regression_nothing_is_replayed(pair, monkeypatch):
    base, head = pair(2)

    def refuse(*args, **kwargs):
        raise AssertionError("replayed without being asked")
    monkeypatch.setattr("memdiff.report.build.buy_back", refuse)
    doc = as_json(base, head, "--fail-over-pct", "5")
    assert doc["verdict"] == "fail" and "buy_back" not in doc and "buy_back_notes" not in doc
    code, out, _ = run(base, head, "--fail-over-pct", "5", "--format", "markdown")
    assert code == 1 and "What buys it back" not in out
    # Asked, but nothing regressed (the default rule allows +50% on a run this small): nothing replayed.
    doc = as_json(base, head, "--whatif")
    assert doc["verdict"] == "pass" and "buy_back" not in doc


def test_a_regression_lists_the_changes_that_bring_the_peak_back(pair, validate):
    base, head = pair(2)
    assert peak_by_hand(2 * test_whatif.A) == 19200
    doc = as_json(base, head, "--fail-over-pct", "5", "--whatif")
    validate("diff", doc)
    assert doc["devices"][0]["base_peak_bytes"] == BASE_PEAK and doc["devices"][0]["head_peak_bytes"] == 19200
    allowed = BASE_PEAK * 105 // 100
    every = {c.change: c for c in memdiff.whatif(head).devices[0].changes if c.applies}
    want = {name for name, c in every.items() if c.predicted_peak_bytes <= allowed}
    items = doc["buy_back"]
    assert {b["change"] for b in items} == want and want
    # weights=bf16 halves everything: 19200 / 2, worked out by hand.
    bf16 = next(b for b in items if b["change"] == "weights=bf16")
    assert bf16["predicted_peak_bytes"] == 9600 and bf16["delta_bytes"] == -9600
    assert bf16["text"] == "weights=bf16: -9.38 KiB, peak 9.38 KiB in the backward (within base's 12.89 KiB)"
    savings = [b["delta_bytes"] for b in items]
    assert savings == sorted(savings, reverse=True)  # the smallest saving first
    for b in items:
        assert b["enough"] and b["target_bytes"] == BASE_PEAK
        assert b["predicted_peak_bytes"] == every[b["change"]].predicted_peak_bytes
    # Checkpointing keeps each block's output and brings back one block's activation and transient
    # at a time: 6 W + O + 2 W + 2 A + T, over the rule.
    assert "checkpoint" not in want and every["checkpoint"].predicted_peak_bytes == 6000 + 100 + 2000 + 6000 + 500


def test_when_no_change_is_enough_the_largest_saving_is_named(pair, validate):
    base, head = pair(10)
    doc = as_json(base, head, "--fail-over-pct", "5", "--whatif")
    validate("diff", doc)
    every = [c for c in memdiff.whatif(head).devices[0].changes if c.applies]
    best = min(every, key=lambda c: c.predicted_peak_bytes)
    assert best.predicted_peak_bytes > BASE_PEAK * 105 // 100
    [item] = doc["buy_back"]
    assert item["change"] == best.change and not item["enough"]
    assert "not enough" in item["text"]
    assert any("no single change brings the peak back" in n for n in doc["buy_back_notes"])


def test_every_output_shows_the_same_lines(pair, tmp_path):
    base, head = pair(2)
    items: List[Dict[str, Any]] = as_json(base, head, "--fail-over-pct", "5", "--whatif")["buy_back"]
    page = tmp_path / "r.html"
    code, text_out, _ = run(base, head, "--fail-over-pct", "5", "--whatif", "--html", page)
    assert code == 1
    _, md_out, _ = run(base, head, "--fail-over-pct", "5", "--whatif", "--format", "markdown")
    assert "what buys it back" in text_out and "#### What buys it back" in md_out
    shown = page.read_text()
    assert '<section class="buy-back">' in shown
    for b in items:
        assert f"  {b['text']}\n" in text_out
        assert md_text(b["text"]) in md_out
        assert html.escape(b["text"]) in shown


def test_a_head_it_cannot_replay_is_a_note_never_a_failure(pair, tmp_path, validate):
    base, head = pair(2)
    summary = tmp_path / "head.json"
    assert run("summarize", head, "-o", summary)[0] == 0
    code, out, err = run(base, summary, "--fail-over-pct", "5", "--whatif", "--format", "json")
    assert code == 1, err  # the regression's verdict, not bad input
    doc = json.loads(out)
    validate("diff", doc)
    assert doc["buy_back"] == []
    assert any(n.startswith("what-if not run: ") and "give it the snapshot itself" in n for n in doc["buy_back_notes"])


def test_the_gate_says_it_against_the_baseline(pair, tmp_path, validate):
    base, head = pair(2)
    baseline = tmp_path / "b.json"
    assert run("baseline", base, "-o", baseline)[0] == 0
    docs = as_json("gate", head, "--baseline", baseline, "--fail-over-pct", "5", "--whatif")
    validate("gate", docs)
    items = docs[0]["buy_back"]
    assert items and all("within the baseline's 12.89 KiB" in b["text"] for b in items)


def test_the_api_gate_names_the_same_changes_as_the_cli(pair, tmp_path):
    base, head = pair(2)
    baseline = tmp_path / "b.json"
    assert run("baseline", base, "-o", baseline)[0] == 0
    cli = as_json("gate", head, "--baseline", baseline, "--fail-over-pct", "5", "--whatif")[0]
    report = memdiff.gate(head, baseline, fail_over_pct=5, whatif=True)
    assert not report.passed
    assert report.to_dict()["buy_back"] == cli["buy_back"] and cli["buy_back"]
    assert "buy_back" not in memdiff.gate(head, baseline, fail_over_pct=5).to_dict()
    with pytest.raises(InputError, match="pass its path"):
        memdiff.gate(memdiff.summarize(head), baseline, whatif=True)


@pytest.mark.slow  # the scenario suite's captures
def test_gpt2_with_the_batch_doubled_is_bought_back_as_the_real_change_measures(scenarios, validate):
    """base: GPT-2; head: the batch doubled (a regression); checkpointing and two micro-batches of the
    old batch are suggested, each predicted within 10% of the same loop with the change really made,
    and each really made passes the rule."""
    paths = scenarios("gpt2-base", "gpt2-batch2x", "gpt2-batch2x-wi-checkpoint", "gpt2-batch2x-wi-accumulate-2")
    doc = as_json(paths["gpt2-base"], paths["gpt2-batch2x"], "--fail-over-pct", "15", "--whatif")
    validate("diff", doc)
    items = {b["change"]: b for b in doc["buy_back"]}
    rule = Limit(fail_over_pct=15)
    base_peak = memdiff.summarize(paths["gpt2-base"]).devices[0].peak_bytes
    for change, made in (("checkpoint", "gpt2-batch2x-wi-checkpoint"),
                         ("accumulate=2", "gpt2-batch2x-wi-accumulate-2")):
        assert change in items and items[change]["enough"], doc["buy_back"]
        measured = memdiff.summarize(paths[made]).devices[0]
        predicted = items[change]["predicted_peak_bytes"]
        assert abs(predicted - measured.peak_bytes) <= 0.10 * measured.peak_bytes, (change, predicted, measured)
        assert items[change]["predicted_peak_phase"] == measured.phase_at_peak
        assert not rule.exceeded(base_peak, measured.peak_bytes)


def test_a_hostile_head_name_bends_no_output(pair, tmp_path):
    from test_inert import assert_markdown_inert, assert_no_command_from_data, assert_plain

    base, head = pair(2)
    summary = tmp_path / "x\n::stop-commands::tok\x1b[2J @octocat #123.json"
    assert run("summarize", head, "-o", summary)[0] == 0
    for fmt in ("text", "markdown"):
        code, out, err = run(base, summary, "--fail-over-pct", "5", "--whatif", "--format", fmt)
        assert code == 1, err
        assert "what-if not run: " in out
        assert_plain(out)
        assert_no_command_from_data(out)
        if fmt == "markdown":
            assert_markdown_inert(out, headings=3)  # the verdict, the device, what buys it back


def test_the_notes_are_the_catalogues_findings(pair, tmp_path):
    """Why nothing buys a regression back, and how the changes were found, under their codes
    (docs/findings.md's examples for W001 to W005)."""
    base, head = pair(10)
    code, out, _ = run(base, head, "--fail-over-pct", "5", "--whatif")
    lines = out.splitlines()
    assert code == 1 and "  " + BY_CODE["W004"].example_output in lines and "  " + BY_CODE["W005"].example_output in lines
    # A job: the what-if replays one run.
    jobs = [test_ranks.job(tmp_path / side, {r: test_ranks.rank_snapshot(size) for r in range(2)})
            for side, size in (("base", 100 * 2**20), ("head", 300 * 2**20))]
    out = run(*jobs, "--whatif")[1]
    assert "  " + BY_CODE["W001"].example_output in out.splitlines()
    # A peak within its rule while another check fails: nothing to buy back.
    stored = tmp_path / "b.json"
    assert run("baseline", base, "-o", stored, "--fail-over-pct", "1000")[0] == 0
    code, out, _ = run("gate", head, "--baseline", stored, "--category-fail-over", "activation=0%", "--whatif")
    assert code == 1 and "  " + BY_CODE["W002"].example_output in out.splitlines()


def test_a_change_bought_back_on_an_untraced_head_says_it_rests_on_a_guess(write_snapshot, tmp_path, validate):
    # Two snapshots dumped without a trace: segments only, every block live before the trace with no stack,
    # its category memdiff's guess (C001). The head holds 64 MiB where the base held 32 MiB; halving what
    # is read as weights would bring it back, and every output says that reading is a guess (W016).
    from conftest import block, segment

    mib = 1 << 20
    base, head = (write_snapshot({"segments": [segment(0, 0, [block(0, size)])], "device_traces": [[]]}, name)
                  for size, name in ((32 * mib, "base.pickle"), (64 * mib, "head.pickle")))
    doc = as_json(base, head, "--fail-over-pct", "5", "--whatif")
    validate("diff", doc)
    bf16 = next(b for b in doc["buy_back"] if b["change"] == "weights=bf16")
    assert bf16["guessed_bytes"] == 64 * mib and bf16["predicted_peak_bytes"] == 32 * mib
    assert "on a guess: 64.00 MiB it changes is" in bf16["text"]
    assert any("W016" not in n and "its figure rests on a guess" in n for n in doc["buy_back_notes"])
    page = tmp_path / "r.html"
    _, text_out, _ = run(base, head, "--fail-over-pct", "5", "--whatif", "--html", page)
    _, md_out, _ = run(base, head, "--fail-over-pct", "5", "--whatif", "--format", "markdown")
    for shown in (text_out, md_out, page.read_text()):
        assert "W016" in shown and "on a guess: 64.00 MiB" in shown


def test_a_change_bought_back_on_state_known_by_the_stack_that_freed_it_says_so(shared):
    # cs336's medium model at context 128 against 256 (a regression, G002): on the head, AdamW's moments are
    # older than the trace and known only by the stack that freed them (test_whatif); dropping them (SGD keeps
    # no state) buys the regression back, and the line that says so names the guess, which it left out.
    doc = as_json(shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle",
                  "--whatif")
    sgd = next(b for b in doc["buy_back"] if b["change"] == "optimizer=sgd")
    assert sgd["guessed_bytes"] == test_whatif.CS336_MEDIUM_ADAMW_STATE
    assert "on a guess: 3.15 GiB it changes is optimizer_state by the stack that freed it, W016" in sgd["text"]
    assert any(n.startswith("device 0: optimizer=sgd: its figure rests on a guess") and "by the stack that freed it" in n
               for n in doc["buy_back_notes"])
