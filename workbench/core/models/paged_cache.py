"""The paged KV cache (``PagedKVCache``): ``(L, num_pages, page_size, KV, D)`` pages, a page table per row and
a free list, so a ragged batch stores no padding; and its per-call step (see :mod:`~workbench.core.models.cache`)."""

from __future__ import annotations

import dataclasses
import math
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
    check_value_dim,
    check_values,
    nbytes_of,
    new_positions,
    pytree_dataclass,
    to_stored_heads,
)
from workbench.core.operations import OperationMetadata, OperationRegistry


@pytree_dataclass(("key_pages", "value_pages", "page_table", "lengths", "free_pages", "num_free"),
                  ("page_size", "value_dim"))
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
        check_value_dim(value_dim, head_dim)
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
        return nbytes_of(self.key_pages) + nbytes_of(self.value_pages)

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
        positions_BT, count_B = new_positions(self.lengths, mask_BT)
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
        check_values(self.cache.value_dim, v_BTKD)
        k_BTKD, v_BTKD = to_stored_heads(k_BTKD, kp.shape[3]), to_stored_heads(v_BTKD, kp.shape[3])
        kp = kp.at[layer, self.page_BT, self.offset_BT].set(as_dtype(k_BTKD, kp.dtype), mode="drop")
        k_pages = as_dtype(at_layer(kp, layer), q_BTHD.dtype)
        if vp is None:
            v_pages = k_pages[..., :self.cache.value_dim]
        else:
            vp = vp.at[layer, self.page_BT, self.offset_BT].set(as_dtype(v_BTKD, vp.dtype), mode="drop")
            v_pages = as_dtype(at_layer(vp, layer), q_BTHD.dtype)
        op = OperationRegistry.create("paged", OperationMetadata())
        out = op(q_BTHD, k_pages, v_pages,
                 page_table=self.page_table, kv_lengths=self.lengths_B, causal=True, sliding_window=sliding_window,
                 **options)
        return out.attention_outputs, (kp, vp)

    def finish(self, kv: tuple[Array, Array]) -> PagedKVCache:
        return dataclasses.replace(self.cache, key_pages=kv[0], value_pages=kv[1], page_table=self.page_table,
                                   lengths=self.lengths_B, num_free=self.num_free)

