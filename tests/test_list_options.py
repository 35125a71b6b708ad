"""Every list option takes its values as users write them: the option repeated, a comma list, or
both mixed (`--ignore K002 --ignore K003,K004` is three codes), with white space and stray commas
allowed; two values that contradict each other are one line and exit 2. The pytest marker and
the Python API take the same forms."""

from __future__ import annotations

import json
from typing import Any, List

import pytest
from conftest import ROOT, cli

from memdiff import api
from memdiff.cli import COMMANDS, build_parser
from memdiff.compare.limits import Limit, parse_limit
from memdiff.errors import InputError
from memdiff.lists import ListOption

CUDA = ROOT / "tests" / "data" / "cuda"

# (command, the arguments it needs besides, the option, three items, what the parser makes of them)
OPTIONS = [
    ("gate", ["run.pickle", "--baseline", "b.json"], "--ignore", ["K002", "K003", "K004"], None),
    ("gate", ["run.pickle", "--baseline", "b.json"], "--fail-on", ["K002", "T003", "P"], None),
    ("gate", ["run.pickle", "--baseline", "b.json"], "--category-fail-over",
     ["activation=10%", "gradient=256MiB", "optimizer=1GiB"], None),
    ("gate", ["run.pickle", "--baseline", "b.json"], "--phase-fail-over",
     ["forward=512MiB", "backward=5%", "optimizer=1GiB"], None),
    ("gate", ["run.pickle", "--baseline", "b.json"], "--reserved-fail-over", ["64MiB", "5%", "1GiB"], parse_limit),
    ("gate", ["run.pickle", "--baseline", "b.json"], "--rules", ["a.json", "b.toml", "c.json"], None),
    ("diff", ["a.pickle", "b.pickle"], "--ignore", ["K002", "K003", "K004"], None),
    ("diff", ["a.pickle", "b.pickle"], "--fail-on", ["K002", "T003", "P"], None),
    ("diff", ["a.pickle", "b.pickle"], "--reserved-fail-over", ["64MiB", "5%", "1GiB"], parse_limit),
    ("diff", ["a.pickle", "b.pickle"], "--rules", ["a.json", "b.toml", "c.json"], None),
    ("baseline", ["run.pickle", "-o", "b.json"], "--ignore", ["K002", "K003", "K004"], None),
    ("baseline", ["run.pickle", "-o", "b.json"], "--fail-on", ["K002", "T003", "P"], None),
    ("baseline", ["run.pickle", "-o", "b.json"], "--category-fail-over",
     ["activation=10%", "gradient=256MiB", "optimizer=1GiB"], None),
    ("baseline", ["run.pickle", "-o", "b.json"], "--phase-fail-over",
     ["forward=512MiB", "backward=5%", "optimizer=1GiB"], None),
    ("baseline", ["run.pickle", "-o", "b.json"], "--reserved-fail-over", ["64MiB", "5%", "1GiB"], parse_limit),
    ("whatif", ["run.pickle"], "--change", ["checkpoint=0.5", "weights=bf16", "optimizer=sgd+accumulate=4"], None),
    ("forecast", ["b1.pickle=1", "b2.pickle=2"], "--at", ["16", "32", "64"], int),
    ("rule", [], None, ["K002", "k003", "P"], None),
]
IDS = [f"{c}-{o or 'CODE'}" for c, _, o, _, _ in OPTIONS]
FORMS = {  # how a user may write items a, b, c
    "repeated": lambda o, a, b, c: [o, a, o, b, o, c],
    "comma list": lambda o, a, b, c: [o, f"{a},{b},{c}"],
    "mixed": lambda o, a, b, c: [o, a, o, f"{b},{c}"],
    "white space": lambda o, a, b, c: [o, f" {a} , {b}", o, f"\t{c} "],
    "empty items": lambda o, a, b, c: [o, f",{a},,{b},", o, f"{c},"],
}


