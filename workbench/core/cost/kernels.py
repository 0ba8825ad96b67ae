"""How long one kernel takes on one chip: a GEMM of a shape, a flash-attention call, a memory-bound fusion, at
the efficiencies :mod:`workbench.core.hardware.calibration` holds (each with its evidence).

>>> from workbench.core.hardware.chips import H100
>>> round(gemm_efficiency(8192, 4096, 4096, H100), 2), round(gemm_efficiency(8192, 4096, 64, H100), 3)
(0.7, 0.087)
>>> round(attention_efficiency(8192, 128, H100), 2)  # cuDNN, causal, fwd+bwd: measured 497 / 989 = 0.50
0.5
"""

from __future__ import annotations

import math

from workbench.core.checks import one_of
from workbench.core.hardware.calibration import ChipCalibration, calibration
from workbench.core.hardware.chips import Hardware
from workbench.core.vocab import ATTENTION_KERNELS

_K_REF = 4096  # the contraction of the large GEMMs ``gemm`` was measured on


def _padded(x: float, tile: int) -> float:
    return math.ceil(x / tile) * tile


def _cal(chip: Hardware | ChipCalibration) -> ChipCalibration:
    return chip if isinstance(chip, ChipCalibration) else calibration(chip)


def gemm_efficiency(m: float, k: float, n: float, chip: Hardware | ChipCalibration, dtype: str = "bf16") -> float:
    """The fraction of ``chip``'s dense peak an ``(m, k) @ (k, n)`` GEMM reaches: the large-GEMM efficiency, the
    tile padding of every dimension, the contraction's pipeline fill ``k / (k + k_half)`` (relative to
    ``k = 4096``) and an output width below ``n_full`` filling part of the unit."""
    cal = _cal(chip)
    if min(m, k, n) <= 0:
        return 0.0
    base = cal.gemm_fp8.value if dtype == "fp8" and cal.gemm_fp8 is not None else cal.gemm.value
    t = cal.tile
    mp, kp, np_ = _padded(m, t), _padded(k, t), _padded(n, t)
    fill = (k / (k + cal.k_half)) / (_K_REF / (_K_REF + cal.k_half))
    # rows only pad to the tile: a GEMM of few rows (decode) streams its weights and is bound by reading them
    return base * (m / mp) * (k / kp) * (n / np_) * min(1.0, fill) * min(1.0, np_ / cal.n_full)


def attention_rate(chip: Hardware | ChipCalibration, kernel: str = "flash") -> float:
    """The long-sequence fraction of the peak ``kernel``'s forward and backward reach on ``chip`` (at head_dim
    128): the chip's own rate for a kernel the calibration names (``attention_kernels``), else its production
    flash kernel's (``attention``). ``"xla"`` is priced as ``"flash"``: the XLA attention's time is not modelled."""
    cal = _cal(chip)
    one_of("attention", kernel, ATTENTION_KERNELS)
    if kernel in ("xla", "flash"):
        return cal.attention.value
    if kernel not in cal.attention_kernels:
        raise ValueError(f"no measured rate for the {kernel!r} attention kernel on {cal.chip}; kernels with one "
                         f"there: {sorted({'flash', 'xla', *cal.attention_kernels})}")
    return cal.attention_kernels[kernel].value


def attention_efficiency(length: float, head_dim: float, chip: Hardware | ChipCalibration,
                         kernel: str = "flash") -> float:
    """The fraction of the peak a flash-attention kernel's forward and backward reach over sequences of
    ``length`` keys with heads of ``head_dim`` (FLOPs of the tiles a causal mask keeps); ``kernel`` names it
    (:func:`attention_rate`)."""
    cal = _cal(chip)
    ref = 128 / (128 + cal.attention_d_half)
    return attention_rate(cal, kernel) * length / (length + cal.attention_t_half) * (
        head_dim / (head_dim + cal.attention_d_half)) / ref


def memory_seconds(nbytes: float, chip: Hardware | ChipCalibration, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` to and from HBM of ``bandwidth`` B/s in memory-bound fusions."""
    return nbytes / (bandwidth * _cal(chip).hbm.value) if nbytes else 0.0


__all__ = ["attention_efficiency", "attention_rate", "gemm_efficiency", "memory_seconds"]
