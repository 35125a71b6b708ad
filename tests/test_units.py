"""Sizes in and out: what users type (decimal or binary units), what they read (binary units)."""

from __future__ import annotations

import re

import pytest

from memdiff.units import format_bytes, parse_size


@pytest.mark.parametrize("text, n", [
    ("0", 0), ("1e9B", 10**9), ("0 GiB", 0), ("512MiB", 512 * 2**20), ("0.5GiB", 2**29), ("64 MB", 64 * 10**6),
    ("3GiB", 3 * 2**30), ("10kb", 10_000), ("2KiB", 2048), ("7B", 7), ("1.5TiB", 3 * 2**39),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["5 parsecs", "", "GiB", "-1MiB", "1..2MB", "0x10"])
def test_parse_size_rejects_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("text, n", [("80", 80), ("1e9", 10**9), (" 2.5 ", 2), ("1073741824", 2**30)])
def test_a_number_without_its_unit_is_bytes_and_deprecated(text, n):
    # `--budget 80` meant 80 GiB; read silently as 80 bytes it fit nothing and forecast said "budget of 80 B".
    # A flag's value is a promise: bytes still, with a warning that names the unit to write.
    number = text.strip()
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(number)} has no unit: read as {re.escape(number)} "
                                                rf"bytes; say {re.escape(number)}B for bytes, or "
                                                rf"{re.escape(number)}GiB or {re.escape(number)}GB"):
        assert parse_size(text) == n


@pytest.mark.parametrize("argv", [
    ["forecast", "a.pickle=1", "b.pickle=2", "--budget", "80"],
    ["whatif", "run.pickle", "--budget", "80"],
    ["diff", "a.pickle", "b.pickle", "--fail-over", "80"],
    ["diff", "a.pickle", "b.pickle", "--min-delta", "80"],
    ["gate", "run.pickle", "--fail-over", "80"],
])
def test_every_size_flag_warns_of_a_bare_number_in_one_line(argv, capsys):
    # Each command's flag parses before any file is read: one warning line for the size, then the command
    # goes on (here to its missing file or baseline: exit 2, in one line of its own).
    from memdiff.cli import main

    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own refusal (gate without a baseline)
        code = exited.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2, err
    assert err[0].startswith("memdiff: warning: 80 has no unit: read as 80 bytes; say 80B for bytes"), err


@pytest.mark.parametrize("n, signed, text", [
    (0, False, "0 B"), (1023, False, "1023 B"), (1024, False, "1.00 KiB"), (7013335044, False, "6.53 GiB"),
    (2**40 * 3, False, "3.00 TiB"), (-(2**20), True, "-1.00 MiB"), (2**30, True, "+1.00 GiB"), (0, True, "0 B"),
])
def test_format_bytes_uses_binary_units(n, signed, text):
    assert format_bytes(n, signed=signed) == text


# Arabic-Indic and full-width digits: int() and float() read them (`int('١٢')` is 12), a reviewer reads none.
FOREIGN = ["١٢", "１２", "۱۲"]


@pytest.mark.parametrize("digits", FOREIGN)
def test_every_number_a_user_types_is_ascii_digits_only(digits):
    """Each place user text becomes a number refuses what is not 0-9, naming the value, as bad input."""
    from memdiff import api
    from memdiff.compare.limits import parse_limit, parse_pct
    from memdiff.errors import InputError
    from memdiff.numbers import decimal, whole_number
    from memdiff.predict.fit import parse_range, parse_set
    from memdiff.predict.forecast.course import parse_run
    from memdiff.read.job import rank_of, rank_patterns
    from memdiff.read.window import parse_window

    for parse, text in ((parse_size, f"{digits} GiB"), (parse_size, f"{digits}MiB"), (parse_pct, f"{digits}%"),
                        (parse_limit, f"{digits}%"), (parse_limit, f"{digits}MiB"), (whole_number, digits),
                        (decimal, f"{digits}.5"), (lambda t: parse_window("steps", t), f"{digits}:"),
                        (lambda t: parse_window("events", t), f"3:{digits}")):
        with pytest.raises(ValueError, match=digits):
            parse(text)
    for parse, text, where in ((parse_range, f"batch=1:{digits}", "--range"), (parse_set, f"tp={digits}", "--set"),
                               (parse_run, f"b.pickle={digits}", "b.pickle"),
                               (lambda t: api.thresholds(fail_over=t), f"{digits}GiB", "fail_over"),
                               (lambda t: api.thresholds(fail_over_pct=t), digits, "fail_over_pct"),
                               (lambda t: api.thresholds(categories={"activation": t}), f"{digits}%",
                                "categories['activation']")):
        with pytest.raises(InputError) as exc:
            parse(text)
        assert exc.value.path == where and digits in exc.value.message, exc.value
    assert rank_of(f"rank{digits}.pickle", rank_patterns(None)) is None  # no rank 12
    assert (parse_size("12 GiB"), parse_pct("12%"), whole_number(" 12 "), decimal("1e3")) == (12 * 2**30, 12.0, 12, 1e3)


def test_a_superscript_is_no_count_and_no_crash():
    """`'²'.isdigit()` is true and `int('²')` raises: `--change accumulate=²` ended in a traceback (exit 3)."""
    from memdiff.errors import InputError
    from memdiff.predict.whatif import accumulate
    from memdiff.recording.capture import parse_steps
    from memdiff.recording.launch import parse_ranks

    with pytest.raises(InputError, match="accumulate=²: give the micro-batches per step"):
        accumulate.check("²")
    with pytest.raises(ValueError, match="steps must read START:STOP"):
        parse_steps("²")
    with pytest.raises(InputError, match="'0-²' is no list of ranks"):
        parse_ranks("0-²")
    assert (parse_steps("3").start, parse_steps("3").stop) == (3, 4)
