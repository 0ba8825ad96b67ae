"""What every KV cache kind (:mod:`~workbench.core.models.contiguous_cache`,
:mod:`~workbench.core.models.paged_cache`, :mod:`~workbench.core.models.streaming_cache`) builds on: the int32
index type, the pytree registration, the new tokens' positions, per-layer slicing and casting, heads repeated to
the stored ones, and the checks a cache makes of its arguments and of the attention implementation."""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp

from workbench.core.checks import is_int
from workbench.core.operations import OperationRegistry

Array = jax.Array
INDEX = jnp.int32  # every cache index and position: int32 whatever jax_enable_x64 says


def pytree_dataclass(data: tuple[str, ...], meta: tuple[str, ...] = ()):
    def wrap(cls):
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
    return wrap


def new_positions(start_B: Array, mask_BT: Array) -> tuple[Array, Array]:
    """Positions of the new tokens ``(B, T)`` (padding clamped to the row's start) and tokens per row."""
    keep_BT = mask_BT.astype(INDEX)
    return start_B[:, None] + jnp.maximum(jnp.cumsum(keep_BT, axis=1, dtype=INDEX) - 1, 0), keep_BT.sum(axis=1,
                                                                                                    dtype=INDEX)


def index32(*index: tp.Any) -> tuple[Array, ...]:
    """Start indices for ``dynamic_update_slice`` all int32 (Python ints would be int64 under x64)."""
    return tuple(jnp.asarray(i, INDEX) for i in index)


def at_layer(x: Array, layer: tp.Any) -> Array:
    """``x[layer]`` for a static or traced layer index."""
    return x[layer] if isinstance(layer, int) else jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)


def as_dtype(x: Array, dtype) -> Array:
    return x if x.dtype == dtype else x.astype(dtype)


def nbytes_of(x: tp.Any) -> int:
    """Bytes of an array or a ``ShapeDtypeStruct`` (0 for None: values kept inside the keys)."""
    return 0 if x is None else math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def check_cacheable(attn_mechanism: str) -> None:
    """Sequence-parallel attention splits one long sequence over ``sp`` for training and a cache-less
    forward; decoding with a KV cache is not built for it: say which implementations decode."""
    if OperationRegistry.capabilities(attn_mechanism).mesh_axes:
        decoders = [n for n in OperationRegistry.list_implementations() if not OperationRegistry.capabilities(n)
                    .mesh_axes and n != "paged"]
        raise ValueError(f"{attn_mechanism!r} splits the sequence over a mesh axis and does not decode with a KV "
                         f"cache; generate with model.with_attention(...) one of {decoders} (or a paged cache), "
                         f"and keep {attn_mechanism!r} for training and cache-less forwards")


def check_value_dim(value_dim: int | None, head_dim: int) -> None:
    if value_dim is not None and not (is_int(value_dim) and 1 <= value_dim <= head_dim):
        raise ValueError(f"value_dim (values = the keys' first value_dim channels) must be an int in [1, head_dim="
                         f"{head_dim}] or None; got {value_dim!r}")


def to_stored_heads(x_BTKD: Array | None, stored: int) -> Array | None:
    """New keys or values with each KV head repeated to the ``stored`` heads a cache keeps (see
    :func:`~workbench.core.shapes.stored_kv_heads`): consecutive copies, so stored head ``s`` is KV head
    ``s // repeats``."""
    if x_BTKD is None or x_BTKD.shape[2] == stored:
        return x_BTKD
    if stored % x_BTKD.shape[2]:
        raise ValueError(f"internal: a cache of {stored} heads cannot hold {x_BTKD.shape[2]} KV heads repeated")
    return jnp.repeat(x_BTKD, stored // x_BTKD.shape[2], axis=2)


def check_values(value_dim: int | None, v_BTKD: Array | None) -> None:
    if (value_dim is None) == (v_BTKD is None):
        raise ValueError("internal: a cache whose values live in its keys (value_dim set, MLA) takes value=None; "
                         "any other takes the new values")
