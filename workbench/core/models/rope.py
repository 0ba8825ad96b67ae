"""Rotary position embedding in Hugging Face's ``rotate_half`` convention, with Llama-3 or linear scaling.

The head dimension is split in halves ``(x1, x2)``; position ``p`` rotates pair ``(x1[i], x2[i])``
by the angle ``p * inv_freq[i]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.models.config import LinearRopeScaling, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | None = None,
                    dtype=np.float32) -> np.ndarray:
    """``(head_dim // 2,)`` inverse frequencies, Llama-3 or linearly scaled when ``scaling`` is given.

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
    old_len, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(dtype)


def cos_sin(positions_BT: jax.Array, inv_freq_K: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of shape ``(B, T, head_dim)`` for integer positions, in ``inv_freq_K``'s dtype."""
    angles_BTK = positions_BT.astype(inv_freq_K.dtype)[..., None] * jnp.asarray(inv_freq_K)
    angles_BTD = jnp.concatenate([angles_BTK, angles_BTK], axis=-1)
    return jnp.cos(angles_BTD), jnp.sin(angles_BTD)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_BTHD: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
    """Rotate queries or keys ``(B, T, H, D)``; the result keeps ``x``'s dtype."""
    cos, sin = cos_BTD[:, :, None, :].astype(x_BTHD.dtype), sin_BTD[:, :, None, :].astype(x_BTHD.dtype)
    return x_BTHD * cos + rotate_half(x_BTHD) * sin
