"""KV caches: a contiguous one (``KVCache``) and a paged one with a page table and a free list
(``PagedKVCache``). Both are pytrees passed to the model and returned updated.

One model call with a cache has three steps, so the model never needs to know the kind:
``step = cache.begin(mask_BT)`` (positions of the new tokens, slots or pages to write),
``out, update = step.attend(layer, q, k, v, ...)`` per layer (write, then attend over all that
is cached), ``cache = step.finish(updates)``.

Layouts: ``KVCache.keys[layer]`` is ``(B, S, KV, D)``, slot ``s`` holding the ``s``-th token
written for every row (left padding included, marked invalid in ``valid_BS``).
``PagedKVCache.key_pages[layer]`` is ``(num_pages, page_size, KV, D)``; row ``b``'s token at
position ``p`` lives at ``key_pages[page_table[b, p // page_size], p % page_size]`` and padding
is never stored, so each row holds ``lengths[b]`` tokens (a ragged batch).
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.operations import OperationMetadata, OperationRegistry

Array = jax.Array


def _pytree(data: tuple[str, ...], meta: tuple[str, ...] = ()):
    def wrap(cls):
        return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
    return wrap


def _new_positions(start_B: Array, mask_BT: Array) -> tuple[Array, Array]:
    """Positions of the new tokens ``(B, T)`` (padding clamped to the row's start) and tokens per row."""
    keep_BT = mask_BT.astype(jnp.int32)
    return start_B[:, None] + jnp.maximum(jnp.cumsum(keep_BT, axis=1) - 1, 0), keep_BT.sum(axis=1)


@_pytree(("keys", "values", "valid_BS", "positions_B", "index"))
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Contiguous cache: per layer ``(B, max_length, KV, D)`` keys and values.

    ``valid_BS`` marks slots holding real tokens, ``positions_B`` is each row's next position,
    ``index`` the number of slots written (the same for every row).
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    valid_BS: Array
    positions_B: Array
    index: Array

    @classmethod
    def create(cls, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> KVCache:
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        shape = (batch_size, max_length, num_kv_heads, head_dim)
        return cls(keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   valid_BS=jnp.zeros((batch_size, max_length), bool),
                   positions_B=jnp.zeros((batch_size,), jnp.int32), index=jnp.zeros((), jnp.int32))

    @property
    def batch_size(self) -> int:
        return self.valid_BS.shape[0]

    @property
    def max_length(self) -> int:
        return self.valid_BS.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def reorder(self, index_B: Array) -> KVCache:
        """Rows gathered by ``index_B`` (beam search keeps the cache of the beams it continues)."""
        take = lambda x: jnp.take(x, index_B, axis=0)
        return dataclasses.replace(self, keys=tuple(map(take, self.keys)), values=tuple(map(take, self.values)),
                                   valid_BS=take(self.valid_BS), positions_B=take(self.positions_B))

    def begin(self, mask_BT: Array) -> _ContiguousStep:
        b, t = mask_BT.shape
        if b != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} rows but the input has {b}; "
                             f"init_cache(batch_size={b}, ...)")
        if not isinstance(self.index, jax.core.Tracer) and int(self.index) + t > self.max_length:
            raise ValueError(f"{t} new tokens do not fit: the cache holds {int(self.index)} of max_length="
                             f"{self.max_length}; init_cache with a larger max_length")
        positions_BT, count_B = _new_positions(self.positions_B, mask_BT)
        valid_BS = jax.lax.dynamic_update_slice(self.valid_BS, mask_BT.astype(bool), (0, self.index))
        return _ContiguousStep(self, positions_BT, valid_BS, count_B)


@dataclasses.dataclass
class _ContiguousStep:
    cache: KVCache
    positions_BT: Array
    valid_BS: Array
    count_B: Array

    def mask(self, t: int, sliding_window: int | None) -> Array:
        """``(B, 1, T, S)``: valid slots at or before each query's slot (and inside its window)."""
        q_T = self.cache.index + jnp.arange(t)
        s_S = jnp.arange(self.cache.max_length)
        visible_TS = s_S[None, :] <= q_T[:, None]
        if sliding_window is not None:
            visible_TS &= s_S[None, :] > q_T[:, None] - sliding_window
        return self.valid_BS[:, None, None, :] & visible_TS[None, None]

    def attend(self, layer: int, q_BTHD: Array, k_BTKD: Array, v_BTKD: Array, *, attn_mechanism: str,
               sliding_window: int | None) -> tuple[Array, tuple[Array, Array]]:
        start = (0, self.cache.index, 0, 0)
        keys = jax.lax.dynamic_update_slice(self.cache.keys[layer], k_BTKD.astype(self.cache.keys[layer].dtype), start)
        values = jax.lax.dynamic_update_slice(self.cache.values[layer],
                                              v_BTKD.astype(self.cache.values[layer].dtype), start)
        op = OperationRegistry.create(attn_mechanism, OperationMetadata())
        out = op(q_BTHD, keys.astype(q_BTHD.dtype), values.astype(q_BTHD.dtype),
                 mask=self.mask(q_BTHD.shape[1], sliding_window), causal=False)
        return out.attention_outputs, (keys, values)

    def finish(self, updates: tp.Sequence[tuple[Array, Array]]) -> KVCache:
        t = self.positions_BT.shape[1]
        return KVCache(keys=tuple(k for k, _ in updates), values=tuple(v for _, v in updates),
                       valid_BS=self.valid_BS, positions_B=self.cache.positions_B + self.count_B,
                       index=self.cache.index + t)


