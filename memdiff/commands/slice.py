"""`memdiff slice SNAPSHOT --steps 3:4 -o SMALL.pickle`: one window of a big snapshot as a snapshot of its own."""

from __future__ import annotations

import argparse
import pickle
import sys
from typing import Any, Dict

from memdiff.atomic import check_output, write_stream
from memdiff.inert import text
from memdiff.read.inputs import read_summary
from memdiff.read.load import load, paused_gc
from memdiff.read.window import add_window_arguments, cut
from memdiff.units import format_bytes

DESCRIPTION = ("Write one window of a snapshot (some steps, trace events or microseconds) as a snapshot of "
               "its own, pickle protocol 4, which PyTorch's viewer opens and every memdiff command reads. "
               "Memory live when the window begins is carried in, so its static memory and peak are those "
               "of the window in the full trace.")

PROTOCOL = 4  # what pytorch.org/memory_viz reads (it refuses 5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    p.add_argument("snapshot", help="snapshot file (pickle or JSON, optionally gzip/bz2/xz)")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="the snapshot file to write (pickle)")
    add_window_arguments(p, required=True)


def _write(path: str, raw: Dict[str, Any]) -> None:
    """`raw` pickled straight into the file (never whole in memory as bytes), atomically."""
    write_stream(path, lambda f: pickle.dump(raw, f, protocol=PROTOCOL), in_place=False)


def run(args: argparse.Namespace) -> int:
    """Read the snapshot, cut the window, write it atomically and say what it holds."""
    check_output(args.output, in_place=False, inputs=[args.snapshot])
    with paused_gc():
        _write(args.output, cut(load(args.snapshot, columns=True), args.window))
    summary = read_summary(args.output, [])
    peaks = ", ".join(f"device {d.device}: {d.trace_events:,} events, static {format_bytes(d.static_bytes)}, "
                      f"peak {format_bytes(d.peak_bytes)}" for d in summary.devices)
    print(f"memdiff: wrote {text(args.output)} ({args.window.describe()}): {peaks}", file=sys.stderr)
    return 0
