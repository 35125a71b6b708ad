"""Sizes in and out: what users type (decimal or binary units), what they read (binary units)."""

from __future__ import annotations

import pytest

from memdiff.units import format_bytes, parse_size


@pytest.mark.parametrize("text, n", [
    ("0", 0), ("1e9", 10**9), ("512MiB", 512 * 2**20), ("0.5GiB", 2**29), ("64 MB", 64 * 10**6),
    ("3GiB", 3 * 2**30), ("10kb", 10_000), ("2KiB", 2048), ("7B", 7), ("1.5TiB", 3 * 2**39),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["5 parsecs", "", "GiB", "-1MiB", "1..2MB", "0x10"])
def test_parse_size_rejects_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize("n, signed, text", [
    (0, False, "0 B"), (1023, False, "1023 B"), (1024, False, "1.00 KiB"), (7013335044, False, "6.53 GiB"),
    (2**40 * 3, False, "3.00 TiB"), (-(2**20), True, "-1.00 MiB"), (2**30, True, "+1.00 GiB"), (0, True, "0 B"),
])
def test_format_bytes_uses_binary_units(n, signed, text):
    assert format_bytes(n, signed=signed) == text
