"""`memdiff fit`: the largest batch whose emulated run trains on a GPU, checked against the emulator's own
out-of-memory error. The ground truth is `memdiff record --emulate GPU` of the unmodified scenario script at
the value fit gives (it trains, exit 0) and at the next one (the script dies of torch.OutOfMemoryError),
never fit's own arithmetic.

The scenario (tests/scenarios/fit_mlp.py) is a 4-layer, 8192-wide MLP trained with Adam on batches of
128 tokens: about 1 GiB of weights and 4 GiB with gradients and Adam's state, and some 36 MiB of
activations per sample, so an L4's 21 GiB runs out near batch 470 (the emulated runs settle where).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import List

import pytest

from memdiff.errors import InputError
from memdiff.predict.fit import FITS, OVER_LIMIT, Fewest, FitRun, Grid, Search, knob_of, parse_range
from memdiff.predict.fit_gate import judge
from memdiff.recording.emulate.gpus import gpu

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scenarios" / "fit_mlp.py"
MLP = ["--width", "8192", "--layers", "4", "--seq", "128"]
# The runs fit may make for one GPU: the two smallest values, one below the boundary, the forecast's value
# and its neighbour, and one more step for a forecast that is off by one or two.
MAX_RUNS = 6


def memdiff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memdiff", *args], capture_output=True, text=True, cwd=ROOT)


def fit(out: Path, *flags: str, script: List[str] = MLP) -> subprocess.CompletedProcess:
    return memdiff("fit", "--emulate", "l4", "-o", f"{out}/", "--format", "json", *flags, "--",
                   "python", str(SCRIPT), "--batch-size", "{batch}", *script)


def record(out: Path, batch: int, *flags: str) -> subprocess.CompletedProcess:
    return memdiff("record", "--emulate", "l4", "-o", str(out / f"truth-{batch}.pickle"), "--",
                   "python", str(SCRIPT), "--batch-size", str(batch), *MLP, *flags)


@pytest.fixture(scope="module")
def l4_fit(tmp_path_factory, torch):
    """The fit of the scenario on an emulated L4, by a script that catches its own out-of-memory errors."""
    out = tmp_path_factory.mktemp("fit")
    done = fit(out / "runs", "--html", str(out / "fit.html"), script=[*MLP, "--catch-oom"])
    assert done.returncode == 0, done.stderr
    return out, json.loads(done.stdout)


@pytest.mark.slow
def test_the_value_found_trains_and_the_next_runs_out_of_memory(l4_fit):
    out, doc = l4_fit
    (gpu,) = doc["gpus"]
    value = gpu["value"]
    assert gpu["fails"]["value"] == value + 1 and gpu["fails"]["outcome"] == "oom"
    # The ground truth: the emulated script itself, without the catch.
    fits = record(out, value)
    assert fits.returncode == 0, fits.stderr
    fails = record(out, value + 1)
    assert fails.returncode == 1 and "torch.OutOfMemoryError: CUDA out of memory" in fails.stderr, fails.stderr
    # The script caught its error and exited 0 at value + 1: fit still read the run as out of memory, and
    # words the failing request as the script saw it.
    said = fails.stderr.split("torch.OutOfMemoryError: ")[1].splitlines()[0]
    assert gpu["fails"]["oom_message"] == said
    assert "Tried to allocate" in said and "of which" in said


@pytest.mark.slow
def test_the_fit_reports_peaks_headroom_and_keeps_every_run(l4_fit):
    out, doc = l4_fit
    (gpu,) = doc["gpus"]
    runs = gpu["runs"]
    assert len(runs) <= MAX_RUNS, [(r["value"], r["why"]) for r in runs]
    assert doc["runs"] == len(runs)
    for r in runs:  # one snapshot per run, named by GPU and value
        assert Path(r["snapshot"]).name == f"l4-batch{r['value']}.pickle" and Path(r["snapshot"]).is_file()
    fits = gpu["fits"]
    assert fits["outcome"] == "fits" and fits["peak_bytes"] <= fits["reserved_peak_bytes"] <= gpu["capacity_bytes"]
    assert gpu["headroom_bytes"] == gpu["capacity_bytes"] - fits["reserved_peak_bytes"]
    # The L4 of gpus.json: 23,570,219,008 bytes less the 267,386,880 a real L4 process held outside the allocator.
    assert gpu["capacity_bytes"] == 23_570_219_008 - 267_386_880
    assert fits["phase"] in ("forward", "backward", "optimizer") and fits["site"]


@pytest.mark.slow
def test_max_memory_leaves_headroom_by_the_reserved_peak(tmp_path, l4_fit, torch):
    _, whole = l4_fit
    done = fit(tmp_path / "runs", "--max-memory", "0.5")
    assert done.returncode == 0, done.stderr
    (gpu,) = json.loads(done.stdout)["gpus"]
    limit = gpu["limit_bytes"]
    assert limit == int(0.5 * gpu["capacity_bytes"])
    assert gpu["fits"]["reserved_peak_bytes"] <= limit < gpu["fails"]["reserved_peak_bytes"]
    assert gpu["fails"]["outcome"] == "over-limit" and gpu["fails"]["value"] == gpu["value"] + 1
    assert gpu["value"] < whole["gpus"][0]["value"]


@pytest.mark.slow
def test_a_lower_value_than_the_baseline_fails_the_gate_in_one_line(tmp_path, l4_fit):
    _, doc = l4_fit
    run, base = tmp_path / "fit.json", tmp_path / "baseline.json"
    run.write_text(json.dumps(doc))
    higher = copy.deepcopy(doc)
    higher["gpus"][0]["value"] += 8
    base.write_text(json.dumps(higher))
    same = memdiff("gate", str(run), "--baseline", str(run))
    assert same.returncode == 0 and same.stdout.startswith("PASS"), same.stdout + same.stderr
    dropped = memdiff("gate", str(run), "--baseline", str(base), "--format", "markdown")
    assert dropped.returncode == 1, dropped.stderr
    value = doc["gpus"][0]["value"]
    lines = [line for line in dropped.stdout.splitlines() if "G011" in line]
    assert len(lines) == 1 and f"fit: l4 batch {value + 8:,} -> {value:,}" in lines[0]


@pytest.mark.slow
def test_a_script_failing_otherwise_is_one_line_exit_2_never_out_of_memory(tmp_path, torch):
    done = fit(tmp_path / "runs", script=[*MLP, "--fail"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "not out of memory" in done.stderr
    assert "ValueError: the data set is missing" in done.stderr
    # which run, in words: `failed on l4 at batch 2`, where it said `failed l4 at 2`
    assert re.search(r"^memdiff: fit: the script failed on l4 at batch [12]: ValueError: the data set is missing, "
                     r"called at fit_mlp.py:\d+ \(exit 1, not out of memory\)", done.stderr), done.stderr


@pytest.mark.slow
def test_a_model_that_does_not_fit_at_the_smallest_value_exits_1(tmp_path, torch):
    # 2 layers of 65536 x 65536 fp32 weights: 34 GB, more than an L4 holds before any batch.
    done = memdiff("fit", "--emulate", "l4", "-o", f"{tmp_path}/runs/", "--range", "batch=1:64", "--", "python",
                   str(SCRIPT), "--batch-size", "{batch}", "--width", "65536", "--layers", "2")
    assert done.returncode == 1, done.stderr
    assert "l4: does not fit at 1: runs out of memory" in done.stdout


def test_a_command_without_a_placeholder_is_one_line_exit_2(tmp_path):
    done = memdiff("fit", "--emulate", "l4", "-o", f"{tmp_path}/", "--", "python", str(SCRIPT), "--batch-size", "8")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no placeholder" in done.stderr
    assert not any(tmp_path.iterdir())


def test_a_missing_baseline_is_refused_before_any_run(tmp_path):
    done = memdiff("fit", "--emulate", "l4", "-o", f"{tmp_path}/runs/", "--baseline", str(tmp_path / "none.json"),
                   "--", "python", str(SCRIPT), "--batch-size", "{batch}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_an_html_path_that_cannot_be_written_is_refused_before_any_run(tmp_path):
    done = memdiff("fit", "--emulate", "l4", "-o", f"{tmp_path}/runs/", "--html", str(tmp_path), "--", "python",
                   str(SCRIPT), "--batch-size", "{batch}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is a folder" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_an_unknown_gpu_is_refused():
    done = memdiff("fit", "--emulate", "h100,v100", "-o", "x/", "--", "python", str(SCRIPT), "--batch-size",
                   "{batch}")
    assert done.returncode == 2 and "no GPU named 'v100'" in done.stderr


def test_the_knob_is_the_one_placeholder_and_its_range_names_it():
    assert knob_of(["train.py", "--seq-len", "{seq}"], {}) == "seq"
    with pytest.raises(InputError, match="2 placeholders"):
        knob_of(["train.py", "--batch", "{batch}", "--seq", "{seq}"], {})
    with pytest.raises(InputError, match="placeholder is {batch}"):
        knob_of(["train.py", "--batch", "{batch}"], dict([parse_range("seq=1:8")]))
    with pytest.raises(InputError):
        parse_range("batch=8:1")


def test_the_grid_holds_multiples_or_powers_of_two():
    assert Grid("batch", 1, 40, multiple=8).values() == [8, 16, 24, 32, 40]
    assert Grid("batch", 3, 100, pow2=True).values() == [4, 8, 16, 32, 64]
    assert Grid("batch", 1, 3).values() == [1, 2, 3]


@pytest.mark.parametrize("span", ["1:100000000", f"1:{2**70}"])
def test_a_range_of_more_values_than_a_search_walks_is_refused_before_any_run(tmp_path, span):
    # 1:100000000 built a list of a hundred million values (3.8 GB) before the first run; 2**70 was exit 3.
    done = subprocess.run(["prlimit", "--as=1000000000", "--", sys.executable, "-m", "memdiff", "fit",
                           "--emulate", "l4", "-o", f"{tmp_path}/runs/", "--range", f"batch={span}", "--", "python",
                           str(SCRIPT), "--batch-size", "{batch}"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "and fit searches at most 1,048,576: narrow --range, or give --multiple N or --pow2" in done.stderr
    assert not (tmp_path / "runs").exists()
    assert Grid("seq", 1, 2**70, pow2=True).values()[-1] == 2**70  # powers of two are few at any height
    assert len(Grid("seq", 1, 2**20).values()) == 2**20


def test_a_gpu_only_one_side_fits_is_not_compared_and_nothing_is_a_drop():
    baseline = {"knob": "batch", "gpus": [{"gpu": "h100", "value": 48}, {"gpu": "l4", "value": 8}]}
    found = judge({"h100": 40, "a100": 4}, "batch", baseline, "b.json")
    assert [f.code for f in found] == ["G011"] and found[0].message.startswith("fit: h100 batch 48 -> 40")
    assert judge({"l4": None}, "batch", baseline, "b.json")[0].message.startswith("fit: l4 batch 8 -> nothing")
    with pytest.raises(InputError, match="cannot be compared"):
        judge({"h100": 48}, "seq", baseline, "b.json")


def test_the_fits_verdict_is_one_sentence_in_every_format():
    # A fit whose L4 value fell from the baseline's 8 to 4 (G011): text said `FAIL  fit against b.json`
    # and markdown `fit against b.json: fail`; the result holds the sentence and both show it.
    from memdiff.predict.fit import FitResult, GpuFit
    from memdiff.predict.fit_gate import gated
    from memdiff.render.fit import render_markdown, render_text

    l4 = GpuFit(gpu="l4", name="NVIDIA L4", capacity_bytes=21 * 2**30, limit_bytes=21 * 2**30, value=4, fits=None,
                fails=None, headroom_bytes=None, runs=[], forecasts=[], line="l4: largest batch 4")
    result = FitResult(command=["python", "train.py"], knob="batch", grid=Grid("batch", 1, 64), max_memory=1.0,
                       gpus=[l4], runs=0, seconds=0.0, output="runs/")
    dropped = gated(result, {"knob": "batch", "gpus": [{"gpu": "l4", "value": 8}]}, "b.json")
    assert [f.code for f in dropped.findings] == ["G011"] and dropped.verdict_line == "FAIL  fit against b.json"
    assert dropped.verdict_line in render_text(dropped).splitlines()
    # Its own line: a hard break after it and after each finding (markdown ran them into one paragraph).
    md = render_markdown(dropped).splitlines()
    verdict = md.index("❌ FAIL  fit against b.json  ")
    assert md[verdict + 1].startswith("❌ error: G011 ") and md[verdict + 1].endswith("  ")


def _fit_baseline(tmp_path: Path, doc: dict, raised_by: int) -> tuple:
    """A baseline of the fit's own largest run, holding a fit whose L4 value is `raised_by` above this one's,
    and the fit result of this change: what a pull request's gate is given."""
    snapshot = doc["gpus"][0]["fits"]["snapshot"]
    head_fit, base_fit, baseline = tmp_path / "fit.json", tmp_path / "base-fit.json", tmp_path / "b" / "train.json"
    head_fit.write_text(json.dumps(doc))
    higher = copy.deepcopy(doc)
    higher["gpus"][0]["value"] += raised_by
    base_fit.write_text(json.dumps(higher))
    made = memdiff("baseline", snapshot, "-o", str(baseline), "--fit", str(base_fit))
    assert made.returncode == 0, made.stderr
    return snapshot, str(head_fit), str(baseline)


