"""Text from a snapshot, a baseline or a file name bends no output (issue 33).

Names are written as an attacker would: workflow commands after newlines, terminal escapes,
markdown that ends a code fence and plants a heading, mentions, issue references, HTML
comments, links, a shell substitution. Each surface memdiff writes is checked for the property
a reader relies on, first on one hand-written name per case, then on names drawn at random from
the same alphabet (hypothesis) through every renderer.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import pickle
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import jsonschema
import pytest
import referencing
import referencing.exceptions
from conftest import alloc, free
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from markdown_it import MarkdownIt

from memdiff.cli import main

# Hypothesis keeps caches in ./.hypothesis by default: tests write only into temporary folders,
# and leave none behind.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="memdiff-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)

MiB = 2**20
SCHEMAS = Path(__file__).resolve().parent.parent / "memdiff" / "schemas"

HOSTILE = ("evil\n::stop-commands::tok\n::add-mask::x\n::error file=a.py::INJ\x1b[2J"
           "\x1b]8;;https://evil.example\x07link\x1b]8;;\x07\n```\n### :white_check_mark: memdiff: PASS (forged)\n"
           "cc @octocat #123 <!-- memdiff:other-gate --> [x](https://evil.example) | \x9b2J \u2028 $(touch PWNED)")
OUR_COMMAND = re.compile(r"::(error|warning) title=memdiff( [A-Z][0-9]{3} [a-z0-9-]+)?::")
# What no byte of output may hold, whatever a name held: ESC, the C1 CSI, a carriage return, BEL,
# the Unicode line separator, a bidi override.
RAW_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _frames(name: str) -> List[Dict[str, object]]:
    return [{"filename": f"/src/{name}.py", "line": 3, "name": name},
            {"filename": "/src/train.py", "line": 5, "name": "<module>"}]


def write_pair(folder: Path, name: str = HOSTILE, base_file: str = "base.pickle",
               head_file: str = "head.pickle") -> Tuple[Path, Path]:
    """Two runs where the site called `name` grows from 100 MiB to 300 MiB and a second one is new."""
    paths = []
    for file, size in ((base_file, 100), (head_file, 300)):
        events = [alloc(1, size * MiB, _frames(name))]
        if size == 300:
            events += [alloc(2, 8 * MiB, _frames(name + "#2")), free(2, 8 * MiB, _frames(name + "#2"))]
        snap = {"segments": [], "device_traces": [events]}
        path = folder / file
        path.write_bytes(pickle.dumps(snap, 4))
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture
def github_env(tmp_path, monkeypatch):
    """A pull_request run's environment: summary, outputs and event payload files."""
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"number": 7, "pull_request": {"number": 7, "base": {"sha": "a" * 40},
                                                               "head": {"sha": "b" * 40}}}))
    env = {"GITHUB_STEP_SUMMARY": tmp_path / "summary.md", "GITHUB_OUTPUT": tmp_path / "output.txt",
           "GITHUB_EVENT_PATH": event, "GITHUB_SHA": "c" * 40, "RUNNER_TEMP": tmp_path,
           "GITHUB_REPOSITORY": "acme/trainer"}
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    return env


def run(*argv: object) -> Tuple[int, str, str]:
    """memdiff in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_no_command_from_data(stdout: str) -> None:
    """Every line starting with `::` is one of memdiff's own annotations."""
    for line in stdout.splitlines():
        assert not line.startswith("::") or OUR_COMMAND.match(line), line


def assert_plain(text: str) -> None:
    """No control character or escape reaches a terminal or a log."""
    found = RAW_CONTROLS.search(text)
    assert found is None, f"raw {found.group()!r} in: {text[max(0, found.start() - 40): found.end() + 40]!r}"


_MARKDOWN = MarkdownIt("commonmark").enable("table")


def assert_markdown_inert(markdown: str, headings: int) -> None:
    """Rendered as CommonMark with tables: only memdiff's own headings, no link, no HTML from data,
    no mention or issue reference left whole."""
    tokens = _MARKDOWN.parse(markdown)
    flat = tokens + [c for t in tokens for c in (t.children or [])]
    assert sum(t.type == "heading_open" for t in flat) == headings
    assert not [t for t in flat if t.type == "link_open"]
    html = [t.content for t in flat if t.type in ("html_block", "html_inline")]
    assert not [h for h in html if "other-gate" in h or "script" in h], html
    # GitHub links mentions, issue references and URLs in text, never in code.
    words = " ".join(t.content for t in flat if t.type == "text")
    assert "@octocat" not in words and "#123" not in words and "https://evil" not in words, words
    assert_plain(markdown)


# --- each numbered case of the issue ------------------------------------------------------------

