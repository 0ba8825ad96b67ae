"""Tensor parallelism (Megatron, no sequence parallelism) in a predicted step: its all-reduces and what hides them.

An all-reduce of the ``n D`` activations after attention's output projection and after the MLP's (a MoE layer's
output likewise), the same two in the backward (the input gradients of the column-parallel projections, summed
before one all-reduce), and the recompute's (the attention one only: a dense MLP's output projection is not
recomputed, :mod:`~workbench.core.cost.work`); the embedding's vocabulary-split lookup and the head's input
gradient one each. They sit between dependent matmuls, on the critical path, unless ``tp_overlap`` (collective
matmul, async TP) hides them behind the matmuls (:func:`exposed_s`).
"""

from __future__ import annotations

from workbench.core.cost.flops import ModelShapes
from workbench.core.cost.step_counts import StepCounts, StepSizes


def _layer_runs(step: StepSizes, recomputed: bool) -> int:
    """All-reduces of a layer's output a step runs: forward, backward and, if ``recomputed``, a recompute's."""
    return step.microbatches * (1 + (1 + (step.remat_passes if recomputed else 0) if step.train else 0))


def _activation_bytes(step: StepSizes, shapes: ModelShapes) -> float:
    return step.microbatch_tokens * shapes.hidden * step.item_bytes


def attention_all_reduces(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """The all-reduce of each attention layer's output projection."""
    counts.comm("attention", "all-reduce", ("tp",), _activation_bytes(step, shapes),
                step.layers_attention * _layer_runs(step, True), "attention output (TP)", True, "tp")


def mlp_all_reduces(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """The all-reduce of each dense MLP's output (recomputed only where a post-MLP norm reads it)."""
    counts.comm("mlp", "all-reduce", ("tp",), _activation_bytes(step, shapes),
                step.layers_dense * _layer_runs(step, shapes.recompute_down), "MLP output (TP)", True, "tp")


def moe_all_reduces(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """The all-reduce of each MoE layer's output."""
    counts.comm("experts", "all-reduce", ("tp",), _activation_bytes(step, shapes),
                step.layers_moe * _layer_runs(step, True), "MoE output (TP)", True, "tp")


def embedding_head_all_reduces(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> None:
    """The vocabulary-split embedding lookup's all-reduce, and the head's input gradient's in a train step."""
    counts.comm("embedding+head", "all-reduce", ("tp",), step.tokens * shapes.hidden * step.item_bytes,
                1 + step.train, "embedding lookup, head input (TP)", role="tp")


def exposed_s(tp_s: float, matmul_s: float, *, hidden: bool) -> float:
    """The seconds of the TP all-reduces (``tp_s``) on the critical path: what outlasts the matmuls
    (``matmul_s``) if ``hidden`` behind them (collective matmul), else all of them."""
    return max(0.0, tp_s - matmul_s) if hidden else tp_s
