"""StreamingLLM's KV cache (``StreamingKVCache``): the first ``sinks`` tokens plus the ``window`` most recent,
keys stored before rotary embedding and re-positioned each call; its per-call step and the check of the attention
implementation it needs (see :mod:`~workbench.core.models.cache`)."""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.checks import positive_int
from workbench.core.models.cache_base import (
    INDEX,
    Array,
    as_dtype,
    at_layer,
    check_cacheable,
    index32,
    nbytes_of,
    new_positions,
    pytree_dataclass,
)
from workbench.core.models.rope import apply_rope
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import MASK


def check_streaming_attention(attn_mechanism: str) -> None:
    """The streaming cache's visibility (sinks, the window, left padding, the new chunk's causality) is one
    explicit ``mask``: refuse an implementation that takes none, naming those that do."""
    check_cacheable(attn_mechanism)
    if MASK not in OperationRegistry.capabilities(attn_mechanism).features:
        takers = [n for n in OperationRegistry.list_implementations() if MASK in OperationRegistry.capabilities(n)
                  .features and not OperationRegistry.capabilities(n).mesh_axes]
        raise ValueError(f"the streaming cache passes its visibility as an explicit mask, which {attn_mechanism!r} "
                         f"does not take; generate with model.with_attention(...) one of {takers}")


