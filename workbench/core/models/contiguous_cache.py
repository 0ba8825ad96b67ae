"""The contiguous KV cache (``KVCache``): ``(L, B, max_length, KV, D)`` keys and values, slot ``s`` holding the
``s``-th token written for every row, and its per-call step (see :mod:`~workbench.core.models.cache`)."""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp

from workbench.core.checks import positive_int
from workbench.core.models.cache_base import (
    INDEX,
    Array,
    as_dtype,
    at_layer,
    check_cacheable,
    check_value_dim,
    check_values,
    index32,
    nbytes_of,
    new_positions,
    pytree_dataclass,
    to_stored_heads,
)
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import KV_LENGTHS


@pytree_dataclass(("keys", "values", "valid_BS", "positions_B", "index"), ("value_dim",))
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Contiguous cache: ``(L, B, max_length, KV, D)`` keys and values for all layers.

    ``valid_BS`` marks slots holding real tokens, ``positions_B`` is each row's next position,
    ``index`` the number of slots written (the same for every row). With ``value_dim`` (MLA) ``values``
    is None: the values are ``keys[..., :value_dim]``, stored once.
    """

    keys: Array
    values: Array | None
    valid_BS: Array
    positions_B: Array
    index: Array
    value_dim: int | None = None

    @classmethod
    def create(cls, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32, *, value_dim: int | None = None) -> KVCache:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_length", max_length)):
            positive_int(name, value)
        check_value_dim(value_dim, head_dim)
        shape = (num_layers, batch_size, max_length, num_kv_heads, head_dim)
        return cls(keys=jnp.zeros(shape, dtype), values=None if value_dim else jnp.zeros(shape, dtype),
                   valid_BS=jnp.zeros((batch_size, max_length), bool),
                   positions_B=jnp.zeros((batch_size,), INDEX), index=jnp.zeros((), INDEX),
                   value_dim=None if value_dim is None else int(value_dim))

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.valid_BS.shape[0]

    @property
    def max_length(self) -> int:
        return self.valid_BS.shape[1]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys) + nbytes_of(self.values)

    def reorder(self, index_B: Array) -> KVCache:
        """Rows gathered by ``index_B`` (beam search keeps the cache of the beams it continues)."""
        values = None if self.values is None else jnp.take(self.values, index_B, axis=1)
        return dataclasses.replace(self, keys=jnp.take(self.keys, index_B, axis=1), values=values,
                                   valid_BS=jnp.take(self.valid_BS, index_B, axis=0),
                                   positions_B=jnp.take(self.positions_B, index_B, axis=0))

    def check_fits(self, mask_BT: Array) -> None:
        """Raise a ValueError if ``mask_BT``'s tokens do not fit (needs concrete values; a no-op when traced)."""
        b, t = mask_BT.shape
        if b != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} rows but the input has {b}; "
                             f"init_cache(batch_size={b}, ...)")
        if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_length:
            raise ValueError(f"{t} new tokens do not fit: the cache holds {int(self.index)} of max_length="
                             f"{self.max_length}; init_cache with a larger max_length")

    def begin(self, mask_BT: Array) -> _ContiguousStep:
        self.check_fits(mask_BT)
        positions_BT, count_B = new_positions(self.positions_B, mask_BT)
        valid_BS = jax.lax.dynamic_update_slice(self.valid_BS, mask_BT.astype(bool), index32(0, self.index))
        return _ContiguousStep(self, positions_BT, valid_BS, count_B)


@dataclasses.dataclass
class _ContiguousStep:
    cache: KVCache
    positions_BT: Array
    valid_BS: Array
    count_B: Array

    def arrays(self) -> tuple[Array, Array]:
        return self.cache.keys, self.cache.values

    def attend(self, kv: tuple[Array, Array | None], layer: tp.Any, q_BTHD: Array, k_BTKD: Array,
               v_BTKD: Array | None, *, attn_mechanism: str, sliding_window: int | None, **options: tp.Any
               ) -> tuple[Array, tuple[Array, Array | None]]:
        """Write this layer's new keys/values at slots ``index ..`` and attend over the layer's slots
        (``options``: the family's extra attention arguments, e.g. ``softmax_scale``). A cache with
        ``value_dim`` (MLA) takes ``v_BTKD=None`` and reads the values as the keys' first channels. A cache
        storing more heads than ``k_BTKD`` has (repeated to one per tp device) gets each head repeated.

        Visibility is causal in slot order with ``kv_lengths = index + T`` (so a blockwise kernel
        skips the unwritten tail) and ``valid_BS`` hiding left padding; a window counts slots,
        which equals positions because a row's real tokens are contiguous.
        """
        keys, values = kv
        b, t = q_BTHD.shape[:2]
        check_values(self.cache.value_dim, v_BTKD)
        k_BTKD, v_BTKD = to_stored_heads(k_BTKD, keys.shape[3]), to_stored_heads(v_BTKD, keys.shape[3])
        start = index32(layer, 0, self.cache.index, 0, 0)
        keys = jax.lax.dynamic_update_slice(keys, as_dtype(k_BTKD, keys.dtype)[None], start)
        k_BSKD = as_dtype(at_layer(keys, layer), q_BTHD.dtype)
        if values is None:
            v_BSKD = k_BSKD[..., :self.cache.value_dim]
        else:
            values = jax.lax.dynamic_update_slice(values, as_dtype(v_BTKD, values.dtype)[None], start)
            v_BSKD = as_dtype(at_layer(values, layer), q_BTHD.dtype)
        check_cacheable(attn_mechanism)
        op = OperationRegistry.create(attn_mechanism, OperationMetadata())
        filled_B = jnp.full((b,), self.cache.index + t, INDEX)
        mask_B11S = self.valid_BS[:, None, None, :]
        if KV_LENGTHS in op.capabilities.features:
            out = op(q_BTHD, k_BSKD, v_BSKD, mask=mask_B11S, kv_lengths=filled_B, causal=True,
                     sliding_window=sliding_window, **options)
        else:  # the same visibility as one explicit mask
            q_T = self.cache.index + jnp.arange(t, dtype=INDEX)
            s_S = jnp.arange(keys.shape[2], dtype=INDEX)
            visible_TS = s_S[None, :] <= q_T[:, None]
            if sliding_window is not None:
                visible_TS &= s_S[None, :] > q_T[:, None] - sliding_window
            out = op(q_BTHD, k_BSKD, v_BSKD, mask=mask_B11S & visible_TS[None, None], causal=False, **options)
        return out.attention_outputs, (keys, values)

    def finish(self, kv: tuple[Array, Array]) -> KVCache:
        t = self.positions_BT.shape[1]
        return KVCache(keys=kv[0], values=kv[1], valid_BS=self.valid_BS,
                       positions_B=self.cache.positions_B + self.count_B, index=self.cache.index + t,
                       value_dim=self.cache.value_dim)
