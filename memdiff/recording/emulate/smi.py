"""An `nvidia-smi` for the emulated run: scripts log the GPU table at start (modded-nanogpt's records
print `nvidia-smi`'s output into every log) or ask it for names and memory (`--query-gpu=...`), and on
a machine without NVIDIA's driver the command is missing, so the script stopped in FileNotFoundError
where a GPU host would have answered. The stand-in is a small Python program put first on PATH for the
emulated process and the processes it starts; it describes the emulated GPUs (name, total memory, as
torch.cuda answers) and, being a process of its own, sees no allocation: memory used reads 0 MiB."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from memdiff.recording.emulate.gpus import Gpu
from memdiff.recording.emulate.swap import environment

# The program run as `nvidia-smi`: the GPU's facts are filled in below (a str.format template, so its
# own braces are doubled). It answers `-L`, `--query-gpu=FIELDS --format=csv[,noheader][,nounits]`
# and, for anything else, the default table.
_PROGRAM = '''#!{python}
"""nvidia-smi as memdiff's emulation of {count} x {name} answers it (memdiff record --emulate)."""
import sys

NAME, COUNT, TOTAL_MIB = {name!r}, {count}, {total_mib}
FIELDS = {{
    "index": lambda i: str(i), "name": lambda i: NAME, "count": lambda i: str(COUNT),
    "memory.total": lambda i: f"{{TOTAL_MIB}} MiB", "memory.used": lambda i: "0 MiB",
    "memory.free": lambda i: f"{{TOTAL_MIB}} MiB", "utilization.gpu": lambda i: "0 %",
    "uuid": lambda i: f"GPU-00000000-0000-0000-0000-{{i:012d}}",
}}


def query(args):
    fields = [f.strip() for a in args if a.startswith("--query-gpu=") for f in a.split("=", 1)[1].split(",")]
    fmt = [a.split("=", 1)[1] for a in args if a.startswith("--format=")]
    options = fmt[0].split(",") if fmt else ["csv"]
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        print(f"Field \\"{{unknown[0]}}\\" is not a valid field to query.", file=sys.stderr)
        return 2
    if "noheader" not in options:
        print(", ".join(f + (" [MiB]" if f.startswith("memory.") and "nounits" not in options else "")
                        for f in fields))
    for i in range(COUNT):
        cells = [FIELDS[f](i) for f in fields]
        if "nounits" in options:
            cells = [c.split(" ")[0] if c.endswith((" MiB", " %")) else c for c in cells]
        print(", ".join(cells))
    return 0


def table():
    width = 89
    print("+" + "-" * (width - 2) + "+")
    print("| NVIDIA-SMI (memdiff --emulate: no driver; memory used is not seen by this program)".ljust(width - 1) + "|")
    print("+" + "-" * (width - 2) + "+")
    for i in range(COUNT):
        print(f"| {{i:>3}}  {{NAME:<40}} {{'0MiB / ' + str(TOTAL_MIB) + 'MiB':>24}}  0%".ljust(width - 1) + "|")
    print("+" + "-" * (width - 2) + "+")
    return 0


def main(args):
    if "-L" in args or "--list-gpus" in args:
        for i in range(COUNT):
            print(f"GPU {{i}}: {{NAME}} (UUID: {{FIELDS['uuid'](i)}})")
        return 0
    if any(a.startswith("--query-gpu=") for a in args):
        return query(args)
    return table()


sys.exit(main(sys.argv[1:]))
'''


def program(gpu: Gpu, count: int) -> str:
    """The text of the stand-in `nvidia-smi` for `count` emulated `gpu`s."""
    return _PROGRAM.format(python=sys.executable, name=gpu.name, count=count,
                           total_mib=gpu.total_memory // 2**20)


@contextlib.contextmanager
def nvidia_smi(gpu: Gpu, count: int) -> Iterator[Path]:
    """For the block, `nvidia-smi` on PATH (first, so that a real one does not describe another GPU)
    runs the stand-in; yields its folder, a temporary one removed after the block (or at exit, for a
    launched rank that emulates until it ends)."""
    folder = tempfile.TemporaryDirectory(prefix="memdiff-smi-")
    path = Path(folder.name) / "nvidia-smi"
    path.write_text(program(gpu, count), encoding="utf-8")
    path.chmod(0o755)
    try:
        with environment({"PATH": folder.name + os.pathsep + os.environ.get("PATH", "")}):
            yield Path(folder.name)
    finally:
        folder.cleanup()
