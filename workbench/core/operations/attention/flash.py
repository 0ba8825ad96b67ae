"""``flash``: blockwise attention with an online softmax, O(T x block) memory instead of O(T x S).

Queries go block by block (``lax.scan``); each query block folds key blocks into a
:class:`SoftmaxCarry` (an inner ``lax.scan``). Tiles that no query can see by position
(above the causal diagonal, outside the sliding window, past ``kv_lengths``) are skipped
with ``lax.cond``. The tile step is ``jax.checkpoint``-ed, so the backward pass recomputes
tiles instead of storing their ``(tq, tk)`` probabilities.

Block sizes come from ``OperationMetadata(options={"block_q": ..., "block_k": ...})``.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp

from workbench.core.checks import positive_int
from workbench.core.operations.attention.common import (
    ALL_FEATURES,
    RETURN_WEIGHTS,
    Array,
    AttentionCall,
    AttentionImplMixin,
    SoftmaxCarry,
    Visibility,
    keys_to_tiles,
    queries_to_tiles,
    tile_finish,
    tile_update,
)
from workbench.core.operations.base import AttentionOutput, Capabilities, OperationImpl, OperationRegistry

DEFAULT_BLOCK_Q = 128  # fastest of 64..512 x 256..512 on CPU at T=2048 (causal); any size is correct
DEFAULT_BLOCK_K = 512


@OperationRegistry.register
class FlashAttention(AttentionImplMixin, OperationImpl):
    """Online-softmax attention over key blocks; never materialises the ``(B, H, T, S)`` logits."""

    capabilities = Capabilities(
        features=ALL_FEATURES - {RETURN_WEIGHTS},
        description="blockwise online softmax (lax.scan over query and key blocks); O(T x block) memory, "
                    "skips fully masked causal/window tiles; options block_q, block_k")

    @classmethod
    def get_impl_name(cls):
        return "flash", "chunked", "blockwise"

    def block_sizes(self, t: int, s: int) -> tuple[int, int]:
        """``(block_q, block_k)`` from the options, clipped to ``(T, S)``."""
        return option_block_sizes("flash", self.metadata.options, t, s)

    def forward_native(self, query, key, value, **kwargs) -> AttentionOutput:
        call = self.prepare(query, key, value, **kwargs)
        _, t, s, *_ = call.shape
        out = flash_attention(call, *self.block_sizes(t, s))
        return AttentionOutput(out, None, kernel_path="flash/native")


def option_block_sizes(impl: str, options: tp.Mapping[str, tp.Any], t: int, s: int, default_q: int = DEFAULT_BLOCK_Q,
                       default_k: int = DEFAULT_BLOCK_K) -> tuple[int, int]:
    """``(block_q, block_k)`` from an implementation's ``options`` (or the defaults), clipped to ``(T, S)``."""
    sizes = {"block_q": options.get("block_q", default_q), "block_k": options.get("block_k", default_k)}
    for name, size in sizes.items():
        positive_int(f"{impl}: option {name}", size)
    return min(sizes["block_q"], t), min(sizes["block_k"], s)


