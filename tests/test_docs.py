"""The README is a short front page whose set-up commands are the real ones and whose example output
is what memdiff prints; the docs' examples on real snapshots are too, and every link resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
from conftest import ROOT

from memdiff.cli import main

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -n auto'
DEMO_COMMAND = "pip install torch==2.13.0 && pip install -e . && memdiff demo"
# A `$ memdiff ...` block, its output up to the closing fence.
EXAMPLE = re.compile(r"```text\n\$ (memdiff [^\n]*)\n(.*?)```", re.DOTALL)


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; reference belongs in docs/"


def test_the_set_up_commands_are_the_real_ones():
    text = README.read_text(encoding="utf-8")
    top = text[:text.index("## One real diff")]
    assert DEMO_COMMAND in top and TEST_COMMAND in top
    # .ci/run installs torch (pinned, from its own index) earlier, then runs the rest of it
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'python -m pip install -q -e ".[test]" && python -m pytest -n auto\n' in ci


def _on_files_here(command: str) -> bool:
    """Whether every file the command reads is one the repository ships (`tests/data/...`, `RUN=VALUE`
    included): such an example runs from a clone alone, and is checked here."""
    paths = [word.split("=")[0] for word in shlex.split(command)[1:] if "/" in word and not word.startswith("-")]
    return bool(paths) and all((ROOT / path).is_file() and (ROOT / path).resolve().is_relative_to(ROOT)
                               for path in paths)


def _examples() -> Iterator[Tuple[str, str, str]]:
    for page in PAGES:
        if page.name == "findings.md":
            continue  # generated from memdiff/compare/findings.py; tests/test_findings.py runs its examples
        for match in EXAMPLE.finditer(page.read_text(encoding="utf-8")):
            if _on_files_here(match.group(1)):
                yield page.relative_to(ROOT).as_posix(), match.group(1), match.group(2)


def _chunks(shown: str) -> List[List[str]]:
    """The shown output's runs of lines between `...` elisions."""
    chunks: List[List[str]] = [[]]
    for line in shown.rstrip("\n").split("\n"):
        if line == "...":
            chunks.append([])
        else:
            chunks[-1].append(line)
    return [c for c in chunks if c]


EXAMPLES = list(_examples())


def test_the_readme_shows_a_real_diff():
    assert any(page == "README.md" and " --top " in command for page, command, _ in EXAMPLES)


def test_no_page_shows_a_command_on_files_beside_the_project():
    # A clone has no ../shared: an example there would not run for a newcomer (docs/findings.md names
    # the public snapshots some codes were seen on without a path, as not shipped).
    for page in PAGES:
        for match in EXAMPLE.finditer(page.read_text(encoding="utf-8")):
            assert "../shared/" not in match.group(1), f"{page.name}: `{match.group(1)}` needs ../shared"


@pytest.mark.parametrize("page, command, shown", EXAMPLES, ids=[f"{p}:{c[8:60]}" for p, c, _ in EXAMPLES])
def test_examples_on_real_snapshots_show_what_memdiff_prints(capsys, monkeypatch, page, command, shown):
    monkeypatch.chdir(ROOT)  # the pages name the snapshots from the project's root: tests/data/cuda/...
    main(shlex.split(command)[1:])
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    elided = "\n...\n" in f"\n{shown}"
    if not elided:
        assert printed == shown.rstrip("\n").split("\n"), (
            f"{page}: the output of `{command}` changed; paste what it prints now:\n" + "\n".join(printed))
        return
    at = 0
    for chunk in _chunks(shown):  # each shown run of lines appears, in order, in what it prints
        found = next((i for i in range(at, len(printed) - len(chunk) + 1) if printed[i:i + len(chunk)] == chunk), None)
        assert found is not None, (f"{page}: `{command}` no longer prints:\n" + "\n".join(chunk)
                                   + "\n\nit prints:\n" + "\n".join(printed))
        at = found + len(chunk)


def _anchors(path: Path) -> List[str]:
    """GitHub's anchors for a page's headings."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.append(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_links_between_pages_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        # A clone has nothing beside it (no ../shared): a link leaving the repository is broken there.
        assert path.is_relative_to(ROOT.resolve()), f"{page.name}: link to {target}: outside the repository"
        assert path.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: link to {target}: no such heading"


def test_every_feature_the_emulator_refuses_is_in_the_docs_with_its_workaround():
    from memdiff.recording.emulate.escapes import FEATURES

    text = (ROOT / "docs" / "emulate.md").read_text(encoding="utf-8")
    for _, feature, instead in FEATURES:
        assert f"| {feature} | {instead} |" in text, f"docs/emulate.md does not list {feature!r}"
