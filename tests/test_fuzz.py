"""Seeded fuzzing of the readers: mutated real snapshots and summaries, flipped and cut bytes.

Every input must end in exit 0 with output that validates against memdiff's own schema (and
is strict JSON), or exit 2 with exactly one line on stderr; never exit 3, never longer than
CASE_S seconds. The mutations are structured (type swaps, missing keys, extreme integers,
deep nesting, entries that are not dicts, one list or dict shared many times) and raw (byte
flips, truncation, inside and outside gzip). Seeded, so a failure names a case that replays.
"""

from __future__ import annotations

import copy
import gzip
import json
import pickle
import random
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

from memdiff.cli import main
from memdiff.read.schema import validate

SEED = 20261122
CASE_S = 10
BASES = ("linear-grad.pickle", "empty-trace.pickle", "opt13b-oom-legacy.pickle", "diffusion-segments-list.pickle",
         "cs336-windows.pickle")
STRUCTURED, RAW, SUMMARY_MUTANTS = 240, 120, 60

NASTY: Tuple[Any, ...] = (None, True, -1, 0, -5, 2**31, 2**62, 2**63, 2**64 + 3, 2**70, -2**63, 10**400, 1.5,
                          float("nan"), float("inf"), "", "x", "12", "\udcff", "a\nb\x1b[31m", b"bytes", (),
                          [], {}, [[[]]], {"k": "v"}, {1: 2}, "(1): a" * 200)


def _containers(node: Any, rng: random.Random, path: Tuple = ()) -> List[Tuple[Tuple, Any]]:
    """(path, container) for up to a few thousand lists and dicts under `node`, sampled with the
    case's own generator: a seed must name one case, whatever ran before it."""
    out: List[Tuple[Tuple, Any]] = []
    stack = [(path, node)]
    while stack and len(out) < 4000:
        where, value = stack.pop()
        if isinstance(value, dict):
            out.append((where, value))
            stack.extend((where + (k,), v) for k, v in list(value.items())[:50])
        elif isinstance(value, list):
            out.append((where, value))
            picks = value if len(value) <= 20 else rng.sample(value, 20)
            stack.extend((where + ("*",), v) for v in picks)
    return out


def _mutate(doc: Any, rng: random.Random) -> str:
    """Change one place of `doc` in place; returns what was done, for the failure message."""
    places = _containers(doc, rng)
    where, node = places[rng.randrange(len(places))]
    op = rng.choice(("swap", "swap", "delete", "insert", "nest", "share", "duplicate"))
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        if op == "delete":
            del node[key]
        elif op == "nest":
            deep: Any = 0
            for _ in range(rng.choice((50, 900))):
                deep = [deep]
            node[key] = deep
        elif op == "share":
            node[key] = [node[key]] * 5_000
        else:
            node[key] = rng.choice(NASTY)
        return f"{op} {where}[{key!r}]"
    if isinstance(node, list):
        if op == "insert" or not node:
            node.insert(rng.randrange(len(node) + 1), rng.choice(NASTY))
        elif op == "delete":
            del node[rng.randrange(len(node))]
        elif op == "duplicate":
            k = rng.randrange(len(node))
            node[k:k] = [node[k]] * rng.choice((2, 1000))
        else:
            node[rng.randrange(len(node))] = rng.choice(NASTY)
        return f"{op} {where}"
    return "none"


