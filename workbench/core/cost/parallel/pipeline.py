"""Pipeline parallelism in a predicted step: the activations sent between stages, the share of the step the
stages run, and the bubble.

A collective-permute of the ``n D / m`` activations per microbatch and stage, forward and backward, on the
critical path; and the bubble: ``(p - 1) / (v m + p - 1)`` of the schedule idle
(:class:`~workbench.core.pipeline_schedule.PipelineConfig`'s closed form), ``f / (1 - f)`` times the pipelined
layers' busy time added to the step (:func:`bubble_s`). A MoE family's leading dense layers run outside the
pipeline, on every device, as :mod:`workbench.core.pipeline` runs them.
"""

from __future__ import annotations

from workbench.core.cost.flops import ModelShapes
from workbench.core.cost.step_counts import StepCounts, StepSizes


def stage_collectives(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """The activations each microbatch sends to the next stage (and its gradient back)."""
    if step.sizes["pp"] > 1:
        counts.comm("pipeline", "collective-permute", ("pp",), step.microbatch_tokens * shapes.hidden * step.item_bytes,
                    step.microbatches * step.virtual_stages * (2 if step.train else 1),
                    "activations between stages (PP)", True)


def staged_shares(shapes: ModelShapes, step: StepSizes) -> dict[str, float]:
    """The share of each kind's per-layer work and collectives the schedule runs (a MoE's dense prefix runs
    before it)."""
    return {"attention": step.stacked_layers / step.layers_attention,
            "mlp": 0.0 if shapes.moe or not step.layers_dense else 1.0, "experts": 1.0, "pipeline": 1.0}


def bubble_s(busy_s: float, bubble: float) -> float:
    """The idle seconds a schedule whose ``bubble`` fraction of ticks run nothing adds to ``busy_s`` of work."""
    return busy_s * bubble / (1 - bubble)
