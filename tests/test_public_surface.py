"""The public surface holds still: docs/api.md's `public-surface` block lists every public import
path and name, CLI command and flag, pytest option and marker keyword, Action input and output,
and the JSON keys of each document; a listed thing that disappears fails here, and so does a flag,
input or JSON key that is added without being listed. The block is the list; nothing generates it."""

from __future__ import annotations

import importlib
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import pytest
import yaml
from conftest import ROOT

from memdiff.cli import COMMANDS, build_parser

SCHEMAS = ROOT / "memdiff" / "schemas"
FRAMEWORK = {"memdiff.integrations.transformers": "transformers", "memdiff.integrations.lightning": "lightning"}


def surface() -> List[Tuple[str, str, List[str]]]:
    """(kind, subject, names) for each line of docs/api.md's public-surface block."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = re.search(r"^```public-surface\n(.*?)^```$", text, re.S | re.M)
    assert block, "docs/api.md has no ```public-surface block"
    out = []
    for line in block.group(1).splitlines():
        if line.strip() and not line.startswith("#"):
            head, _, names = line.partition(":")
            kind, _, subject = head.partition(" ")
            out.append((kind, subject, names.split()))
    return out


def lines(kind: str) -> List[Tuple[str, List[str]]]:
    return [(subject, names) for k, subject, names in surface() if k == kind]


def test_the_block_names_only_kinds_this_test_checks():
    assert {k for k, _, _ in surface()} == {"module", "deprecated", "command", "pytest-option", "pytest-marker",
                                            "action-input", "action-output", "json"}


@pytest.mark.parametrize("path, names", lines("module"), ids=lambda v: v if isinstance(v, str) else "")
def test_each_public_module_has_each_listed_name(path, names):
    if path in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[path], reason=f"{path} needs {FRAMEWORK[path]} (memdiff[{FRAMEWORK[path]}])")
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lost {missing}: a public name is kept, or docs/api.md says it is gone"


@pytest.mark.parametrize("path", sorted(FRAMEWORK))
def test_the_callbacks_public_paths_are_the_same_objects_and_do_not_warn(monkeypatch, path):
    pytest.importorskip(FRAMEWORK[path], reason=f"{path} needs {FRAMEWORK[path]}")
    inner = importlib.import_module(path.replace("memdiff.integrations", "memdiff.recording.integrations"))
    monkeypatch.delitem(sys.modules, path, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        public = importlib.import_module(path)
    assert public.MemdiffCallback is inner.MemdiffCallback
    assert not [w for w in seen if "memdiff" in str(w.message)]


@pytest.mark.parametrize("old, new", [(o, n[0]) for o, n in lines("deprecated")])
def test_each_old_path_still_imports_warning_with_its_new_path(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def _flags(parser: Any) -> Set[str]:
    return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def test_each_command_and_flag_is_listed_and_there():
    listed = dict(lines("command"))
    assert set(listed) == {"memdiff", *COMMANDS}, "a command came or went: docs/api.md lists every one"
    assert set(listed.pop("memdiff")) == _flags(build_parser(None))
    for name, flags in listed.items():
        sub = next(a for a in build_parser(name)._actions if a.dest == "command").choices[name]
        assert set(flags) == _flags(sub) - {"--debug"}, name


def test_the_pytest_options_and_marker_keywords_are_listed_and_there():
    from memdiff import pytest_plugin

    class Group:
        def __init__(self) -> None:
            self.options: List[str] = []

        def addoption(self, *names: str, **_: Any) -> None:
            self.options += names

    class Parser:
        group = Group()

        def getgroup(self, *_: Any) -> Group:
            return self.group

        def addini(self, *_: Any, **__: Any) -> None:
            pass

    parser = Parser()
    pytest_plugin.pytest_addoption(parser)  # type: ignore[arg-type]
    assert lines("pytest-option") == [("", parser.group.options)]
    assert lines("pytest-marker") == [(pytest_plugin.MARKER, list(pytest_plugin.MARKER_KEYWORDS))]


def test_the_actions_inputs_and_outputs_are_listed_and_there():
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    assert lines("action-input") == [("", list(action["inputs"]))]
    assert lines("action-output") == [("", list(action["outputs"]))]


def _resolve(ref: str, here: Path) -> Tuple[Dict[str, Any], Path]:
    """The schema node a `$ref` (or a listed `file#/pointer`) names, and the file it is in."""
    name, _, pointer = ref.partition("#")
    path = SCHEMAS / name if name else here
    node: Any = json.loads(path.read_text())
    for part in [p for p in pointer.split("/") if p]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, path


def keys_of(node: Dict[str, Any], here: Path) -> Set[str]:
    """The keys an object of this schema node may have: its properties and those of what it is made
    of (`allOf`, `$ref`)."""
    keys = set(node.get("properties", {}))
    for part in node.get("allOf", []) + ([node] if "$ref" in node else []):
        keys |= keys_of(*_resolve(part["$ref"], here)) if "$ref" in part else keys_of(part, here)
    return keys


@pytest.mark.parametrize("where, names", lines("json"), ids=lambda v: v if isinstance(v, str) else "")
def test_each_json_document_has_the_listed_keys_and_no_others(where, names):
    node, path = _resolve(where, SCHEMAS)
    assert set(names) == keys_of(node, path), f"{where}: a key came or went; docs/api.md lists each one"


def test_every_schema_is_listed():
    listed = {where.partition("#")[0] for where, _ in lines("json")}
    assert listed == {p.name for p in SCHEMAS.glob("*.schema.json")}
