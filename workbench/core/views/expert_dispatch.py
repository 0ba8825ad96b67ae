"""What expert parallelism does with a batch, layer by layer: tokens per expert, slots, dropped copies.

The ``alltoall`` strategy (:mod:`workbench.core.models.moe_alltoall`) dispatches each device's own tokens
into ``C`` slots per expert; which copies it drops depends on the router's choices and on how the batch
is split over the devices. :func:`dispatch_report` recomputes that from a model's router logits for a
batch, a mesh (or none) and a capacity factor, without running any collective, for the explorer, the
module tree and notebooks.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from workbench.core.axes import PartitionAxis
from workbench.core.models.block import ACTIVATION_AXES
from workbench.core.models.moe_alltoall import capacity, dispatch_slots, token_split
from workbench.core.views import explore


@dataclasses.dataclass(frozen=True)
class DispatchReport:
    """One batch through every MoE layer: ``groups`` token shares dispatched apart (one per device holding
    distinct tokens), each of ``share`` tokens with ``slots`` slots per expert; per layer the tokens routed
    to each expert ``(L, E)`` and the copies dropped ``(L,)``, out of ``copies`` per layer."""

    capacity_factor: float | None
    groups: int
    share: int
    slots: int
    copies: int
    tokens_per_expert_LE: np.ndarray
    dropped_L: np.ndarray

    @property
    def dropped_fraction(self) -> float:
        return float(self.dropped_L.sum()) / (self.copies * len(self.dropped_L))

    @property
    def imbalance_L(self) -> np.ndarray:
        """Per layer, the busiest expert's tokens over the mean (1 is perfect balance)."""
        load = self.tokens_per_expert_LE.astype(float)
        return load.max(1) / np.maximum(load.mean(1), 1e-9)

    def __str__(self) -> str:
        cf = "no drop" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        return (f"{cf}: {self.groups} token shares of {self.share}, {self.slots} slots per expert each; "
                f"{self.dropped_fraction:.1%} of {self.copies * len(self.dropped_L):,} copies dropped")


def token_groups(batch: int, length: int, mesh: Mesh | None, partition_axis: PartitionAxis | None = None
                 ) -> tuple[int, int, int]:
    """``(shards, split, share)``: the batch's tokens fall into ``shards`` contiguous batch shards, each split
    ``split`` ways over ``ep`` (when the batch is not already split over it) into shares of ``share`` tokens
    (the last one shorter when ``ep`` does not divide a shard), as the alltoall strategy dispatches them."""
    n = batch * length
    if mesh is None:
        return 1, 1, n
    pa = partition_axis or PartitionAxis()
    sizes = dict(mesh.shape)
    axes, split = token_split(pa.resolve(ACTIVATION_AXES, shape=(batch, length, 1), mesh=mesh), sizes,
                              pa.expert_parallel_axis)
    shards = math.prod(sizes[a] for a in axes)
    return shards, split, -(-(n // shards) // split)


def dispatch_report(model: tp.Any, input_ids: tp.Any, attention_mask: tp.Any = None, *, mesh: Mesh | None = None,
                    partition_axis: PartitionAxis | None = None, capacity_factor: float | None = None
                    ) -> DispatchReport:
    """Tokens per expert and dropped copies per MoE layer of a live ``model`` for ``input_ids (B, T)`` under
    the alltoall dispatch on ``mesh`` at ``capacity_factor`` (None: never drop). Every token is dispatched,
    padding too, as in the model."""
    ids = jnp.asarray(input_ids, jnp.int32)
    out = model(ids, attention_mask)
    if out.router_logits is None:
        raise ValueError(f"this {model.config.model_type} model has no mixture-of-experts layers to dispatch")
    b, t = ids.shape
    shards, split, share = token_groups(b, t, mesh, partition_axis)
    k, num_experts = model.config.num_experts_per_tok, out.router_logits.shape[-1]
    slots = capacity(share, k, num_experts, capacity_factor)
    counts, dropped = [], []
    for layer, logits_NE in enumerate(out.router_logits):
        experts_NK = np.asarray(model.layers[layer].mlp.choose(logits_NE)[1])
        dropped.append(dropped_copies(experts_NK, shards, share, slots, num_experts))
        counts.append(np.bincount(experts_NK.reshape(-1), minlength=num_experts))
    return DispatchReport(capacity_factor, shards * split, share, slots, b * t * k, np.stack(counts),
                          np.asarray(dropped))


def dropped_copies(experts_NK: np.ndarray, shards: int, share: int, slots: int, num_experts: int) -> int:
    """Copies the alltoall dispatch drops: the ``N`` tokens in ``shards`` contiguous batch shards, each cut
    into shares of ``share`` tokens dispatched apart with ``slots`` slots per expert."""
    n = experts_NK.shape[0]
    per_shard, lost = n // shards, 0
    for start in range(0, n, per_shard):
        for first in range(start, start + per_shard, share):
            part = jnp.asarray(experts_NK[first:min(first + share, start + per_shard)])
            lost += int((~np.asarray(dispatch_slots(part, num_experts, slots)[1])).sum())
    return lost


@dataclasses.dataclass(frozen=True)
class ExpertParallelSummary:
    """What the explorer shows of a MoE model's experts on a layout: the forward's collectives and matmul
    FLOPs per device under ``alltoall`` (at ``capacity_factor``) and under ``dense``, and, for a live model,
    the dispatch of a sample batch (None for an abstract model: no router to run)."""

    capacity_factor: float | None
    alltoall: tp.Any  # explore.StepCollectives
    dense: tp.Any
    dispatch: DispatchReport | None

    @property
    def all_to_alls(self) -> list[tp.Any]:
        return [r for r in self.alltoall.records if r.kind == "all-to-all"]

    @property
    def flops_vs_dense(self) -> float:
        return self.alltoall.matmul_flops / self.dense.matmul_flops


def expert_parallel_summary(model: tp.Any, layout: tp.Any, *, batch: tuple[int, int] = (8, 64),
                            capacity_factor: float | None = 1.25, seed: int = 0,
                            cluster: tp.Any = None) -> ExpertParallelSummary:
    """Compile the forward of ``model`` on ``layout`` with the ``alltoall`` and ``dense`` strategies (for a
    virtual ``cluster``, on its devices) and, for a live model, dispatch a batch of random token ids
    (``seed``) at ``capacity_factor``."""
    import functools

    import jax

    step = (explore.step_collectives if cluster is None else
            functools.partial(explore.cluster_step_collectives, cluster=cluster))
    a2a = model.with_options(moe_strategy="alltoall", capacity_factor=capacity_factor)
    alltoall = step(a2a, layout, kind="forward", batch=batch)
    dense = step(model.with_options(moe_strategy="dense"), layout, kind="forward", batch=batch)
    report = None
    if all(isinstance(x, jax.Array) for x in jax.tree.leaves(model)):  # live weights: an abstract model routes nothing
        ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, batch)
        report = dispatch_report(model, ids, mesh=layout.mesh, partition_axis=layout.partition_axis,
                                 capacity_factor=capacity_factor)
    return ExpertParallelSummary(capacity_factor, alltoall, dense, report)
