"""KV caches: a contiguous one (``KVCache``) and a paged one with a page table and a free list
(``PagedKVCache``). Both are pytrees passed to the model and returned updated.

One model call with a cache has three steps, so the model never needs to know the kind:
``step = cache.begin(mask_BT)`` (positions of the new tokens, slots or pages to write);
``kv = step.arrays()``, the stacked key/value arrays the layer scan carries; per layer
``out, kv = step.attend(kv, layer, q, k, v, ...)`` writes the new tokens of that layer (only
them: ``dynamic_update_slice`` or a scatter into the carried arrays) and attends over what the
layer holds; then ``cache = step.finish(kv)``.

Layouts (layers stacked first, like the model's parameters): ``KVCache.keys`` is
``(L, B, S, KV, D)``, slot ``s`` holding the ``s``-th token written for every row (left padding
included, marked invalid in ``valid_BS``); ``keys[layer]`` is one layer's ``(B, S, KV, D)``.
``PagedKVCache.key_pages`` is ``(L, num_pages, page_size, KV, D)``; row ``b``'s token at position
``p`` lives at ``key_pages[layer, page_table[b, p // page_size], p % page_size]`` and padding is
never stored, so each row holds ``lengths[b]`` tokens (a ragged batch).

Multi-head latent attention (DeepSeek-V3) caches ``[latent ; rope key]`` once per token: keys
``(L, B, S, 1, C + R)`` (pages ``(L, num_pages, page_size, 1, C + R)``) and no value array; its values
are the keys' first ``value_dim = C`` channels (the latent, stored once). :func:`kv_layout` gives a
config's layout and :func:`cache_footprint` its bytes per token against the expanded cache.

On a mesh the cache is ``(BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)`` resolved in decode mode
(:func:`cache_decisions`). When the head dimension's mesh axes (``tp`` by default) are more than the
KV heads, the cache stores each KV head repeated ``tp // KV`` times, one head per device, as serving
engines (vLLM, MaxText) do: :func:`stored_kv_heads` says how many heads that is, and a step writes
each new key/value repeated (``jnp.repeat`` per head, so query head ``h`` still reads original KV
head ``h // (H // KV)``).
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.axes import BATCH, KV_HEAD, KV_HEAD_DIM, KV_LENGTH, MODE_DECODE, DimDecision, PartitionAxis
from workbench.core.checks import is_int, positive_int
from workbench.core.models.config import ModelConfig
from workbench.core.models.rope import apply_rope
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import KV_LENGTHS, MASK
from workbench.core.shapes import stored_kv_heads

Array = jax.Array
INDEX = jnp.int32  # every cache index and position: int32 whatever jax_enable_x64 says
# A KV cache's dimensions, resolved in decode mode (it exists only while generating, and prefill writes the
# same arrays decode reads).
KV_CACHE_AXES = (BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)
KV_CACHE_MODE = MODE_DECODE


def _pytree(data: tuple[str, ...], meta: tuple[str, ...] = ()):
    def wrap(cls):
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
    return wrap


def _new_positions(start_B: Array, mask_BT: Array) -> tuple[Array, Array]:
    """Positions of the new tokens ``(B, T)`` (padding clamped to the row's start) and tokens per row."""
    keep_BT = mask_BT.astype(INDEX)
    return start_B[:, None] + jnp.maximum(jnp.cumsum(keep_BT, axis=1, dtype=INDEX) - 1, 0), keep_BT.sum(axis=1,
                                                                                                    dtype=INDEX)


def index32(*index: tp.Any) -> tuple[Array, ...]:
    """Start indices for ``dynamic_update_slice`` all int32 (Python ints would be int64 under x64)."""
    return tuple(jnp.asarray(i, INDEX) for i in index)


def _layer(x: Array, layer: tp.Any) -> Array:
    """``x[layer]`` for a static or traced layer index."""
    return x[layer] if isinstance(layer, int) else jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)


def _as(x: Array, dtype) -> Array:
    return x if x.dtype == dtype else x.astype(dtype)


def _nbytes(x: tp.Any) -> int:
    """Bytes of an array or a ``ShapeDtypeStruct`` (0 for None: values kept inside the keys)."""
    return 0 if x is None else math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