@pytest.mark.slow
def test_a_baseline_holds_the_fit_and_the_snapshot_gate_fails_when_it_drops(tmp_path, l4_fit):
    _, doc = l4_fit
    value = doc["gpus"][0]["value"]
    snapshot, head_fit, baseline = _fit_baseline(tmp_path, doc, 8)
    stored = json.loads(Path(baseline).read_text())
    assert stored["schema_version"] == 3
    assert stored["fit"]["knob"] == "batch" and stored["fit"]["gpus"] == [{"gpu": "l4", "value": value + 8}]
    md = memdiff("gate", snapshot, "--baseline", baseline, "--fit", head_fit, "--format", "markdown")
    assert md.returncode == 1, md.stdout + md.stderr
    said = [line for line in md.stdout.splitlines() if "G011" in line]
    assert len(said) == 1 and f"fit: l4 batch {value + 8:,} -> {value:,}" in said[0]
    page = tmp_path / "gate.html"
    js = memdiff("gate", snapshot, "--baseline", baseline, "--fit", head_fit, "--format", "json", "--html",
                 str(page))
    assert js.returncode == 1, js.stderr
    (report,) = json.loads(js.stdout)
    assert report["verdict"] == "fail"
    assert any(n.startswith(f"fit: l4 batch {value + 8:,} -> {value:,}") for n in report["notes"])
    # The snapshot against itself: every peak check passes, only the fit fails it.
    assert all(c["passed"] for c in report["checks"])
    assert f"fit: l4 batch {value + 8:,} -&gt; {value:,}" in page.read_text()


