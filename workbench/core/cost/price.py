"""One entry to the step model: :func:`price` a :class:`~workbench.core.plan.Plan` for a model on a cluster.

The advisor's candidates, the explorer, the recipe readers and the published runs price through it, so a plan is
priced one way wherever it is shown.
"""

from __future__ import annotations

import typing as tp

from workbench.core.cost.predicted import predict_step
from workbench.core.cost.step import StepTime
from workbench.core.hardware.cluster import Cluster
from workbench.core.plan import Plan


def price(plan: Plan, model: tp.Any, cluster: Cluster, batch: tuple[int, int], task: str = "train", *,
          kv_length: int | None = None, efficiency: float | None = None, overlap: bool = True,
          causal: bool = True, ring_overlap: bool = True) -> StepTime:
    """The predicted time of one ``task`` step of ``model`` (a model or its config) run as ``plan`` on ``cluster``,
    for a global ``batch = (sequences, length)`` (:func:`~workbench.core.cost.predicted.predict_step` says what
    each term is and what ``kv_length``, ``efficiency``, ``overlap``, ``causal`` and ``ring_overlap`` change)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan is a workbench.core.plan.Plan; got {type(plan).__name__}")
    config = getattr(model, "config", model)
    return predict_step(config, cluster, dict(plan.mesh_shape), batch=batch, task=task, remat=plan.remat,
                        pipeline=plan.pipeline, kv_length=kv_length, dtype=plan.dtype, efficiency=efficiency,
                        overlap=overlap, batch_axes=plan.batch_axes, zero_stage=plan.zero_stage,
                        grad_accumulation=plan.grad_accumulation, recompute=plan.recompute,
                        capacity_factor=plan.capacity_factor, tp_overlap=plan.tp_overlap, causal=causal,
                        experts_fsdp=plan.experts_fsdp, ring_overlap=ring_overlap, attention=plan.attention,
                        vocab_tiles=plan.vocab_tiles)


__all__ = ["price"]