@pytree_dataclass(("keys", "values", "lengths_B", "seen_B"), ("sinks", "window"))
@dataclasses.dataclass(frozen=True)
class StreamingKVCache:
    """StreamingLLM's cache (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
    the first ``sinks`` tokens plus the ``window`` most recent, ``(L, B, sinks + window, KV, D)`` keys and values
    whatever the length streamed, so memory is flat.

    Row ``b`` holds its ``lengths_B[b]`` tokens compacted at slots ``0 ..`` in stream order (padding is never
    stored); ``seen_B`` counts the tokens it has streamed (evicted ones included). Keys are stored *before*
    rotary embedding: a step rotates every key with its position within the cache (section 3.2: a cache
    holding tokens [0,1,2,3,6,7,8] rotates them at 0..6 and the next token at 7), each layer with its own
    rotary table, so positions never exceed ``sinks + window - 1`` in decode.

    A call with ``T`` new tokens first makes room for them (the oldest non-sink cached tokens leave), then
    attends over the sinks, the cached tokens left and the chunk causally, every key at its position within
    that order; the query of a decode step (``T = 1``) thus sees the sinks and the ``window`` most recent tokens
    itself included, at positions ``0 .. sinks + window - 1``: StreamingLLM exactly. A chunk longer than the room
    (a prompt longer than ``sinks + window``) is attended whole, like the plain forward of it on an empty cache,
    then trimmed to the sinks and its last ``window`` tokens. Memory in a call is ``sinks + window + T`` keys.

    As in the paper, only positions change on eviction: keys and values of layers past the first keep the
    context they were computed in, so re-running the kept tokens from scratch (the paper's "sliding window with
    re-computation", its Figure 1c) gives the same logits for a one-layer model only.
    """

    keys: Array
    values: Array
    lengths_B: Array
    seen_B: Array
    sinks: int
    window: int

    @classmethod
    def create(cls, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, *, sinks: int, window: int,
               dtype=jnp.float32) -> StreamingKVCache:
        for name, value, least in (("num_layers", num_layers, 1), ("batch_size", batch_size, 1),
                                   ("sinks", sinks, 0), ("window", window, 1)):
            positive_int(name, value, least=least,
                         what="a non-negative int (StreamingLLM keeps 4)" if least == 0 else "a positive int")
        shape = (num_layers, batch_size, int(sinks) + int(window), num_kv_heads, head_dim)
        return cls(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype),
                   lengths_B=jnp.zeros((batch_size,), INDEX), seen_B=jnp.zeros((batch_size,), INDEX),
                   sinks=int(sinks), window=int(window))

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.lengths_B.shape[0]

    @property
    def capacity(self) -> int:
        """Tokens a row holds at most: ``sinks + window``."""
        return self.sinks + self.window

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.keys) + nbytes_of(self.values)

    def reorder(self, index_B: Array) -> StreamingKVCache:
        """Rows gathered by ``index_B`` (beam search keeps the cache of the beams it continues)."""
        take = lambda x, axis: jnp.take(x, index_B, axis=axis)
        return dataclasses.replace(self, keys=take(self.keys, 1), values=take(self.values, 1),
                                   lengths_B=take(self.lengths_B, 0), seen_B=take(self.seen_B, 0))

    def check_fits(self, mask_BT: Array) -> None:
        """Any number of tokens fits (the oldest non-sink ones are evicted); only the rows must match."""
        if mask_BT.shape[0] != self.batch_size:
            raise ValueError(f"the streaming cache holds {self.batch_size} rows but the input has {mask_BT.shape[0]}; "
                             f"init_streaming_cache(batch_size={mask_BT.shape[0]}, ...)")

    def begin(self, mask_BT: Array) -> _StreamingStep:
        self.check_fits(mask_BT)
        c, s = self.capacity, self.sinks
        count_B = mask_BT.astype(INDEX).sum(axis=1, dtype=INDEX)
        # make room first: the oldest non-sink cached tokens the new ones displace leave before the call attends
        made_B = jnp.clip(self.lengths_B + count_B - c, 0, jnp.maximum(self.lengths_B - s, 0))[:, None]
        slot_C = jnp.arange(c, dtype=INDEX)[None]
        held_BC = (slot_C < self.lengths_B[:, None]) & ((slot_C < s) | (slot_C >= s + made_B))
        # the call's keys: the cache's C slots, then the T new tokens (X = C + T), each at its rank among the
        # row's kept tokens, which is its position within the cache
        valid_BX = jnp.concatenate([held_BC, mask_BT.astype(bool)], axis=1)
        rank_BX = jnp.maximum(jnp.cumsum(valid_BX, axis=1, dtype=INDEX) - 1, 0)
        positions_BT, _ = new_positions(self.lengths_B - made_B[:, 0], mask_BT)
        total_B = self.lengths_B - made_B[:, 0] + count_B
        # a chunk longer than the room left is attended whole, then trimmed to the sinks and the last window
        drop_B1 = jnp.maximum(total_B - c, 0)[:, None]
        kept_BX = valid_BX & ((rank_BX < s) | (rank_BX >= s + drop_B1))
        slot_BX = jnp.where(kept_BX, jnp.where(rank_BX < s, rank_BX, rank_BX - drop_B1), c)  # c: not kept
        visible_BTX = valid_BX[:, None, :] & (rank_BX[:, None, :] <= positions_BT[:, :, None])
        return _StreamingStep(self, positions_BT, rank_BX, visible_BTX, slot_BX, jnp.minimum(total_B, c),
                              self.seen_B + count_B)