class KVLayout(tp.NamedTuple):
    """What a cache stores per token and layer: ``kv_heads`` heads of ``key_dim`` keys, and values of
    ``key_dim`` each, or, with ``value_dim`` set (MLA), no values of their own: they are the keys' first
    ``value_dim`` channels."""

    kv_heads: int
    key_dim: int
    value_dim: int | None = None

    @property
    def numbers_per_token(self) -> int:
        """Numbers cached per token and layer (keys, plus values unless they live in the keys)."""
        return self.kv_heads * self.key_dim * (1 if self.value_dim is not None else 2)


def kv_layout(config: ModelConfig) -> KVLayout:
    """The cache layout of ``config``: ``(KV, D)`` keys and values, or MLA's ``[latent ; rope key]`` alone."""
    if config.mla:
        return KVLayout(1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank)
    return KVLayout(config.num_key_value_heads, config.head_dim)


def _head_axes(decisions: tp.Sequence[DimDecision]) -> tuple[str, ...]:
    """The mesh axes the head dimension (dim 2) can split over: its candidates the batch and length leave free."""
    taken = {a for d in decisions[:2] for a in d.chosen}
    return tuple(a for a in dict.fromkeys(decisions[2].candidates) if a not in taken)


def cache_decisions(config: ModelConfig, batch: int, max_length: int, mesh: tp.Any,
                    partition_axis: PartitionAxis | None = None) -> tuple[tuple[int, ...], list[DimDecision]]:
    """Shape ``(B, S, stored heads, D)`` of one layer's keys (or values) on ``mesh`` and how each dimension is
    resolved (``KV_CACHE_AXES`` in decode mode; the heads' reason says when they are repeated or why not).

    >>> from jax.sharding import AbstractMesh
    >>> from workbench.core.mesh import MESH_AXES
    >>> from workbench.core.models.presets import full_config
    >>> tp16 = AbstractMesh(tuple(16 if a == "tp" else 1 for a in MESH_AXES), MESH_AXES)
    >>> shape, decisions = cache_decisions(full_config("llama-3-70b"), 8, 8192, tp16)
    >>> shape, decisions[2].chosen
    ((8, 8192, 16, 128), ('tp',))
    >>> decisions[2].reason.split(";")[0]
    '8 KV heads repeated 2x to one per tp device (as serving engines do)'
    """
    pa = PartitionAxis() if partition_axis is None else partition_axis
    kv = kv_layout(config)  # MLA: one head of [latent ; rope key]
    shape = (batch, max_length, kv.kv_heads, kv.key_dim)
    decisions = pa.explain(KV_CACHE_AXES, KV_CACHE_MODE, shape=shape, mesh=mesh)
    sizes = dict(mesh.shape)
    free = _head_axes(decisions)
    ways = math.prod(sizes[a] for a in free)
    axes = "×".join(a for a in free if sizes[a] > 1)
    if config.mla:
        note = (f"MLA caches one latent head, replicated over {axes} as MaxText and vLLM keep it (split the "
                f"sequence over sp instead)") if ways > 1 else ""
    else:
        stored = stored_kv_heads(kv.kv_heads, config.num_attention_heads, ways)
        note = ""
        if stored != kv.kv_heads:
            shape = (batch, max_length, stored, kv.key_dim)
            decisions = pa.explain(KV_CACHE_AXES, KV_CACHE_MODE, shape=shape, mesh=mesh)
            note = (f"{kv.kv_heads} KV heads repeated {stored // kv.kv_heads}x to one per {axes} device "
                    f"(as serving engines do)")
        elif ways > kv.kv_heads:
            why = (f"{ways} is not a multiple of them" if ways % kv.kv_heads else
                   f"the {config.num_attention_heads} query heads do not split {ways} ways")
            note = f"{kv.kv_heads} KV heads do not repeat to one per {axes} device ({why})"
    if note:
        decisions[2] = dataclasses.replace(decisions[2], reason=f"{note}; {decisions[2].reason}")
    return shape, decisions


