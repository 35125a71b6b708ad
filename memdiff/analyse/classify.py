"""classify: Summary -> Summary with a category on every group and bytes per category per device.

The rules are data (rules/categories.json, format in schemas/rules.schema.json): a group gets
the category of the highest-priority rule that matches its display frames and its lifetime
(born in which phase, freed in which, outliving its phase or step: see lifetimes.py); user rules
(`--rules FILE`, `--custom-profile JSON`) rank above the built-in ones. A group no rule
matches is `other`. Classification reads only the summary, so a stored summary can be
classified again with other rules.
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, replace
from importlib import resources
from typing import AbstractSet, Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple, Union

from memdiff.analyse.patterns import TIMEOUT_S, Pattern
from memdiff.errors import InputError, clip
from memdiff.lists import chosen_codes
from memdiff.model import DeviceSummary, Frame, Group, Summary, largest_first
from memdiff.read.frames import FREED_PREFIX, UPDATED_PREFIX
from memdiff.read.load import parse_json, read_json, read_small
from memdiff.read.schema import validate
from memdiff.read.source import enclosing_class

OTHER = "other"
# Categories expected to live across steps; memory of any other kept from an earlier step is a leak.
PERSISTENT = ("parameter", "gradient", "optimizer_state", "workspace")
USER_PRIORITY = 10_000  # user rules without a priority rank above every built-in rule
# Every distinct frame of a run is searched with every frame test, so a command's cost grows with
# rules x frames: 20,000 rules made `memdiff peak` of a real run take 23 s. 1,000 (over 16x the
# built-in 62) adds under a second to the real snapshots' (docs/categories.md).
MAX_USER_RULES = 1_000

@dataclass(frozen=True)
class FrameTest:
    """Regular expressions one frame must satisfy (each given one is searched). `cls` (`class` in a
    rules file) is searched in the name of the class whose body holds the frame's line, read from its
    file where this machine has it (source.enclosing_class): a trace names the function only. It is
    tested last, so that only the frames the other expressions pass cost a look at a file."""

    name: Optional[Pattern] = None
    file: Optional[Pattern] = None
    any: Optional[Pattern] = None
    cls: Optional[Pattern] = None

    def matches(self, f: Frame) -> bool:
        """Whether frame `f` passes every given expression."""
        return ((self.name is None or self.name.search(f.name) is not None)
                and (self.file is None or self.file.search(f.file) is not None)
                and (self.any is None or self.any.search(f.name) is not None or self.any.search(f.file) is not None)
                and (self.cls is None or self._in_class(f)))

    def _in_class(self, f: Frame) -> bool:
        assert self.cls is not None
        name = enclosing_class(f)
        return name is not None and self.cls.search(name) is not None


@dataclass(frozen=True)
class Rule:
    """One category rule; `origin` says where it came from, for messages."""

    category: str
    priority: int
    frames: Tuple[FrameTest, ...]
    without: Tuple[FrameTest, ...]
    site: Optional[Pattern]
    freed: bool
    origin: str
    lifetime: Tuple[Tuple[str, Pattern], ...] = ()

    def fits(self, freed: bool, lifetime: Optional[Dict[str, str]]) -> bool:
        """Whether the rule can apply to a group freed (or not) with this lifetime."""
        if freed != self.freed:
            return False
        return not self.lifetime or (lifetime is not None and all(
            pattern.fullmatch(lifetime.get(fact, "")) for fact, pattern in self.lifetime))

    def matches(self, site: str, passed: AbstractSet[FrameTest]) -> bool:
        """Whether the rule's site and frame tests pass, given the frame tests some frame of the
        stack passes: every `frames` test does, no `without` test does."""
        return ((self.site is None or self.site.search(site) is not None)
                and all(t in passed for t in self.frames) and not any(t in passed for t in self.without))


def parse_rules(path: str, data: Any, default_priority: int, builtin: bool = False) -> List[Rule]:
    """Rules from a decoded rules document; InputError naming the rule when one is invalid.

    `builtin` is for the shipped rules: the tests validate them against the schema and their
    regexes run without a time limit.
    """
    if not builtin:
        validate(path, data, "rules")
    timeout = None if builtin else TIMEOUT_S
    rules = []
    for i, r in enumerate(data["rules"], 1):
        rule = f"rule {i} ({clip(r['category'])})"
        origin = f"{path}: {rule}"

        def pattern(text: str, origin: str = origin) -> Pattern:  # this rule's origin, bound here (B023)
            return Pattern(text, origin, timeout)

        def test(spec: Dict[str, str]) -> FrameTest:
            return FrameTest(**{("cls" if k == "class" else k): pattern(v) for k, v in spec.items()})

        try:
            rules.append(Rule(
                category=r["category"], priority=r.get("priority", default_priority),
                frames=tuple(test(t) for t in r.get("frames", [])),
                without=tuple(test(t) for t in r.get("without", [])),
                site=pattern(r["site"]) if "site" in r else None,
                freed=r.get("freed", False), origin=origin,
                lifetime=tuple((fact, pattern(v)) for fact, v in r.get("lifetime", {}).items())))
        except ValueError as exc:
            raise InputError(path, f"{rule}: {exc}") from None
    return rules


def builtin_rules() -> List[Rule]:
    """The rules shipped in memdiff/rules/categories.json."""
    text = (resources.files("memdiff") / "rules" / "categories.json").read_text(encoding="utf-8")
    return parse_rules("memdiff/rules/categories.json", json.loads(text), 0, builtin=True)


def _read_rules_file(path: str) -> Any:
    if not path.endswith(".toml"):
        return read_json(path, "a rules file", allow_nan=True)
    raw = read_small(path, "a rules file")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the same parser, packaged for older Pythons
        import tomli as tomllib
    try:
        # utf-8-sig: a byte-order mark (a Windows editor's) read as `Invalid statement (at line 1,
        # column 1)`, where the same rules as JSON were read.
        return tomllib.loads(raw.decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(path, f"invalid TOML: {exc}") from None
    except RecursionError:
        raise InputError(path, "invalid TOML: nested deeper than Python can read") from None


def custom_profile_rules(text: str, before: int = 0) -> List[Rule]:
    """Mosaic-style `{"category": "regex", ...}`: each regex is searched in frame names and files;
    `before`: the user rules from files, counted with these against MAX_USER_RULES."""
    data = parse_json("--custom-profile", text.encode("utf-8", "surrogateescape"))
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise InputError("--custom-profile", 'expected a JSON object of category names to regexes, '
                                             'e.g. {"kv_cache": "KVCache|kv_cache"}')
    _check_count("--custom-profile", len(data), before + len(data))
    doc = {"rules": [{"category": k, "frames": [{"any": v}]} for k, v in data.items()]}
    return parse_rules("--custom-profile", doc, USER_PRIORITY)


RuleFile = Union[str, Tuple[str, Any]]  # a path, or a path and the document read from it


def read_rule_files(paths: Sequence[str]) -> List[Tuple[str, Any]]:
    """Each rules file read once, as (path, document): what load_rules and findings_chosen both take,
    so that an entry needing a file's categories and its choice of findings reads it one time."""
    return [(path, _read_rules_file(path)) for path in paths]