def _parse(command: str, argv: List[str]) -> Any:
    return build_parser(command).parse_args([command, *argv])


def _flag_words(option: Any, words: List[str]) -> List[str]:
    """The words of a form for a positional list (rule's codes): the option's name dropped."""
    return words if option is not None else [w for w in words if w is not None]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("command, needed, option, items, convert", OPTIONS, ids=IDS)
def test_each_list_option_takes_repeats_comma_lists_and_both(command, needed, option, items, convert, form):
    words = _flag_words(option, FORMS[form](option, *items))
    # nargs="+" options swallow what follows them: the positionals go first, as users write them.
    args = _parse(command, needed + words)
    dest = (option or "--codes").lstrip("-").replace("-", "_")
    assert getattr(args, dest) == [convert(i) if convert else i for i in items]


@pytest.mark.parametrize("command, needed, option, items, convert", OPTIONS, ids=IDS)
def test_a_list_option_given_nothing_is_one_line_and_exit_2(capsys, command, needed, option, items, convert):
    words = [option, " , "] if option else [" , "]
    with pytest.raises(SystemExit) as exit_:
        _parse(command, needed + words)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "' , ' names nothing: give one or more items, separated by commas or with the option repeated" in err


def test_every_option_that_takes_several_values_is_a_list_option():
    # Lists of paths given as positionals (runs, a job's files) and the command a run or a fit runs stay
    # as the shell gives them.
    positional_paths = {("gate", "snapshots"), ("baseline", "snapshot"), ("forecast", "runs"), ("record", "command"),
                        ("fit", "command"), ("whatif", "command")}
    for name in COMMANDS:
        sub = next(a for a in build_parser(name)._actions if a.dest == "command").choices[name]
        for action in sub._actions:
            several = action.nargs in ("+", "*", "...") or type(action).__name__ == "_AppendAction"
            if several and (name, action.dest) not in positional_paths:
                assert isinstance(action, ListOption), (name, action.dest)