def test_no_stdout_line_starts_a_workflow_command_from_a_snapshot_or_a_baseline(tmp_path, github_env):
    base, head = write_pair(tmp_path)
    code, out, err = run(base, head, "--github")
    assert code == 1
    assert_no_command_from_data(out)
    assert "::stop-commands::tok" in out  # still shown, escaped inside one line: `evil\n::stop-commands::tok`
    # The same names, stored in a baseline that was merged and is read by every later run.
    assert run("baseline", base, "-o", tmp_path / "hb.json")[0] == 0
    code, out, err = run("gate", head, "--baseline", tmp_path / "hb.json", "--github")
    assert code == 1
    assert_no_command_from_data(out)
    assert_no_command_from_data(err)
    outputs = Path(github_env["GITHUB_OUTPUT"]).read_text().splitlines()
    assert [line.split("=", 1)[0] for line in outputs] == ["verdict", "peak-delta-bytes", "report", "findings",
                                                           "failed-findings"] * 2


@pytest.mark.parametrize("github", [False, True])
def test_no_terminal_escape_reaches_stdout(tmp_path, github_env, github):
    base, head = write_pair(tmp_path)
    flags = ["--github"] if github else []
    assert run("baseline", base, "-o", tmp_path / "b.json")[0] == 0
    for argv in ([base, head, *flags], ["peak", head], ["gate", head, "--baseline", tmp_path / "b.json", *flags]):
        code, out, err = run(*argv)
        assert code in (0, 1), err
        assert_plain(out)
        assert_plain(err)


def test_markdown_comment_and_summary_plant_nothing(tmp_path, github_env):
    base, head = write_pair(tmp_path)
    report = tmp_path / "report.md"
    assert run(base, head, "--github", "--report", report)[0] == 1
    markdown = report.read_text()
    assert_markdown_inert(markdown, headings=2)  # the verdict and device 0
    assert_markdown_inert(Path(github_env["GITHUB_STEP_SUMMARY"]).read_text(), headings=2)
    assert "memdiff: PASS (forged)" in markdown  # the name is shown, as text


def test_markdown_stack_fences_hold_against_any_backtick_run(tmp_path):
    base, head = write_pair(tmp_path, name="a ```` b\n````\n# planted")
    code, out, _ = run(base, head, "--format", "markdown")
    tokens = _MARKDOWN.parse(out)
    assert sum(t.type == "heading_open" for t in tokens) == 2
    fences = [t for t in tokens if t.type == "fence" and t.info == "text"]
    assert fences and all("planted" in t.content for t in fences)


def test_a_cell_is_capped_and_the_html_report_keeps_the_whole_name(tmp_path):
    long_name = "layer_" + "x" * 500
    base, head = write_pair(tmp_path, name=long_name)
    _, markdown, _ = run(base, head, "--format", "markdown", "--top", "3")
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "layer" in line]
    assert rows and all(long_name not in row and "…" in row for row in rows)
    page = tmp_path / "r.html"
    run(base, head, "--html", page)
    assert long_name in page.read_text()


def test_the_shell_hint_quotes_every_path(tmp_path, github_env):
    name = "a$(touch${IFS}PWNED).pickle"
    base, run_path = write_pair(tmp_path, name="train", head_file=name)
    baselines = tmp_path / "baselines"
    code, out, err = run("gate", run_path, "--baselines", baselines, "--github", "--report", tmp_path / "r.md")
    assert code == 2
    hints = re.findall(r"`(memdiff baseline [^`]*)`", err) + re.findall(r"`(memdiff baseline [^`]*)`", out)
    fenced = re.search(r"````*sh\n(.*?)\n`", (tmp_path / "r.md").read_text(), re.S)
    assert hints and fenced
    for command in [*hints, *fenced.group(1).splitlines()]:
        # Run what a maintainer would paste, with memdiff, mkdir and git only printing their arguments.
        shell = "memdiff() { printf '%s\\n' \"$@\"; }; mkdir() { :; }; git() { :; }; " + command
        done = subprocess.run(["sh", "-c", shell], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / "PWNED").exists()
    printed = subprocess.run(["sh", "-c", "memdiff() { printf '%s\\n' \"$@\"; }; " + hints[0]], cwd=tmp_path,
                             capture_output=True, text=True).stdout.splitlines()
    assert printed == ["baseline", str(run_path), "-o", str(baselines / "a$(touch${IFS}PWNED).json")]


@pytest.mark.parametrize("content", ['"ghp_supersecret123"', '{"schema_version": "ghp_supersecret123"}',
                                     '{"ghp_supersecret123": 1}', '["ghp_supersecret123"]'])
def test_a_baseline_error_never_echoes_what_the_file_holds(tmp_path, content):
    secret = tmp_path / "secret.txt"
    secret.write_text(content)
    link = tmp_path / "b.json"
    link.symlink_to(secret)
    _, head = write_pair(tmp_path, name="train")
    code, out, err = run("gate", head, "--baseline", link)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "ghp_supersecret123" not in out + err
    assert "not a valid memdiff baseline" in err or "schema_version of type str" in err


