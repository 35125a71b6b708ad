"""Every JSON output the CLI prints satisfies its schema in memdiff/schemas/, on real snapshots:
the summary, the baseline, the diff (runs and jobs), the gate (a run, several, a job) and ranks."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any, Dict, List

import jsonschema  # a dependency of memdiff (>=4.18, which brings referencing)
import pytest
import referencing
from conftest import alloc, free, py_frames

from memdiff.cli import main

SCHEMAS = Path(__file__).resolve().parent.parent / "memdiff" / "schemas"
CTX128, CTX256 = "cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle"
INFER = "cs336-medium-ctx128-infer.pickle"
# Pairs of real runs covering every snapshot generation: timed and untimed traces, a legacy
# torch 2.0 dump, a bare segments list, a dump without a trace, a 4-device machine.
PAIRS = [(CTX128, CTX256), (CTX128, INFER), ("linear-nograd.pickle", "linear-grad.pickle"),
         ("cs336-ctx128-fwd-fp32.pickle", "cs336-ctx128-fwd-mixed.pickle"),
         ("tinyllama-lora-fwdbwd.pickle", "opt13b-oom-legacy.pickle"),
         ("empty-trace.pickle", "diffusion-segments-list.pickle"), ("cs336-windows.pickle", "bert-4gpu.pickle")]


def _schemas() -> Dict[str, Dict[str, Any]]:
    return {p.name[:-len(".schema.json")]: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}


@pytest.fixture(scope="module")
def validate():
    """validate(name, document): fails naming every error against schemas/NAME.schema.json."""
    schemas = _schemas()
    # The schemas name each other by file name, as they lie side by side in memdiff/schemas/.
    registry = referencing.Registry().with_resources(
        [(f"{name}.schema.json", referencing.Resource.from_contents(s)) for name, s in schemas.items()])

    def check(name: str, document: Any) -> Any:
        schema = schemas[name]
        cls = jsonschema.validators.validator_for(schema)
        errors = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}"
                  for e in cls(schema, registry=registry).iter_errors(document)]
        assert not errors, f"{name}: " + "\n".join(errors[:10])
        return document
    return check


def cli_json(capsys, *argv) -> Any:
    """The JSON a command prints (exit 0 or 1: a regression still prints its document)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return json.loads(out)


def job(folder: Path, shared: Path, names: List[str]) -> Path:
    """A job folder of symlinks to real snapshots, one per rank."""
    folder.mkdir(parents=True)
    for rank, name in enumerate(names):
        os.symlink(shared / name, folder / f"rank{rank}.pickle")
    return folder


def test_every_schema_is_a_valid_draft_2020_12_schema():
    schemas = _schemas()
    assert {"summary", "baseline", "diff", "gate", "ranks", "rules"} <= set(schemas)
    for name, schema in schemas.items():
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("base, head", PAIRS)
def test_the_diff_of_two_real_runs_matches_diff_schema(shared, capsys, validate, base, head):
    doc = validate("diff", cli_json(capsys, shared / base, shared / head, "--format", "json"))
    assert "devices" in doc and "ranks" not in doc
    for d in doc["devices"]:  # JSON never folds: the rows add up to the peak delta
        assert sum(r["delta_bytes"] for r in d["rows"]) == d["peak_delta_bytes"]


@pytest.mark.parametrize("at", ["forward", "backward", "optimizer"])
def test_a_diff_at_a_phase_matches_diff_schema(shared, capsys, validate, at):
    doc = validate("diff", cli_json(capsys, shared / CTX128, shared / CTX256, "--at", at, "--format", "json"))
    assert {d["at"] for d in doc["devices"]} == {at}


def test_summaries_and_their_diff_match_their_schemas(shared, tmp_path, capsys, validate):
    paths = []
    for name in (CTX128, CTX256):
        out = tmp_path / f"{name}.json"
        assert main(["summarize", str(shared / name), "-o", str(out)]) == 0
        validate("summary", json.loads(out.read_text()))
        paths.append(out)
    capsys.readouterr()
    doc = validate("diff", cli_json(capsys, *paths, "--format", "json"))
    assert doc["base"]["file"].endswith(CTX128)  # a summary carries the source of its snapshot