def flash_attention(call: AttentionCall, block_q: int, block_k: int) -> Array:
    """Output BTHD of ``call``, ``block_q`` queries by ``block_k`` keys at a time."""
    b, t, s, h, kv, _ = call.shape
    nq, nk = -(-t // block_q), -(-s // block_k)
    call, varying = all_varying(call)
    may_see = tile_filter(call.visibility, block_q, block_k)
    call = pad_call(call, nq * block_q, nk * block_k)
    # Scale the queries once rather than every (block_q, block_k) tile of logits.
    call = dataclasses.replace(call, query=call.query * jnp.asarray(call.scale, call.query.dtype), scale=1.0)
    sees_all = tile_unmasked(call.visibility, block_q, block_k)
    # Tiles every query of which sees every key skip the mask arithmetic.
    unmasked = dataclasses.replace(call, visibility=Visibility(call.visibility.q_len, call.visibility.kv_len))
    q_NBKGtD = split_blocks(queries_to_tiles(call.query, kv), nq, axis=3)
    k_NBKsD, v_NBKsD = (split_blocks(keys_to_tiles(x), nk, axis=2) for x in (call.key, call.value))
    q_starts, k_starts = jnp.arange(nq) * block_q, jnp.arange(nk) * block_k

    def query_block(_, xs):
        q_BKGTD, q_start = xs
        q_idx = q_start + jnp.arange(block_q)

        @jax.checkpoint
        def key_block(carry, ys):
            k_BKSD, v_BKSD, k_start = ys
            k_idx = k_start + jnp.arange(block_k)
            update = lambda c: tile_update(c, q_BKGTD, k_BKSD, v_BKSD, call, q_idx, k_idx)
            if may_see is None:
                return update(carry), None
            if sees_all is None:
                return jax.lax.cond(may_see(q_start, k_start), update, lambda c: c, carry), None
            branch = jnp.where(sees_all(q_start, k_start), 2, may_see(q_start, k_start).astype(jnp.int32))
            full = lambda c: tile_update(c, q_BKGTD, k_BKSD, v_BKSD, unmasked, q_idx, k_idx)
            return jax.lax.switch(branch, [lambda c: c, update, full], carry), None

        init = SoftmaxCarry.init(b, kv, h // kv, block_q, call.value_dim, call.query.dtype)
        if varying:  # inside shard_map the carry varies as its inputs do
            init = jax.lax.pcast(init, varying, to="varying")
        carry, _ = jax.lax.scan(key_block, init, (k_NBKsD, v_NBKsD, k_starts))
        return None, tile_finish(carry, call.query.dtype, call.sinks_tiles())

    _, o_NBtHD = jax.lax.scan(query_block, None, (q_NBKGtD, q_starts))
    return o_NBtHD.swapaxes(0, 1).reshape(b, nq * block_q, h, call.value_dim)[:, :t]


def all_varying(call: AttentionCall) -> tuple[AttentionCall, tuple[str, ...]]:
    """Inside ``shard_map``: ``call`` with every array varying over each manual mesh axis any of them varies over,
    and those axes (``()`` outside ``shard_map``). Cast here, once, an array replicated over an axis (a bias
    shared by a sequence's devices) gets its gradient summed here, not by a psum inside a tile's ``lax.cond``
    that the devices skipping the tile never join."""
    vis = call.visibility
    arrays = {"query": call.query, "key": call.key, "value": call.value, "bias": call.bias, "sinks": call.sinks}
    masks = {"kv_lengths": vis.kv_lengths, "q_segment_ids": vis.q_segment_ids,
             "kv_segment_ids": vis.kv_segment_ids, "mask": vis.mask}
    vma = lambda x: jax.typeof(x).manual_axis_type.varying
    axes = tuple(sorted(set().union(*(vma(x) for x in (*arrays.values(), *masks.values()) if x is not None))))
    if not axes:
        return call, ()

    def cast(x: Array | None) -> Array | None:
        missing = tuple(a for a in axes if x is not None and a not in vma(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    vis = dataclasses.replace(vis, **{n: cast(x) for n, x in masks.items()})
    return dataclasses.replace(call, visibility=vis, **{n: cast(x) for n, x in arrays.items()}), axes


def tile_filter(vis: Visibility, block_q: int, block_k: int) -> tp.Callable[[Array, Array], Array] | None:
    """``may_see(q_start, k_start)``: False only if no query of the tile sees a key of it by position.

    Conservative over the batch (max/min of ``kv_lengths``); None when every tile may see keys.
    """
    window = vis.sliding_window
    if not (vis.causal or window is not None or vis.kv_lengths is not None):
        return None
    t = vis.q_len
    lengths = jnp.asarray([vis.kv_len]) if vis.kv_lengths is None else vis.kv_lengths
    l_max, l_min = jnp.max(lengths), jnp.min(lengths)

    def may_see(q_start: Array, k_start: Array) -> Array:
        ok = k_start < l_max
        if vis.causal or window is not None:
            last_q_pos = l_max - t + jnp.minimum(q_start + block_q, t) - 1  # padded queries do not count
            ok &= k_start <= last_q_pos
        if window is not None:
            ok &= k_start + block_k - 1 > l_min - t + q_start - window
        return ok

    return may_see


def tile_unmasked(vis: Visibility, block_q: int, block_k: int) -> tp.Callable[[Array, Array], Array] | None:
    """``sees_all(q_start, k_start)``: True only if every query of the tile sees every key of it.

    Only for visibility made of positions alone (causal, window, lengths); None otherwise.
    """
    if vis.q_segment_ids is not None or vis.mask is not None:
        return None
    if not (vis.causal or vis.sliding_window is not None or vis.kv_lengths is not None):
        return None
    t, window = vis.q_len, vis.sliding_window
    lengths = jnp.asarray([vis.kv_len]) if vis.kv_lengths is None else vis.kv_lengths
    l_max, l_min = jnp.max(lengths), jnp.min(lengths)

    def sees_all(q_start: Array, k_start: Array) -> Array:
        k_last = k_start + block_k - 1
        ok = k_last < l_min
        if vis.causal or window is not None:
            ok &= k_last <= l_min - t + q_start  # the first query of the tile sees the last key
        if window is not None:
            ok &= k_start > l_max - t + q_start + block_q - 1 - window  # the last query sees the first key
        return ok

    return sees_all


def pad_call(call: AttentionCall, t_pad: int, s_pad: int) -> AttentionCall:
    """``call`` with queries padded to ``t_pad`` and keys to ``s_pad``; padded keys are invisible.

    Positions stay those of the unpadded call (``Visibility.q_len``/``kv_len`` unchanged);
    padded queries are sliced off the output.
    """
    b, t, s, *_ = call.shape
    if (t, s) == (t_pad, s_pad):
        return call
    vis = call.visibility
    lengths = jnp.full((b,), s, jnp.int32) if vis.kv_lengths is None and s_pad > s else vis.kv_lengths
    vis = dataclasses.replace(vis, kv_lengths=lengths,
                              q_segment_ids=pad_axes(vis.q_segment_ids, {1: t_pad}),
                              kv_segment_ids=pad_axes(vis.kv_segment_ids, {1: s_pad}),
                              mask=pad_axes(vis.mask, {2: t_pad, 3: s_pad}))
    return dataclasses.replace(call, query=pad_axes(call.query, {1: t_pad}), key=pad_axes(call.key, {1: s_pad}),
                               value=pad_axes(call.value, {1: s_pad}), visibility=vis,
                               bias=pad_axes(call.bias, {2: t_pad, 3: s_pad}))


def pad_axes(x: Array | None, sizes: dict[int, int]) -> Array | None:
    """Zero-pad the given axes of ``x`` to ``sizes``; broadcast (size 1) axes stay as they are."""
    if x is None:
        return None
    widths = [(0, sizes[i] - n if i in sizes and n != 1 else 0) for i, n in enumerate(x.shape)]
    return jnp.pad(x, widths)


def split_blocks(x: Array, n: int, axis: int) -> Array:
    """Split ``axis`` (length ``n * blk``) into ``n`` blocks, stacked first for ``lax.scan``."""
    shape = x.shape
    x = x.reshape(*shape[:axis], n, shape[axis] // n, *shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)
