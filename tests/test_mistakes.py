"""User mistakes end in exit 2 with one line saying what to do, and never cost a run's snapshot."""

from __future__ import annotations

import gzip
import subprocess
import sys

import pytest

from memdiff.cli import main


def one_line(capsys, code: int, start: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1, err


@pytest.mark.parametrize("flags", [["--baselines", "baselines"], ["--baselines", "baselines", "--require-baseline"]])
def test_gating_a_run_that_does_not_exist_is_bad_input(tmp_path, capsys, flags):
    (tmp_path / "baselines").mkdir()
    missing = str(tmp_path / "runs" / "*.pickle")  # a glob the shell found nothing for
    folder = str(tmp_path / "baselines")
    assert main(["gate", *[folder if f == "baselines" else f for f in flags], missing]) == 2
    one_line(capsys, 2, f"memdiff: {missing}: no such file")


def test_an_empty_baseline_path_is_bad_input(shared, capsys):
    assert main(["gate", "--baseline", "", str(shared / "linear-grad.pickle")]) == 2
    one_line(capsys, 2, "memdiff: --baseline: empty path")


def test_a_report_into_a_missing_folder_is_bad_input(shared, tmp_path, capsys):
    run = str(shared / "linear-grad.pickle")
    report = str(tmp_path / "missing" / "dir" / "r.md")
    assert main([run, run, "--report", report]) == 2
    one_line(capsys, 2, f"memdiff: {report}: the folder {tmp_path / 'missing' / 'dir'} does not exist")


def test_the_demo_on_cuda_without_a_gpu_says_to_use_the_cpu(torch, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda", "--dir", str(tmp_path)]) == 2
    one_line(capsys, 2, "memdiff: --device cuda: no CUDA device here")


def test_the_demo_without_torch_says_how_to_install_it(no_torch, tmp_path, capsys):
    assert main(["demo", "--dir", str(tmp_path)]) == 2
    one_line(capsys, 2, "memdiff: torch: capturing needs PyTorch: pip install torch (without a GPU, its CPU build: "
                        "pip install torch --index-url https://download.pytorch.org/whl/cpu)")


@pytest.mark.parametrize("command", [["peak"], ["summarize"], ["whatif"], ["diff", "RUN"]])
def test_a_baseline_given_as_a_run_says_to_gate_against_it(shared, tmp_path, capsys, command):
    baseline = tmp_path / "b.json"
    assert main(["baseline", str(shared / "linear-grad.pickle"), "-o", str(baseline)]) == 0
    capsys.readouterr()
    argv = [str(shared / "linear-grad.pickle") if a == "RUN" else a for a in command] + [str(baseline)]
    assert main(argv) == 2
    one_line(capsys, 2, f"memdiff: {baseline}: is a baseline, not a run: hold a run to it with "
                        f"`memdiff gate RUN --baseline {baseline}`")


def record(tmp_path, output, *command):
    return subprocess.run([sys.executable, "-m", "memdiff", "record", "-o", str(output), "--", *command],
                          capture_output=True, text=True, cwd=tmp_path)


@pytest.fixture
def kept(tmp_path):
    """An existing snapshot that a mistaken run must leave byte for byte."""
    path = tmp_path / "keep.pickle"
    path.write_bytes(b"an earlier run's snapshot")
    return path


@pytest.mark.parametrize("command, message", [
    (["python", "tran.py"], "memdiff: tran.py: no such script"),
    (["torchrun", "--nproc-per-node", "2", "train.py"], "memdiff: record: `torchrun` is not python"),
    (["python", "-c", "print(1)"], "memdiff: record: `python -c` is not supported"),
    (["python", "-m", "no_such_module"], "memdiff: no_such_module: no such module"),
    # A folder that is there is no missing script (it read 'no such script').
    (["python", "src"], "memdiff: src: is a folder, not a script: give the script's path, or `-- python -m MODULE`"),
])
def test_a_mistyped_command_records_nothing_and_keeps_the_snapshot(torch, tmp_path, kept, command, message):
    (tmp_path / "train.py").write_text("import torch\nx = torch.ones(10)\n")
    (tmp_path / "src").mkdir()
    done = record(tmp_path, kept, *command)
    assert done.returncode == 2 and done.stderr.startswith(message) and done.stderr.count("\n") == 1
    assert kept.read_bytes() == b"an earlier run's snapshot"


@pytest.mark.slow  # records
def test_a_run_that_allocates_nothing_keeps_the_snapshot_and_prints_sys_exit(torch, tmp_path, kept):
    (tmp_path / "fails.py").write_text("import sys\nsys.exit('bad config: no data')\n")
    done = record(tmp_path, kept, "python", "fails.py")
    assert done.returncode == 1
    assert "bad config: no data" in done.stderr
    assert f"the run recorded no allocation; kept the existing {kept}" in done.stderr
    assert kept.read_bytes() == b"an earlier run's snapshot"


@pytest.mark.slow  # records
def test_a_window_of_steps_a_script_never_reaches_is_one_line(torch, tmp_path, kept):
    """A forward and backward with no optimizer: `--steps 1:3` is never reached. The window said so and the
    command said again that nothing was written: two lines for one exit 2."""
    (tmp_path / "train.py").write_text("import torch\nm = torch.nn.Linear(4, 4)\nm(torch.randn(2, 4)).sum().backward()\n")
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--steps", "1:3", "-o", str(kept), "--", "python",
                           "train.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (f"memdiff: {kept}: nothing written: the window 1:3 was not reached: training ran 0 "
                           f"optimizer step(s)\n")
    assert kept.read_bytes() == b"an earlier run's snapshot"


@pytest.mark.slow  # records
def test_record_makes_the_folder_of_its_output(torch, tmp_path):
    (tmp_path / "train.py").write_text("import torch\nx = torch.ones(1000)\n")
    done = record(tmp_path, "runs/train.pickle", "python", "train.py")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "train.pickle").stat().st_size > 100
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["train.pickle"]