@dataclasses.dataclass(frozen=True)
class CacheFootprint:
    """Bytes one token costs in one layer's cache (``cached``) and in the cache of the same attention with
    per-head keys and values (``expanded``: ``KV x 2 x D``, or for MLA ``H x (qk_head_dim + v_head_dim)``)."""

    cached: int
    expanded: int
    layers: int
    dtype: str
    what: str

    @property
    def ratio(self) -> float:
        return self.expanded / self.cached

    def __str__(self) -> str:
        return (f"{self.what}: {self.cached:,} B per token per layer ({self.dtype}) vs {self.expanded:,} B expanded, "
                f"{self.ratio:.1f}x smaller; {self.layers} layers: {self.cached * self.layers:,} B vs "
                f"{self.expanded * self.layers:,} B per token")


def cache_footprint(config: ModelConfig, dtype=jnp.bfloat16) -> CacheFootprint:
    """Bytes per token per layer of ``config``'s KV cache in ``dtype`` against the expanded (GQA/MHA) one.

    >>> from workbench.core.models.presets import full_config
    >>> print(cache_footprint(full_config("deepseek-v3")))  # doctest: +ELLIPSIS
    MLA latent 512 + rope key 64: 1,152 B per token per layer (bfloat16) vs 81,920 B expanded, 71.1x smaller; ...
    """
    itemsize = jnp.dtype(dtype).itemsize
    layout = kv_layout(config)
    c = config
    if c.mla:
        expanded = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
        what = f"MLA latent {c.kv_lora_rank} + rope key {c.qk_rope_head_dim}"
    else:
        expanded = layout.numbers_per_token
        what = f"{'MHA' if c.num_key_value_heads == c.num_attention_heads else 'GQA'} {layout.kv_heads} x 2 x " \
               f"{layout.key_dim}"
    return CacheFootprint(layout.numbers_per_token * itemsize, expanded * itemsize, c.num_hidden_layers,
                          jnp.dtype(dtype).name, what)


def _check_cacheable(attn_mechanism: str) -> None:
    """Sequence-parallel attention splits one long sequence over ``sp`` for training and a cache-less
    forward; decoding with a KV cache is not built for it: say which implementations decode."""
    if OperationRegistry.capabilities(attn_mechanism).mesh_axes:
        decoders = [n for n in OperationRegistry.list_implementations() if not OperationRegistry.capabilities(n)
                    .mesh_axes and n != "paged"]
        raise ValueError(f"{attn_mechanism!r} splits the sequence over a mesh axis and does not decode with a KV "
                         f"cache; generate with model.with_attention(...) one of {decoders} (or a paged cache), "
                         f"and keep {attn_mechanism!r} for training and cache-less forwards")


def _check_value_dim(value_dim: int | None, head_dim: int) -> None:
    if value_dim is not None and not (is_int(value_dim) and 1 <= value_dim <= head_dim):
        raise ValueError(f"value_dim (values = the keys' first value_dim channels) must be an int in [1, head_dim="
                         f"{head_dim}] or None; got {value_dim!r}")


@_pytree(("keys", "values", "valid_BS", "positions_B", "index"), ("value_dim",))
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
        _check_value_dim(value_dim, head_dim)
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
        return _nbytes(self.keys) + _nbytes(self.values)

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
        positions_BT, count_B = _new_positions(self.positions_B, mask_BT)
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
        _check_values(self.cache.value_dim, v_BTKD)
        k_BTKD, v_BTKD = _to_stored_heads(k_BTKD, keys.shape[3]), _to_stored_heads(v_BTKD, keys.shape[3])
        start = index32(layer, 0, self.cache.index, 0, 0)
        keys = jax.lax.dynamic_update_slice(keys, _as(k_BTKD, keys.dtype)[None], start)
        k_BSKD = _as(_layer(keys, layer), q_BTHD.dtype)
        if values is None:
            v_BSKD = k_BSKD[..., :self.cache.value_dim]
        else:
            values = jax.lax.dynamic_update_slice(values, _as(v_BTKD, values.dtype)[None], start)
            v_BSKD = _as(_layer(values, layer), q_BTHD.dtype)
        _check_cacheable(attn_mechanism)
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


