"""The work per layer kind (``cost/work.py``) against hand counts from a tiny Llama's published shapes
(D = 64, 4 heads of 16, 2 KV heads, F = 128, 2 layers, V = 264): "How to Scale Your Model", Transformer Math
(https://jax-ml.github.io/scaling-book/transformers/): a matmul is 2 x tokens x weights, the backward twice the
forward."""

import pytest

from workbench.core.cost.flops import model_shapes
from workbench.core.cost.step_counts import StepCounts
from workbench.core.cost.work import (
    ADAMW_ACCESSES,
    attention_work,
    embedding_head_work,
    kv_heads_per_device,
    mlp_work,
    optimizer_work,
)
from workbench.core.models import ModelConfig, tiny_config
from workbench.core.models.presets import full_config

from .step_sizes import hand_step

D, HEADS, HEAD_DIM, KV, F, LAYERS, V = 64, 4, 16, 2, 128, 2, 264
TOKENS, T = 128, 16


@pytest.fixture(scope="module")
def shapes():
    return model_shapes(ModelConfig.from_hf(tiny_config("llama")))


def test_attention_flops_are_projections_and_scores(shapes):
    """A train step: 3 x (2 n (q, k, v, o weights) + 2 n T H (d_qk + d_v)) a layer."""
    step = hand_step()
    counts = StepCounts(step.sizes)
    attention_work(counts, step, shapes)
    weights = 2 * D * HEADS * HEAD_DIM + 2 * D * KV * HEAD_DIM
    per_layer = 2 * TOKENS * weights + 2 * TOKENS * T * HEADS * 2 * HEAD_DIM
    assert counts.flops["attention"] == LAYERS * 3 * per_layer
    assert counts.recomputed == 0


def test_mlp_full_remat_skips_the_output_projection(shapes):
    """remat="full" recomputes the forward but the down projection: 8 N - 2 N_down a token (N = 3 D F)."""
    step = hand_step(remat_passes=1, recompute=1, recompute_any=True)
    counts = StepCounts(step.sizes)
    groups = mlp_work(counts, step, shapes)
    assert counts.flops["mlp"] == LAYERS * TOKENS * (8 * 3 * D * F - 2 * D * F)
    assert counts.recomputed == LAYERS * TOKENS * 2 * 2 * D * F
    assert [(g.name, g.gathered_bytes, g.layers) for g in groups] == [("MLP", 3 * D * F * 2, LAYERS)]


def test_tensor_parallelism_splits_the_mlp_and_the_head(shapes):
    step = hand_step({"tp": 4})
    counts = StepCounts(step.sizes)
    mlp_work(counts, step, shapes)
    embedding_head_work(counts, step, shapes)
    assert counts.flops["mlp"] == LAYERS * 3 * 2 * TOKENS * 3 * D * F / 4
    assert counts.flops["embedding+head"] == 3 * 2 * TOKENS * D * V / 4
    gemm = next(g for g in counts.gemms if g.part == "embedding+head")
    assert (gemm.rows, gemm.inner, gemm.cols) == (TOKENS, D, V / 4)


def test_prefill_head_reads_only_the_last_positions(shapes):
    step = hand_step(task="prefill", train=False, head_tokens=8)
    counts = StepCounts(step.sizes)
    groups = embedding_head_work(counts, step, shapes)
    assert counts.flops["embedding+head"] == 2 * 8 * D * V  # one logit row a sequence, forward only
    assert [g.name for g in groups] == ["head", "embedding"]  # untied


def test_kv_heads_per_device_repeats_heads_past_the_kv_heads():
    """Llama 3 70B has 8 KV heads of 64 query heads: tp=4 holds 2 a device; tp=16 repeats each to one a device
    (as vLLM serves it); tp=3 does not divide the heads, so every device keeps all 8; MLA keeps its latent."""
    llama = model_shapes(full_config("llama-3-70b"))
    assert [kv_heads_per_device(llama, tp) for tp in (1, 4, 8, 16, 3)] == [8, 2, 1, 1, 8]
    assert kv_heads_per_device(model_shapes(full_config("deepseek-v3")), 8) == 1


def test_adamw_touches_each_shard_seven_times_and_zero_divides_by_dp():
    counts = StepCounts(hand_step().sizes)
    optimizer_work(counts, hand_step({"dp": 4}), 1000.0)
    assert counts.bytes["optimizer"] == ADAMW_ACCESSES * 1000.0 == 7000.0
    zero = StepCounts(hand_step().sizes)
    optimizer_work(zero, hand_step({"dp": 4}, zero=True), 1000.0)
    assert zero.bytes["optimizer"] == 7000.0 / 4
    inference = StepCounts(hand_step().sizes)
    optimizer_work(inference, hand_step(task="decode", train=False, decode=True), 1000.0)
    assert inference.bytes["optimizer"] == 0