@pytest.mark.slow
def test_the_snapshot_gate_passes_an_equal_fit_and_never_skips_a_missing_one(tmp_path, l4_fit):
    _, doc = l4_fit
    value = doc["gpus"][0]["value"]
    snapshot, head_fit, baseline = _fit_baseline(tmp_path, doc, 0)
    same = memdiff("gate", snapshot, "--baseline", baseline, "--fit", head_fit)
    assert same.returncode == 0, same.stdout + same.stderr
    assert f"PASS  fit: l4 batch {value:,} -> {value:,}" in same.stdout.splitlines()
    # The baseline holds fit values and no fit is given: nothing compared for that check, exit 2.
    missing = memdiff("gate", snapshot, "--baseline", baseline)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "--fit" in missing.stderr
    # A fit result and a baseline without fit values: nothing to gate it against, exit 2.
    plain = tmp_path / "plain.json"
    assert memdiff("baseline", snapshot, "-o", str(plain)).returncode == 0
    unheld = memdiff("gate", snapshot, "--baseline", str(plain), "--fit", head_fit)
    assert unheld.returncode == 2 and "holds no fit values" in unheld.stderr
    # A fit of another GPU than the baseline's: the baseline's L4 was not fitted, which fails.
    other = copy.deepcopy(doc)
    other["gpus"][0]["gpu"] = "h100"
    (tmp_path / "h100.json").write_text(json.dumps(other))
    left_out = memdiff("gate", snapshot, "--baseline", baseline, "--fit", str(tmp_path / "h100.json"))
    assert left_out.returncode == 1 and f"fit: l4 batch {value:,} -> not fitted" in left_out.stdout


