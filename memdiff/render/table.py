"""Tables laid out for the text and markdown reports (same cells, different tablefmt)."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from tabulate import tabulate

from memdiff.report.types import ROW_HEADERS, DeviceReport, Table


def layout(t: Table, tablefmt: str, escape: Callable[[str], str] = str) -> str:
    """A Table in `tablefmt`: its left columns left-aligned, numbers right-aligned."""
    return tabulate([[escape(c) for c in row] for row in t.rows], headers=t.headers, tablefmt=tablefmt,
                    colalign=tuple("left" if k in t.left else "right" for k in range(len(t.headers))))


def row_table(d: DeviceReport, status: Callable[[str], str] = str) -> Table:
    """The device's shown rows, the folded rest and the TOTAL as one Table; `status` labels the status column."""
    rows: List[List[str]] = [[status(r.cells[0]), *r.cells[1:]] for r in d.rows]
    extra: Sequence[Optional[List[str]]] = (d.others, d.total)
    rows += [cells for cells in extra if cells is not None]
    return Table(ROW_HEADERS, rows, left=[0, 6])
