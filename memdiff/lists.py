"""List values as users write them: an option repeated, a comma list, or both mixed
(`--ignore K002 --ignore K003,K004`), alike on the command line, in the pytest marker and in the
Action's inputs. One place cuts them into items and says when two items contradict each other.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from memdiff.compare.findings import parse_codes
from memdiff.compare.limits import Limit, parse_limit, pct_text
from memdiff.errors import InputError, clip
from memdiff.units import format_bytes


def split_items(values: Union[str, Iterable[str]], where: str,
                keep_whole: Optional[Callable[[str], bool]] = None) -> List[str]:
    """Every item of `values` (one string or several), in order: each cut at commas and stripped of
    white space. An empty item beside others (`K002,`, `K002,,K003`) is skipped, as a trailing comma
    in a list is; a value with no item at all (`""`, `","`) names nothing, which nobody means:
    InputError naming `where`. `keep_whole(value)` true leaves that value uncut (a file whose name
    holds a comma)."""
    if isinstance(values, (Mapping, bytes)) or not isinstance(values, Iterable):
        # An int or a dict from the API or the pytest marker (`fail_on=5`): not a list of items.
        raise InputError(where, f"a value of type {type(values).__name__} is not a list: give a string "
                                f"(\"K002,K003\") or a list of strings")
    out: List[str] = []
    for value in [values] if isinstance(values, str) else values:
        value = str(value)
        parts = [value.strip()] if keep_whole is not None and keep_whole(value) else value.split(",")
        items = [p.strip() for p in parts if p.strip()]
        if not items:
            raise InputError(where, f"{clip(value)!r} names nothing: give one or more items, separated by commas "
                                    f"or with the option repeated")
        out += items
    return out


def joined_limit(old: Limit, part: Limit, where: str) -> Limit:
    """A limit with one more part (`256MiB` then `10%`: both must be exceeded). Two sizes or two
    percents for one thing contradict each other: InputError, rather than the later one silently
    winning."""
    if part.fail_over_bytes is not None and old.fail_over_bytes is not None:
        raise InputError(where, f"two sizes, {format_bytes(old.fail_over_bytes)} and "
                                f"{format_bytes(part.fail_over_bytes)}: give one size (and at most one percent)")
    if part.fail_over_pct is not None and old.fail_over_pct is not None:
        raise InputError(where, f"two percents, {pct_text(old.fail_over_pct)} and {pct_text(part.fail_over_pct)}: "
                                f"give one percent (and at most one size)")
    return Limit(old.fail_over_bytes if part.fail_over_bytes is None else part.fail_over_bytes,
                 old.fail_over_pct if part.fail_over_pct is None else part.fail_over_pct)


def limit_of(parts: Union[str, Iterable[str]], where: str) -> Limit:
    """One limit from its parts as written (`"256MiB,10%"`, or `["256MiB", "10%"]`)."""
    limit = Limit()
    for item in split_items(parts, where):
        try:
            limit = joined_limit(limit, parse_limit(item), where)
        except ValueError as exc:
            raise InputError(where, str(exc)) from None
    return limit


def named_limits(values: Union[str, Iterable[str]], where: str,
                 names: Optional[Sequence[str]] = None) -> Dict[str, Limit]:
    """`["activation=256MiB", "activation=10%,gradient=5%"]` -> {"activation": Limit(256 MiB, 10%),
    "gradient": Limit(5%)}; `names`, when given, are the only names allowed (the phases). A name
    given a size (or a percent) twice is InputError."""
    out: Dict[str, Limit] = {}
    what = "PHASE" if names else "CATEGORY"
    for value in split_items(values, where):
        name, sep, limit = value.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InputError(where, f"{clip(value)!r} is not {what}=SIZE or {what}=P%")
        if names and name not in names:
            raise InputError(where, f"{clip(name)!r} is not a phase: use one of {', '.join(names)}")
        try:
            part = parse_limit(limit)
        except ValueError as exc:
            raise InputError(where, f"{clip(name)}: {exc}") from None
        out[name] = joined_limit(out.get(name, Limit()), part, f"{where}: {clip(name)}")
    return out


def chosen_codes(fail_on: Union[str, Iterable[str]], ignore: Union[str, Iterable[str]], fail_where: str,
                 ignore_where: str) -> Tuple[List[str], List[str]]:
    """(codes to fail on, codes to ignore) from both lists as written (`K002,k003`, a family letter),
    each checked against the catalogue. A code or family named in both contradicts itself:
    InputError. A code named alone wins over its family in the other list (`--fail-on K
    --ignore K004`: every K code fails but K004, which is ignored)."""
    fail_items = split_items(fail_on, fail_where)
    ignore_items = split_items(ignore, ignore_where)
    fail_named = {i.upper() for i in fail_items}
    ignore_named = {i.upper() for i in ignore_items}
    both = sorted(fail_named & ignore_named)
    if both:
        raise InputError(ignore_where, f"{', '.join(clip(b) for b in both[:5])} also given to {fail_where}: a "
                                       f"finding either fails or is ignored, so give each code to one of them")
    fail = parse_codes(fail_where, fail_items)
    ignored = parse_codes(ignore_where, ignore_items)
    return [c for c in fail if c not in ignore_named], [c for c in ignored if c not in fail_named]


class ListOption(argparse.Action):
    """An option whose items collect over repeats and comma lists, mixed (`--ignore K002 --ignore
    K003,K004` is three codes), each converted by `item_type`: every list option of every command
    takes its values this way (memdiff.lists.split_items). `keep_whole(value)` true keeps a value
    uncut (a rules file whose name holds a comma)."""

    def __init__(self, option_strings: Sequence[str], dest: str, item_type: Optional[Callable[[str], Any]] = None,
                 keep_whole: Optional[Callable[[str], bool]] = None, **kwargs: Any) -> None:
        kwargs.setdefault("default", [])
        super().__init__(option_strings, dest, **kwargs)
        self.item_type = item_type
        self.keep_whole = keep_whole

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        """Add this occurrence's items to those before it; a bad item is argparse's one-line usage error."""
        where = option_string or str(self.metavar or self.dest)
        try:
            items = split_items(values if isinstance(values, list) else [values], where, self.keep_whole)
            converted = [self.item_type(i) for i in items] if self.item_type is not None else items
        except InputError as exc:
            raise argparse.ArgumentError(self, exc.message) from None
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        # A new list: the default one is shared by every parse.
        setattr(namespace, self.dest, list(getattr(namespace, self.dest, None) or []) + converted)


LISTS = "; repeat it or give a comma list"
