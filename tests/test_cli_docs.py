"""docs/cli.md is generated from the argument parsers: it fails here when a command's options
changed and the reference was not regenerated."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_is_up_to_date():
    gen = _generator()
    current = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == gen.render(), f"docs/cli.md is stale: run `{gen.COMMAND}` and commit docs/cli.md"


def test_the_cli_reference_names_every_command_and_option():
    from memdiff.cli import COMMANDS, build_parser

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in COMMANDS:
        assert f"## memdiff {name}\n" in text
        sub = next(a for a in build_parser(name)._actions if a.dest == "command").choices[name]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "--debug"):
                    assert f"`{flag}" in text or f", {flag}" in text, (name, flag)


def test_the_generator_checks_without_writing():
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["diff", "gate", "baseline"])
def test_the_help_names_the_default_rule_a_verdict_applies(command, shared, capsys):
    # linear-nograd -> linear-grad (two real runs of nn.Linear(10000, 50000)): judged with no flag,
    # the rule the verdict prints is the one --fail-over-pct's help must name as the default,
    # its "or by more than 50%" part included (a small run doubling fails by it alone).
    from memdiff.cli import build_parser, main

    main([str(shared / "linear-nograd.pickle"), str(shared / "linear-grad.pickle")])
    out = capsys.readouterr().out
    limit = next(line for line in out.splitlines() if line.startswith("FAIL  device 0 peak")).split("limit: ")[1]
    assert limit == "more than 1% and by more than 64.00 MiB, or by more than 50%"
    sub = next(a for a in build_parser(command)._actions if a.dest == "command").choices[command]
    help_text = " ".join(sub.format_help().split())
    assert f"else the default rule, {limit})" in help_text
