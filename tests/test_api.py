"""The Python API: the example in docs/api.md runs as written, and results match the CLI's JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from memdiff.cli import main


def docs_api_example() -> str:
    text = (ROOT / "docs" / "api.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


@pytest.mark.slow  # records, in a child process
def test_the_docs_api_example_runs(torch, tmp_path):
    done = subprocess.run([sys.executable, "-c", docs_api_example()], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    delta, headline, verdict, keys = done.stdout.splitlines()
    assert int(delta.split()[0]) > 0  # a batch of 256 holds more than one of 32
    assert headline.startswith("peak +")
    assert verdict.startswith("False ['device 0 peak']")
    assert keys == "fail base"
    assert (tmp_path / "base.json").is_file()


def test_import_memdiff_stays_cheap_and_torch_free():
    code = "import sys, memdiff; print(sorted(m for m in ('torch', 'numpy', 'memdiff.api') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    # ... and everything it names is there on first use, memdiff.api included.
    code = ("import memdiff; print(memdiff.api.__name__, all(getattr(memdiff, n) is getattr(memdiff.api, n) "
            "for n in memdiff.API))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "memdiff.api True", done.stderr


def test_results_match_the_cli_json(shared, capsys):
    import memdiff

    base, head = shared / "linear-nograd.pickle", shared / "linear-grad.pickle"
    assert main(["summarize", str(base)]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(memdiff.summarize(base).to_dict()))
    main([str(base), str(head), "--format", "json"])
    cli = json.loads(capsys.readouterr().out)
    api = json.loads(json.dumps(memdiff.diff(base, head).to_dict()))
    # The API's diff is not judged: the CLI's findings add only the judge's (G002), whose sentences `notes` holds.
    judged = [f for f in cli["findings"] if f["code"].startswith("G")]
    assert [f["code"] for f in judged] == ["G002"]
    assert [f"device {f['device']}: {f['message']}" for f in judged] == cli["notes"]
    cli["findings"] = [f for f in cli["findings"] if f not in judged]
    assert {k: cli[k] for k in api} == api
