"""Numbers as users type them (flags, limits, marker keywords, knob values): ASCII digits only.

Python's int() and float() read any Unicode decimal digit (`int('١٢٣')` is 123, `float('１２')`
is 12.0) and a regex's `\\d` matches them too, while str.isdigit() takes `²`, which int() then
refuses with a traceback. A limit a reviewer reads as text in another script, or a value that
crashes, is no input a gate should take: every number a user types is read here, or through
DECIMAL, and anything but 0-9 (with a sign, a point and an exponent where they fit) is refused.
"""

from __future__ import annotations

import re

DIGITS = re.compile(r"[0-9]+")  # [0-9], never \d: the ASCII digits alone (what str.isdigit() is not)
WHOLE = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# int() and float() also strip Unicode white space around a number; only ASCII's is taken.
SPACE = " \t\n\r\f\v"
MAX_DIGITS = 4_000  # under Python's limit for int() of text (4,300); no count or size needs 40


def whole_number(text: str) -> int:
    """The integer in `text` (`12`, ` -3 `); ValueError naming `text` when it is anything else
    (`١٢`, `1_000`, `1.0`, `²`)."""
    body = text.strip(SPACE)
    if WHOLE.fullmatch(body) is None:
        raise ValueError(f"{text[:40]!r} is not a whole number (digits 0-9)")
    if len(body) > MAX_DIGITS:  # int() refuses them with a paragraph about sys.set_int_max_str_digits
        raise ValueError(f"{text[:40]!r}... is not a number memdiff can use: {len(body):,} digits")
    return int(body)


def decimal(text: str) -> float:
    """The number in `text` (`2.5`, `.5`, `1e9`); ValueError naming `text` when it is anything
    else (`１２`, `nan`, `inf`, `1_0`)."""
    body = text.strip(SPACE)
    if DECIMAL.fullmatch(body) is None:
        raise ValueError(f"{text[:40]!r} is not a number (digits 0-9, as in 2.5 or 1e9)")
    return float(body)