class _Svg(HTMLParser):
    """The fit page's charts as their elements' attributes, by GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict = {}
        self.gpu = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.gpu = a["data-gpu"]
            self.charts[self.gpu] = []
        elif self.gpu and tag in ("line", "polyline", "circle"):
            self.charts[self.gpu].append((tag, a))

    def handle_endtag(self, tag):
        if tag == "svg":
            self.gpu = ""


@pytest.mark.slow
def test_the_html_page_plots_each_run_and_the_capacity_per_gpu(l4_fit):
    out, doc = l4_fit
    page = (out / "fit.html").read_text()
    assert "<script" not in page and "http" not in page.split("</style>")[1]  # self-contained, nothing fetched
    parsed = _Svg()
    parsed.feed(page)
    assert list(parsed.charts) == [g["gpu"] for g in doc["gpus"]]
    (gpu,) = doc["gpus"]
    elements = parsed.charts["l4"]
    series = [a["data-series"] for tag, a in elements if tag == "polyline"]
    assert series == ["allocated", "reserved"]
    for name, key in (("allocated", "peak_bytes"), ("reserved", "reserved_peak_bytes")):
        points = sorted((int(a["data-value"]), int(a["data-bytes"]), a["data-outcome"])
                        for tag, a in elements if tag == "circle" and a["data-series"] == name)
        assert points == sorted((r["value"], r[key], r["outcome"]) for r in gpu["runs"])
    (capacity,) = [a for tag, a in elements if tag == "line" and a.get("class") == "capacity"]
    assert int(capacity["data-bytes"]) == gpu["capacity_bytes"]
    # Drawn at the capacity: every fitting run's reserved point on or below the line (SVG's y grows downwards),
    # the first that ran out of memory reserved above what the largest that fits holds.
    line_y = float(capacity["y1"])
    reserved = {int(a["data-value"]): float(a["cy"]) for tag, a in elements
                if tag == "circle" and a["data-series"] == "reserved"}
    assert all(reserved[r["value"]] >= line_y for r in gpu["runs"] if r["outcome"] == "fits")
    (found,) = [a for tag, a in elements if tag == "line" and a.get("class") == "found"]
    assert int(found["data-value"]) == gpu["value"]


FSDP = ROOT / "tests" / "scenarios" / "fsdp_train.py"


@pytest.mark.slow
def test_nproc_finds_the_fewest_processes_on_which_every_rank_of_a_sharded_job_fits(tmp_path, torch):
    # FSDP2 shards the weights, gradients and AdamW's state over the ranks: fewer ranks, more per rank. At
    # width 2048 (256 MiB of fp32 weights, made whole on each rank before sharding) the rank that reserves most
    # holds 1.35 GiB at 1 process, 0.99 GiB at 2, 0.81 GiB at 3 and 0.63 GiB at 4 (FSDP2 frees each block's
    # all-gathered weights after its forward, with resize_(0)); 0.054 of an L4's capacity (1.17 GiB) lands
    # the boundary within 1..4 processes, with a margin of 0.18 GiB either side.
    done = memdiff("fit", "--emulate", "l4", "--max-memory", "0.054", "--range", "nproc=1:4", "-o",
                   f"{tmp_path}/runs/", "--format", "json", "--", sys.executable, "-m", "torch.distributed.run",
                   "--nproc-per-node", "{nproc}", str(FSDP), "--cuda", "--width", "2048")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["direction"] == "smallest" and doc["knob"] == "nproc"
    (gpu,) = doc["gpus"]
    value, limit = gpu["value"], gpu["limit_bytes"]
    assert 1 < value <= 4
    # The value one fewer was run and did not fit; the answer's run fits on every rank, each with its snapshot.
    assert gpu["fails"]["value"] == value - 1 and gpu["fails"]["outcome"] == "over-limit"
    assert gpu["fails"]["reserved_peak_bytes"] > limit
    ranks = sorted(Path(gpu["fits"]["snapshot"]).glob("rank*.pickle"))
    assert len(ranks) == value
    reserved = []
    for rank in ranks:  # each rank runs on its own GPU, cuda:LOCAL_RANK
        peak = memdiff("peak", str(rank), "--format", "json")
        assert peak.returncode == 0, peak.stderr
        reserved.append(max(d["reserved_peak_bytes"] or 0 for d in json.loads(peak.stdout)["devices"]))
    assert max(reserved) <= limit and gpu["fits"]["reserved_peak_bytes"] == max(reserved)


def _searched(reserved_by_value: dict, limit_share: float) -> Fewest:
    """Fewest over the values given, each run it asks for ending with that value's reserved peak."""
    values = sorted(reserved_by_value)
    search = Fewest(gpu("l4"), Grid("nproc", values[0], values[-1]), limit_share, None)
    while not search.done:
        (index, why), = search.wants()
        search.started(index, why)
        value = search.values[index]
        reserved = reserved_by_value[value]
        search.finished(index, FitRun(
            gpu="l4", value=value, outcome=FITS if reserved <= search.limit else OVER_LIMIT, snapshot="", log="",
            peak_bytes=reserved, reserved_peak_bytes=reserved, phase=None, step=None, site=None, oom_message=None,
            seconds=0.0, cpu_seconds=0.0, why=why))
    return search