def test_a_job_diff_matches_diff_schema(shared, tmp_path, capsys, validate):
    base = job(tmp_path / "base", shared, [CTX128, INFER])
    head = job(tmp_path / "head", shared, [CTX256, INFER, "linear-grad.pickle"])
    doc = validate("diff", cli_json(capsys, base, head, "--format", "json"))
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["only_head"] == [2] and doc["worst_rank"] == 0


def test_gate_on_a_baseline_matches_gate_schema(shared, tmp_path, capsys, validate):
    stored = tmp_path / "baselines" / "train.json"
    stored.parent.mkdir()
    assert main(["baseline", str(shared / CTX128), "-o", str(stored), "--category-fail-over", "activation=10%",
                 "--phase-fail-over", "forward=512MiB"]) == 0
    validate("baseline", json.loads(stored.read_text()))
    capsys.readouterr()
    docs = validate("gate", cli_json(capsys, "gate", shared / CTX256, "--baseline", stored, "--format", "json"))
    assert len(docs) == 1 and docs[0]["verdict"] == "fail" and docs[0]["baseline"] == str(stored)
    # the same run under its own baseline passes, and is still a list of one
    docs = validate("gate", cli_json(capsys, "gate", shared / CTX128, "--baseline", stored, "--format", "json"))
    assert [d["verdict"] for d in docs] == ["pass"]


def test_gate_on_a_folder_of_baselines_matches_gate_schema(shared, tmp_path, capsys, validate):
    runs = tmp_path / "runs"
    runs.mkdir()
    for stem, name in (("train", CTX256), ("infer", INFER), ("linear", "linear-grad.pickle")):
        os.symlink(shared / name, runs / f"{stem}.pickle")
    baselines = tmp_path / "baselines"
    baselines.mkdir()
    for stem, name in (("train", CTX128), ("infer", INFER)):  # linear has none
        assert main(["baseline", str(shared / name), "-o", str(baselines / f"{stem}.json")]) == 0
    capsys.readouterr()
    docs = validate("gate", cli_json(capsys, "gate", "--baselines", baselines, *sorted(runs.iterdir()),
                                     "--format", "json"))
    assert sorted(Path(d["run"]).stem for d in docs) == ["infer", "linear", "train"]
    # Not gated, and the document says so: a step reading the JSON cannot take it for a pass.
    linear = next(d for d in docs if Path(d["run"]).stem == "linear")
    assert linear["verdict"] == "no-baseline" and linear["required"] is False
    assert linear["command"] == f"memdiff baseline {runs / 'linear.pickle'} -o {baselines / 'linear.json'}"


def test_gate_on_a_job_baseline_matches_gate_schema(shared, tmp_path, capsys, validate):
    base = job(tmp_path / "base" / "train", shared, [CTX128, INFER])
    head = job(tmp_path / "head" / "train", shared, [CTX256, INFER])
    baselines = tmp_path / "baselines"
    baselines.mkdir()
    assert main(["baseline", str(base), "-o", str(baselines / "train.json")]) == 0
    validate("baseline", json.loads((baselines / "train.json").read_text()))
    capsys.readouterr()
    docs = validate("gate", cli_json(capsys, "gate", head, "--baseline", baselines / "train.json", "--format", "json"))
    assert len(docs) == 1 and [r["rank"] for r in docs[0]["ranks"]] == [0, 1]
    docs = validate("gate", cli_json(capsys, "gate", "--baselines", baselines, head, shared / CTX256,
                                     "--format", "json"))
    # The single run has no baseline in the folder: its document says so.
    assert [d["verdict"] for d in docs][1:] == ["no-baseline"]


@pytest.mark.parametrize("flags", [[], ["--fail-imbalance", "10"], ["--fail-imbalance", "1000"]])
def test_ranks_match_ranks_schema(shared, tmp_path, capsys, validate, flags):
    folder = job(tmp_path / "job", shared, [CTX128, CTX256, INFER, "linear-grad.pickle"])
    doc = validate("ranks", cli_json(capsys, "ranks", folder, "--format", "json", *flags))
    assert len(doc["ranks"]) == 4 and len(doc["checks"]) == (1 if flags else 0)


def test_ranks_with_a_missing_rank_match_ranks_schema(shared, tmp_path, capsys, validate):
    folder = tmp_path / "job"
    folder.mkdir()
    for rank, name in ((0, CTX128), (2, CTX256)):
        os.symlink(shared / name, folder / f"rank{rank}.pickle")
    doc = validate("ranks", cli_json(capsys, "ranks", folder, "--allow-missing-ranks", "--format", "json"))
    assert doc["missing"] == [1]


