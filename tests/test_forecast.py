"""memdiff forecast: exact fits on hand-built loops, refusals, the JSON contract, and CPU captures
of real models whose forecast is checked against a capture at that size (PyTorch's own count)."""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import ROOT, alloc, free, py_frames

import memdiff
from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.errors import InputError
from memdiff.inert import md_text
from memdiff.predict.forecast.course import KnobRun, parse_run
from memdiff.predict.forecast.engine import _fit
from memdiff.read.inputs import read_summary
from memdiff.read.schema import validate
from memdiff.units import format_bytes

FWD = py_frames("model.py:10:forward")
BWD = py_frames("/v/site-packages/torch/autograd/__init__.py:1:backward")
OPT = py_frames("/v/site-packages/torch/optim/adam.py:1:step")
INIT = py_frames("/v/site-packages/torch/optim/adam.py:2:_init_group")


def loop(b: int, steps: int = 2, weights: int = 4000, model: str = "model.py") -> Dict[str, Any]:
    """A training loop at batch `b`: weights (constant), activations linear and quadratic in b,
    gradients and optimizer state constant, an optimizer temporary. Small b peaks in the
    optimizer step, large b in the backward."""
    fwd = py_frames(f"{model}:10:forward")
    trace: List[Dict[str, Any]] = [alloc(1, weights, fwd)]
    addr = 100
    for step in range(steps):
        acts = [(addr, 100 * b), (addr + 1, 10 * b * b)]
        addr += 2
        trace += [alloc(a, s, py_frames(f"{model}:{20 + k}:forward")) for k, (a, s) in enumerate(acts)]
        grad = addr
        addr += 1
        trace += [alloc(grad, weights, BWD)] + [free(a, s, BWD) for a, s in acts]
        if step == 0:
            trace.append(alloc(2, 2 * weights, INIT))
        trace += [alloc(addr, 600, OPT), free(addr, 600, OPT), free(grad, weights, OPT)]
        addr += 1
    return {"segments": [], "device_traces": [trace]}


def actual_peak(b: int, weights: int = 4000) -> int:
    optimizer = weights + weights + 2 * weights + 600
    backward = weights + 100 * b + 10 * b * b + weights + 2 * weights * 1  # step 1: state exists
    return max(optimizer, backward)


@pytest.fixture
def series(write_snapshot):
    def make(values, **kw) -> List[str]:
        return [f"{write_snapshot(loop(v, **kw), f'b{v}.pickle')}={v}" for v in values]
    return make


def test_fit_picks_the_simplest_exact_form():
    assert _fit([(1, 5), (2, 5), (4, 5)])[0] == 0
    assert _fit([(1, 10), (2, 20), (4, 40)]) == (1, (0.0, 10.0, 0.0))
    assert _fit([(1, 11), (2, 44), (4, 176)])[0] == 2
    assert _fit([(1, 1), (2, 3), (4, 9), (8, 100)])[0] == 3  # four points no quadratic passes through
    assert _fit([(2, 8), (4, 16)])[0] == 1


