"""units: bytes (binary), seconds, FLOPs, counts and a reader's guess as text; never in exponent notation."""

import pytest

from workbench.core.units import NO_GUESS, format_bytes, format_count, format_flops, format_guess, format_seconds


def test_bytes_in_binary_units():
    assert [format_bytes(n) for n in (0, 512, 1536, 2**21, 3 * 2**30, 2**40 * 1.5)] == [
        "0 B", "512 B", "1.5 KiB", "2 MiB", "3 GiB", "1.5 TiB"]
    assert format_bytes(2**50) == "1024 TiB"  # TiB is the largest unit
    assert format_bytes(1000.5 * 1024) == "1000 KiB" and format_bytes(5000.5 * 2**40) == "5000 TiB"  # no exponent


@pytest.mark.parametrize(("seconds", "text"), [(2.5, "2.5 s"), (0.0123, "12.3 ms"), (4.6e-5, "46 us"),
                                                (3e-9, "3 ns"), (1.0, "1 s"), (0, "0 s")])
def test_seconds_to_three_significant_digits(seconds, text):
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(("seconds", "text"), [(999.9e-6, "1 ms"), (0.9996, "1 s"), (4070.0, "4070 s"),
                                                (12345.6, "12346 s"), (-0.03, "-30 ms"), (3e-12, "0.003 ns")])
def test_seconds_never_in_exponent_notation(seconds, text):
    """A value that rounds up to 1000 of a unit is written in the next (the review's "4.07e+03 ms" was 4.07 s);
    beyond the largest unit or below the smallest, plain digits."""
    assert format_seconds(seconds) == text


def test_flops_in_si_units():
    assert [format_flops(n) for n in (0, 512, 999.6, 6.95e10, 1.2e15, 3e21, -3e9)] == [
        "0 FLOP", "512 FLOP", "1 KFLOP", "69.5 GFLOP", "1.2 PFLOP", "3000 EFLOP", "-3 GFLOP"]


def test_counts():
    assert [format_count(n) for n in (999, 1000, 91392, 7_241_732_096, 1.5e12)] == [
        "999", "1K", "91.4K", "7.24B", "1.5T"]


def test_a_guess_not_yet_written_says_so_instead_of_a_number():
    assert format_guess(None, ".0%") == NO_GUESS and "write it" in NO_GUESS
    assert (format_guess(0.5, ".0%"), format_guess(12), format_guess("tp=16")) == ("50%", "12", "tp=16")
    assert format_guess(9.0, ".1f", "x") == "9.0x" and format_guess(None, ".1f", "x") == NO_GUESS  # no stray unit