def _dumps(doc: Any) -> bytes:
    """The pickle of `doc`; nested mutants go deeper than the pickler's default recursion allows."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return pickle.dumps(doc, protocol=4)
    finally:
        sys.setrecursionlimit(limit)


class _Slow(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Slow()


def _check(argv: List[str], out: Path, capsys, case: str) -> int:
    """Run memdiff; assert the contract for this input; return the exit code."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_S)
    try:
        code = main(argv)
    except _Slow:
        pytest.fail(f"{case}: took more than {CASE_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err
    assert code in (0, 2), f"{case}: exit {code}: {err[-500:]}"
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("memdiff: "), f"{case}: {err[:500]!r}"
    elif out.exists():
        def strict(name: str) -> Any:
            raise AssertionError(f"{case}: not strict JSON ({name})")
        data = json.loads(out.read_text(encoding="utf-8"), parse_constant=strict)
        validate(case, data, "summary")
    return code


@pytest.fixture(scope="module")
def bases(shared) -> Dict[str, Any]:
    return {name: pickle.loads((shared / name).read_bytes()) for name in BASES}


def _run_cases(make: Callable[[random.Random, int], Tuple[bytes, str]], count: int, tmp_path: Path, capsys,
               seed: int, options: Tuple[Tuple[str, ...], ...] = ((),)) -> Dict[int, int]:
    rng = random.Random(seed)
    codes: Dict[int, int] = {}
    for i in range(count):
        data, case = make(rng, i)
        path, out = tmp_path / f"case{i}", tmp_path / f"case{i}.json"
        path.write_bytes(data)
        extra = list(options[i % len(options)])
        code = _check(["summarize", str(path), "-o", str(out), *extra], out, capsys,
                      f"seed {seed} case {i}: {case} {' '.join(extra)}")
        codes[code] = codes.get(code, 0) + 1
        path.unlink()
        out.unlink(missing_ok=True)
    return codes


def _mutants(bases: Dict[str, Any]) -> Callable[[random.Random, int], Tuple[bytes, str]]:
    """Case i: a real snapshot in turn, with one to four structured mutations, and what was done."""
    def make(rng: random.Random, i: int) -> Tuple[bytes, str]:
        name = BASES[i % len(BASES)]
        doc = copy.deepcopy(bases[name])
        done = [_mutate(doc, rng) for _ in range(rng.choice((1, 1, 2, 4)))]
        return _dumps(doc), f"{name}: {'; '.join(done)}"
    return make


@pytest.mark.slow  # reads many mutated real snapshots
def test_structured_mutations_of_real_snapshots(bases, tmp_path, capsys):
    codes = _run_cases(_mutants(bases), STRUCTURED, tmp_path, capsys, SEED)
    print(f"\nstructured mutants: {STRUCTURED}, exit codes {codes}")
    assert codes.get(0) and codes.get(2)  # the mutants reach both outcomes


WINDOWS = (("--events", "3:30"), ("--steps", "0"), ("--time-us", "1:"), ("--events", "0:1"))


@pytest.mark.slow  # reads many mutated real snapshots
def test_windows_of_structured_mutations(bases, tmp_path, capsys):
    """The same mutants read through a window (memdiff.read.window walks and cuts them first)."""
    codes = _run_cases(_mutants(bases), STRUCTURED // 2, tmp_path, capsys, SEED + 3, WINDOWS)
    print(f"\nstructured mutants through windows: {STRUCTURED // 2}, exit codes {codes}")
    assert codes.get(0) and codes.get(2)


def test_flipped_and_cut_bytes(shared, tmp_path, capsys):
    originals = {name: (shared / name).read_bytes() for name in ("linear-grad.pickle", "opt13b-oom-legacy.pickle")}

    def make(rng: random.Random, i: int) -> Tuple[bytes, str]:
        name = list(originals)[i % 2]
        data = bytearray(originals[name])
        kind = rng.choice(("flip", "cut", "gzip-flip", "gzip-cut"))
        if kind.startswith("gzip"):
            data = bytearray(gzip.compress(bytes(data)))
        if kind.endswith("flip"):
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(2, len(data))] = rng.randrange(256)
        else:
            data = data[: rng.randrange(1, len(data))]
        return bytes(data), f"{name}: {kind}"

    codes = _run_cases(make, RAW, tmp_path, capsys, SEED + 1)
    print(f"\nbyte-level mutants: {RAW}, exit codes {codes}")
    assert codes.get(2)


@pytest.mark.slow  # reads many mutated summaries
def test_mutated_summaries(shared, tmp_path, capsys):
    source = tmp_path / "summary.json"
    assert main(["summarize", str(shared / "linear-grad.pickle"), "-o", str(source)]) == 0
    summary = json.loads(source.read_text())

    def make(rng: random.Random, i: int) -> Tuple[bytes, str]:
        doc = copy.deepcopy(summary)
        done = _mutate(doc, rng)
        return json.dumps(doc, default=str).encode("utf-8", "surrogatepass"), f"summary: {done}"

    codes = _run_cases(make, SUMMARY_MUTANTS, tmp_path, capsys, SEED + 2)
    print(f"\nsummary mutants: {SUMMARY_MUTANTS}, exit codes {codes}")
    assert codes.get(2)