def test_a_bad_item_in_a_list_is_one_line_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse("forecast", ["b1.pickle=1", "b2.pickle=2", "--at", "16,zero"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == ("memdiff: forecast: argument --at: 'zero' is not a whole number (digits "
                                             "0-9) (see `memdiff forecast --help`)\n")


@pytest.mark.parametrize("command, argv", [
    ("gate", ["run.pickle", "--baseline", "b.json", "--fail-over-pct", "١٠"]),
    ("gate", ["run.pickle", "--baseline", "b.json", "--fail-over", "١٠MiB"]),
    ("gate", ["run.pickle", "--baseline", "b.json", "--history-points", "١٠"]),
    ("diff", ["a.pickle", "b.pickle", "--steps", "١٠:"]),
    ("peak", ["run.pickle", "--top", "١٠"]),
    ("peak", ["run.pickle", "--device", "١٠"]),
    ("forecast", ["b1.pickle=1", "b2.pickle=2", "--at", "١٠"]),
    ("record", ["--steps", "١٠:٢٠", "--", "python", "train.py"]),
    ("fit", ["--emulate", "H100", "--range", "batch=1:8", "--max-memory", "٠.٩", "--", "python", "t.py"]),
], ids=["fail-over-pct", "fail-over", "history-points", "window", "top", "device", "at", "record-steps",
        "max-memory"])
def test_a_flag_takes_ascii_digits_only(capsys, command, argv):
    """int('١٠') is 10 to Python: `--fail-over-pct ١٠` was a 10% limit that a reviewer reads as no number."""
    with pytest.raises(SystemExit) as exit_:
        _parse(command, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and ("١٠" in err or "٠.٩" in err), err


def test_a_rules_file_whose_name_holds_a_comma_is_one_file(tmp_path):
    odd = tmp_path / "team,gpu.json"
    odd.write_text("{}")
    args = _parse("gate", ["run.pickle", "--baseline", "b.json", "--rules", str(odd), "--rules", "x.json,y.json"])
    assert args.rules == [str(odd), "x.json", "y.json"]


# --- through the whole command: what a baseline stores, what the gate applies ----------------

@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    """The summary of a real GPT-2 window (H100): the runs below read it, not the snapshot."""
    path = tmp_path_factory.mktemp("lists") / "base.json"
    from memdiff.cli import main

    assert main(["summarize", str(CUDA / "gpt2-base.pickle.gz"), "-o", str(path)]) == 0
    return path


def test_repeated_ignores_all_apply_where_the_last_one_alone_did(capsys, tmp_path, summary):
    stored = tmp_path / "b.json"
    code, _, err = cli(capsys, "baseline", summary, "-o", stored, "--ignore", "K002", "--ignore", "K003",
                       "--ignore", "K004")
    assert code == 0, err
    assert sorted(json.loads(stored.read_text())["thresholds"]["findings"]["ignore"]) == ["K002", "K003", "K004"]
    code, out, _ = cli(capsys, "gate", summary, "--baseline", stored, "--format", "json",
                       "--fail-on", "T003", "--fail-on", "t004, P001", "--ignore", "A002,")
    rules = {(r["code"], r["action"], r["source"]) for r in json.loads(out)[0]["finding_rules"]}
    assert code == 0 and rules == {("K002", "ignore", "baseline"), ("K003", "ignore", "baseline"),
                                   ("K004", "ignore", "baseline"), ("A002", "ignore", "--ignore"),
                                   ("T003", "fail", "--fail-on"), ("T004", "fail", "--fail-on"),
                                   ("P001", "fail", "--fail-on"), ("P002", "fail", "default")}


def test_limits_given_as_comma_lists_are_stored_whole(capsys, tmp_path, summary):
    stored = tmp_path / "b.json"
    code, _, err = cli(capsys, "baseline", summary, "-o", stored,
                       "--category-fail-over", "activation=10%, gradient=256MiB", "--category-fail-over",
                       "activation=1GiB", "--phase-fail-over", "forward=1GiB,backward=5%",
                       "--reserved-fail-over", "64MiB,5%")
    assert code == 0, err
    thresholds = json.loads(stored.read_text())["thresholds"]
    assert thresholds["categories"] == {"activation": {"fail-over": "1GiB", "fail-over-pct": 10.0},
                                        "gradient": {"fail-over": "256MiB"}}
    assert thresholds["phases"] == {"forward": {"fail-over": "1GiB"}, "backward": {"fail-over-pct": 5.0}}
    assert thresholds["reserved"] == {"fail-over": "64MiB", "fail-over-pct": 5.0}


def test_rules_files_given_as_a_comma_list_all_apply(capsys, tmp_path, summary):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps({"rules": [], "findings": {"ignore": ["P001"]}}))
    two.write_text(json.dumps({"rules": [], "findings": {"fail-on": ["T003"]}}))
    stored = tmp_path / "b.json"
    assert cli(capsys, "baseline", summary, "-o", stored)[0] == 0
    code, out, err = cli(capsys, "gate", summary, "--baseline", stored, "--format", "json", "--rules",
                         f"{one},{two}")
    rules = {(r["code"], r["action"], r["source"]) for r in json.loads(out)[0]["finding_rules"]}
    assert code == 0, err
    assert {("P001", "ignore", str(one)), ("T003", "fail", str(two))} <= rules


@pytest.mark.parametrize("argv, message", [
    (["--fail-on", "K004", "--ignore", "k002,k004"],
     "memdiff: --ignore: K004 also given to --fail-on: a finding either fails or is ignored, so give each code to "
     "one of them\n"),
    (["--fail-on", "T", "--ignore", "T"],
     "memdiff: --ignore: T also given to --fail-on: a finding either fails or is ignored, so give each code to one "
     "of them\n"),
    (["--category-fail-over", "activation=10%", "--category-fail-over", "gradient=1GiB,activation=20%"],
     "memdiff: --category-fail-over: activation: two percents, 10% and 20%: give one percent (and at most one "
     "size)\n"),
    (["--phase-fail-over", "forward=1GiB,forward=2GiB"],
     "memdiff: --phase-fail-over: forward: two sizes, 1.00 GiB and 2.00 GiB: give one size (and at most one "
     "percent)\n"),
    (["--reserved-fail-over", "5%", "--reserved-fail-over", "64MiB,6%"],
     "memdiff: --reserved-fail-over: two percents, 5% and 6%: give one percent (and at most one size)\n"),
], ids=["code in both", "family in both", "category twice", "phase twice", "reserved twice"])
def test_values_that_contradict_each_other_are_one_line_and_exit_2(capsys, tmp_path, summary, argv, message):
    stored = tmp_path / "b.json"
    code, _, err = cli(capsys, "baseline", summary, "-o", stored, *argv)
    assert (code, err) == (2, message)
    assert not stored.exists()


def test_a_code_named_alone_wins_over_its_family_in_the_other_list(capsys, tmp_path, summary):
    stored = tmp_path / "b.json"
    assert cli(capsys, "baseline", summary, "-o", stored, "--fail-on", "K", "--ignore", "K004")[0] == 0
    findings = json.loads(stored.read_text())["thresholds"]["findings"]
    assert "K004" not in findings["fail-on"] and "K002" in findings["fail-on"] and findings["ignore"] == ["K004"]
    assert cli(capsys, "baseline", summary, "-o", stored, "--fail-on", "K004", "--ignore", "K")[0] == 0
    findings = json.loads(stored.read_text())["thresholds"]["findings"]
    assert findings["fail-on"] == ["K004"] and "K004" not in findings["ignore"] and "K002" in findings["ignore"]


def test_rule_prints_each_code_of_a_comma_list(capsys):
    code, out, _ = cli(capsys, "rule", "K002,k003", "P001")
    assert code == 0 and [line for line in out.splitlines() if line.startswith("## ")] == [
        "## K002 kept-memory-grew", "## K003 kept-graphs-new", "## P001 peaks-in-different-phases"]


# --- the Python API and the pytest marker (which passes its keywords to it) -----------------------

def test_the_api_takes_the_flags_forms():
    t = api.thresholds(fail_on="K002, T003", ignore=["P001", "T004,T005"],
                       categories="activation=10%,gradient=256MiB", phases={"forward": "1GiB,5%"})
    assert t.categories == {"activation": Limit(fail_over_pct=10.0), "gradient": Limit(fail_over_bytes=256 << 20)}
    assert t.phases == {"forward": Limit(1 << 30, 5.0)}
    assert t.findings.to_dict() == {"fail-on": ["K002", "T003"], "ignore": ["P001", "T004", "T005"]}
    assert api.thresholds(categories=["activation=10%", "activation=1GiB"]).categories == {
        "activation": Limit(1 << 30, 10.0)}


@pytest.mark.parametrize("limits, message", [
    ({"fail_on": "K004", "ignore": "K002,K004"}, "ignore: K004 also given to fail_on"),
    ({"categories": {"activation": "10%,20%"}}, "categories['activation']: two percents, 10% and 20%"),
    ({"phases": "forward=5%,backward=1GiB,forward=6%"}, "phases: forward: two percents, 5% and 6%"),
    ({"phases": {"fwd": "5%"}}, "phases: 'fwd' is not a phase: use one of forward, backward, optimizer"),
    ({"ignore": ""}, "ignore: '' names nothing"),
    # The marker's fail_over="5%" said only that '5%' is not a size; categories take "5%" so it is a natural slip.
    ({"fail_over": "5%"}, "fail_over: '5%' is a percent, not a size: give it as fail_over_pct=5 (or a size: "
                          '"512MiB")'),
])
def test_the_api_refuses_values_that_contradict_each_other(limits, message):
    with pytest.raises(InputError) as error:
        api.thresholds(**limits)
    assert str(error.value).startswith(message)
