"""A category rule file is read and checked once, at the entry, and travels down as the loaded rules
(issue 51 item 4): no stage below the API or the CLI reads it again, and the CLI
reads it once for its categories and its choice of findings both. Counted on a real H100 window."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

import memdiff.api as api
from memdiff.analyse import classify
from memdiff.cli import main

WINDOW = Path(__file__).resolve().parent / "data" / "cuda" / "gpt2-warm.pickle.gz"


@pytest.fixture
def reads(monkeypatch):
    """Every read of a rule file, by any module: the one reader, counted."""
    seen = []
    reader = classify._read_rules_file

    def counting(path):
        seen.append(path)
        return reader(path)
    monkeypatch.setattr(classify, "_read_rules_file", counting)
    return seen


@pytest.fixture
def inputs(tmp_path):
    snapshot = tmp_path / "gpt2-warm.pickle"
    with gzip.open(WINDOW, "rb") as src, open(snapshot, "wb") as dst:
        shutil.copyfileobj(src, dst)
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"category": "embedding", "frames": [{"name": "embedding"}]}]}))
    return snapshot, rules


def test_the_api_reads_a_rule_file_once(inputs, reads):
    snapshot, rules = inputs
    api.summarize(snapshot, rules=str(rules), history=True)
    assert reads == [str(rules)]



def test_memdiff_diff_reads_a_rule_file_once(inputs, reads, capsys):
    snapshot, rules = inputs
    code = main(["diff", str(snapshot), str(snapshot), "--rules", str(rules)])
    assert code == 0, capsys.readouterr().err
    assert reads == [str(rules)]
