"""KV caches: a contiguous one (``KVCache``, :mod:`~workbench.core.models.contiguous_cache`), a paged one with a
page table and a free list (``PagedKVCache``, :mod:`~workbench.core.models.paged_cache`) and StreamingLLM's
(``StreamingKVCache``, :mod:`~workbench.core.models.streaming_cache`), all three importable from here. All are
pytrees passed to the model and returned updated. This module holds what they share besides the helpers of
:mod:`~workbench.core.models.cache_base`: the layout a config caches (:func:`kv_layout`), its bytes
(:func:`cache_footprint`) and its dimensions on a mesh (:func:`cache_decisions`).

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

import jax.numpy as jnp

from workbench.core.axes import BATCH, KV_HEAD, KV_HEAD_DIM, KV_LENGTH, MODE_DECODE, DimDecision, PartitionAxis
from workbench.core.models.cache_base import INDEX, index32
from workbench.core.models.config import ModelConfig
from workbench.core.models.contiguous_cache import KVCache
from workbench.core.models.paged_cache import PagedKVCache
from workbench.core.models.streaming_cache import StreamingKVCache, check_streaming_attention
from workbench.core.shapes import stored_kv_heads

__all__ = ["INDEX", "KV_CACHE_AXES", "KV_CACHE_MODE", "CacheFootprint", "KVCache", "KVLayout", "PagedKVCache",
           "StreamingKVCache", "cache_decisions", "cache_footprint", "check_streaming_attention", "index32",
           "kv_layout", "stored_kv_heads"]

# A KV cache's dimensions, resolved in decode mode (it exists only while generating, and prefill writes the
# same arrays decode reads).
KV_CACHE_AXES = (BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)
KV_CACHE_MODE = MODE_DECODE


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