def test_a_mistyped_command_is_named(shared, capsys):
    assert main(["pek", str(shared / "linear-grad.pickle")]) == 2
    one_line(capsys, 2, "memdiff: pek: no such file or command; did you mean `memdiff peak`?")


@pytest.mark.parametrize("argv, says", [
    # `explain` was read as a file to diff: `explain: no such file`, and alone `diff: the following arguments
    # are required: head`
    (["explain", "P001"], "did you mean `memdiff rule`?"),
    (["explain"], "did you mean `memdiff rule`?"),
    (["frobnicate", "RUN"], "the commands are diff, gate, baseline, history, summarize, peak, slice, ranks, "
                            "forecast, whatif, fit, record, rule, demo, comment (`memdiff --help`)"),
])
def test_a_word_that_is_no_command_says_which_are(shared, capsys, argv, says):
    argv = [str(shared / "linear-grad.pickle") if a == "RUN" else a for a in argv]
    assert main(argv) == 2
    one_line(capsys, 2, f"memdiff: {argv[0]}: no such file or command; {says}")


def test_peak_has_a_json_form(shared, capsys):
    import json

    from memdiff.read.schema import validate

    assert main(["peak", str(shared / "bert-4gpu.pickle"), "--format", "json", "--device", "0"]) == 0
    data = validate("peak", json.loads(capsys.readouterr().out), "summary")
    assert [d["device"] for d in data["devices"]] == [0]


