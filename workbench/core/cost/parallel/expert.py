"""Expert parallelism in a predicted step: the routed tokens' all-to-alls and the ``ep`` token split.

Two all-to-alls of the ``n k D`` routed copies a MoE layer forward (dispatch, return), two backward, two more
under ``"full"``; with ``ep`` outside ``batch_axes`` each ``ep`` device takes ``1/ep`` of the tokens (as
:mod:`workbench.core.models.moe_alltoall` does) and an all-gather of that split follows the layer (its transpose,
a reduce-scatter, in the backward); perfectly balanced, nothing dropped. They sit between dependent matmuls:
nothing hides them.
"""

from __future__ import annotations

from workbench.core.cost.flops import ModelShapes
from workbench.core.cost.step_counts import StepCounts, StepSizes


def routed_tokens(step: StepSizes) -> float:
    """Tokens a device sends to the experts: all it holds, or its ``1/ep`` share with ``ep`` outside the batch
    axes."""
    return step.tokens if "ep" in step.batch_axes else step.tokens / step.sizes["ep"]


def moe_collectives(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """Each MoE layer's all-to-alls and, with ``ep`` outside the batch axes, its token split's gather."""
    if not step.layers_moe:
        return
    m, d, ab, remat = step.microbatches, shapes.hidden, step.item_bytes, step.remat_passes
    copies = routed_tokens(step) * shapes.topk
    all_to_alls = m * (2 + (2 + 2 * remat if step.train else 0))
    counts.comm("experts", "all-to-all", ("ep",), copies / m * d * ab, step.layers_moe * all_to_alls,
                "routed tokens (EP)", True)
    if "ep" not in step.batch_axes:
        runs = step.layers_moe * m
        counts.comm("experts", "all-gather", ("ep",), step.microbatch_tokens * d * ab, runs * (1 + remat),
                    "token split (EP)", True)
        if step.train:
            counts.comm("experts", "reduce-scatter", ("ep",), step.microbatch_tokens / step.sizes["ep"] * d * ab,
                        runs, "token split (EP)", True)