def test_the_schemas_resolve_without_the_network(tmp_path, monkeypatch):
    base, head = write_pair(tmp_path, name="train")
    assert run("baseline", base, "-o", tmp_path / "b.json")[0] == 0
    documents = {"diff": json.loads(run(base, head, "--format", "json")[1]),
                 "gate": json.loads(run("gate", head, "--baseline", tmp_path / "b.json", "--format", "json")[1]),
                 "summary": json.loads(run("summarize", head)[1])}

    def no_network(*args, **kwargs):
        raise AssertionError("a schema reached for the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    schemas = {p.name: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}
    assert not [s for s in schemas.values() if "$id" in s or "://" in json.dumps(
        {k: v for k, v in s.items() if k != "$schema"})]
    registry = referencing.Registry().with_resources(
        (name, referencing.Resource.from_contents(s)) for name, s in schemas.items())
    for name, document in documents.items():
        schema = schemas[f"{name}.schema.json"]
        jsonschema.Draft202012Validator(schema, registry=registry).validate(document)
    # Schemas that stand alone validate with the plainest call; one that names a sibling says so.
    jsonschema.validate(documents["summary"], schemas["summary.schema.json"])
    jsonschema.validate(documents["diff"], schemas["diff.schema.json"])
    with pytest.raises(referencing.exceptions.Unresolvable):
        jsonschema.validate(documents["gate"], schemas["gate.schema.json"])


# --- every renderer, names drawn at random --------------------------------------------------------

ALPHABET = ["\n", "\r", "\t", "\x1b", "\x07", "\x9b", "\u2028", "\u202e", "`", "~", "|", "@", "#", "<", ">",
            "!", "-", "[", "]", "(", ")", "$", "*", "_", "&", ";", ":", "=", "%", "\\", "'", '"', "a", "1",
            " ", "::", "```", "<!--", "-->", "@octocat", "#12", "http://x", "\ud800"]
names = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=24).map("".join)


@pytest.mark.slow  # about 40 runs of every renderer
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=names)
def test_every_renderer_keeps_any_name_inert(github_env, name):
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        base, head = write_pair(tmp, name=name)
        assert run("baseline", base, "-o", tmp / "b.json")[0] == 0
        summary, outputs = Path(github_env["GITHUB_STEP_SUMMARY"]), Path(github_env["GITHUB_OUTPUT"])
        summary.write_text("")
        outputs.write_text("")
        texts = [run(base, head), run(base, head, "--github", "--report", tmp / "r.md"), run("peak", head),
                 run("gate", head, "--baseline", tmp / "b.json", "--github")]
        for code, out, err in texts:
            assert code in (0, 1), err
            assert_plain(out + err)
            assert_no_command_from_data(out)
        assert_markdown_inert((tmp / "r.md").read_text(), headings=2)
        assert_markdown_inert(run(base, head, "--format", "markdown")[1], headings=2)
        for line in outputs.read_text().splitlines():
            assert re.fullmatch(r"(verdict|peak-delta-bytes|report)=.*|(failed-)?findings=([A-Z][0-9]{3}( |$))*",
                                line), line
        assert_plain(run(base, head, "--format", "json")[1])
        json.loads(run(base, head, "--format", "json")[1])
        run(base, head, "--html", tmp / "r.html")
        page = (tmp / "r.html").read_text()
        body = page.split('id="memdiff-data">', 1)
        assert len(body) == 2 and "</script>" not in body[1].split("</script>", 1)[0]
        assert page.count("<script") == 2  # memdiff's data and code, nothing a name opened
        assert "<!--" not in page


def test_shell_words_survive_the_shell():
    from memdiff.inert import shell

    for path in ["runs/a b.pickle", "a$(touch x).pickle", "it's", "-o", "`x`", "a\nb"]:
        assert shlex.split(shell(path)) == [path.replace("\n", "\\n")]


def test_html_report_escapes_names(tmp_path):
    base, head = write_pair(tmp_path, name="<script>alert(1)</script><!-- x -->")
    run(base, head, "--html", tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    assert os.path.getsize(tmp_path / "r.html") > 0


def test_a_baselines_name_stays_one_line_in_check_and_gate(tmp_path, github_env):
    base, head = write_pair(tmp_path, name="train")
    assert run("baseline", base, "-o", tmp_path / "b.json", "--name", "x\n::error::INJ\x1b[2J")[0] == 0
    code, out, err = run("baseline", "--check", tmp_path / "b.json")
    assert code == 0 and out.count("\n") == 1
    assert_plain(out + err)
    code, out, err = run("gate", head, "--baseline", tmp_path / "b.json", "--github")
    assert_no_command_from_data(out)
    assert_plain(out + err)