def _documents(rules_files: Sequence[RuleFile]) -> List[Tuple[str, Any]]:
    """The documents of the rules files, their rules counted (at most MAX_USER_RULES in all) before
    any is validated or compiled."""
    documents = [f if isinstance(f, tuple) else (f, _read_rules_file(f)) for f in rules_files]
    total = 0
    for path, data in documents:
        rules = data.get("rules") if isinstance(data, dict) else None
        count = len(rules) if isinstance(rules, list) else 0  # no list: the schema says what is wrong
        total += count
        _check_count(path, count, total)
    return documents


def _check_count(where: str, count: int, total: int) -> None:
    """InputError naming `where` when the user rules so far (`total`, `count` of them here) pass MAX_USER_RULES."""
    if total > MAX_USER_RULES:
        before = f" (with the rules files before it, {total:,})" if total != count else ""
        raise InputError(where, f"{count:,} rules{before}: at most {MAX_USER_RULES:,} user rules are read, as each "
                                f"one is searched in every frame of the run; merge the rules of a category into one "
                                f"regex (`attn|mlp`)")


def load_rules(rules_files: Sequence[RuleFile] = (), custom_profile: Optional[str] = None) -> List[Rule]:
    """User rules (files in order, then the custom profile) ranked above the built-in rules."""
    user: List[Rule] = []
    for path, data in _documents(rules_files):
        user += parse_rules(path, data, USER_PRIORITY)
    if custom_profile:
        user += custom_profile_rules(custom_profile, len(user))
    # sorted() is stable: equal priorities keep their order, user rules before built-in ones.
    return sorted(user + builtin_rules(), key=lambda r: -r.priority)