def test_nproc_answers_the_fewest_processes_even_when_memory_does_not_fall_with_them():
    # A job whose memory does not fall with the processes: its heaviest rank reserves 122, 134, 134 and
    # 118 MiB at 1, 2, 3 and 4 processes on an L4. With a limit of 125 MiB one process fits; a search that
    # assumed memory falls with the processes (the largest first, then halving) answered 4 here. Every
    # value below the answer is run and shown as not fitting.
    mib = 1 << 20
    reserved = {1: 122 * mib, 2: 134 * mib, 3: 134 * mib, 4: 118 * mib}
    share = 125 * mib / gpu("l4").capacity
    answer = _searched(reserved, share).answer()
    assert answer.value == 1 and answer.fails is None and [r.value for r in answer.runs] == [1]
    # A limit of 120 MiB: 1, 2 and 3 are run and do not fit; 4 is the fewest, 3 the value one down.
    answer = _searched(reserved, 120 * mib / gpu("l4").capacity).answer()
    assert answer.value == 4 and answer.fails is not None and answer.fails.value == 3
    assert [(r.value, r.fits) for r in answer.runs] == [(1, False), (2, False), (3, False), (4, True)]
    # None fits: every value was run, and the answer says the largest does not fit.
    answer = _searched(reserved, 100 * mib / gpu("l4").capacity).answer()
    assert answer.value is None and len(answer.runs) == 4 and "does not fit at 4" in answer.line


