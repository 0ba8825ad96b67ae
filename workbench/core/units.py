"""Numbers as people read them: bytes (binary units), seconds, FLOPs, counts, a reader's guess. The one formatter of
each."""

from __future__ import annotations

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")
_SECONDS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_FLOPS = (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3),
          ("FLOP", 1.0))


def format_bytes(n: int | float, unit: str | None = None, decimals: int = 1) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.5 KiB"``, ``2**21`` -> ``"2 MiB"``; with ``unit`` (a column of
    figures to compare) always in that unit, to ``decimals`` places.

    >>> format_bytes(512), format_bytes(1536), format_bytes(2**21), format_bytes(37.4e9)
    ('512 B', '1.5 KiB', '2 MiB', '34.8 GiB')
    >>> format_bytes(2**29, "GiB"), format_bytes(3 * 2**30, "GiB", decimals=3)
    ('0.5 GiB', '3.000 GiB')
    """
    if unit is not None:
        if unit not in _BINARY:
            raise ValueError(f"unit must be one of {_BINARY}; got {unit!r}")
        return f"{n / 1024 ** _BINARY.index(unit):.{decimals}f} {unit}"
    value = float(n)
    for unit in _BINARY:
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit == "B" or value == int(value) else _digits(value)
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _digits(value: float) -> str:
    """Three significant digits, never in exponent notation: ``1023.4`` -> ``"1023"``, ``0.0123`` -> ``"0.0123"``."""
    text = f"{value:.3g}"
    return f"{value:.0f}" if "e" in text else text


def _scaled(value: float, units: tuple[tuple[str, float], ...]) -> str:
    """``value`` in the largest of ``units`` (name, scale; largest first) it reaches once rounded to three
    significant digits, so 0.9996 s reads "1 s", not "1e+03 ms"; a sign kept, no exponent."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    for name, scale in units:
        if float(f"{value / scale:.3g}") >= 1 or scale == units[-1][1]:
            return f"{sign}{_digits(value / scale)} {name}"
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"`` (three significant digits, s / ms / us / ns; never an exponent).

    >>> format_seconds(2.5), format_seconds(0.0123), format_seconds(4.6e-5), format_seconds(3e-9)
    ('2.5 s', '12.3 ms', '46 us', '3 ns')
    >>> format_seconds(4070.0), format_seconds(0.9996), format_seconds(-0.03), format_seconds(0)
    ('4070 s', '1 s', '-30 ms', '0 s')
    """
    if seconds == 0:
        return "0 s"
    return _scaled(seconds, _SECONDS)


def format_flops(n: float) -> str:
    """Floating-point operations in SI units: ``6.95e10`` -> ``"69.5 GFLOP"`` (three significant digits).

    >>> format_flops(6.95e10), format_flops(1.2e15), format_flops(512), format_flops(0)
    ('69.5 GFLOP', '1.2 PFLOP', '512 FLOP', '0 FLOP')
    """
    if n == 0:
        return "0 FLOP"
    return _scaled(n, _FLOPS)


def format_count(n: int) -> str:
    """A parameter count for labels: ``91392`` -> ``"91.4K"``, ``7241732096`` -> ``"7.24B"``.

    >>> format_count(999), format_count(91392), format_count(7_241_732_096)
    ('999', '91.4K', '7.24B')
    """
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


NO_GUESS = "none yet (write it in the cell above, run that cell, then this one)"


def format_guess(guess: object, spec: str = "", unit: str = "") -> str:
    """A reader's guess as a predict-then-check cell prints it: ``format(guess, spec)`` and its ``unit``, or
    :data:`NO_GUESS` while it is still ``None`` (every guess cell starts empty, so the answer is never printed
    before the guess).

    >>> format_guess(0.25, ".0%"), format_guess(8960, ",", " chips"), format_guess(None, ",", " chips") == NO_GUESS
    ('25%', '8,960 chips', True)
    """
    return NO_GUESS if guess is None else format(guess, spec) + unit