def findings_chosen(rules_files: Sequence[RuleFile]) -> List[Tuple[str, List[str], List[str]]]:
    """Each rules file's choice of findings (its `findings`: `fail-on` and `ignore` codes, checked
    against the catalogue), as (path, fail-on, ignore), in order; files without one are left out."""
    out = []
    for path, data in _documents(rules_files):
        chosen = validate(path, data, "rules").get("findings")
        if chosen:
            out.append((path, *chosen_codes(chosen.get("fail-on", []), chosen.get("ignore", []),
                                            f"{path}: findings.fail-on", f"{path}: findings.ignore")))
    return out


def check_categories(names: Iterable[str], rules: Sequence[Rule], source: str) -> None:
    """InputError when a limit names a category no rule gives: a misspelt name would check 0 B
    against 0 B and pass, whatever grew."""
    known = {r.category for r in rules} | {OTHER}
    unknown = sorted(set(names) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(source, f"no rule gives the categor{'y' if len(unknown) == 1 else 'ies'} "
                                 f"{', '.join(repr(clip(u)) for u in unknown[:5])}{hint}, so a limit on it would "
                                 f"check nothing; known: {', '.join(sorted(known))} (a --rules file adds more)")


class Categorizer:
    """The category of groups under one list of rules, each distinct group worked out once.

    A lifetime and being freed or not rule out most rules, and there are few of them (at most
    90 lifetimes), so the rules left for each are listed once; the same site, stack and lifetime
    (a group again at a phase's peak) is looked up. Each distinct frame object is tested once
    against every frame test: stacks share their frames (normalization makes one Frame per
    distinct frame), so thousands of distinct 500-frame stacks cost dict lookups, not regex
    searches.
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._rules = list(rules)
        self._fitting: Dict[Tuple[bool, Any], List[Rule]] = {}
        self._known: Dict[Tuple[Any, ...], str] = {}
        self._tests = list(dict.fromkeys(t for r in self._rules for t in r.frames + r.without))
        # id of a frame -> (the frame, kept so that its id stays its own, the tests it passes)
        self._passes: Dict[int, Tuple[Frame, FrozenSet[FrameTest]]] = {}

    def of(self, group: Group) -> str:
        """The category of the first (highest-priority) rule that matches `group`, else `other`."""
        freed = group.site.startswith((FREED_PREFIX, UPDATED_PREFIX))
        life = None if group.lifetime is None else tuple(sorted(group.lifetime.items()))
        key = (group.site, life, *group.frames)
        known = self._known.get(key)
        if known is not None:
            return known
        fitting = self._fitting.get((freed, life))
        if fitting is None:
            fitting = self._fitting[(freed, life)] = [r for r in self._rules if r.fits(freed, group.lifetime)]
        passed = self._passed(group.frames) if fitting else frozenset()
        category = next((r.category for r in fitting if r.matches(group.site, passed)), OTHER)
        self._known[key] = category
        return category

    def _passed(self, frames: Sequence[Frame]) -> Set[FrameTest]:
        """The frame tests some frame of `frames` passes (what Rule.matches asks of a stack)."""
        passed: Set[FrameTest] = set()
        for f in frames:
            hit = self._passes.get(id(f))
            if hit is None:
                hit = self._passes[id(f)] = (f, frozenset(t for t in self._tests if t.matches(f)))
            passed |= hit[1]
        return passed


def category_of(group: Group, rules: Sequence[Rule]) -> str:
    """The category of the first (highest-priority) rule that matches, else `other`."""
    return Categorizer(rules).of(group)


def _classified(groups: Sequence[Group], categorizer: Categorizer) -> Tuple[List[Group], Dict[str, int]]:
    out: List[Group] = []
    totals: Dict[str, int] = {}
    for g in groups:
        category = categorizer.of(g)
        out.append(replace(g, category=category))
        totals[category] = totals.get(category, 0) + g.bytes
    return out, largest_first(totals)


def _classify_device(d: DeviceSummary, rules: Categorizer) -> DeviceSummary:
    groups, categories = _classified(d.groups, rules)
    phase_peaks = []
    for p in d.phase_peaks:
        if p.groups is None:
            phase_peaks.append(replace(p, categories=categories))
        else:
            p_groups, p_categories = _classified(p.groups, rules)
            phase_peaks.append(replace(p, groups=p_groups, categories=p_categories))
    return replace(d, groups=groups, categories=categories, phase_peaks=phase_peaks)


def classify(summary: Summary, rules: Sequence[Rule]) -> Summary:
    """A copy of `summary` with every group categorized and `categories` filled per device."""
    categorizer = Categorizer(rules)
    return replace(summary, devices=[_classify_device(d, categorizer) for d in summary.devices])
