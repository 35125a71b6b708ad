"""Write the per-family accuracy table of docs/emulate.md: each real H100 window of
../shared/cuda-truth emulated from the script that made it, unmodified, and compared.

    python docs/gen_truth.py                  # emulate into a temporary folder, rewrite the table
    python docs/gen_truth.py --keep DIR       # keep the emulated runs in DIR (reused when there)

Needs torch (the test extra) and the libraries the real runs were made with, in a folder named by
MEMDIFF_TRUTH_LIBS (LIBS_INSTALL below installs them there; .ci/run does): the same script is the
same program only with them (transformers 5.23 makes T5's position bias contiguous, which 5.17
did not, and PyTorch then picks another attention kernel). torchvision, which cannot be installed
beside torch's CPU build, is our stand-in of tests/data/standins. tests/test_emulate_truth.py measures the same rows
with the same functions, holds them to issue 49's targets and fails when the table here is stale.
The table sits between the two markers in docs/emulate.md; nothing else in the page is touched.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
TRUTH = ROOT.parent / "shared" / "cuda-truth"
PAGE = ROOT / "docs" / "emulate.md"
START, END = "<!-- truth-table: start -->", "<!-- truth-table: end -->"
STANDINS = ROOT / "tests" / "data" / "standins"
FAMILIES = ["llama-base", "llama1b-bf16", "bert-base", "t5-base", "vit-base", "resnet50-sgdm"]
# The library versions of the real runs (../shared/cuda-truth/README.md) that the test extra's do not match.
LIBS = "MEMDIFF_TRUTH_LIBS"
LIBS_INSTALL = ("python -m pip install --no-deps --target \"$MEMDIFF_TRUTH_LIBS\" transformers==5.17.0 "
                "huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9")


def libraries() -> Optional[Path]:
    """The folder holding the real runs' library versions (MEMDIFF_TRUTH_LIBS), None when not set up."""
    folder = os.environ.get(LIBS)
    return Path(folder) if folder and (Path(folder) / "transformers").is_dir() else None
# A category at the peak is equal when it is within this many bytes of the real one (issue 49).
CATEGORY_SLACK = 1 << 20


@dataclass
class Row:
    """One family: the real window's figures and the emulated run's, as the tests hold them."""

    name: str
    real_peak: int
    emulated_peak: int
    real_reserved: int
    emulated_reserved: int
    real_max_allocated: int
    emulated_max_allocated: int
    # category -> (real bytes, emulated bytes) at the peak, for those more than CATEGORY_SLACK apart
    categories_apart: Dict[str, List[int]] = field(default_factory=dict)

    @staticmethod
    def error(emulated: int, real: int) -> float:
        """The emulated figure's error, as a fraction of the real one."""
        return emulated / real - 1


def emulate(name: str, folder: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run families.py NAME under `memdiff record --emulate h100`, writing into `folder` what the
    script itself writes on a GPU (NAME.pickle, NAME.facts.json); kept when already there."""
    if (folder / f"{name}.facts.json").is_file() and (folder / f"{name}.pickle").is_file():
        return subprocess.CompletedProcess([], 0, "", "")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
    paths = (str(libraries() or ""), str(STANDINS), str(ROOT), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # The script's facts file is one of its writes, which an emulated run keeps in its overlay: kept
    # (--keep-writes) and taken from there. Its snapshot (_dump_snapshot) is memdiff's own, written as is.
    kept = folder / f"{name}.writes"
    shutil.rmtree(kept, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "memdiff", "record", "--emulate", "h100",
                           "-o", str(folder / f"{name}.rec.pickle"), "--keep-writes", str(kept), "--",
                           sys.executable, str(TRUTH / "families.py"), str(folder), name],
                          env=env, capture_output=True, text=True, cwd=folder)
    facts = kept / "upper" / os.path.abspath(folder / f"{name}.facts.json").lstrip(os.sep)
    if done.returncode == 0 and facts.is_file():
        shutil.copyfile(facts, folder / f"{name}.facts.json")
    return done


def measure(name: str, folder: Path) -> Row:
    """Compare the emulated run of NAME in `folder` with the real window and its facts."""
    sys.path.insert(0, str(ROOT))
    from memdiff import api

    real_pickle = folder / f"{name}.real.pickle"
    if not real_pickle.is_file():
        with gzip.open(TRUTH / f"{name}.pickle.gz") as src, open(real_pickle, "wb") as dst:
            shutil.copyfileobj(src, dst)
    real = api.summarize(real_pickle).devices[0]
    emu = api.summarize(folder / f"{name}.pickle").devices[0]
    real_facts = json.loads((TRUTH / f"{name}.facts.json").read_text())
    emu_facts = json.loads((folder / f"{name}.facts.json").read_text())
    apart = {c: [real.categories.get(c, 0), emu.categories.get(c, 0)]
             for c in sorted(set(real.categories) | set(emu.categories))
             if abs(real.categories.get(c, 0) - emu.categories.get(c, 0)) > CATEGORY_SLACK}
    return Row(name, real.peak_bytes, emu.peak_bytes, real.reserved_peak_bytes or 0,
               emu.reserved_peak_bytes or 0, real_facts["cuda_max_allocated_bytes"],
               emu_facts["cuda_max_allocated_bytes"], apart)


def table(rows: List[Row]) -> str:
    """The markdown table of the measured rows."""
    sys.path.insert(0, str(ROOT))
    from memdiff.units import format_bytes

    def pair(real: int, emulated: int) -> str:
        return f"{format_bytes(real)} / {format_bytes(emulated)} ({Row.error(emulated, real) * 100:+.2f}%)"

    out = ["| family | allocated peak, real / emulated | reserved peak, real / emulated "
           "| `max_memory_allocated()`, real / emulated | categories at the peak |",
           "| --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        cats = "equal" if not r.categories_apart else "; ".join(
            f"{c} {format_bytes(a)} / {format_bytes(b)}" for c, (a, b) in r.categories_apart.items())
        out.append(f"| `{r.name}` | {pair(r.real_peak, r.emulated_peak)} | {pair(r.real_reserved, r.emulated_reserved)} "
                   f"| {pair(r.real_max_allocated, r.emulated_max_allocated)} | {cats} |")
    return "\n".join(out)


def render(page: str, rows: List[Row]) -> str:
    """The page with its table between the markers replaced by the measured one."""
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table(rows)}\n{END}{tail}"


def main() -> None:
    """Emulate every family and rewrite the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", help="emulate into this folder and keep the runs")
    args = p.parse_args()
    if libraries() is None:
        sys.exit(f"set {LIBS} to a folder holding the real runs' libraries: {LIBS_INSTALL}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in FAMILIES:
            done = emulate(name, folder)
            if done.returncode:
                sys.exit(f"{name}: the emulated run failed:\n{done.stderr[-2000:]}")
        rows = [measure(name, folder) for name in FAMILIES]
    PAGE.write_text(render(PAGE.read_text(), rows))
    print(f"{len(rows)} families: {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