@_pytree(("key_pages", "value_pages", "page_table", "lengths", "free_pages", "num_free"), ("page_size",))
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged cache: per layer ``(num_pages, page_size, KV, D)`` pages shared by all rows.

    ``page_table (B, pages_per_row)`` maps each row's logical pages to physical ones;
    ``lengths (B,)`` counts the tokens each row holds; ``free_pages[:num_free]`` is the free
    list (a stack). Pages are taken from it as rows grow, inside the compiled step.
    """

    key_pages: tuple[Array, ...]
    value_pages: tuple[Array, ...]
    page_table: Array
    lengths: Array
    free_pages: Array
    num_free: Array
    page_size: int

    @classmethod
    def create(cls, num_layers: int, batch_size: int, num_pages: int, page_size: int, max_model_length: int,
               num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> PagedKVCache:
        for name, value in (("batch_size", batch_size), ("num_pages", num_pages), ("page_size", page_size),
                            ("max_model_length", max_model_length)):
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(key_pages=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   value_pages=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   page_table=jnp.zeros((batch_size, math.ceil(max_model_length / page_size)), jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   free_pages=jnp.arange(num_pages, dtype=jnp.int32)[::-1],
                   num_free=jnp.asarray(num_pages, jnp.int32), page_size=int(page_size))

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
        return sum(x.nbytes for x in (*self.key_pages, *self.value_pages))

    def pages_needed(self, new_tokens_B: np.ndarray) -> int:
        """Pages the rows need in all after adding ``new_tokens_B`` tokens each (host-side check)."""
        total = np.asarray(self.lengths) + np.asarray(new_tokens_B)
        return int(np.sum(-(-total // self.page_size)))

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

    def begin(self, mask_BT: Array) -> _PagedStep:
        b, t = mask_BT.shape
        if b != self.batch_size:
            raise ValueError(f"the paged cache has a page table for {self.batch_size} rows but the input has {b}; "
                             f"init_ragged_pages(batch_size={b}, ...)")
        concrete = not any(isinstance(x, jax.core.Tracer) for x in (self.lengths, mask_BT, self.num_free))
        if concrete:
            new_B = np.asarray(mask_BT).astype(bool).sum(1)
            longest = int((np.asarray(self.lengths) + new_B).max())
            if longest > self.max_length:
                raise ValueError(f"a row would hold {longest} tokens; max_model_length allows {self.max_length}")
            held = int(np.sum(-(-np.asarray(self.lengths) // self.page_size)))
            if self.pages_needed(new_B) - held > int(self.num_free):
                raise ValueError(f"out of pages: {self.pages_needed(new_B) - held} more needed, "
                                 f"{int(self.num_free)} free; pass a larger num_pages or release() finished rows")
        positions_BT, count_B = _new_positions(self.lengths, mask_BT)
        lengths_B = self.lengths + count_B
        held_B = -(-self.lengths // self.page_size)
        need_B = -(-lengths_B // self.page_size) - held_B
        first_B = jnp.cumsum(need_B) - need_B  # this row's first page in the pop order
        table = self.page_table
        rows_B = jnp.arange(b)
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

    def attend(self, layer: int, q_BTHD: Array, k_BTKD: Array, v_BTKD: Array, *, attn_mechanism: str,
               sliding_window: int | None) -> tuple[Array, tuple[Array, Array]]:
        """Writes the new keys/values into their pages, then runs ``paged`` attention (whatever the
        model's ``attn_mechanism``: only ``paged`` reads pages)."""
        kp, vp = self.cache.key_pages[layer], self.cache.value_pages[layer]
        kp = kp.at[self.page_BT, self.offset_BT].set(k_BTKD.astype(kp.dtype), mode="drop")
        vp = vp.at[self.page_BT, self.offset_BT].set(v_BTKD.astype(vp.dtype), mode="drop")
        op = OperationRegistry.create("paged", OperationMetadata())
        out = op(q_BTHD, kp.astype(q_BTHD.dtype), vp.astype(q_BTHD.dtype), page_table=self.page_table,
                 kv_lengths=self.lengths_B, causal=True, sliding_window=sliding_window)
        return out.attention_outputs, (kp, vp)

    def finish(self, updates: tp.Sequence[tuple[Array, Array]]) -> PagedKVCache:
        return dataclasses.replace(self.cache, key_pages=tuple(k for k, _ in updates),
                                   value_pages=tuple(v for _, v in updates), page_table=self.page_table,
                                   lengths=self.lengths_B, num_free=self.num_free)