def test_replay_finds_the_moved_peak_exactly(series, capsys):
    runs = series((1, 2, 4))
    assert main(["forecast", *runs, "--at", "64", "128", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("forecast", doc, "forecast")
    d = doc["devices"][0]
    assert [p["peak_bytes"] for p in d["predictions"]] == [actual_peak(64), actual_peak(128)]
    assert d["predicted_peak_bytes"] == actual_peak(64)
    assert d["predictions"][0]["phase"] == "backward"
    assert d["runs"][-1]["actual_phase"] == "optimizer"
    assert d["method"] == "events" and d["fit_error_pct"] == 0.0
    assert d["forms"]["optimizer_state"] == "constant"


def test_budget_gives_the_largest_value_that_fits(series, capsys):
    runs = series((1, 2, 4))
    budget = actual_peak(50)
    assert main(["forecast", *runs, "--budget", f"{budget}B", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["max_value_within_budget"] == 50
    assert main(["forecast", *runs, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"][0]["max_value_within_budget"] is None


def test_two_runs_are_a_linear_forecast_and_say_so(series, capsys):
    assert main(["forecast", *series((2, 4)), "--at", "8"]) == 0
    out = capsys.readouterr().out
    assert "a linear forecast from two runs" in out and "constant or linear only" in out


def attention_loop(seq: int) -> Dict[str, Any]:
    """One step of a model at sequence length `seq`: weights (constant), a projection's output (64 seq bytes)
    and attention scores (seq x seq, 4 bytes each), freed in the backward."""
    trace = [alloc(1, 4096, py_frames("model.py:5:__init__")), alloc(2, 64 * seq, py_frames("model.py:20:project")),
             alloc(3, 4 * seq * seq, py_frames("model.py:30:scores")),
             alloc(4, 4096, BWD), free(3, 4 * seq * seq, BWD), free(2, 64 * seq, BWD)]
    return {"segments": [], "device_traces": [trace]}


def test_two_runs_say_what_grew_faster_than_a_line_and_by_what_power(write_snapshot, capsys):
    # The scores are seq^2 x 4 bytes: from 64 to 128 they grow 4x, the knob's 2x to the power 2, the
    # projection 2x, the power 1. Two runs fit lines; they still show that growth (before, the headline said
    # "unchecked" and nothing of it), and the scores' line gives 114,688 B at 256 where the loop allocates 262,144.
    runs = [f"{write_snapshot(attention_loop(s), f's{s}.pickle')}={s}" for s in (64, 128)]
    assert main(["forecast", *runs, "--at", "256", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["growth_between"] == [64, 128]
    sites = {s["site"]: s for s in d["predictions"][0]["sites"]}
    assert (sites["model.py:scores"]["runs_ratio"], sites["model.py:scores"]["runs_power"]) == (4.0, 2.0)
    assert (sites["model.py:project"]["runs_ratio"], sites["model.py:project"]["runs_power"]) == (2.0, 1.0)
    (w015,) = [f for f in d["findings"] if f["code"] == "W015"]
    assert w015["severity"] == "warning" and w015["data"]["count"] == 1
    assert "model.py:scores grew 4.00x for 2.00x the knob (64 to 128), as its power 2.00" in w015["message"]
    assert "unchecked (no third run to leave out), and between the runs model.py:scores" in d["headline"]
    assert main(["forecast", *runs, "--at", "256"]) == 0
    out = capsys.readouterr().out
    assert "64 to 128" in out and "4.00x (power 2.00)" in out and "2.00x (power 1.00)" in out
    # the tables' cells are the forecast's: the JSON carries the words the text shows (it had only the numbers)
    assert (sites["model.py:scores"]["runs_growth_text"], sites["model.py:project"]["runs_growth_text"]) == \
        ("4.00x (power 2.00)", "2.00x (power 1.00)")
    assert [(r["fitted_text"], r["error_text"]) for r in d["runs"]] == [("yes", ""), ("yes", "")]  # two: unchecked


def test_two_real_runs_show_attention_growing_with_the_square_of_the_context(shared, capsys):
    # The cs336 Transformer at context 128 and 256: its attention scores (the softmax over q k^T, and the
    # causal mask compared to make them) are context x context per head, so they grow 4x when the context
    # doubles, and the q, k, v projections 2x. Two runs fit lines; before, the forecast called itself
    # "unchecked" and said nothing of the 4x.
    a, b = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    assert main(["forecast", f"{a}=128", f"{b}=256", "--at", "512", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    sites = {s["site"]: s for s in d["predictions"][0]["sites"]}
    softmax = [s for name, s in sites.items() if name.startswith("nn_utils.py:softmax")]
    assert len(softmax) == 2 and all(s["runs_power"] == 2.0 and s["runs_ratio"] == 4.0 for s in softmax)
    assert sites["functional.py:einsum <- einsum <- clone"]["runs_power"] == 1.0
    (w015,) = [f for f in d["findings"] if f["code"] == "W015"]
    assert w015["data"]["count"] == 3  # the two softmax sites and the causal mask (model.py:forward <- ge_Tensor)
    assert "nn_utils.py:softmax" in d["headline"] and "as its power 2.00" in d["headline"]
    # Each site the warning counts is a row of the table it points to: the mask, 1.50 MiB in the larger run,
    # grew least of all and was beyond the five rows that grew most, so no output showed it.
    counted = [x["site"] for x in w015["data"]["faster_sites"]]
    assert "model.py:forward <- ge_Tensor" in counted and set(counted) <= set(sites)
    assert main(["forecast", f"{a}=128", f"{b}=256", "--at", "512"]) == 0
    table = capsys.readouterr().out.split("growing site", 1)[1]
    assert all(f"\n{site} " in table for site in counted)


def test_w015_says_how_many_sites_the_table_leaves_out_and_where_they_are(write_snapshot, capsys):
    # Five projections grow with the sequence (64 x seq x 1,000 B each) and seven score tensors with its square
    # (4 seq^2 B): the projections grow most, the scores faster. The table adds up to five of the seven; the
    # warning counted seven and named none of the other two.
    def loop(seq: int) -> Dict[str, Any]:
        trace = [alloc(1 + k, 64_000 * seq, py_frames(f"model.py:{10 + k}:project{k}")) for k in range(5)]
        trace += [alloc(10 + k, 4 * seq * seq, py_frames(f"model.py:{30 + k}:scores{k}")) for k in range(7)]
        return {"segments": [], "device_traces": [trace]}
    runs = [f"{write_snapshot(loop(s), f's{s}.pickle')}={s}" for s in (64, 128)]
    assert main(["forecast", *runs, "--at", "256", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    (w015,) = [f for f in d["findings"] if f["code"] == "W015"]
    shown = {x["site"] for x in d["predictions"][0]["sites"]}
    counted = {x["site"] for x in w015["data"]["faster_sites"]}
    assert counted == {f"model.py:scores{k}" for k in range(7)} and len(shown & counted) == 5
    assert {f"model.py:project{k}" for k in range(5)} <= shown
    assert w015["message"].endswith("forecasts 7 such sites too low (a third run fits a quadratic); the growing-site "
                                    "table shows 5 of them, and the forecast's JSON (--format json) names all 7 in "
                                    "this warning's data")


def test_text_markdown_and_html(series, capsys, tmp_path):
    runs = series((1, 2, 4))
    page = tmp_path / "f.html"
    assert main(["forecast", *runs, "--at", "64", "--budget", "1GiB", "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("memdiff: device 0: predicted peak") and "in the backward" in text
    assert "<table>" in page.read_text()
    # The page says what the text says above the tables: the runs and what the budget is compared with.
    budget = next(line for line in text.splitlines() if line.startswith("budget 1.00 GiB: "))
    assert f"<p>{html.escape(budget)}</p>" in page.read_text() and "<p>runs: <code>b1.pickle</code>=1, " in page.read_text()
    assert main(["forecast", *runs, "--at", "64", "--format", "markdown"]) == 0
    assert "| growing site" in capsys.readouterr().out


def test_every_format_says_the_budget_the_alignment_and_the_largest_value_within_it(series, capsys, tmp_path):
    # Only the text said what the budget is compared with, how the runs line up, what the tables are at and
    # the largest value within the budget; the forecast document holds the sentences and every format shows
    # them. The loop's peak at batch 50 is the budget: 50 is the largest value within it (actual_peak).
    runs, page = series((1, 2, 4)), tmp_path / "f.html"
    flags = ["forecast", *runs, "--at", "64", "--budget", f"{actual_peak(50)}B"]
    assert main([*flags, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("forecast", doc, "forecast")
    d = doc["devices"][0]
    said = [doc["budget_line"], d["alignment"], d["at_peak"], d["within_line"]]
    assert d["within_line"] == "largest value within the budget: 50" and d["max_value_within_budget"] == 50
    assert doc["budget_line"].startswith(f"budget {format_bytes(actual_peak(50))}: the budget is compared with the peak")
    assert d["at_peak"] == "at the predicted peak for 64 (backward, step 1)"
    assert main([*flags, "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert main([*flags, "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    for sentence in said:
        assert sentence in text and md_text(sentence) in markdown and html.escape(sentence) in page.read_text()
    # Each note its own line (a hard break), as the diff's alerts: markdown ran the cs336 pair's W008, W010
    # and W015 into one paragraph. Two runs give W010 at least.
    assert main(["forecast", *series((1, 2)), "--at", "64", "--format", "markdown"]) == 0
    quoted = [line for line in capsys.readouterr().out.splitlines() if line.startswith("> ")]
    assert quoted and all(line.endswith("  ") for line in quoted), quoted
    assert "runs   b1.pickle=1, b2.pickle=2, b4.pickle=4" in text  # and the page, which named no run
    assert "<p>runs: <code>b1.pickle</code>=1, <code>b2.pickle</code>=2, <code>b4.pickle</code>=4</p>" in page.read_text()


@pytest.mark.parametrize("argv, says", [
    (["b1.pickle"], "RUN=VALUE"),
    (["x.pickle=0", "y.pickle=2"], "positive integer"),
    (["x.pickle=a", "y.pickle=2"], "positive integer"),
])
def test_bad_run_arguments_exit_2(argv, says, capsys):
    assert main(["forecast", *argv]) == 2
    assert says in capsys.readouterr().err


def test_runs_that_are_not_one_loop_are_refused(series, write_snapshot, capsys):
    runs = series((1, 2))
    other = write_snapshot(loop(4, weights=8000, model="other.py"), "other.pickle")
    assert main(["forecast", *runs, f"{other}=4"]) == 2
    err = capsys.readouterr().err
    assert "not the same loop" in err and err.count("\n") == 1
    steps = write_snapshot(loop(4, steps=3), "steps.pickle")
    assert main(["forecast", *runs, f"{steps}=4"]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(["forecast", runs[0], runs[0].replace("=1", "=1")]) == 2
    assert "same value" in capsys.readouterr().err


def test_a_summary_is_refused(series, tmp_path, capsys):
    runs = series((1, 2))
    summary = tmp_path / "s.json"
    summary.write_text(json.dumps(read_summary(runs[0].split("=")[0], load_rules([])).to_dict()))
    assert main(["forecast", f"{summary}=1", runs[1]]) == 2
    assert "snapshot itself" in capsys.readouterr().err


def test_hostile_sizes_are_input_errors(write_snapshot, capsys):
    bad = loop(2)
    bad["device_traces"][0][1]["size"] = "big"
    path = write_snapshot(bad, "bad.pickle")
    good = write_snapshot(loop(1), "good.pickle")
    assert main(["forecast", f"{good}=1", f"{path}=2"]) == 2


def test_api_is_the_cli_json(series, capsys):
    runs = series((1, 2, 4))
    result = memdiff.forecast({r.split("=")[0]: int(r.split("=")[1]) for r in runs}, at=[64], budget="1MiB")
    assert main(["forecast", *runs, "--at", "64", "--budget", "1MiB", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result.to_dict()))
    with pytest.raises(InputError):
        memdiff.forecast({runs[0].split("=")[0]: 1})
    assert parse_run("a=b=3") == KnobRun("a=b", 3)
    # int() made a run given at 1.5 one at 1 (and True one at 1), took "٤" as 4, and at=2.5 was a TypeError.
    b1, b2 = (r.split("=")[0] for r in runs[:2])
    for given, at in (({b1: 1.5, b2: 2}, None), ({b1: True, b2: 2}, None), ({b1: "٤", b2: 2}, None),
                      ({b1: 1, b2: 2}, 2.5), ({b1: 1, b2: 2}, [2.5]), ({b1: 1, b2: 2}, ["١٦"])):
        with pytest.raises(InputError, match="is not a knob value"):
            memdiff.forecast(given, at=at)


# ---------------------------------------------------------------- CPU captures of real models

# name: (model, flags, knob flag, values given, values checked). Tiny models, two steps each.
SERIES = {
    # a large vocabulary and a short sequence: the optimizer step holds the peak at batch 1-4,
    # the backward at 8 and 16
    "gpt2-batch": ("gpt2", ["--vocab", "8000", "--seq", "16"], "--batch", (1, 2, 4), (8, 16)),
    "bert-infer-batch": ("bert", ["--inference", "--seq", "64"], "--batch", (1, 2, 4), (8, 16)),
    "bert-seq": ("bert", ["--batch", "2", "--positions", "512"], "--seq", (64, 128, 256), (512,)),
    "llama-infer-seq": ("llama", ["--inference", "--batch", "2", "--positions", "512"], "--seq", (64, 128, 256),
                        (512,)),
}


@pytest.fixture(scope="session")
def forecast_captures(torch, tmp_path_factory):
    """{series: {value: snapshot}}, captured once per session (two processes, as the scenario suite)."""
    if sys.version_info < (3, 11):
        pytest.skip("the scenario suite's transformers needs Python 3.11+")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("forecast")
    paths: Dict[str, Dict[int, Path]] = {}
    jobs: Dict[str, List[List[str]]] = {}
    for name, (model, flags, knob, given, checked) in SERIES.items():
        paths[name] = {}
        for v in (*given, *checked):
            out = folder / f"{name}-{v}.pickle"
            paths[name][v] = out
            jobs.setdefault(model, []).append(["--model", model, "--out", str(out), "--steps", "2", *flags,
                                               knob, str(v)])
    from scenario_suite import record_jobs

    record_jobs(jobs, folder)
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SERIES))
def test_forecast_within_3pct_of_the_capture(forecast_captures, name):
    _, _, _, given, checked = SERIES[name]
    runs = forecast_captures[name]
    result = memdiff.forecast({str(runs[v]): v for v in given}, at=list(checked))
    device = result.devices[0]
    rules = load_rules([])
    for p in device.predictions:
        actual = read_summary(str(runs[p.value]), rules).devices[0]
        error = 100.0 * (p.peak_bytes - actual.peak_bytes) / actual.peak_bytes
        print(f"{name} at {p.value}: predicted {p.peak_bytes:,} ({p.phase}), actual {actual.peak_bytes:,} "
              f"({actual.phase_at_peak}), error {error:+.2f}%; leave-one-out {device.fit_error_pct}%")
        assert abs(error) <= 3.0, (name, p.value, error)
        if name == "gpt2-batch":
            assert p.phase == actual.phase_at_peak == "backward"
    if name == "gpt2-batch":
        assert device.runs[-1].actual_phase == "optimizer"


@pytest.mark.slow
def test_different_models_are_refused(forecast_captures, capsys):
    bert, llama = forecast_captures["bert-seq"], forecast_captures["llama-infer-seq"]
    assert main(["forecast", f"{bert[64]}=64", f"{bert[128]}=128", f"{llama[256]}=256"]) == 2
    assert "not the same loop" in capsys.readouterr().err


def test_a_baseline_headroom_limit_fails_a_forecast_that_costs_capacity(series, write_snapshot, tmp_path,
                                                                         capsys):
    runs = series((1, 2, 4))
    baseline = tmp_path / "train.json"
    assert main(["baseline", runs[0].split("=")[0], "-o", str(baseline)]) == 0
    data = json.loads(baseline.read_text())
    data["thresholds"]["headroom"] = {"budget": actual_peak(50), "min-value": 50}
    baseline.write_text(json.dumps(data))
    assert main(["baseline", "--check", str(baseline)]) == 0
    capsys.readouterr()
    assert main(["forecast", *runs, "--baseline", str(baseline), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("forecast", doc, "forecast")
    assert doc["headroom"]["passed"] and doc["devices"][0]["max_value_within_budget"] == 50
    # a change that costs capacity: heavier weights leave room for fewer samples
    heavier = [f"{write_snapshot(loop(v, weights=4100), f'h{v}.pickle')}={v}" for v in (1, 2, 4)]
    page = tmp_path / "f.html"
    assert main(["forecast", *heavier, "--baseline", str(baseline), "--html", str(page)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  headroom (device 0): the largest value within" in out and "limit: fail below 50" in out
    # The page says the failing check too (it showed the tables, and no verdict).
    failed = next(line for line in out.splitlines() if line.startswith("FAIL  headroom"))
    assert html.escape(failed) in page.read_text()
    result = memdiff.forecast({r.split("=")[0]: int(r.split("=")[1]) for r in heavier}, baseline=baseline)
    assert result.headroom is not None and not result.headroom.passed
    # a baseline without the limit is bad input for --baseline, and a second budget is refused
    del data["thresholds"]["headroom"]
    baseline.write_text(json.dumps(data))
    assert main(["forecast", *runs, "--baseline", str(baseline)]) == 2
    assert "no headroom limit" in capsys.readouterr().err


def test_a_headroom_check_on_a_line_that_forecasts_too_low_says_at_most(write_snapshot, tmp_path, capsys):
    # Attention scores (seq x seq) grow 4x from 64 to 128: above 128 the line of two runs forecasts
    # them too low (W015), so the largest value it finds within the budget is only an upper bound.
    runs = [f"{write_snapshot(attention_loop(s), f's{s}.pickle')}={s}" for s in (64, 128)]
    baseline = tmp_path / "attn.json"
    assert main(["baseline", runs[0].split("=")[0], "-o", str(baseline)]) == 0
    data = json.loads(baseline.read_text())
    data["thresholds"]["headroom"] = {"budget": 2**20, "min-value": 256}
    baseline.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["forecast", *runs, "--baseline", str(baseline), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    largest = doc["devices"][0]["max_value_within_budget"]
    # the loop allocates 4 x seq^2 bytes of scores: past 1 MiB at that value, whatever the line says
    assert 4 * largest**2 > 2**20 and doc["devices"][0]["within_text"] == f"at most {largest:,}"
    assert f"the largest value within 1.00 MiB is at most {largest:,}, limit" in doc["headroom"]["line"]


def test_hostile_and_empty_runs_are_one_line_exit_2(write_snapshot, capsys):
    empty = [write_snapshot({"segments": [], "device_traces": [[]]}, f"e{k}.pickle") for k in (1, 2)]
    assert main(["forecast", f"{empty[0]}=1", f"{empty[1]}=2"]) == 2
    assert "nothing to forecast" in capsys.readouterr().err
    one = write_snapshot({"segments": [], "device_traces": [[alloc(1, 10)]]}, "one.pickle")
    two = write_snapshot({"segments": [], "device_traces": [[alloc(1, 20)]]}, "two.pickle")
    for argv in (["--at", str(10**30)], [f"{one}={10**4000}"], [f"{one}={'9' * 5000}"]):  # past int()'s 4300 digits
        assert main(["forecast", f"{one}=1", f"{two}=2", *argv]) == 2
        err = capsys.readouterr().err
        assert "is not a knob value" in err and err.count("\n") == 1 and len(err) < 300
    # far from the runs sizes are capped, never wrapped around
    assert main(["forecast", f"{one}=1", f"{two}=3", "--at", str(2**40), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert 0 < d["predicted_peak_bytes"] <= 2**62
    assert main(["forecast", f"{one}=1", f"{two}=3", "--at", "5", "--budget", "1KiB", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["predicted_peak_bytes"] == 30 and d["max_value_within_budget"] == 203  # 5x + 5 <= 1024


def test_real_runs_whose_traces_differ_are_lined_up_by_stack_and_say_so(shared, capsys):
    # The shared cs336 runs at context 128 and 256 are ring-buffer traces that start at different
    # moments: few allocations line up one for one, so they are lined up by stack, and the
    # report says that, and that two runs give lines only.
    a, b = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    assert main(["forecast", f"{a}=128", f"{b}=256", "--at", "512", "--budget", "80GiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("forecast", doc, "forecast")
    d = doc["devices"][0]
    assert d["method"] == "aligned" and d["fit_error_pct"] is None
    assert any("line up by stack" in n for n in d["notes"]) and any("two runs" in n for n in d["notes"])
    assert d["predicted_peak_bytes"] > d["runs"][-1]["actual_peak_bytes"]
    assert doc["overhead_ratio"] > 1  # CUDA runs carry segments: reserved over allocated
    # The line's largest value within 80 GiB is no value the model fits: each softmax site holds
    # context x context per head (384 MiB at 256), alone past the budget there. It said "12,058"
    # plainly beside W015; it is an upper bound, and says so.
    within = d["max_value_within_budget"]
    softmax = next(s for s in d["predictions"][0]["sites"] if s["site"] == "nn_utils.py:softmax <- exp")
    assert softmax["largest_run_bytes"] == 384 * 2**20 and 384 * 2**20 * (within / 256) ** 2 > 80 * 2**30
    assert d["within_text"] == f"at most {within:,}" and d["headline"].endswith(f"80.00 GiB: at most {within:,}")


def test_what_only_the_largest_run_records_is_said_to_keep_its_size(shared, expected, capsys):
    # Forecast at 128 from the runs at 128 and 256: PyTorch's trace of the run at 128 peaks at
    # 7,013,335,044 B (expected.json), yet the replay of the run at 256 overshoots it, because
    # the allocations only that run records (no other run to fit them with) stay at their size.
    # The note must say so: "fitted from the runs that have them" read as if they were scaled.
    a, b = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx256-train.pickle"
    assert main(["forecast", f"{a}=128", f"{b}=256", "--at", "128", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["predicted_peak_bytes"] > expected[a.name]["0"]["peak_bytes"] * 1.1
    w008 = next(f for f in d["findings"] if f["code"] == "W008")
    assert w008["data"]["alone"] > 0
    assert w008["message"].endswith(f"; the {w008['data']['alone']:,} others, which only the largest run records, "
                                    "keep their size in it at every value")


def test_one_snapshot_at_two_values_is_refused(shared, tmp_path, capsys):
    # A copy-paste slip: the context-128 run given as 4 and as 8 (once by a copy). Nothing in it
    # can grow with the knob; forecasting it said every value fits 80 GiB.
    run = shared / "cs336-medium-ctx128-train.pickle"
    copy = tmp_path / "b8.pickle"
    copy.write_bytes(run.read_bytes())
    for other in (run, copy):
        assert main(["forecast", f"{run}=4", f"{other}=8", "--budget", "80GiB"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"memdiff: {other}: the same snapshot as {run} (sha256 8a8f19ab3d15), given at 4 "
                                     "and at 8: a forecast needs a run recorded at each value\n")


def test_runs_whose_peak_never_outgrows_the_budget_say_any_value_not_a_number(capsys):
    # Two H100 repeats of GPT-2 at batch 4 (tests/data/cuda, both facts files say so) given as
    # batch 4 and 8 by mistake: nothing grows, and the largest value within the budget is no
    # value at all; the search's ceiling, 1,099,511,627,776, was printed as if it were one.
    a, b = ROOT / "tests/data/cuda/gpt2-base.pickle.gz", ROOT / "tests/data/cuda/gpt2-base-again.pickle.gz"
    assert main(["forecast", f"{a}=4", f"{b}=8", "--at", "16", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "1,099,511,627,776" not in out
    assert out.splitlines()[0].endswith("; largest value within 80.00 GiB: any (the predicted peak never outgrows it)")
    assert "\nlargest value within the budget: any (the predicted peak never outgrows it)\n" in out
    assert main(["forecast", f"{a}=4", f"{b}=8", "--at", "16", "--budget", "80GiB", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    validate("forecast", doc, "forecast")
    assert doc["devices"][0]["within_text"] == "any (the predicted peak never outgrows it)"


def test_different_real_models_are_refused(shared, capsys):
    a, b = shared / "cs336-medium-ctx128-train.pickle", shared / "linear-grad.pickle"
    assert main(["forecast", f"{a}=1", f"{b}=2"]) == 2
    err = capsys.readouterr().err
    assert "not the same loop" in err and err.count("\n") == 1


def test_a_training_run_and_an_inference_run_are_refused(shared, capsys):
    # The inference run's few allocations all line up inside the training run's: lining up only
    # the largest run's allocations took them for one loop and predicted 1.62 GiB at 4 though the
    # run at 1 peaks at 6.53 GiB.
    train, infer = shared / "cs336-medium-ctx128-train.pickle", shared / "cs336-medium-ctx128-infer.pickle"
    for argv in ([f"{train}=1", f"{infer}=2"], [f"{infer}=1", f"{train}=2"]):
        assert main(["forecast", *argv]) == 2
        err = capsys.readouterr().err
        assert "not the same loop" in err and "inference" in err and err.count("\n") == 1


def test_a_run_that_records_much_more_is_refused_and_the_share_reads_true(write_snapshot, capsys):
    # No phases here: only the share of the other run's own allocations that line up tells them apart.
    small = [alloc(k, 100 * (k + 1), py_frames(f"model.py:{10 + k}:forward")) for k in range(3)]
    extra = [alloc(10 + k, 50, py_frames(f"extra.py:{k + 1}:helper")) for k in range(5)]
    ref = write_snapshot({"segments": [], "device_traces": [small]}, "ref.pickle")
    more = write_snapshot({"segments": [], "device_traces": [small + extra]}, "more.pickle")
    assert main(["forecast", f"{more}=1", f"{ref}=2"]) == 2
    err = capsys.readouterr().err
    assert "not the same loop" in err and "38% of its allocations" in err and err.count("\n") == 1
    # one extra allocation in eight: lined up, and the note says what lines up on each side
    six = small + [alloc(20 + k, 100 * (k + 1), py_frames(f"model.py:{10 + k}:forward")) for k in range(3)]
    few = write_snapshot({"segments": [], "device_traces": [six + extra[:1]]}, "few.pickle")
    ref2 = write_snapshot({"segments": [], "device_traces": [six]}, "ref2.pickle")
    assert main(["forecast", f"{few}=1", f"{ref2}=2", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    note = next(n for n in d["notes"] if "do not record the same allocations" in n)
    assert "every allocation of the largest run lines up" in note and "85.7% of each other run's" in note
    assert "100.0%" not in note and "the others are fitted" not in note


def test_sizes_no_polynomial_fits_are_counted_and_said(write_snapshot, capsys):
    runs = [f"{write_snapshot({'segments': [], 'device_traces': [[alloc(1, size)]]}, f'x{v}.pickle')}={v}"
            for v, size in ((1, 10), (2, 20), (3, 40), (4, 100))]
    assert main(["forecast", *runs, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["unfitted_allocations"] == 1 and d["unfitted_bytes"] == 100 and d["forms"] == {"other": "none"}
    assert any("fit no polynomial" in n for n in d["notes"])


def test_memory_from_before_the_trace_can_be_the_peak(write_snapshot, capsys):
    # a ring-buffer trace that starts by freeing what was live before it: the peak is before its
    # first event (as normalize counts it), and so is the forecast's
    runs = [write_snapshot({"segments": [], "device_traces": [[free(1, 100 * v), alloc(2, 10 * v)]]}, f"r{v}.pickle")
            + f"={v}" for v in (1, 2, 4)]
    assert main(["forecast", *runs, "--at", "8", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["predicted_peak_bytes"] == 800 and d["fit_error_pct"] == 0.0
    assert [r["actual_peak_bytes"] for r in d["runs"]] == [100, 200, 400]


def test_the_notes_are_the_catalogues_findings(write_snapshot, capsys):
    """docs/findings.md's hand-built examples of W009, W011 and W013, as `memdiff forecast` prints them."""
    from memdiff.compare.findings import BY_CODE

    def runs(name, sizes_at):
        # Each run at its own addresses: three files of one content are one snapshot, refused.
        return [f"{write_snapshot({'segments': [], 'device_traces': [[alloc(512 * v + k, s) for k, s in enumerate(sizes)]]}, f'{name}{v}.pickle')}={v}"
                for v, sizes in sizes_at]
    said = {}
    for argv in (runs("q", [(v, [100, 10 * v * v]) for v in (1, 2, 3)]),  # three runs, a quadratic size
                 runs("x", [(1, [10]), (2, [20]), (3, [40]), (4, [100])]),  # no polynomial fits
                 runs("c", [(v, [100]) for v in (1, 2, 3)]) + ["--budget", "1MiB"]):  # nothing grows
        assert main(["forecast", *argv]) == 0
        said.update({line.split()[1]: line for line in capsys.readouterr().out.splitlines()
                     if line.startswith(("note: W", "warning: W"))})
    for code in ("W009", "W011", "W013"):
        assert said[code] == BY_CODE[code].example_output
