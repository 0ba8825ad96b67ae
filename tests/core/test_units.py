"""units: bytes (binary), seconds, counts and a reader's guess as text."""

import pytest

from workbench.core.units import NO_GUESS, format_bytes, format_count, format_guess, format_seconds


def test_bytes_in_binary_units():
    assert [format_bytes(n) for n in (0, 512, 1536, 2**21, 3 * 2**30, 2**40 * 1.5)] == [
        "0 B", "512 B", "1.5 KiB", "2 MiB", "3 GiB", "1.5 TiB"]
    assert format_bytes(2**50) == "1024 TiB"  # TiB is the largest unit


@pytest.mark.parametrize(("seconds", "text"), [(2.5, "2.5 s"), (0.0123, "12.3 ms"), (4.6e-5, "46 us"),
                                                (3e-9, "3 ns"), (1.0, "1 s"), (999.9e-6, "1e+03 us")])
def test_seconds_to_three_significant_digits(seconds, text):
    assert format_seconds(seconds) == text


def test_counts():
    assert [format_count(n) for n in (999, 1000, 91392, 7_241_732_096, 1.5e12)] == [
        "999", "1K", "91.4K", "7.24B", "1.5T"]


def test_a_guess_not_yet_written_says_so_instead_of_a_number():
    assert format_guess(None, ".0%") == NO_GUESS and "write it" in NO_GUESS
    assert (format_guess(0.5, ".0%"), format_guess(12), format_guess("tp=16")) == ("50%", "12", "tp=16")
    assert format_guess(9.0, ".1f", "x") == "9.0x" and format_guess(None, ".1f", "x") == NO_GUESS  # no stray unit