@dataclasses.dataclass
class _StreamingStep:
    cache: StreamingKVCache
    positions_BT: Array  # the new tokens' positions within the cache (their ranks)
    rank_BX: Array  # every key's position within the cache: the C slots, then the new tokens
    visible_BTX: Array  # real keys at or before each query (no window yet: that is per layer)
    slot_BX: Array  # where each key lands after eviction (C: evicted, or padding)
    lengths_B: Array
    seen_B: Array
    key_cos_NBXD: Array | None = None  # set by with_key_rope: each rotary table at the keys' positions
    key_sin_NBXD: Array | None = None
    table_L: np.ndarray | None = None  # each layer's index into the tables

    rotates_keys: tp.ClassVar[bool] = True  # Attention hands this step its keys un-rotated

    def with_key_rope(self, rope_tables: tp.Callable[[Array], dict[str, tuple[Array, Array]] | None],
                      table_names_L: tp.Sequence[str]) -> _StreamingStep:
        """This step with the model's rotary tables (``CausalLM.rope_tables``) at the keys' positions, and
        layer ``l``'s table named ``table_names_L[l]`` (Gemma's local and global layers rotate differently)."""
        tables = rope_tables(self.rank_BX)
        if tables is None:
            raise ValueError("the streaming cache re-positions keys with rotary embeddings, and this model has "
                             "learned absolute positions: use init_cache() or init_ragged_pages()")
        names = sorted(tables)
        return dataclasses.replace(self, key_cos_NBXD=jnp.stack([tables[n][0] for n in names]),
                                   key_sin_NBXD=jnp.stack([tables[n][1] for n in names]),
                                   table_L=np.asarray([names.index(n) for n in table_names_L], np.int32))

    def arrays(self) -> tuple[Array, Array]:
        return self.cache.keys, self.cache.values

    def attend(self, kv: tuple[Array, Array], layer: tp.Any, q_BTHD: Array, k_BTKD: Array, v_BTKD: Array | None,
               *, attn_mechanism: str, sliding_window: int | None, **options: tp.Any
               ) -> tuple[Array, tuple[Array, Array]]:
        """Attend over the cache's keys and the new ones, every key rotated at its position within the cache
        (``q_BTHD`` comes rotated at the new tokens' positions, ``k_BTKD`` un-rotated), then store the layer's
        un-rotated keys and values after eviction. A sliding window (Mistral, Gemma's local layers) counts
        positions within the cache, as the plain forward of the kept tokens does."""
        if v_BTKD is None:
            raise ValueError("the streaming cache stores keys and values per head; multi-head latent attention "
                             "(MLA) is not supported: use init_cache() or init_ragged_pages()")
        if self.key_cos_NBXD is None:
            raise ValueError("internal: a streaming step attends only after with_key_rope (CausalLM.hidden_states "
                             "calls it)")
        check_streaming_attention(attn_mechanism)
        keys, values = kv
        b = q_BTHD.shape[0]
        k_BXKD = jnp.concatenate([as_dtype(at_layer(keys, layer), k_BTKD.dtype), k_BTKD], axis=1)
        v_BXKD = jnp.concatenate([as_dtype(at_layer(values, layer), v_BTKD.dtype), v_BTKD], axis=1)
        table = jnp.asarray(self.table_L)[layer]
        cos_BXD = jax.lax.dynamic_index_in_dim(self.key_cos_NBXD, table, 0, keepdims=False)
        sin_BXD = jax.lax.dynamic_index_in_dim(self.key_sin_NBXD, table, 0, keepdims=False)
        rotated_BXKD = apply_rope(k_BXKD, cos_BXD, sin_BXD)
        visible_BTX = self.visible_BTX
        if sliding_window is not None:
            visible_BTX &= self.rank_BX[:, None, :] > self.positions_BT[:, :, None] - sliding_window
        op = OperationRegistry.create(attn_mechanism, OperationMetadata())
        out = op(q_BTHD, as_dtype(rotated_BXKD, q_BTHD.dtype), as_dtype(v_BXKD, q_BTHD.dtype),
                 mask=visible_BTX[:, None], causal=False, **options)
        rows_B1 = jnp.arange(b, dtype=INDEX)[:, None]
        start = index32(layer, 0, 0, 0, 0)
        kept_BSKD = jnp.zeros(keys.shape[1:], keys.dtype).at[rows_B1, self.slot_BX].set(as_dtype(k_BXKD, keys.dtype),
                                                                                        mode="drop")
        keys = jax.lax.dynamic_update_slice(keys, kept_BSKD[None], start)
        kept_BSKD = jnp.zeros(values.shape[1:], values.dtype).at[rows_B1, self.slot_BX].set(
            as_dtype(v_BXKD, values.dtype), mode="drop")
        values = jax.lax.dynamic_update_slice(values, kept_BSKD[None], start)
        return out.attention_outputs, (keys, values)

    def finish(self, kv: tuple[Array, Array]) -> StreamingKVCache:
        return dataclasses.replace(self.cache, keys=kv[0], values=kv[1], lengths_B=self.lengths_B, seen_B=self.seen_B)
