"""Jobs of per-rank snapshots: rank numbers from file names, missing ranks, `memdiff ranks`,
job-against-job diffs, and the Dask map giving the same summaries as the local one."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Dict

import pytest
from conftest import alloc, free, py_frames

from memdiff import api
from memdiff.analyse.classify import load_rules
from memdiff.cli import main
from memdiff.compare.findings import BY_CODE
from memdiff.errors import InputError
from memdiff.read.job import discover, ranges, rank_of, rank_patterns, summarize_ranks

MiB = 2**20
PARAMS = py_frames("model.py:3:__init__", "train.py:4:<module>")
FWD = py_frames("model.py:10:forward", "train.py:20:step", "train.py:30:<module>")
LOGITS = py_frames("model.py:40:gather_logits", "train.py:22:step", "train.py:30:<module>")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def rank_snapshot(activation: int, extra: int = 0, device: int = 0) -> Dict:
    """A data-parallel rank: weights, one forward's activations, and `extra` bytes of gathered
    logits that only some ranks keep."""
    trace = [alloc(1, 200 * MiB, PARAMS), alloc(2, activation, FWD)]
    if extra:
        trace.append(alloc(3, extra, LOGITS))
    trace.append(free(2, activation, FWD))
    traces = [[] for _ in range(device)] + [trace]
    return {"segments": [], "device_traces": traces}


def job(folder: Path, ranks: Dict[int, Dict], name: str = "rank{}.pickle") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, snap in ranks.items():
        (folder / name.format(rank)).write_bytes(pickle.dumps(snap, protocol=4))
    return folder


@pytest.mark.parametrize("name, rank", [
    ("rank3.pickle", 3), ("rank-3.pickle", 3), ("rank_3.pickle", 3),
    ("rank12_memory_snapshot.pickle", 12),          # torchtitan
    ("memory_trace_7.pickle", 7),                   # Megatron
    ("rank2.15.memory_snapshot", 2),                # Composer: rank, then batch
    ("snapshot-5.json.gz", 5), ("RANK4.pickle", 4),
    ("train.pickle", None), ("ranking.pickle", None),
])
def test_rank_numbers_are_read_from_the_usual_file_names(name, rank):
    assert rank_of(name, rank_patterns(None)) == rank


def test_a_rank_pattern_of_ones_own(tmp_path):
    folder = job(tmp_path / "job", {0: rank_snapshot(MiB), 1: rank_snapshot(MiB)}, name="gpu{}-trace.pkl")
    with pytest.raises(InputError, match="no rank in the file name"):
        discover(str(folder / "*.pkl"))
    assert [f.rank for f in discover(str(folder), r"gpu(\d+)").files] == [0, 1]
    with pytest.raises(InputError, match="one group that captures"):
        discover(str(folder), r"gpu\d+")


def test_missing_ranks_are_named_unless_allowed(tmp_path, capsys):
    folder = job(tmp_path / "job", {r: rank_snapshot(MiB) for r in (0, 1, 4, 5, 7)})
    code, _, err = run(capsys, "ranks", folder)
    assert code == 2 and err.count("\n") == 1
    assert "3 ranks missing of 0-7: 2-3, 6 (--allow-missing-ranks" in err
    code, out, _ = run(capsys, "ranks", folder, "--allow-missing-ranks")
    assert code == 0 and "5 ranks (0-1, 4-5, 7); missing: 2-3, 6" in out


def test_two_files_for_one_rank_and_empty_jobs_are_bad_input(tmp_path, capsys):
    folder = job(tmp_path / "job", {0: rank_snapshot(MiB)})
    (folder / "rank_0.pickle").write_bytes((folder / "rank0.pickle").read_bytes())
    code, _, err = run(capsys, "ranks", folder)
    assert code == 2 and "rank 0 has two files: rank0.pickle and rank_0.pickle" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "ranks", tmp_path / "empty")
    assert code == 2 and "no rank files here" in err
    code, _, err = run(capsys, "ranks", str(tmp_path / "nowhere" / "rank*.pickle"))
    assert code == 2 and "the pattern matches no file" in err


def test_leftovers_of_a_recording_are_not_ranks(tmp_path):
    folder = job(tmp_path / "job", {0: rank_snapshot(MiB), 1: rank_snapshot(MiB)})
    (folder / ".rank2.pickle.recording").write_bytes(b"partial")
    assert [f.rank for f in discover(str(folder)).files] == [0, 1]


@pytest.mark.parametrize("make", ["dangling link", "fifo"])
def test_a_rank_file_that_is_no_file_is_bad_input_not_a_smaller_job(tmp_path, capsys, make):
    # The last rank's file replaced by a link to a file that is gone (or a FIFO): it was dropped without a
    # word, and the job read as 3 ranks, exit 0. A folder beside the ranks (another job's) is still no rank.
    folder = job(tmp_path / "job", {r: rank_snapshot(MiB) for r in range(3)})
    (folder / "job2").mkdir()
    last = folder / "rank3.pickle"
    if make == "fifo":
        os.mkfifo(last)
    else:
        last.symlink_to(tmp_path / "gone.pickle")
    code, out, err = run(capsys, "ranks", folder)
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert "rank3.pickle: is no regular file" in err
    last.unlink()
    assert [f.rank for f in discover(str(folder)).files] == [0, 1, 2]


def test_the_heaviest_rank_and_what_makes_it_heaviest(tmp_path, capsys):
    # Four data-parallel ranks, each on its own GPU; rank 0 also keeps 300 MiB of gathered logits.
    ranks = {r: rank_snapshot(100 * MiB + r * MiB, extra=300 * MiB if r == 0 else 0, device=r) for r in range(4)}
    folder = job(tmp_path / "job", ranks)
    code, out, _ = run(capsys, "ranks", folder, "--fail-imbalance", "20")
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "4 ranks (0-3)"
    row0 = next(line for line in lines if line.startswith("0 heaviest"))
    assert "rank0.pickle" in row0 and "600.00 MiB" in row0
    assert "median 302.00 MiB (rank 2), max 600.00 MiB (rank 0); spread 299.00 MiB, max/median 1.99x" in out
    assert ("ranks by shape (the same stacks hold the peak; % over the lightest): rank 0: 600.00 MiB (+98.0%); "
            "ranks 1-3: 301.00 MiB-303.00 MiB") in out
    assert "heaviest rank 0 (device 0) against the median rank 2 (device 2)" in out
    diff_rows = lines[lines.index(next(line for line in lines if line.startswith("status"))) + 2:]
    assert diff_rows[0].startswith("NEW") and "model.py:gather_logits" in diff_rows[0] and "+300.00 MiB" in diff_rows[0]
    assert "FAIL  imbalance (heaviest rank / median rank): 302.00 MiB -> 600.00 MiB" in out
    assert run(capsys, "ranks", folder, "--fail-imbalance", "100")[0] == 0


def test_ranks_json(tmp_path, capsys):
    folder = job(tmp_path / "job", {r: rank_snapshot(100 * MiB, extra=50 * MiB if r == 1 else 0) for r in range(3)})
    code, out, _ = run(capsys, "ranks", folder, "--format", "json", "--fail-imbalance", "10")
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "fail" and doc["schema_version"] == 1
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2] and doc["heaviest_rank"] == 1
    assert doc["max_bytes"] - doc["median_bytes"] == doc["spread_bytes"] == 50 * MiB
    rows = doc["heaviest_vs_median"]["devices"][0]["rows"]
    assert rows[0]["status"] == "NEW" and rows[0]["delta_bytes"] == 50 * MiB


def test_job_against_job_shows_the_worst_rank_in_full(tmp_path, capsys):
    base = job(tmp_path / "base", {r: rank_snapshot(100 * MiB) for r in range(4)})
    head = job(tmp_path / "head", {r: rank_snapshot(100 * MiB, extra=200 * MiB if r == 2 else 0) for r in range(4)})
    code, out, _ = run(capsys, base, head)
    assert code == 1
    assert out.startswith("memdiff: regression: rank 2 (of 4): peak +200.00 MiB")
    assert "\nFAIL: 4 ranks compared, failing: 2\n" in out
    assert "\nworst rank: 2, shown in full\n" in out and "model.py:gather_logits" in out
    assert "FAIL  rank 2 device 0 peak: 300.00 MiB -> 500.00 MiB" in out
    # One sentence in every format: text said `worst rank: 2`, markdown `Worst rank, shown in full: **2**`
    # and the page `shown in full: rank 2`.
    page = tmp_path / "job.html"
    code, markdown, _ = run(capsys, base, head, "--format", "markdown", "--html", page)
    assert "\n**worst rank: 2, shown in full**\n" in markdown and "; worst rank: 2, shown in full</p>" in page.read_text()
    code, out, _ = run(capsys, base, head, "--format", "json")
    doc = json.loads(out)
    assert doc["verdict"] == "fail" and doc["worst_rank"] == 2
    assert [r["verdict"] for r in doc["ranks"]] == ["pass", "pass", "fail", "pass"]
    assert any(c["subject"] == "rank 2 device 0 peak" and not c["passed"] for c in doc["checks"])
    assert run(capsys, base, base)[0] == 0


def test_a_job_against_a_single_run_is_bad_input(tmp_path, capsys):
    base = job(tmp_path / "base", {0: rank_snapshot(MiB)})
    code, _, err = run(capsys, base, base / "rank0.pickle")
    assert code == 2 and "compare a job with a job" in err


def test_ranks_only_one_job_has_are_warned_about(tmp_path, capsys):
    base = job(tmp_path / "base", {r: rank_snapshot(MiB) for r in range(3)})
    head = job(tmp_path / "head", {r: rank_snapshot(MiB) for r in range(2)})
    code, out, _ = run(capsys, base, head)
    assert code == 0 and "warning: T011 rank 2 only in base, not compared" in out.splitlines()
    assert BY_CODE["T011"].example_output in out


def test_ranges():
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert ranges([3]) == "3"


@pytest.mark.slow  # starts a Dask cluster
def test_dask_gives_the_summaries_the_local_path_gives(tmp_path, shared):
    import distributed  # a test dependency: this test runs wherever the tests do

    folder = tmp_path / "job"
    folder.mkdir()
    for rank, name in enumerate(["cs336-medium-ctx128-train.pickle", "cs336-medium-ctx256-train.pickle"]):
        os.symlink(shared / name, folder / f"rank{rank}.pickle")
    files = discover(str(folder)).files
    rules = load_rules()
    local = [json.dumps(s.to_dict(), sort_keys=True) for s in summarize_ranks(files, rules)]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        remote = [json.dumps(s.to_dict(), sort_keys=True) for s in summarize_ranks(files, rules, cluster.scheduler_address)]
    assert remote == local


@pytest.mark.slow  # waits for Dask's connection timeout
def test_an_unreachable_dask_scheduler_is_one_line(tmp_path, capsys, monkeypatch):
    # Dask retries a refused connection until its timeout: a second is enough to be refused here.
    monkeypatch.setattr("memdiff.cluster.DASK_CONNECT_TIMEOUT_S", 1)
    folder = job(tmp_path / "job", {0: rank_snapshot(MiB)})
    code, _, err = run(capsys, "ranks", folder, "--dask", "tcp://127.0.0.1:9")
    assert code == 2 and err.count("\n") == 1 and "cannot reach the scheduler" in err


def test_a_job_baseline_gates_every_rank(tmp_path, capsys):
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(4)})
    stored = tmp_path / "baselines" / "train.json"
    stored.parent.mkdir()
    assert run(capsys, "baseline", base, "-o", stored)[0] == 0
    doc = json.loads(stored.read_text())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3] and "devices" not in doc
    code, out, _ = run(capsys, "baseline", "--check", stored)
    assert code == 0 and "4 ranks" in out
    assert run(capsys, "gate", base, "--baseline", stored)[0] == 0
    assert run(capsys, "gate", "--baselines", stored.parent, str(base) + "/")[0] == 0  # DIR/<folder>.json

    head = job(tmp_path / "head" / "train", {r: rank_snapshot(100 * MiB, extra=100 * MiB if r == 3 else 0)
                                             for r in range(4)})
    code, out, _ = run(capsys, "gate", head, "--baseline", stored)
    assert code == 1 and out.startswith("memdiff: regression: rank 3 (of 4): ") and "worst rank: 3" in out
    assert "\nFAIL: 4 ranks compared, failing: 3\n" in out
    code, out, _ = run(capsys, "gate", head, "--baseline", stored, "--format", "json")
    [document] = json.loads(out)
    assert document["verdict"] == "fail" and document["worst_rank"] == 3 and len(document["ranks"]) == 4


def test_a_job_of_one_rank_counts_it_in_the_singular(tmp_path, capsys):
    base = job(tmp_path / "train", {0: rank_snapshot(100 * MiB)})
    stored = tmp_path / "train.json"
    code, _, err = run(capsys, "baseline", base, "-o", stored)
    assert code == 0 and "1 rank, highest peak" in err
    code, out, _ = run(capsys, "baseline", "--check", stored)
    assert code == 0 and "(train, 1 rank)" in out
    code, out, _ = run(capsys, "gate", base, "--baseline", stored)
    assert code == 0 and "\nPASS: 1 rank compared\n" in out
    code, out, _ = run(capsys, "ranks", base)
    assert code == 0 and out.startswith("1 rank (0)\n")
    assert "ranks" not in out.replace("ranks by shape", "").replace("across ranks", "")


def test_a_rank_that_crashed_fails_the_gate(tmp_path, capsys):
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(4)})
    stored = tmp_path / "train.json"
    run(capsys, "baseline", base, "-o", stored)
    (base / "rank3.pickle").unlink()  # ranks 0-2 left: no gap in the numbers, but rank 3 is gone
    code, out, _ = run(capsys, "gate", base, "--baseline", stored)
    assert code == 1 and "rank 3: in the baseline but not in the run" in out
    assert BY_CODE["G005"].example_output in out.splitlines()
    assert run(capsys, "gate", base, "--baseline", stored, "--allow-missing-ranks")[0] == 0


def test_a_rank_without_its_baseline_fails_a_gate_that_requires_one(tmp_path, capsys):
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(2)})
    stored = tmp_path / "train.json"
    run(capsys, "baseline", base, "-o", stored)
    (base / "rank2.pickle").write_bytes((base / "rank1.pickle").read_bytes())  # a rank the baseline lacks
    assert run(capsys, "gate", base, "--baseline", stored)[0] == 0  # said, not gated
    code, out, _ = run(capsys, "gate", base, "--baseline", stored, "--require-baseline")
    assert code == 1 and BY_CODE["G006"].example_output in out.splitlines()


def test_a_run_baseline_does_not_gate_a_job(tmp_path, capsys):
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(2)})
    stored = tmp_path / "one.json"
    run(capsys, "baseline", base / "rank0.pickle", "-o", stored)
    code, _, err = run(capsys, "gate", base, "--baseline", stored)
    assert code == 2 and "is the baseline of one run" in err and f"memdiff baseline {base}" in err


def test_a_job_baseline_does_not_gate_one_run(tmp_path, capsys):
    # One rank's file gated against its job's baseline was exit 3 (KeyError 'file'), by the CLI and the API alike.
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(2)})
    stored = tmp_path / "train.json"
    run(capsys, "baseline", base, "-o", stored)
    for fmt in ("text", "json"):
        code, _, err = run(capsys, "gate", base / "rank0.pickle", "--baseline", stored, "--format", fmt)
        assert code == 2 and err.count("\n") == 1 and "is the baseline of a job (2 ranks)" in err
    with pytest.raises(InputError, match="is the baseline of a job"):
        api.gate(base / "rank0.pickle", stored)


def test_a_job_baseline_storing_a_rank_twice_is_bad_input(tmp_path, capsys):
    base = job(tmp_path / "train", {r: rank_snapshot(100 * MiB) for r in range(2)})
    stored = tmp_path / "train.json"
    run(capsys, "baseline", base, "-o", stored)
    doc = json.loads(stored.read_text())
    doc["ranks"][1]["rank"] = 0  # a hand-merged file: which of the two would gate rank 0?
    stored.write_text(json.dumps(doc))
    for argv in (["gate", base, "--baseline", stored], ["baseline", "--check", stored]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "rank 0 is stored twice" in err


def test_workers_are_as_many_as_the_cores_and_the_memory_allow(monkeypatch):
    from memdiff.read import inputs
    monkeypatch.setattr(inputs.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(inputs, "_available_memory", lambda: 8 * 2**30)
    assert inputs.worker_count([100 * MiB] * 64) == 7  # 8 GiB / (150 MiB + 10 x 100 MiB)
    assert inputs.worker_count([MiB] * 64) == 16
    assert inputs.worker_count([10 * 2**30]) == 1  # one file too big for the memory still gets read
    monkeypatch.setattr(inputs, "_available_memory", lambda: None)
    assert inputs.worker_count([100 * MiB] * 64) == 16


def test_ranks_whose_peaks_are_in_different_phases_are_warned_as_in_a_diff(tmp_path, shared, capsys):
    # Rank 1 is the ctx256 run (peak in the forward), rank 0 the ctx128 run (peak in the optimizer
    # step): the heaviest-vs-median rows compare different moments, and the report must say so.
    folder = tmp_path / "job"
    folder.mkdir()
    for rank, name in ((0, "cs336-medium-ctx128-train.pickle"), (1, "cs336-medium-ctx256-train.pickle")):
        os.symlink(shared / name, folder / f"rank{rank}.pickle")
    code, out, _ = run(capsys, "ranks", folder)
    assert code == 0
    assert "warning: P001 device 0: the peaks are in different phases: base in the optimizer step of step 0, " \
           "head in the forward of step 0" in out
    # ranks has no --at: the advice names the diff of the two ranks' files that has it
    warning = next(line for line in out.splitlines() if "different phases" in line)
    assert warning.endswith(f"(compare like with like: memdiff {folder / 'rank0.pickle'} "
                            f"{folder / 'rank1.pickle'} --at forward)")
    assert "like: --at" not in out


@pytest.mark.parametrize("name", ["diffusion-segments-list.pickle", "empty-trace.pickle",
                                  "opt13b-oom-legacy.pickle"])
def test_ranks_without_a_trace_say_the_peaks_phase_is_unknown(tmp_path, shared, capsys, name):
    folder = tmp_path / "job"
    folder.mkdir()
    for rank in (0, 1):
        os.symlink(shared / name, folder / f"rank{rank}.pickle")
    code, out, _ = run(capsys, "ranks", folder)
    assert code == 0 and "None" not in out
    rows = [line for line in out.splitlines() if line.startswith(("0 heaviest", "1 median"))]
    assert len(rows) == 2 and all(" unknown " in row for row in rows)


def test_a_recorded_jobs_manifest_keeps_an_earlier_runs_ranks_out(tmp_path, capsys):
    # runs/ held a 4-rank recording; a 2-rank one was then recorded into it. Its manifest says 2
    # ranks: rank2 and rank3 are the earlier run's and must never be read as this job's.
    folder = job(tmp_path / "runs", {r: rank_snapshot(100 * MiB, extra=(50 * MiB if r == 3 else 0)) for r in range(4)})
    (folder / "memdiff-job.json").write_text(json.dumps({"memdiff_job_version": 1, "world_size": 2, "ranks": []}))
    code, out, err = run(capsys, "ranks", folder)
    assert code == 0 and out.startswith("2 ranks (0-1)")
    assert ("rank2.pickle, rank3.pickle: not of this job, whose memdiff-job.json says 2 ranks (an earlier run's?): "
            "not read") in err
    # A folder left with only an earlier run's ranks is no job at all.
    for r in (0, 1):
        (folder / f"rank{r}.pickle").unlink()
    code, _, err = run(capsys, "ranks", folder)
    assert code == 2 and "no rank file of the job its memdiff-job.json describes (2 ranks)" in err


def test_a_job_of_which_some_ranks_were_emulated_misses_none_of_the_others(tmp_path, capsys):
    # record --ranks 0,63 of a 64-rank job: two files, the manifest naming the ranks run
    folder = job(tmp_path / "runs", {r: rank_snapshot(100 * MiB) for r in (0, 5, 63)})
    manifest = {"memdiff_job_version": 1, "world_size": 64, "emulated_ranks": [0, 63], "ranks": []}
    (folder / "memdiff-job.json").write_text(json.dumps(manifest))
    code, out, err = run(capsys, "ranks", folder)
    assert code == 0 and out.startswith("2 ranks (0, 63)")
    assert "2 ranks of 64 ranks emulated, each alone (record --ranks 0,63): the others were not run" in err
    assert "rank5.pickle: not of this job" in err  # an earlier run's file of a rank not run now
    # a manifest whose emulated ranks are not ranks of its job is bad input, one line
    for bad in ([], [64], ["0"], [True], "0,63"):
        (folder / "memdiff-job.json").write_text(json.dumps({**manifest, "emulated_ranks": bad}))
        code, _, err = run(capsys, "ranks", folder)
        assert code == 2 and "emulated_ranks must list ranks below world_size 64" in err, err
    # A manifest of a version this memdiff does not know may mean other things by the same keys
    # (which ranks ran): it was read as version 1 and the job gated as if it were.
    for version, shown in ((99, "99"), ("1", "of type str"), (True, "of type bool"), (None, "of type NoneType")):
        (folder / "memdiff-job.json").write_text(json.dumps({**manifest, "memdiff_job_version": version}))
        code, out, err = run(capsys, "ranks", folder)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert f"memdiff_job_version {shown} is not one this memdiff reads (1)" in err, err


def test_a_finding_that_fails_another_rank_is_listed_with_the_other_ranks(tmp_path, capsys):
    # Rank 1's head trace starts mid-run (a free of memory it never saw allocated); rank 0 grew most,
    # so it is shown in full, and rank 1's failing finding is listed with the other ranks.
    mid_run = rank_snapshot(100 * MiB)
    mid_run["device_traces"][0].insert(0, free(99, MiB, FWD))
    base = job(tmp_path / "base", {0: rank_snapshot(100 * MiB), 1: rank_snapshot(100 * MiB)})
    head = job(tmp_path / "head", {0: rank_snapshot(100 * MiB, extra=MiB), 1: mid_run})
    assert run(capsys, base, head)[0] == 0  # T003 is a warning, failing nothing by default
    code, out, _ = run(capsys, base, head, "--fail-on", "T003")
    assert code == 1 and "FAIL: 2 ranks compared, failing: 1" in out
    other = out[out.index("other ranks:"):].splitlines()
    assert other[1] == ("FAIL  finding T003 mid-run-in-one-run: rank 1 device 0: only the head trace starts mid-run "
                        "(its ring buffer dropped events), so its static memory includes what the other run shows as "
                        "allocations (fails on T003: --fail-on)")
