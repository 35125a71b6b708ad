"""Write docs/findings.md, one section per finding code, from memdiff's catalogue (memdiff/compare/findings.py).

    python docs/gen_findings.py            # rewrite docs/findings.md
    python docs/gen_findings.py --check    # exit 1 when docs/findings.md is stale

The page is `memdiff rule --all --markdown`; tests/test_findings.py fails when the committed
file differs from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "findings.md"


def main() -> int:
    """Write the page, or with --check say whether the committed one is current."""
    sys.path.insert(0, str(ROOT))
    from memdiff.compare.findings import docs_page

    page = docs_page()
    if "--check" in sys.argv[1:]:
        if not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != page:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python docs/gen_findings.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