def test_nproc_needs_a_place_in_the_command(tmp_path):
    done = memdiff("fit", "--emulate", "l4", "--nproc", "2", "-o", f"{tmp_path}/runs/", "--", "python", str(SCRIPT),
                   "--batch-size", "{batch}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "{nproc}" in done.stderr


def test_a_process_count_that_rises_is_the_loss_and_says_so():
    baseline = {"knob": "nproc", "direction": "smallest",
                "gpus": [{"gpu": "l4", "value": 2}, {"gpu": "h100", "value": 1}]}
    (found,) = judge({"l4": 4, "h100": 1}, "nproc", baseline, "baselines/fit.json")
    assert found.code == "G011" and found.message == (
        "fit: l4 nproc 2 -> 4 (the fewest processes on which every rank's emulated run trains, baseline "
        "baselines/fit.json)")
    assert judge({"l4": 1, "h100": 1}, "nproc", baseline, "baselines/fit.json") == []  # fewer is a gain


def _stopped_while_starting(log: str) -> None:
    """A forked run that the parent's SIGINT stops while it still imports (what Python says then, and
    the interrupt)."""
    import multiprocessing

    from memdiff.recording import fitrun

    # As in a real run, Python's streams write to the file descriptors (pytest's capture swaps the objects).
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)

    def interrupted(*args, **kwargs):
        sys.stderr.write("Exception ignored in: <function _get_module_lock.<locals>.cb>\n")
        sys.stderr.flush()
        raise KeyboardInterrupt

    fitrun.run_emulated = interrupted
    ours, theirs = multiprocessing.Pipe(duplex=False)
    fitrun.child(theirs, "h100", ["train.py"], log + ".pickle", log, 1000, [])


