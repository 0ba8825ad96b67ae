"""Sequence parallelism (ring attention) in a predicted step: its passes round the ``sp`` ring and what hides them.

Each layer passes its K and V around the ``sp`` ring, ``sp - 1`` collective-permutes forward and twice that
backward (K, V and their gradients), and again in a recompute; they hide behind the attention kernels
(:func:`exposed_s`). Decode, with the cache split over ``sp``, all-reduces each layer's partial attention
outputs (with their softmax statistics, float32), on the critical path.
"""

from __future__ import annotations

from workbench.core.cost.flops import ModelShapes
from workbench.core.cost.step_counts import StepCounts, StepSizes


def kv_ring_elements(shapes: ModelShapes, tp_size: int) -> float:
    """K and V elements a token a device passes round the ring (its ``tp`` share of the heads; MLA's latent
    whole)."""
    return shapes.kv_ring / (tp_size if shapes.kv_split else 1)


def attention_collectives(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """Each attention layer's ring passes (train, prefill) or its partial outputs' all-reduce (decode)."""
    sp, tp_size, layers = step.sizes["sp"], step.sizes["tp"], step.layers_attention
    if not step.decode:
        ring = step.microbatches * (sp - 1) * (1 + (2 + step.remat_passes if step.train else 0))
        counts.comm("attention", "collective-permute", ("sp",),
                    step.microbatch_tokens * kv_ring_elements(shapes, tp_size) * step.item_bytes, layers * ring,
                    "K, V round the ring (SP)", True, "ring")
    else:
        heads = shapes.heads / tp_size
        counts.comm("attention", "all-reduce", ("sp",), step.sequences * heads * (shapes.score_v + 2) * 4, layers,
                    "partial attention outputs (SP)", True)


def exposed_s(ring_s: float, attention_s: float, *, overlap: bool) -> float:
    """The seconds of the ring passes (``ring_s``) the attention kernels (``attention_s``) do not hide; all of
    them without ``overlap``."""
    return max(0.0, ring_s - attention_s) if overlap else ring_s
