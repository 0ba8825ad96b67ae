"""Shape rules the models follow and the cost model counts, in one place below both: the KV heads a cache stores
under tensor parallelism and the slots per expert of a capacity-bounded MoE dispatch.
"""

from __future__ import annotations

import math


def stored_kv_heads(kv_heads: int, num_heads: int, ways: int) -> int:
    """Heads a cache stores when its head dimension is split ``ways`` ways: ``ways`` (each KV head repeated
    ``ways // kv_heads`` times, one head per device, as vLLM and MaxText serve GQA when tp exceeds the KV heads)
    when ``ways`` is a multiple of ``kv_heads`` above it that splits the ``num_heads`` query heads evenly;
    otherwise ``kv_heads`` (they split over ``ways``, or stay whole where they do not divide).
    MLA's one latent head is not repeated: pass ``ways=1`` for it (see
    :func:`workbench.core.models.cache.cache_decisions`).

    >>> stored_kv_heads(8, 64, 16), stored_kv_heads(8, 64, 4), stored_kv_heads(8, 64, 12)
    (16, 8, 8)
    """
    if ways > kv_heads and ways % kv_heads == 0 and num_heads % ways == 0:
        return ways
    return kv_heads


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per expert for ``tokens`` local tokens choosing ``k`` experts each (see
    :mod:`workbench.core.models.moe_alltoall`)."""
    if capacity_factor is None:
        return max(tokens, 1)
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: never drop); got {capacity_factor!r}")
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))
