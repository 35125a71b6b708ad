"""The house's layout holds: no module of memdiff imports, directly or round about, one that
imports it back (imports under TYPE_CHECKING aside: they never run), and each of the emulator's
modules imports on its own, as a reader or a test would import it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memdiff"


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _imports(tree: ast.AST, modules: Dict[str, Path]) -> List[str]:
    """memdiff modules imported anywhere in the module (functions' included), TYPE_CHECKING blocks
    left out; `from package import module` names the module, not the package's __init__."""
    out: List[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("memdiff"):
                for a in child.names:
                    full = f"{child.module}.{a.name}"
                    out.append(full if full in modules else child.module)
            elif isinstance(child, ast.Import):
                out.extend(a.name for a in child.names if a.name.startswith("memdiff"))
            visit(child)
    visit(tree)
    return out


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text(encoding="utf-8")), modules):
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


EMULATOR_MODULES = sorted(m for m in _modules() if m.startswith("memdiff.recording.emulate."))
# One process imports torch (seconds) and forks a child per module, which imports that module
# alone: no memdiff module is loaded before it, as in a fresh interpreter, and torch is imported
# once rather than once per module (a fresh process each took about 8 s of CPU, 45 of them).
_FORK_IMPORTS = """
import json, os, sys, traceback
import torch  # noqa: F401
failed = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    if os.waitpid(pid, 0)[1] != 0:
        failed[name] = text or "the child died"
print(json.dumps(failed))
"""


@pytest.fixture(scope="module")
def import_failures(torch) -> Dict[str, str]:
    """module -> the traceback of importing it alone (modules that import cleanly are absent)."""
    done = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, *EMULATOR_MODULES], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", EMULATOR_MODULES)
def test_each_emulator_module_imports_on_its_own(module, import_failures):
    assert module not in import_failures, import_failures.get(module)


def test_an_emulator_module_that_fails_alone_is_caught(torch, tmp_path):
    # The forked import must report a module whose import raises, not only a clean exit.
    (tmp_path / "breaks_alone.py").write_text("import memdiff.no_such_module\n")
    done = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, "breaks_alone", "memdiff.units"],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(failed) == ["breaks_alone"] and "no_such_module" in failed["breaks_alone"]


# The top of memdiff/ holds the thin entries, the shared small modules every stage uses, and the
# public short paths; the stages live in their folders (docs/development.md), so a new module
# lands in one of them, or is added here on purpose.
ENTRIES = {"__init__", "__main__", "cli", "api", "github", "pytest_plugin"}
SHARED = {"model", "errors", "units", "numbers", "lists", "progress", "atomic", "inert", "cluster"}
PUBLIC_PATHS = {"baseline", "capture"}  # memdiff.baseline (public), memdiff.capture (deprecated, warns)
FOLDERS = {"recording", "read", "analyse", "compare", "predict", "report", "render", "commands",
           "integrations", "examples", "rules", "schemas"}
MAX_LINES = 800


def test_the_top_of_memdiff_holds_only_the_entries_and_the_shared_modules():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert modules == ENTRIES | SHARED | PUBLIC_PATHS
    assert folders == FOLDERS


def test_no_module_is_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


# Every renderer (the diff's, the gate's, the trend's, the peak's, the forecast's, the what-if's, the fit's
# and its page's) lays a report out: a size or a count in words (memdiff.units) is the report stage's, so
# every output says it alike.
RENDERERS = sorted(m for m in _modules() if m.startswith("memdiff.render."))


def _wording_imports(name: str) -> List[str]:
    modules = _modules()
    return sorted({m for m in _imports(ast.parse(modules[name].read_text(encoding="utf-8")), modules)
                   if m == "memdiff.units"})


def test_no_renderer_words_a_size_or_count():
    assert {"memdiff.render.forecast", "memdiff.render.whatif", "memdiff.render.fit",
            "memdiff.render.fit_html", "memdiff.render.text"} <= set(RENDERERS)
    assert {name: _wording_imports(name) for name in RENDERERS} == {name: [] for name in RENDERERS}
    # control: the report stage's headline words its sizes, and the check sees it
    assert _wording_imports("memdiff.report.headline") == ["memdiff.units"]
