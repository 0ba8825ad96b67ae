"""``paged``: decode and chunked-prefill attention over a paged KV cache (vLLM-style page table).

Its call differs from the other attention implementations::

    impl(query, key_pages, value_pages, *, page_table, kv_lengths, causal=True,
         sliding_window=None, logits_soft_cap=None, softmax_scale=None)

``query (B, T, H, D)``; ``key_pages (num_pages, page_size, KV, D)``, ``value_pages (num_pages, page_size,
KV, Dv)`` (``Dv = D`` but for MLA's latent values, ``value_head_dim``; output ``(B, T, H, Dv)``);
``page_table (B, pages_per_seq)`` int: sequence ``b``'s keys ``j * page_size + i`` live at
``key_pages[page_table[b, j], i]``; ``kv_lengths (B,)``: keys at ``>= kv_lengths[b]`` are
padding. The queries are the last ``T`` positions of each sequence (bottom-right aligned at
``kv_lengths[b]``, as everywhere): ``T = 1`` to decode, ``T > 1`` for a chunk of prefill whose
keys are already in the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.operations.attention.common import (
    CAUSAL,
    GQA,
    KV_LENGTHS,
    SINKS,
    SLIDING_WINDOW,
    SOFT_CAP,
    VALUE_DIM,
    Array,
    AttentionCall,
    AttentionImplMixin,
    SoftmaxCarry,
    keys_to_tiles,
    queries_to_tiles,
    tile_finish,
    tile_update,
)
from workbench.core.operations.base import AttentionOutput, Capabilities, OperationImpl, OperationRegistry

PAGED_KV = "paged_kv"  # takes (query, key_pages, value_pages, page_table=, kv_lengths=), not contiguous K/V


def _check_pages(query, key_pages, value_pages, page_table) -> None:
    """Static shape checks (page table entries themselves are checked only when concrete)."""
    for name, x in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"paged: {name} must be 4-D; got shape {getattr(x, 'shape', type(x))}. query is "
                             f"(B, T, H, D), key_pages and value_pages (num_pages, page_size, KV, D)")
    if key_pages.shape[:3] != value_pages.shape[:3] or key_pages.shape[3] != query.shape[3]:
        raise ValueError(f"paged: key_pages {key_pages.shape} and value_pages {value_pages.shape} must be "
                         f"(num_pages, page_size, KV, D) and (num_pages, page_size, KV, Dv) with D={query.shape[3]} "
                         f"from query {query.shape}")
    is_int = jnp.issubdtype(page_table.dtype, jnp.integer)
    if page_table.ndim != 2 or page_table.shape[0] != query.shape[0] or not is_int:
        raise ValueError(f"paged: page_table must be an int array (B, pages_per_seq) with B={query.shape[0]}; got "
                         f"{page_table.dtype} {page_table.shape}")


def _check_concrete(page_table: Array, kv_lengths: Array, num_pages: int, page_size: int) -> None:
    """Lengths and the page table entries in use, when their values are known (not under ``jit``)."""
    if isinstance(page_table, jax.core.Tracer) or isinstance(kv_lengths, jax.core.Tracer):
        return
    table, lengths = np.asarray(page_table), np.asarray(kv_lengths)
    capacity = table.shape[1] * page_size
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > capacity:
        raise ValueError(f"paged: kv_lengths {lengths.tolist()} must lie in [0, pages_per_seq * page_size] = "
                         f"[0, {capacity}]")
    used = np.arange(table.shape[1])[None, :] * page_size < lengths[:, None]
    bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
    if len(bad):
        b, j = bad[0]
        raise ValueError(f"paged: page_table[{b}, {j}] = {table[b, j]} is not a page index in [0, {num_pages}) "
                         f"but sequence {b} (length {lengths[b]}) uses it")


def _page_range(call: AttentionCall, page_size: int, pages_per_seq: int) -> tuple[Array, Array]:
    """The pages any sequence can see: none past the longest length, none before the earliest window."""
    vis = call.visibility
    hi = jnp.minimum(-(-jnp.max(vis.kv_lengths) // page_size), pages_per_seq)
    if vis.sliding_window is None:
        return jnp.zeros((), hi.dtype), hi
    first_key = jnp.maximum(jnp.min(vis.kv_lengths) - vis.q_len - vis.sliding_window + 1, 0)
    return first_key // page_size, hi


def paged_attention(call: AttentionCall, key_pages: Array, value_pages: Array, page_table: Array) -> Array:
    """Online softmax over the pages of ``page_table``, one page (gathered per sequence) at a time."""
    b, t, _, h, kv, _ = call.shape
    page_size = key_pages.shape[1]
    q_BKGTD, q_idx = queries_to_tiles(call.query, kv), jnp.arange(t)

    def step(j, carry):
        pages_B = page_table[:, j]
        # mode="clip": entries past a sequence's length may hold anything (-1, say); those keys are invisible
        k_BPKD = jnp.take(key_pages, pages_B, axis=0, mode="clip")
        v_BPKD = jnp.take(value_pages, pages_B, axis=0, mode="clip")
        return tile_update(carry, q_BKGTD, keys_to_tiles(k_BPKD), keys_to_tiles(v_BPKD), call, q_idx,
                           j * page_size + jnp.arange(page_size))

    lo, hi = _page_range(call, page_size, page_table.shape[1])
    carry = jax.lax.fori_loop(lo, hi, step, SoftmaxCarry.init(b, kv, h // kv, t, call.value_dim, call.query.dtype))
    return tile_finish(carry, call.query.dtype, call.sinks_tiles())


@OperationRegistry.register
class PagedAttention(AttentionImplMixin, OperationImpl):
    """Attention over a paged KV cache, for decoding and chunked prefill.

    Not a drop-in for the contiguous implementations: call it as
    ``impl(query, key_pages, value_pages, *, page_table, kv_lengths, causal=True,
    sliding_window=None, logits_soft_cap=None)`` (see the module docstring). Reads only the
    pages some sequence can see, one page at a time; never builds the contiguous cache.
    """

    capabilities = Capabilities(
        features=frozenset({PAGED_KV, CAUSAL, SLIDING_WINDOW, SOFT_CAP, KV_LENGTHS, GQA, SINKS, VALUE_DIM}),
        description="paged KV cache (decode, chunked prefill); its own signature: impl(query, key_pages, "
                    "value_pages, *, page_table, kv_lengths, causal=True, sliding_window=None, logits_soft_cap=None)")

    @classmethod
    def get_impl_name(cls):
        return "paged"

    def forward_native(self, query, key_pages, value_pages, *, page_table, kv_lengths, causal=True,
                       sliding_window=None, logits_soft_cap=None, softmax_scale=None, sinks=None,
                       return_weights=False) -> AttentionOutput:
        if kv_lengths is None:
            raise ValueError("paged: kv_lengths (B,) is required: the number of valid keys of each sequence")
        page_table = jnp.asarray(page_table)
        _check_pages(query, key_pages, value_pages, page_table)
        num_pages, page_size, kv, d = key_pages.shape
        # the logical contiguous cache, as shapes only: prepare checks them, nothing builds them
        logical = (query.shape[0], page_table.shape[1] * page_size, kv)
        keys = jax.ShapeDtypeStruct((*logical, d), key_pages.dtype)
        values = jax.ShapeDtypeStruct((*logical, value_pages.shape[3]), value_pages.dtype)
        call = self.prepare(query, keys, values, causal=causal, sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap, kv_lengths=kv_lengths, softmax_scale=softmax_scale,
                            sinks=sinks, return_weights=return_weights)
        _check_concrete(page_table, call.visibility.kv_lengths, num_pages, page_size)
        out = paged_attention(call, key_pages, value_pages, page_table)
        return AttentionOutput(out, None, kernel_path="paged/native")
