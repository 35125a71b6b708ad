"""Write the accuracy table of docs/whatif.md from captures: each pair of the scenario suite's
WHATIF_PAIRS (tests/scenario_suite.py) is captured on CPU, memdiff whatif predicts the head from
the base, and the head's measured peak is compared.

    python docs/gen_whatif.py                 # capture into a temporary folder, rewrite the table
    python docs/gen_whatif.py --keep DIR      # keep the captures in DIR (reused when there)

Needs torch and transformers (the test extra). The table sits between the two markers in
docs/whatif.md; nothing else in the page is touched.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "whatif.md"
START, END = "<!-- whatif-table: start -->", "<!-- whatif-table: end -->"


def table(rows: list) -> str:
    """The markdown table of whatif_rows()."""
    from memdiff.units import format_bytes

    out = ["| base run | change | predicted | phase | measured (head) | phase | error |",
           "| --- | --- | ---: | --- | ---: | --- | ---: |"]
    for r in rows:
        if r["predicted"] is None:
            out.append(f"| {r['base']} | `{r['change']}` | does not apply: {r['reason']} | | "
                       f"{format_bytes(r['measured'])} | {r['measured_phase']} | |")
            continue
        out.append(f"| {r['base']} | `{r['change']}` | {format_bytes(r['predicted'])} | {r['predicted_phase']} | "
                   f"{format_bytes(r['measured'])} | {r['measured_phase']} | {r['error_pct']:+.1f}% |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", help="capture into this folder and keep the captures")
    args = p.parse_args()
    from scenario_suite import WHATIF_PAIRS, capture, whatif_rows

    names = sorted({n for base, _, head in WHATIF_PAIRS for n in (base, head)})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        rows = whatif_rows(capture(names, folder))
    text = PAGE.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    PAGE.write_text(f"{head}{START}\n{table(rows)}\n{END}{tail}")
    worst = max(abs(r["error_pct"]) for r in rows if r["error_pct"] is not None)
    print(f"{len(rows)} pairs, largest error {worst:.1f}%: {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