def test_a_run_stopped_while_it_starts_says_nothing_on_the_users_terminal(tmp_path, capfd):
    # fit and whatif --emulate stop runs they no longer need with SIGINT; one that lands before the script
    # starts must neither print beside the one-line answer nor report a failure of memdiff's
    import multiprocessing

    log = tmp_path / "run.log"
    process = multiprocessing.get_context("fork").Process(target=_stopped_while_starting, args=(str(log),))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert "Exception ignored" in log.read_text()  # kept in the run's own output, beside its snapshot


class _LinedSearch(Search):
    """The search with the forecast a flat, noisy line gives: the line through the two largest fitting runs'
    reserved peaks, put where it reaches the limit (the top of the range when it does not rise). The real
    forecast reads snapshots; this one stands for it where the peak is a constant plus a staircase."""

    def _forecast(self, lo):
        fitting = tuple(sorted(i for i, r in self.runs.items() if r.fits))[-2:]
        if len(fitting) < 2 or fitting == self._forecast_of:
            return None
        self._forecast_of = fitting
        (v0, p0), (v1, p1) = [(self.values[i], self.runs[i].reserved_peak_bytes) for i in fitting]
        largest = self.values[-1] if p1 <= p0 else int(v1 + (self.limit - p1) * (v1 - v0) / (p1 - p0))
        index = max((i for i, v in enumerate(self.values) if v <= largest), default=-1)
        return (index, "forecast") if index > lo else None


