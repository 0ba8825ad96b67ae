"""Data parallelism, FSDP and ZeRO-1 in a predicted step: the weights' gathers, the gradients' reductions, and
what hides them.

- FSDP: weights shard over ``fsdp`` and ``sp`` (the workbench's layout: ``('fsdp', 'sp')`` on the embedding
  dimension; experts over ``fsdp`` only). Each layer's weights are all-gathered in the forward and again in
  the backward (GSPMD inserts the gather after autodiff: the backward saves the sharded weight, not the
  gathered one, whatever the remat policy; per microbatch under a pipeline), and the gradients are
  reduce-scattered once a step;
- data parallelism: gradients all-reduced over the token axes a weight is replicated on (``dp``, and ``sp``
  for experts), after the reduce-scatter when both; with ZeRO-1 (``zero_stage=1``) the ``dp`` share is a
  reduce-scatter into the optimizer state's split and an all-gather of the updated weights (the same bytes),
  and the optimizer's traffic divides by ``dp`` (:func:`~workbench.core.cost.work.optimizer_work`).

Gathers run ahead of the layer that needs them and hide behind the forward's (the backward's) work, gradient
reductions behind the backward's; what exceeds that work is exposed, and so are the first layer's gather and
the last layer's reduction, which nothing precedes or follows (:func:`exposed_s`).
"""

from __future__ import annotations

import math
import typing as tp

from workbench.core.cost.step_counts import StepCounts, StepSizes, WeightGroup
from workbench.core.mesh import MESH_AXES


def gathered_axes(sizes: tp.Mapping[str, int], axes: tp.Sequence[str]) -> tuple[str, ...]:
    """The FSDP axes (``fsdp``, ``sp``) among ``axes`` that split a weight: a step gathers it over them."""
    return tuple(a for a in ("fsdp", "sp") if a in axes and sizes[a] > 1)


def gather_writes(step: StepSizes, axes: tp.Sequence[str]) -> int:
    """Writes of a layer's weights a step's FSDP gathers make (none where nothing gathers them)."""
    return step.gather_runs if gathered_axes(step.sizes, axes) else 0


def weight_collectives(counts: StepCounts, step: StepSizes, group: WeightGroup) -> float:
    """Count a weight group's FSDP gathers and its gradients' reduce-scatter and all-reduce (ZeRO-1's split of
    the ``dp`` share); return its shard's bytes, what the optimizer updates."""
    gathered = gathered_axes(step.sizes, group.axes)
    ways = math.prod(step.sizes[a] for a in gathered)
    gathers = step.gather_runs if group.gathers is None else group.gathers
    counts.comm(group.part, "all-gather", gathered, group.gathered_bytes, group.layers * gathers,
                f"{group.name} weights (FSDP)", group.pipelined, "gather")
    shard = group.gathered_bytes / ways
    if step.train:
        _gradient_collectives(counts, step, group, gathered, shard)
    return shard * group.layers


def _gradient_collectives(counts: StepCounts, step: StepSizes, group: WeightGroup, gathered: tuple[str, ...],
                          shard: float) -> None:
    part, layers, name = group.part, group.layers, group.name
    # sharded gradients are reduce-scattered per microbatch of an accumulation (a pipeline's once a step)
    counts.comm(part, "reduce-scatter", gathered, shard, layers * (1 if step.pipelined else step.microbatches),
                f"{name} gradients (FSDP)", role="grad")
    reduce = [a for a in MESH_AXES if a in step.token_axes and a not in group.axes]
    if step.zero and "dp" in reduce:  # ZeRO-1: the dp share reduce-scattered, the updated block gathered back
        reduce.remove("dp")
        counts.comm(part, "reduce-scatter", ("dp",), shard / step.sizes["dp"], layers, f"{name} gradients (ZeRO-1)",
                    role="grad")
        counts.comm(part, "all-gather", ("dp",), shard, layers, f"{name} updated weights (ZeRO-1)")
    counts.comm(part, "all-reduce", reduce, shard, layers, f"{name} gradients (data parallel)", role="grad")


def exposed_s(gathers_s: float, gather_runs: int, grads_s: float, grad_runs: int, forward_s: float,
              backward_s: float, *, train: bool, overlap: bool) -> float:
    """The seconds of the FSDP gathers (``gathers_s`` over ``gather_runs``) and gradient reductions the work does
    not hide: the first gather, the last reduction, and what outlasts the forward's (backward's) ``forward_s``
    (``backward_s``); all of them without ``overlap``."""
    if not overlap:
        return gathers_s + grads_s
    first = gathers_s / gather_runs if gathers_s else 0.0
    last = grads_s / grad_runs if grads_s else 0.0
    forward_gathers = gathers_s / 2 if train else gathers_s
    return (first + last + max(0.0, forward_gathers - forward_s)
            + max(0.0, gathers_s - forward_gathers + grads_s - backward_s))
