"""Text from a snapshot, a baseline or a file name made inert for the surface it goes to.

Frame names, file names, labels and paths come from whoever produced the snapshot or the
baseline, and baselines are merged into default branches and read by runs holding a writing
token. Every surface memdiff writes has its own active syntax: a newline on stdout can start a
GitHub workflow command (`::stop-commands::`), an ESC byte drives the terminal, markdown turns
`@name` into a notification and a code fence's end into a real heading, a shell runs `$(...)`.
The rule is one per surface, applied where text leaves memdiff: `text` for every line a
terminal or a log shows, `md_*` for the pull-request comment and the job summary, `shell` for
a command a person is told to paste. HTML escapes with the standard library where it writes.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Any, Iterable, List, TypeVar

# C0 and C1 controls and DEL (a newline, a carriage return, ESC), the Unicode line and
# paragraph separators, and the bidirectional controls that reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
# What json.dumps leaves raw of the above (it escapes C0 itself; its own newlines are layout).
_JSON_UNESCAPED = re.compile("[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    named = _NAMED.get(char)
    if named:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def text(value: object) -> str:
    """One line whatever the value holds: control characters shown escaped (`\\n`, `\\x1b`),
    lone surrogates as `\\udcxx`, so that no output line can start or be bent by data."""
    escaped = _CONTROL.sub(lambda m: _escaped(m.group()), str(value))
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


def json_text(document: str) -> str:
    """JSON text with every character `text` escapes written as a `\\uXXXX` escape: json.dumps
    escapes C0 controls only, and a C1 control (`\\x9b` is CSI) or a bidi override inside a string
    would still reach a terminal. They occur only inside strings, so the JSON reads the same."""
    return _JSON_UNESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", document)


T = TypeVar("T")


def scrubbed(value: T, skip: Iterable[str] = ()) -> T:
    """A copy of a display object (a dataclass of strings, tables and lists) with `text` applied
    to every string in it; fields named in `skip` (the analysis values it carries, which the
    JSON document reads as they are) are kept as they are."""
    skipped = frozenset(skip)
    return _scrub(value, skipped)


def _scrub(value: Any, skip: frozenset) -> Any:
    if isinstance(value, str):
        return text(value)
    if isinstance(value, list):
        return [_scrub(v, skip) for v in value]
    if isinstance(value, tuple):
        return tuple(_scrub(v, skip) for v in value)
    if isinstance(value, dict):
        return {_scrub(k, skip): _scrub(v, skip) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _scrub(getattr(value, f.name), skip) for f in dataclasses.fields(value)
                   if f.init and f.name not in skip}
        return dataclasses.replace(value, **changes)
    return value


def shell(path: str) -> str:
    """A path as a pasteable shell word: one line, quoted when it holds anything the shell reads."""
    return shlex.quote(text(path))


def baseline_command(run: str, path: str, replace: bool = False) -> str:
    """The command that makes or refreshes `path` from `run`, each path quoted for pasting; with
    `replace`, one that writes over a baseline of the other kind (a job's for one run's, or back)."""
    return f"memdiff baseline {shell(run)} -o {shell(path)}" + (" --replace" if replace else "")


# --- markdown (GitHub-flavoured: comments, job summaries) -------------------------------------

# What starts or ends inline markup: emphasis (`_` only at a word's edge: GitHub never reads
# `mul_Tensor` as emphasis), code, links and images (no link without `[`), HTML, comments and
# autolinks (`<` before a letter, `/`, `!` or `?`; `<-` stays as it reads), table cells,
# strikethrough, entities (`&` before a name or `#`). Each is escaped with a backslash, which
# CommonMark reads as the character itself.
_MD_ACTIVE = re.compile(r"([\\`*\[\]|~]|<(?=[A-Za-z/!?])|&(?=[A-Za-z#])|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
# What starts a block at the beginning of a line: a heading, a list item, a setext underline,
# a quote, an ordered list item.
_MD_LEADING = re.compile(r"^([#+=>-]|\d+(?=[.)]))")
# GitHub's own autolinks, run on the rendered text: mentions notify a user or a team, `#123`
# and `GH-123` cross-reference an issue, bare URLs become links. A word joiner (invisible)
# after the trigger breaks each pattern without changing what a reader sees.
_WORD_JOINER = "\u2060"
_MENTION = re.compile(r"@(?=[A-Za-z0-9])")
_REFERENCE = re.compile(r"(#|GH-)(?=[0-9])", re.IGNORECASE)
_URL = re.compile(r"(://|www\.)", re.IGNORECASE)
CELL_CHARS = 200  # a table cell's length cap; the HTML report shows the full text


def md_text(value: object) -> str:
    """Inline markdown that renders as the characters given and nothing else: one line, every
    markup character escaped, mentions, issue references and links broken."""
    return _MD_LEADING.sub(lambda m: m.group(1) + "\\" if m.group(1)[0].isdigit() else "\\" + m.group(1),
                           _inline(value), count=1)


def _inline(value: object) -> str:
    out = _MD_ACTIVE.sub(r"\\\1", text(value))
    out = _MENTION.sub("@" + _WORD_JOINER, out)
    out = _REFERENCE.sub(lambda m: m.group(1) + _WORD_JOINER, out)
    return _URL.sub(lambda m: m.group(1)[0] + _WORD_JOINER + m.group(1)[1:], out)


def md_cell(value: object, chars: int = CELL_CHARS) -> str:
    """A table cell: md_text's inline escaping, cut to `chars` characters (the HTML report keeps
    the whole)."""
    plain = text(value)
    # No block starts inside a cell: a leading `1.` or `+` reads as itself there.
    return _inline(plain if len(plain) <= chars else plain[: chars - 1] + "…")


def _fence_for(lines: Iterable[str], minimum: int) -> str:
    longest = max((len(run) for line in lines for run in re.findall("`+", line)), default=0)
    return "`" * max(minimum, longest + 1)


def md_code(value: object) -> str:
    """An inline code span holding exactly `value` (one line), outside tables: its backtick fence
    is longer than any run of backticks inside, so no name can close it."""
    plain = text(value)
    fence = _fence_for([plain], 1)
    pad = " " if plain.startswith("`") or plain.endswith("`") or not plain.strip() else ""
    return f"{fence}{pad}{plain}{pad}{fence}"


def md_fence(lines: Iterable[str], info: str = "text") -> List[str]:
    """A fenced code block of `lines`, each one line, fenced past the longest backtick run in them,
    so no line can end the block and plant markdown (a heading, a marker) after it."""
    plain = [text(line) for line in lines]
    fence = _fence_for(plain, 3)
    return [f"{fence}{info}", *plain, fence]