@pytest.mark.parametrize("name", [CTX128, "opt13b-oom-legacy.pickle", "diffusion-segments-list.pickle",
                                  "empty-trace.pickle", "bert-4gpu.pickle"])
def test_summarize_and_peak_json_match_summary_schema(shared, capsys, validate, name):
    validate("summary", cli_json(capsys, "summarize", shared / name))
    validate("summary", cli_json(capsys, "peak", shared / name, "--format", "json"))


def test_a_diff_with_memory_kept_from_earlier_steps_matches_diff_schema(write_snapshot, capsys, validate):
    from test_lifetimes import training  # a hand-made loop that keeps its activations: no real snapshot has one

    base = write_snapshot(training(steps=3), "plain.pickle")
    head = write_snapshot(training(steps=3, leak=True), "leaky.pickle")
    doc = validate("diff", cli_json(capsys, base, head, "--format", "json"))
    kept = doc["devices"][0]["kept"]
    assert kept is not None and kept["head_bytes"] > kept["base_bytes"] and kept["rows"]


def test_a_baseline_of_repeats_a_history_and_their_gate_match_their_schemas(tmp_path, capsys, validate):
    """Issue 37's files: a spread (baseline version 2), reserved figures, history lines, trends."""
    # Repeats whose memory depends on the data (each step's activation its own size): a spread.
    mib = 2**20
    fwd, opt = py_frames("model.py:9:forward"), py_frames("/v/site-packages/torch/optim/adam.py:1:step")
    bwd = py_frames("/v/site-packages/torch/autograd/__init__.py:1:backward")
    repeats = []
    for k, sizes in enumerate(((100, 120, 100), (100, 140, 100), (100, 130, 100))):
        trace = [alloc(1, 100 * mib, py_frames("model.py:3:__init__"))]
        for step, size in enumerate(sizes):
            a, g, t = 10 + 3 * step, 11 + 3 * step, 12 + 3 * step
            trace += [alloc(a, size * mib, fwd), alloc(g, 100 * mib, bwd), free(a, size * mib, bwd),
                      alloc(t, mib, opt), free(t, mib, opt), free(g, 100 * mib, opt)]
        repeats.append(tmp_path / f"run-{k}.pickle")
        repeats[-1].write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, 4))
    spread = tmp_path / "spread.json"
    assert main(["baseline", *map(str, repeats), "-o", str(spread), "--noise-margin", "2%"]) == 0
    doc = validate("baseline", json.loads(spread.read_text()))
    assert doc["schema_version"] == 2 and doc["devices"][0]["spread"]["runs"] == 3
    # Real CUDA runs of one loop peak alike: the one-run form, with reserved figures.
    cuda = Path(__file__).parent / "data" / "cuda"
    runs = [cuda / "gpt2-base.pickle.gz", cuda / "gpt2-base-again.pickle.gz", cuda / "gpt2-clip.pickle.gz"]
    stored = tmp_path / "gpt2.json"
    assert main(["baseline", *map(str, runs), "-o", str(stored), "--noise-margin", "2%",
                 "--reserved-fail-over", "10%"]) == 0
    doc = validate("baseline", json.loads(stored.read_text()))
    assert doc["schema_version"] == 1 and "spread" not in doc["devices"][0]
    assert doc["devices"][0]["reserved_peak_bytes"] > doc["devices"][0]["peak_bytes"]
    history = tmp_path / "main.jsonl"
    for k, run in enumerate(runs[:2]):
        assert main(["history", "append", str(run), "--to", str(history), "--commit", f"{k}" * 40,
                     "--workload", "gpt2"]) == 0
    for line in history.read_text().splitlines():
        validate("history", json.loads(line))
    capsys.readouterr()
    docs = validate("gate", cli_json(capsys, "gate", cuda / "gpt2-batch8.pickle.gz", "--baseline", stored,
                                     "--history", history, "--format", "json"))
    assert docs[0]["verdict"] == "fail" and len(docs[0]["trends"][0]["points"]) == 2
    assert docs[0]["devices"][0]["head_reserved_peak_bytes"] is not None
    validate("summary", cli_json(capsys, "summarize", runs[0]))