def _to_stored_heads(x_BTKD: Array | None, stored: int) -> Array | None:
    """New keys or values with each KV head repeated to the ``stored`` heads a cache keeps (see
    :func:`stored_kv_heads`): consecutive copies, so stored head ``s`` is KV head ``s // repeats``."""
    if x_BTKD is None or x_BTKD.shape[2] == stored:
        return x_BTKD
    if stored % x_BTKD.shape[2]:
        raise ValueError(f"internal: a cache of {stored} heads cannot hold {x_BTKD.shape[2]} KV heads repeated")
    return jnp.repeat(x_BTKD, stored // x_BTKD.shape[2], axis=2)


def _check_values(value_dim: int | None, v_BTKD: Array | None) -> None:
    if (value_dim is None) == (v_BTKD is None):
        raise ValueError("internal: a cache whose values live in its keys (value_dim set, MLA) takes value=None; "
                         "any other takes the new values")


@_pytree(("key_pages", "value_pages", "page_table", "lengths", "free_pages", "num_free"), ("page_size", "value_dim"))
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged cache: ``(L, num_pages, page_size, KV, D)`` pages, each page shared by all layers' rows alike.

    ``page_table (B, pages_per_row)`` maps each row's logical pages to physical ones;
    ``lengths (B,)`` counts the tokens each row holds; ``free_pages[:num_free]`` is the free
    list (a stack). Pages are taken from it as rows grow, inside the compiled step. With ``value_dim``
    (MLA: pages of latents) ``value_pages`` is None: the values are ``key_pages[..., :value_dim]``.
    """

    key_pages: Array
    value_pages: Array | None
    page_table: Array
    lengths: Array
    free_pages: Array
    num_free: Array
    page_size: int
    value_dim: int | None = None

    @classmethod
    def create(cls, num_layers: int, batch_size: int, num_pages: int, page_size: int, max_model_length: int,
               num_kv_heads: int, head_dim: int, dtype=jnp.float32, *, value_dim: int | None = None) -> PagedKVCache:
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("num_pages", num_pages),
                            ("page_size", page_size), ("max_model_length", max_model_length)):
            positive_int(name, value)
        _check_value_dim(value_dim, head_dim)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        return cls(key_pages=jnp.zeros(shape, dtype), value_pages=None if value_dim else jnp.zeros(shape, dtype),
                   page_table=jnp.zeros((batch_size, math.ceil(max_model_length / page_size)), INDEX),
                   lengths=jnp.zeros((batch_size,), INDEX),
                   free_pages=jnp.arange(num_pages, dtype=INDEX)[::-1],
                   num_free=jnp.asarray(num_pages, INDEX), page_size=int(page_size),
                   value_dim=None if value_dim is None else int(value_dim))

    @property
    def num_layers(self) -> int:
        return self.key_pages.shape[0]

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_pages(self) -> int:
        return self.free_pages.shape[0]

    @property
    def max_length(self) -> int:
        """Tokens one row can hold (its page-table width times the page size)."""
        return self.page_table.shape[1] * self.page_size

    @property
    def nbytes(self) -> int:
        return _nbytes(self.key_pages) + _nbytes(self.value_pages)

    def pages_to_take(self, new_tokens_B: np.ndarray) -> int:
        """Pages the rows take from the free list to add ``new_tokens_B`` tokens each (host-side check)."""
        pages = lambda tokens_B: -(-tokens_B // self.page_size)
        lengths_B = np.asarray(self.lengths)
        return int(np.sum(pages(lengths_B + np.asarray(new_tokens_B)) - pages(lengths_B)))

    def reorder(self, index_B: Array) -> PagedKVCache:
        raise ValueError("a paged cache cannot reorder rows (rows would share pages); beam search needs the "
                         "contiguous cache from init_cache()")

    def release(self, rows: tp.Sequence[int]) -> PagedKVCache:
        """A cache with ``rows`` emptied and their pages back on the free list (host-side)."""
        table, lengths = np.array(self.page_table), np.array(self.lengths)
        free = list(np.asarray(self.free_pages)[: int(self.num_free)])
        for row in rows:
            held = -(-int(lengths[row]) // self.page_size)
            free.extend(int(p) for p in table[row, :held][::-1])
            table[row], lengths[row] = 0, 0
        stack = np.zeros(self.num_pages, np.int32)
        stack[: len(free)] = free
        return dataclasses.replace(self, page_table=jnp.asarray(table), lengths=jnp.asarray(lengths),
                                   free_pages=jnp.asarray(stack), num_free=jnp.asarray(len(free), jnp.int32))

    def check_fits(self, mask_BT: Array) -> None:
        """Raise a ValueError if the rows or pages cannot take ``mask_BT``'s tokens (a no-op when traced)."""
        b = mask_BT.shape[0]
        if b != self.batch_size:
            raise ValueError(f"the paged cache has a page table for {self.batch_size} rows but the input has {b}; "
                             f"init_ragged_pages(batch_size={b}, ...)")
        if any(isinstance(x, jax.core.Tracer) for x in (self.lengths, mask_BT, self.num_free)):
            return
        new_B = np.asarray(mask_BT).astype(bool).sum(1)
        longest = int((np.asarray(self.lengths) + new_B).max())
        if longest > self.max_length:
            raise ValueError(f"a row would hold {longest} tokens; max_model_length allows {self.max_length}")
        if self.pages_to_take(new_B) > int(self.num_free):
            raise ValueError(f"out of pages: {self.pages_to_take(new_B)} more needed, "
                             f"{int(self.num_free)} free; pass a larger num_pages or release() finished rows")

    def begin(self, mask_BT: Array) -> _PagedStep:
        self.check_fits(mask_BT)
        b, t = mask_BT.shape
        positions_BT, count_B = _new_positions(self.lengths, mask_BT)
        lengths_B = self.lengths + count_B
        held_B = -(-self.lengths // self.page_size)
        need_B = -(-lengths_B // self.page_size) - held_B
        first_B = jnp.cumsum(need_B, dtype=INDEX) - need_B  # this row's first page in the pop order
        table = self.page_table
        rows_B = jnp.arange(b, dtype=INDEX)
        for j in range(math.ceil(t / self.page_size) + 1):  # a row gains at most this many pages
            take_B = j < need_B
            page_B = self.free_pages[jnp.clip(self.num_free - 1 - first_B - j, 0, self.num_pages - 1)]
            col_B = jnp.where(take_B, held_B + j, table.shape[1])  # out of range: dropped
            table = table.at[rows_B, col_B].set(page_B, mode="drop")
        num_free = self.num_free - need_B.sum()
        keep_BT = mask_BT.astype(bool)
        page_BT = jnp.take_along_axis(table, jnp.clip(positions_BT // self.page_size, 0, table.shape[1] - 1), axis=1)
        page_BT = jnp.where(keep_BT, page_BT, self.num_pages)  # padding is not stored
        return _PagedStep(self, positions_BT, table, lengths_B, num_free, page_BT, positions_BT % self.page_size)


@dataclasses.dataclass
class _PagedStep:
    cache: PagedKVCache
    positions_BT: Array
    page_table: Array
    lengths_B: Array
    num_free: Array
    page_BT: Array
    offset_BT: Array

    def arrays(self) -> tuple[Array, Array]:
        return self.cache.key_pages, self.cache.value_pages

    def attend(self, kv: tuple[Array, Array | None], layer: tp.Any, q_BTHD: Array, k_BTKD: Array,
               v_BTKD: Array | None, *, attn_mechanism: str, sliding_window: int | None, **options: tp.Any
               ) -> tuple[Array, tuple[Array, Array | None]]:
        """Writes this layer's new keys/values into their pages, then runs ``paged`` attention over the
        layer's pages (whatever the model's ``attn_mechanism``: only ``paged`` reads pages). Pages of
        latents (``value_dim``, MLA) take ``v_BTKD=None``: values are the key pages' first channels."""
        kp, vp = kv
        _check_values(self.cache.value_dim, v_BTKD)
        k_BTKD, v_BTKD = _to_stored_heads(k_BTKD, kp.shape[3]), _to_stored_heads(v_BTKD, kp.shape[3])
        kp = kp.at[layer, self.page_BT, self.offset_BT].set(_as(k_BTKD, kp.dtype), mode="drop")
        k_pages = _as(_layer(kp, layer), q_BTHD.dtype)
        if vp is None:
            v_pages = k_pages[..., :self.cache.value_dim]
        else:
            vp = vp.at[layer, self.page_BT, self.offset_BT].set(_as(v_BTKD, vp.dtype), mode="drop")
            v_pages = _as(_layer(vp, layer), q_BTHD.dtype)
        op = OperationRegistry.create("paged", OperationMetadata())
        out = op(q_BTHD, k_pages, v_pages,
                 page_table=self.page_table, kv_lengths=self.lengths_B, causal=True, sliding_window=sliding_window,
                 **options)
        return out.attention_outputs, (kp, vp)

    def finish(self, kv: tuple[Array, Array]) -> PagedKVCache:
        return dataclasses.replace(self.cache, key_pages=kv[0], value_pages=kv[1], page_table=self.page_table,
                                   lengths=self.lengths_B, num_free=self.num_free)


def check_streaming_attention(attn_mechanism: str) -> None:
    """The streaming cache's visibility (sinks, the window, left padding, the new chunk's causality) is one
    explicit ``mask``: refuse an implementation that takes none, naming those that do."""
    _check_cacheable(attn_mechanism)
    if MASK not in OperationRegistry.capabilities(attn_mechanism).features:
        takers = [n for n in OperationRegistry.list_implementations() if MASK in OperationRegistry.capabilities(n)
                  .features and not OperationRegistry.capabilities(n).mesh_axes]
        raise ValueError(f"the streaming cache passes its visibility as an explicit mask, which {attn_mechanism!r} "
                         f"does not take; generate with model.with_attention(...) one of {takers}")


@_pytree(("keys", "values", "lengths_B", "seen_B"), ("sinks", "window"))
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
        return _nbytes(self.keys) + _nbytes(self.values)

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
        positions_BT, _ = _new_positions(self.lengths_B - made_B[:, 0], mask_BT)
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
        k_BXKD = jnp.concatenate([_as(_layer(keys, layer), k_BTKD.dtype), k_BTKD], axis=1)
        v_BXKD = jnp.concatenate([_as(_layer(values, layer), v_BTKD.dtype), v_BTKD], axis=1)
        table = jnp.asarray(self.table_L)[layer]
        cos_BXD = jax.lax.dynamic_index_in_dim(self.key_cos_NBXD, table, 0, keepdims=False)
        sin_BXD = jax.lax.dynamic_index_in_dim(self.key_sin_NBXD, table, 0, keepdims=False)
        rotated_BXKD = apply_rope(k_BXKD, cos_BXD, sin_BXD)
        visible_BTX = self.visible_BTX
        if sliding_window is not None:
            visible_BTX &= self.rank_BX[:, None, :] > self.positions_BT[:, :, None] - sliding_window
        op = OperationRegistry.create(attn_mechanism, OperationMetadata())
        out = op(q_BTHD, _as(rotated_BXKD, q_BTHD.dtype), _as(v_BXKD, q_BTHD.dtype), mask=visible_BTX[:, None],
                 causal=False, **options)
        rows_B1 = jnp.arange(b, dtype=INDEX)[:, None]
        start = index32(layer, 0, 0, 0, 0)
        kept_BSKD = jnp.zeros(keys.shape[1:], keys.dtype).at[rows_B1, self.slot_BX].set(_as(k_BXKD, keys.dtype),
                                                                                        mode="drop")
        keys = jax.lax.dynamic_update_slice(keys, kept_BSKD[None], start)
        kept_BSKD = jnp.zeros(values.shape[1:], values.dtype).at[rows_B1, self.slot_BX].set(
            _as(v_BXKD, values.dtype), mode="drop")
        values = jax.lax.dynamic_update_slice(values, kept_BSKD[None], start)
        return out.attention_outputs, (keys, values)

    def finish(self, kv: tuple[Array, Array]) -> StreamingKVCache:
        return dataclasses.replace(self.cache, keys=kv[0], values=kv[1], lengths_B=self.lengths_B, seen_B=self.seen_B)
