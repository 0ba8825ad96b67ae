"""Rotary position embedding in Hugging Face's ``rotate_half`` convention, with Llama-3, linear or YaRN scaling.

The head dimension is split in halves ``(x1, x2)``; position ``p`` rotates pair ``(x1[i], x2[i])``
by the angle ``p * inv_freq[i]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.models.config import LinearRopeScaling, RopeScaling, YarnRopeScaling

Scaling = RopeScaling | LinearRopeScaling | YarnRopeScaling | None


def inv_frequencies(head_dim: int, theta: float, scaling: Scaling = None, dtype=np.float32) -> np.ndarray:
    """``(head_dim // 2,)`` inverse frequencies, Llama-3, linearly or YaRN scaled when ``scaling`` is given.

    Float32 as transformers computes them (exact to its float32 forward); ``dtype=np.float64`` for a
    float64 model.
    """
    dtype = np.dtype(dtype)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=dtype) / dtype.type(head_dim)))
    inv_freq = inv_freq.astype(dtype)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return (inv_freq / dtype.type(scaling.factor)).astype(dtype)
    if isinstance(scaling, YarnRopeScaling):
        return _yarn(head_dim, theta, scaling, dtype)
    old_len, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(dtype)


def _yarn(head_dim: int, theta: float, s: YarnRopeScaling, dtype: np.dtype) -> np.ndarray:
    """YaRN's blend of extrapolated and interpolated frequencies (transformers' ``_compute_yarn_parameters``)."""
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=dtype) / dtype.type(head_dim))
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (dtype.type(s.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=dtype) - dtype.type(low)) / dtype.type(high - low), 0, 1)
    keep = (1 - ramp).astype(dtype)  # 1: extrapolate (high frequencies), 0: interpolate
    return (interpolated * (1 - keep) + extrapolated * keep).astype(dtype)


def attention_factor(scaling: Scaling) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for the other scalings)."""
    if not isinstance(scaling, YarnRopeScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def cos_sin(positions_BT: jax.Array, inv_freq_K: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of shape ``(B, T, head_dim)`` for integer positions, in ``inv_freq_K``'s dtype
    (times ``scale``: YaRN's attention factor)."""
    angles_BTK = positions_BT.astype(inv_freq_K.dtype)[..., None] * jnp.asarray(inv_freq_K)
    angles_BTD = jnp.concatenate([angles_BTK, angles_BTK], axis=-1)
    if scale == 1.0:
        return jnp.cos(angles_BTD), jnp.sin(angles_BTD)
    factor = jnp.asarray(scale, angles_BTD.dtype)
    return jnp.cos(angles_BTD) * factor, jnp.sin(angles_BTD) * factor


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_BTHD: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
    """Rotate queries or keys ``(B, T, H, D)``; the result keeps ``x``'s dtype."""
    cos, sin = cos_BTD[:, :, None, :].astype(x_BTHD.dtype), sin_BTD[:, :, None, :].astype(x_BTHD.dtype)
    return x_BTHD * cos + rotate_half(x_BTHD) * sin
