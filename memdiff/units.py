"""Byte sizes: parsing what users type and formatting what they read (always binary units)."""

from __future__ import annotations

import re
import warnings
from typing import Optional

from memdiff.numbers import DECIMAL

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(rf"^\s*({DECIMAL.pattern})\s*([A-Za-z]*)\s*$", re.ASCII)  # ASCII: digits 0-9, not `١٢ GiB`
MAX_SIZE = 2**63 - 1  # what an int64 running total holds
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
# Beyond this a percent is not read as a number any more: `x13.4` says it better.
RATIO_FROM_PCT = 999
# Growth past RATIO_FROM_PCT from less than this is growth from nothing: `x13,398,529.0` from a 4 B
# scalar says less than `new`.
NEW_BELOW_BYTES = 1024


def parse_size(text: str, bare_is_bytes: bool = False) -> int:
    """Bytes in `text`: `512MiB`, `0.5GiB`, `64 MB` (KB/MB/GB are powers of 10), `1e9B`. ValueError if not a
    size. A number without a unit (but 0) is still bytes, with a DeprecationWarning naming the unit to write:
    `--budget 80` meant 80 GiB, never 80 bytes, and read silently as bytes it fit nothing; every size memdiff
    reads from text comes through here. `bare_is_bytes`: a number alone is bytes without a warning, for what
    memdiff itself wrote so (a baseline's `fail-over` of plain bytes, before it wrote `B`)."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in _UNITS and unit != ""):
        raise ValueError(f"{text!r} is not a size (examples: 512MiB, 0.5GiB, 64MB, 1e9B)")
    value = float(m.group(1)) * _UNITS.get(unit, 1)
    if value < 0:
        raise ValueError(f"{text!r} is not a size: it is negative")
    if not value <= MAX_SIZE:  # also catches 1e400, which reads as infinity
        raise ValueError(f"{text!r} is not a size: more than 8 EiB")
    if unit == "" and value != 0 and not bare_is_bytes:
        number = m.group(1)
        warnings.warn(f"{number} has no unit: read as {number} bytes; say {number}B for bytes, or {number}GiB or "
                      f"{number}GB (a size without a unit is deprecated, and a later memdiff refuses it)",
                      DeprecationWarning, stacklevel=2)
    return int(round(value))


def format_bytes(n: int, signed: bool = False) -> str:
    """`n` bytes in binary units with two decimals (`6.53 GiB`); `signed` adds `+` to growth."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    a = abs(n)
    for factor, unit in _BINARY:
        if a >= factor:
            return f"{sign}{a / factor:.2f} {unit}"
    return f"{sign}{a} B"


def count_of(n: int, word: str, many: str = "") -> str:
    """`1 other`, `2 others`, `1,204 groups`: a count with its noun in the right number."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def growth_pct(base: int, head: int) -> Optional[float]:
    """Percent change from base to head; None when base is 0 (growth from nothing has no percentage)."""
    return 100.0 * (head - base) / base if base else None


# What changed by how much, worded once: the diff's rows and headline, the gate's checks and the trend
# on main all say a change so (a trend's +12,345.0% read as a number where the diff said x124.5).
def pct_cell(base: int, head: int) -> str:
    """Signed percent change; a ratio (`x13.4`) past +999%; `new` when there was (next to) nothing before."""
    pct = growth_pct(base, head)
    if pct is None:
        return "new" if head else ""
    if pct > RATIO_FROM_PCT:
        return "new" if base < NEW_BELOW_BYTES else f"x{head / base:,.1f}"
    return f"{pct:+.1f}%"


def change_text(base: int, head: int) -> str:
    """`+1.95 GiB (+29.8%)`, `+4.00 MiB (new)`."""
    pct = pct_cell(base, head)
    return format_bytes(head - base, signed=True) + (f" ({pct})" if pct else "")


def change_or_unchanged(base: int, head: int) -> str:
    """`unchanged` when nothing moved, else `change_text`: a trend's points, a reserved peak's line."""
    return "unchanged" if head == base else change_text(base, head)
