"""Tolerances derived from float32 rounding, for comparing two float32 computations of the same quantity.

Two float32 evaluations that differ only in order (another fusion, a recomputed forward, another reduction
tree) each carry rounding error. A sum of ``n`` products rounded at every step is off by at most ``n u`` times
the sum of the products' magnitudes, and in practice (errors of random sign) by about ``sqrt(n) u`` times the
result's scale (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sections 3.1 and 4.2). A
value computed through ``stages`` such contractions in a row (a layer's backward after the next one's)
accumulates them once per stage. The bound below is that estimate, relative to the scale of what is compared
(its largest magnitude), with no fudge factor: a test using it states its ``n`` and its ``stages``.
"""

import math

import numpy as np

UNIT_ROUNDOFF = 2.0**-24  # float32: half the spacing of numbers near 1.0 (np.finfo(np.float32).eps / 2)


def float32_atol(scale: float, accumulation: int, stages: int = 1) -> float:
    """``stages * sqrt(accumulation) * u * scale``: the absolute error two float32 evaluations of a quantity of
    magnitude ``scale`` may differ by, through ``stages`` contractions of length ``accumulation`` each."""
    return stages * math.sqrt(accumulation) * UNIT_ROUNDOFF * scale


def assert_float32_close(got, want, *, accumulation: int, stages: int = 1) -> None:
    """Every element of ``got`` within :func:`float32_atol` of ``want``, the scale being ``want``'s largest
    magnitude."""
    got, want = np.asarray(got), np.asarray(want)
    atol = float32_atol(float(np.abs(want).max()), accumulation, stages)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