@pytest.mark.parametrize("field, value, message", [
    ("fail-over-pct", "NaN", "invalid JSON: NaN is not a number (JSON has no NaN or Infinity)"),
    ("fail-over-pct", "Infinity", "invalid JSON: Infinity is not a number (JSON has no NaN or Infinity)"),
    ("fail-over-pct", "1e400", "not a valid memdiff baseline: thresholds.peak.fail-over-pct: a value above the schema's maximum"),
    ("fail-over", '"1e400"', "thresholds.peak.fail-over: '1e400' is not a size: more than 8 EiB"),
    ("fail-over", "-5", "not a valid memdiff baseline: thresholds.peak.fail-over: a value below the schema's minimum of 0"),
    ("fail-over", "9" * 5000, "invalid JSON: a number too long to read"),
    # What the file holds by JSON's names, as the schema's for what it wants (it read 'a value that
    # fails the schema's 'oneOf' rule'; elsewhere 'NoneType', 'str', 'dict').
    ("fail-over", "null", "not a valid memdiff baseline: thresholds.peak.fail-over: a value of type null, where the "
                          "schema wants integer or string"),
], ids=["nan", "infinity", "pct-1e400", "size-1e400", "negative", "5000-digits", "null"])
def test_limits_no_gate_can_use_are_bad_input(shared, tmp_path, capsys, field, value, message):
    path = tmp_path / "b.json"
    assert main(["baseline", str(shared / "linear-grad.pickle"), "-o", str(path)]) == 0
    capsys.readouterr()
    text = path.read_text()
    old = '"fail-over-pct": 1.0' if field == "fail-over-pct" else '"fail-over": "64MiB"'
    path.write_text(text.replace(old, f'"{field}": {value}'))
    for argv in (["gate", str(shared / "linear-grad.pickle"), "--baseline", str(path)], ["baseline", "--check", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"memdiff: {path}: {message}") and err.count("\n") == 1, err


def test_a_percentage_no_limit_can_use_is_refused(shared, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["baseline", str(shared / "linear-grad.pickle"), "-o", str(tmp_path / "b.json"), "--fail-over-pct", "nan"])
    assert exc.value.code == 2 and not (tmp_path / "b.json").exists()


def entry(**fields):
    return {"action": "alloc", "addr": 1, "size": 64, "stream": 0,
            "frames": [{"filename": "train.py", "line": 3, "name": "step"}], **fields}


@pytest.mark.parametrize("fields, message", [
    ({"time_us": "12"}, "device_traces[0][0].time_us: expected microseconds as an integer, got str '12'"),
    # A bad stack is named by its entry, as every other bad field is (it was named by nothing).
    ({"frames": 1.5}, "device_traces[0][0]: 'frames' is float 1.5, not a list"),
    ({"frames": {"name": "x"}}, "device_traces[0][0]: 'frames' is dict of 1 item, not a list"),
    ({"frames": [7]}, "device_traces[0][0]: a frame is int 7, not a dict"),
    # Python's own words were the message: `int too big to convert`, `unhashable type: 'list'`.
    ({"size": 10**30}, "device_traces[0][0].size: 1,000,000,000,000,000,000,000,000,000,000 is not a size in bytes "
                       "(0 to 4,611,686,018,427,387,904)"),
    ({"addr": [1]}, "device_traces[0][0].addr: list of 1 item is not an address"),
    # JSON's `true` is an int to Python: it read as a 1 B allocation (time_us refused it already).
    ({"size": True}, "device_traces[0][0]: 'size' is bool True, not an integer"),
], ids=["time-as-text", "frames-a-number", "frames-a-dict", "frame-a-number", "size-past-int64", "addr-a-list",
        "size-true"])
def test_malformed_entries_are_bad_input(write_snapshot, capsys, fields, message):
    path = write_snapshot({"device_traces": [[entry(**fields)]], "segments": []})
    assert main(["peak", path]) == 2
    one_line(capsys, 2, f"memdiff: {path}: {message}")


def test_an_entry_with_a_key_that_is_not_text_is_read(write_snapshot, capsys):
    path = write_snapshot({"device_traces": [[{**entry(), 7: "extra"}]], "segments": []})
    assert main(["peak", path]) == 0
    assert "64 B" in capsys.readouterr().out


def test_a_file_name_cannot_inject_a_workflow_command(tmp_path, capsys):
    name = tmp_path / "x\n::error title=fake::injected.pickle"
    name.write_bytes(b"not a snapshot")
    assert main(["peak", str(name)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\n::error" not in err and "x\\n::error" in err


@pytest.mark.parametrize("snapshot, message", [
    ({"device_traces": [[entry(size=2**62), entry(addr=2, size=2**62)]], "segments": []},
     "device 0: sizes add up to more than 4,611,686,018,427,387,904 bytes: not a real snapshot"),
    ({"device_traces": [], "segments": [{"device": -1, "address": 0, "total_size": 64, "blocks": []}]},
     "segments[0].device: -1 is not a device index"),
    ({"device_traces": [], "segments": [{"device": 128, "address": 0, "total_size": 64, "blocks": []}]},
     "segments[0].device: 128 is not a device index (PyTorch's run 0-127)"),
    ({"device_traces": [[]] * 129, "segments": []},
     "device_traces: 129 devices, more than PyTorch numbers (128): not a real snapshot"),
    ({"device_traces": [], "segments": [{"device": 0, "address": 0, "total_size": 2**70, "blocks": [
        {"size": 2**70, "requested_size": 2**70, "state": "active_allocated"}]}]},
     "segments[0].total_size: 1,180,591,620,717,411,303,424 is not a size in bytes"),
], ids=["int64-wrap", "negative-device", "device-128", "129-devices", "a-block-of-2**70"])
def test_impossible_sizes_and_devices_are_bad_input(write_snapshot, capsys, snapshot, message):
    path = write_snapshot(snapshot)
    assert main(["peak", path]) == 2
    one_line(capsys, 2, f"memdiff: {path}: {message}")


def test_a_lone_surrogate_in_a_frame_name_is_written_escaped(write_snapshot, tmp_path, capsys):
    import json

    frames = [{"filename": "train.py", "line": 3, "name": "step\udc80"}]
    path = write_snapshot({"device_traces": [[entry(frames=frames)]], "segments": []})
    assert main(["peak", path]) == 0
    assert "step\\udc80" in capsys.readouterr().out
    out = tmp_path / "s.json"
    assert main(["summarize", path, "-o", str(out)]) == 0
    assert json.loads(out.read_text())["devices"][0]["groups"][0]["frames"][0]["name"] == "step\udc80"


def test_writing_to_a_pipe_without_a_reader_does_not_hang(shared, tmp_path, capsys, monkeypatch):
    import os

    import memdiff.atomic

    monkeypatch.setattr(memdiff.atomic, "PIPE_READER_WAIT_S", 0.2)  # the default waits 10 s for a reader
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert main(["summarize", str(shared / "linear-grad.pickle"), "-o", str(pipe)]) == 2
    one_line(capsys, 2, f"memdiff: {pipe}: cannot write: {pipe} is a pipe with no reader")
    # With a reader at the other end the summary goes through (a few KB: within the pipe's buffer).
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert main(["summarize", str(shared / "linear-grad.pickle"), "-o", str(pipe)]) == 0
        assert b'"schema_version": 2' in os.read(reader, 1 << 20)
    finally:
        os.close(reader)


def test_a_dangling_output_link_creates_nothing_outside(shared, tmp_path, capsys):
    link = tmp_path / "out" / "summary.json"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "elsewhere" / "x.json")
    assert main(["summarize", str(shared / "linear-grad.pickle"), "-o", str(link)]) == 2
    assert "which does not exist" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists()


def test_json_nested_too_deep_is_bad_input(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text('{"device_traces": ' + "[" * 100_000 + "]" * 100_000 + ', "segments": []}')
    assert main(["peak", str(path)]) == 2
    one_line(capsys, 2, f"memdiff: {path}: invalid JSON: nested more than 64 levels deep")


def test_a_limit_without_a_unit_is_refused(shared, tmp_path, capsys):
    # `activation=10` meant 10% far more often than 10 bytes, which fails every run.
    run = str(shared / "linear-grad.pickle")
    assert main(["baseline", run, "-o", str(tmp_path / "b.json"), "--category-fail-over", "activation=10"]) == 2
    err = capsys.readouterr().err
    assert err == ("memdiff: --category-fail-over: activation: '10' has no unit: write 10% for a percent, or a size "
                   "such as 10MiB (10B for bytes)\n")


def test_a_misspelt_option_names_its_command_and_the_option_meant(shared, capsys):
    run = str(shared / "linear-grad.pickle")
    with pytest.raises(SystemExit) as exc:  # argparse's way out, exit 2
        main(["gate", run, "--baseline", "b.json", "--categroy-fail-over", "activation=10%"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "memdiff: gate: unrecognized arguments: --categroy-fail-over activation=10%; did you mean "
        "--category-fail-over? (see `memdiff gate --help`)\n")


def _twice(text: str, key: str, value: str) -> str:
    """`text` with the first `"key": ...` preceded by `"key": value`: one object naming the key twice."""
    at = text.index(f'"{key}": ')
    return text[:at] + f'"{key}": {value}, ' + text[at:]


def test_a_key_given_twice_in_a_users_json_is_bad_input_naming_it(shared, tmp_path, capsys):
    """Python's decoder keeps the last of two keys silently: a reviewer read `fail-over: 1MiB` first,
    the gate used the 1 TiB after it. Baselines, rules files, summaries and job manifests alike."""
    run = str(shared / "linear-grad.pickle")
    baseline = tmp_path / "b.json"
    assert main(["baseline", run, "-o", str(baseline)]) == 0
    baseline.write_text(_twice(baseline.read_text(), "fail-over", '"1MiB"').replace('"64MiB"', '"1TiB"'))
    rules = tmp_path / "rules.json"
    rules.write_text('{"rules": [{"category": "kv_cache", "category": "activation", "frames": [{"name": "f"}]}]}')
    summary = tmp_path / "s.json"
    assert main(["summarize", run, "-o", str(summary)]) == 0
    summary.write_text(_twice(summary.read_text(), "peak_bytes", "1"))
    capsys.readouterr()
    twice = "is given twice in one object (JSON keeps only the last, silently): keep one"
    for argv, path, where in (
            (["gate", run, "--baseline", str(baseline)], baseline, "thresholds.peak: the key 'fail-over'"),
            (["peak", run, "--rules", str(rules)], rules, "rules.0: the key 'category'"),
            (["peak", str(summary)], summary, "devices.0: the key 'peak_bytes'")):
        assert main(argv) == 2
        one_line(capsys, 2, f"memdiff: {path}: invalid JSON: {where} {twice}")
    from memdiff.errors import InputError
    from memdiff.recording.manifest import read_manifest

    (tmp_path / "memdiff-job.json").write_text('{"memdiff_job_version": 1, "world_size": 2, "world_size": 8}')
    with pytest.raises(InputError, match=r"^.*memdiff-job\.json: invalid JSON: \(top level\): the key 'world_size' "
                                         r"is given twice"):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize("command", [["fit", "--emulate", "l4"], ["whatif", "--emulate", "h100"]])
@pytest.mark.parametrize("output", ["FILE", "FILE/runs/"])
def test_a_file_as_the_folder_of_emulated_runs_is_bad_input(tmp_path, capsys, command, output):
    """`-o` of fit and whatif --emulate names the folder every run's snapshot goes into: a file there (or
    in its path) is the user's mistake, said before any run, where it was exit 3 (FileExistsError)."""
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    taken = tmp_path / "run.pickle"
    taken.write_bytes(b"")
    out = output.replace("FILE", str(taken))
    assert main([*command, "-o", out, "--", sys.executable, str(script), "--batch-size", "{batch}"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith(f"memdiff: {out}: ") and "not a folder" in said, said
    assert taken.read_bytes() == b"" and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("given", ["snapshot", "gzip", "summary"])
def test_a_run_given_as_the_baseline_says_to_make_its_baseline(shared, tmp_path, capsys, given):
    """A snapshot read as a baseline said `invalid JSON: not UTF-8 text (invalid start byte)`, and a summary
    `the field 'name' is required`: what it is, and the command that makes its baseline, instead."""
    run = str(shared / "linear-grad.pickle")
    wrong = {"snapshot": run, "gzip": str(tmp_path / "run.pickle.gz"), "summary": str(tmp_path / "run.json")}[given]
    if given == "gzip":
        (tmp_path / "run.pickle.gz").write_bytes(gzip.compress((shared / "linear-grad.pickle").read_bytes()))
    if given == "summary":
        assert main(["summarize", run, "-o", wrong]) == 0
    capsys.readouterr()
    assert main(["gate", run, "--baseline", wrong]) == 2
    kind = "a summary (`memdiff summarize`)" if given == "summary" else "a snapshot"
    one_line(capsys, 2, f"memdiff: {wrong}: is {kind}, not a baseline: make the run's baseline with "
                        f"`memdiff baseline {wrong} -o baselines/run.json`" if given != "snapshot" else
                        f"memdiff: {wrong}: is a snapshot, not a baseline: make the run's baseline with "
                        f"`memdiff baseline {wrong} -o baselines/linear-grad.json`")


def test_a_run_and_a_script_to_whatif_says_to_give_one(shared, tmp_path, capsys):
    """`whatif RUN --emulate h100 -o DIR/ -- python train.py` said only `unrecognized arguments: -- python
    train.py`: the run took the place of the script's first word."""
    run = str(shared / "linear-grad.pickle")
    with pytest.raises(SystemExit) as stop:  # argparse's usage error
        main(["whatif", run, "--emulate", "h100", "-o", str(tmp_path / "runs"), "--", "python", "train.py"])
    assert stop.value.code == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith("memdiff: whatif: unrecognized arguments: -- python train.py; "
                                                      "give one recorded run (`memdiff whatif run.pickle`) or a "
                                                      "script to re-run"), said
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv, unknown", [
    (["fit", "--emulate", "l4", "--batch", "1:8", "-o", "runs/", "--", "python", "train.py", "--bs", "{batch}"],
     "--batch"),
    (["record", "--emulate", "h100", "--device", "cpu", "-o", "run.pickle", "--", "python", "train.py"], "--device"),
])
def test_an_unknown_option_with_a_value_before_the_script_is_named(capsys, argv, unknown):
    """A command that runs a script took `1:8 -o runs/ -- ...` as the script and said `the following arguments
    are required: -o/--output`, which was given; the option it does not know is the mistake."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    one_line(capsys, 2, f"memdiff: {argv[0]}: unrecognized arguments: {unknown} (see `memdiff {argv[0]} --help`)")


@pytest.mark.parametrize("argv, said", [
    (["whatif", "RUN", "--budget", "-5GiB"], "whatif: argument --budget: '-5GiB' is not a size: it is negative"),
    (["diff", "RUN", "RUN", "--fail-over", "-64MiB"], "diff: argument --fail-over: '-64MiB' is not a size: it is "
                                                       "negative"),
])
def test_a_negative_size_after_its_option_says_what_the_size_says(shared, capsys, argv, said):
    """argparse reads `-5GiB` as an option and said only `argument --budget: expected one argument`; the option's
    own reader says what is wrong with the value, as `--budget=-5GiB` does."""
    argv = [str(shared / "linear-grad.pickle") if a == "RUN" else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    one_line(capsys, 2, f"memdiff: {said} (see `memdiff {argv[0]} --help`)")


@pytest.mark.parametrize("command", ["gate", "baseline", "diff"])
def test_a_percent_given_to_fail_over_points_to_fail_over_pct(shared, tmp_path, capsys, command):
    """`--fail-over 5%` (as --category-fail-over takes `activation=5%`) said only that 5% is not a size."""
    run = str(shared / "linear-grad.pickle")
    argv = {"gate": ["gate", run, "--baseline", str(tmp_path / "b.json")], "baseline": ["baseline", run, "-o",
            str(tmp_path / "b.json")], "diff": ["diff", run, run]}[command]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--fail-over", "5%"])
    assert stop.value.code == 2
    one_line(capsys, 2, f"memdiff: {command}: argument --fail-over: '5%' is a percent, not a size: give it as "
                        f"--fail-over-pct 5 (or a size: 512MiB) (see `memdiff {command} --help`)")
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("flags", [["-o", "run.pickle"], ["--emulate", "h100", "-o", "run.pickle"],
                                   ["--emulate", "h100", "--repeat", "2", "-o", "run.pickle"]])
def test_ranks_into_one_file_is_refused_before_the_script_runs(tmp_path, capsys, monkeypatch, flags):
    """`record --ranks 0 -o run.pickle -- python train.py` ran the script whole into the file: --ranks went
    unread."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    assert main(["record", "--ranks", "0", *flags, "--", sys.executable, "train.py"]) == 2
    one_line(capsys, 2, "memdiff: --ranks: runs some ranks of an emulated job, each into the job's folder: give it "
                        "with --emulate GPU and -o DIR/ (and no --repeat)")
    assert not (tmp_path / "ran").exists() and not list(tmp_path.glob("run*.pickle"))


@pytest.mark.parametrize("argv, what", [
    (["baseline", "RUN", "-o", "OUT", "--fit", "RUN"], "a fit result"),
    (["peak", "RUN", "--rules", "RUN"], "a rules file"),
])
def test_a_snapshot_given_where_json_goes_says_it_is_one(shared, tmp_path, capsys, argv, what):
    """`--fit run.pickle` said `invalid JSON: not UTF-8 text (invalid start byte)`."""
    run = str(shared / "linear-grad.pickle")
    argv = [run if a == "RUN" else str(tmp_path / "b.json") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    one_line(capsys, 2, f"memdiff: {run}: is a snapshot (pickled or compressed), not {what}")
    assert not (tmp_path / "b.json").exists()


def test_a_missing_output_before_a_script_without_dashes_is_still_said(capsys):
    # The script's own options (`--lr`) are not record's unknown ones: -o is what is missing.
    with pytest.raises(SystemExit) as stop:
        main(["record", "python", "train.py", "--lr", "1"])
    assert stop.value.code == 2
    one_line(capsys, 2, "memdiff: record: the following arguments are required: -o/--output")


def test_jobs_without_emulate_is_refused(shared, capsys):
    # --jobs sets the emulated re-runs at a time; a replay of a recorded run ignored it silently.
    assert main(["whatif", str(shared / "linear-grad.pickle"), "--jobs", "4"]) == 2
    one_line(capsys, 2, "memdiff: --jobs: sets how many emulated runs go at a time: give it with --emulate GPU")