@pytest.mark.parametrize("share", [0.004, 0.005, 0.006])
def test_a_forecast_from_a_flat_noisy_line_never_takes_more_runs_than_bisection_and_four(share):
    # A tiny MLP on an L4 under --max-memory: its weights, Adam's state and the cuBLAS workspace reserve
    # 86 MiB at batch 1 and 2 alike, and each sample adds 16 KiB of activations that the caching allocator
    # reserves 2 MiB at a time (the emulated runs of such an MLP reserved 94, 102, 110, 114 MiB at batches
    # 1,468 to 1,866). The line through two fitting runs is flat, or steep where it crosses a step: its
    # forecasts land anywhere. Before, the steps of 1, 2, 4, ... from each wrong forecast made 26 to 31 runs
    # on the 4,096 values bisection closes in 2 + 12.
    mib = 1 << 20

    def reserved(batch: int) -> int:
        return 86 * mib + -(-batch * 16 * 1024 // (2 * mib)) * 2 * mib

    search = _LinedSearch(gpu("l4"), Grid("batch", 1, 4096), share, None)
    while not search.done:
        for index, why in search.wants():
            search.started(index, why)
        for index, why in list(search.running.items()):
            value = search.values[index]
            search.finished(index, FitRun(
                gpu="l4", value=value, outcome=FITS if reserved(value) <= search.limit else OVER_LIMIT, snapshot="",
                log="", peak_bytes=reserved(value), reserved_peak_bytes=reserved(value), phase=None, step=None,
                site=None, oom_message=None, seconds=0.0, cpu_seconds=0.0, why=why))
    answer = search.answer()
    assert answer.value == max(v for v in range(1, 4097) if reserved(v) <= search.limit)
    assert answer.fails is not None and answer.fails.value == answer.value + 1
    assert len(answer.runs) <= 2 + 12 + 4, [(r.value, r.why) for r in answer.runs]


def test_the_markdown_says_each_gpus_answer_and_what_fits_as_the_text_does():
    """The markdown showed only the table: not the answer's line, nor that with --max-memory 0.9 'largest' is
    the largest whose reserved peak stays within 0.9 of the capacity, not the largest that trains."""
    from memdiff.predict.fit import FitResult, GpuFit
    from memdiff.render.fit import render_markdown, render_text

    def run(value: int, outcome: str, reserved: int) -> FitRun:
        return FitRun(gpu="l4", value=value, outcome=outcome, snapshot=f"runs/l4-batch{value}.pickle",
                      log=f"runs/l4-batch{value}.log", peak_bytes=reserved - 2**20, reserved_peak_bytes=reserved,
                      phase="backward", step=1, site="AddmmBackward0 <- mm", oom_message=None, seconds=1.0,
                      cpu_seconds=1.0, why="halving")
    capacity = 23_570_219_008 - 267_386_880
    fits, fails = run(40, FITS, int(0.85 * capacity)), run(41, OVER_LIMIT, int(0.95 * capacity))
    line = "l4: largest 40, reserved peak 18.44 GiB of 21.70 GiB (3.26 GiB headroom); 41 is over the limit"
    result = FitResult(command=["python", "train.py", "--batch-size", "{batch}"], knob="batch",
                       grid=Grid("batch", 1, 64), max_memory=0.9, runs=2, seconds=2.0, output="runs/",
                       gpus=[GpuFit(gpu="l4", name="NVIDIA L4", capacity_bytes=capacity,
                                    limit_bytes=int(0.9 * capacity), value=40, fits=fits, fails=fails,
                                    headroom_bytes=capacity - fits.reserved_peak_bytes, runs=[fits, fails],
                                    forecasts=[], line=line)])
    md, text = render_markdown(result), render_text(result)
    within = "a value fits when its reserved peak is within 0.9 of the capacity"
    assert md.startswith("### memdiff fit\n\n**l4: largest 40, reserved peak") and within in md
    assert f"memdiff: {line}" in text and within in text


def test_each_gpus_runs_are_the_results_sentences_in_text_markdown_and_page():
    """Where the fitting and the failing value peak, why the failing one failed (over --max-memory's limit) and
    each run were worded by the text renderer and shown only in the text; the result holds them for every format."""
    from memdiff.predict.fit import FitResult, GpuFit
    from memdiff.read.schema import validate
    from memdiff.render.fit import render_json, render_markdown, render_text
    from memdiff.render.fit_html import render_fit_html

    capacity = 23_570_219_008 - 267_386_880  # an L4's memory less its CUDA context

    def run(value: int, outcome: str, reserved: int, why: str) -> FitRun:
        return FitRun(gpu="l4", value=value, outcome=outcome, snapshot=f"runs/l4-batch{value}.pickle",
                      log=f"runs/l4-batch{value}.log", peak_bytes=reserved - 2**20, reserved_peak_bytes=reserved,
                      phase="backward", step=1, site="AddmmBackward0 <- mm", oom_message=None, seconds=1.0,
                      cpu_seconds=1.0, why=why)
    fits, fails = run(40, FITS, int(0.85 * capacity), "halving"), run(41, OVER_LIMIT, int(0.95 * capacity), "neighbour")
    g = GpuFit(gpu="l4", name="NVIDIA L4", capacity_bytes=capacity, limit_bytes=int(0.9 * capacity), value=40,
               fits=fits, fails=fails, headroom_bytes=capacity - int(0.85 * capacity), runs=[fits, fails],
               forecasts=[], line="l4: largest 40")
    result = FitResult(command=["python", "train.py", "--batch-size", "{batch}"], knob="batch",
                       grid=Grid("batch", 1, 64), max_memory=0.9, runs=2, seconds=2.0, output="runs/", gpus=[g])
    # 0.95 and 0.9 of 21.70 GiB: 20.62 GiB over the limit 19.53 GiB
    over = "reserved peak 20.62 GiB over the limit 19.53 GiB"
    assert g.details == ["fits at 40: peak in backward, step 1 at AddmmBackward0 <- mm",
                         "41 does not fit: peak in backward, step 1 at AddmmBackward0 <- mm", f"  {over}",
                         "runs: 40 fits (halving), 41 over-limit (neighbour)"]
    text, md, page = render_text(result), render_markdown(result), render_fit_html(result)
    assert "  fits at 40: peak in backward, step 1 at AddmmBackward0 <- mm" in text.splitlines()
    assert f"    {over}" in text.splitlines()
    assert "  - fits at 40: peak in backward, step 1 at AddmmBackward0 <- mm" in md.splitlines()
    assert f"    - {over}" in md.splitlines() and "  - runs: 40 fits (halving), 41 over-limit (neighbour)" in md
    assert f'<li class="mono">{over}</li>' in page and "<li>runs: 40 fits (halving), 41 over-limit (neighbour)" in page
    assert "0.9 of the capacity" in page  # the knob line, as the text's `knob` and the markdown's
    # The JSON carried the line and not these sentences (its schema forbade the key): now the same lines.
    doc = json.loads(render_json(result))
    assert doc["gpus"][0]["details"] == g.details and validate("fit.json", doc, "fit") == doc
    # added within schema_version 1: a fit result written before it (no details) still reads as a baseline
    del doc["gpus"][0]["details"]
    assert validate("old-fit.json", doc, "fit") == doc
