"""A newcomer's first minutes: every command the README shows runs as written from a fresh clone with
nothing beside it (no ../shared). A temporary `git clone` of this repository's HEAD runs each `memdiff`
line of the README's ```sh and ```text blocks with the clone's own memdiff, and each exit code and first
line is what the README shows."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest
from conftest import ROOT

BLOCK = re.compile(r"```(sh|text)\n(.*?)```", re.DOTALL)


class Shown(NamedTuple):
    """A command the README shows: its words after `memdiff`, the first line it shows printed (None
    where it shows none) and the exit code it implies."""

    argv: List[str]
    first_line: Optional[str]
    exit_code: int


def readme_commands(text: str) -> List[Shown]:
    """The `memdiff` commands of a README's ```sh and ```text blocks. In ```sh, each `memdiff` part of a
    line's `&&` chain (the install parts are left out: the test runs an installed memdiff); in ```text, each
    `$ memdiff` line and the lines below it up to the next `$ `: the output, whose `FAIL` line means exit 1
    (the README calls that a regression, as a failing test)."""
    out: List[Shown] = []
    for kind, body in BLOCK.findall(text):
        lines = body.rstrip("\n").split("\n")
        for i, line in enumerate(lines):
            if kind == "sh":
                for part in " ".join(shlex.split(line, comments=True)).split(" && "):
                    if part.startswith("memdiff"):
                        out.append(Shown(shlex.split(part)[1:], None, 0))
            elif line.startswith("$ memdiff "):
                shown = []
                for later in lines[i + 1:]:
                    if later.startswith("$ "):
                        break
                    shown.append(later)
                code = 1 if any(s.startswith("FAIL ") for s in shown) else 0
                out.append(Shown(shlex.split(line[2:])[1:], shown[0] if shown else None, code))
    return out


def test_the_readme_commands_are_found():
    # What the clone test below runs: the demo, a peak and a diff at least, with the diff's output shown.
    shown = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert [c.argv[0] for c in shown][:3] == ["demo", "peak", "tests/data/cuda/gpt2-base.pickle.gz"]
    assert shown[2].first_line.startswith("memdiff: regression: ") and shown[2].exit_code == 1


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this repository's HEAD commit in a folder of its own: nothing beside it."""
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: there is no commit to clone")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    where = tmp_path_factory.mktemp("clone") / "memdiff"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(where)], check=True)
    subprocess.run(["git", "-C", str(where), "checkout", "--quiet", "--detach", head], check=True)
    assert not (where.parent / "shared").exists()
    return where


@pytest.mark.slow
def test_every_readme_command_runs_from_a_clone_alone(clone, torch, tmp_path):
    # The clone's memdiff, not the installed one; temporary files (the demo's snapshots) under tmp_path.
    env = {**os.environ, "PYTHONPATH": str(clone), "TMPDIR": str(tmp_path)}
    where = subprocess.run([sys.executable, "-c", "import memdiff; print(memdiff.__file__)"], cwd=clone,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(clone), where
    shown = readme_commands((clone / "README.md").read_text(encoding="utf-8"))
    assert shown
    for command in shown:
        done = subprocess.run([sys.executable, "-m", "memdiff", *command.argv], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=600)
        said = f"`memdiff {shlex.join(command.argv)}` from a clone: exit {done.returncode}\n{done.stderr}"
        assert done.returncode == command.exit_code, said
        if command.first_line is not None:
            assert done.stdout.split("\n", 1)[0] == command.first_line, said + done.stdout
