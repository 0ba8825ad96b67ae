"""TP, SP, EP and PP collectives (``cost/parallel/``) against hand counts: "How to Scale Your Model", Training
(Megatron: one all-reduce of the n D activations after attention and after the MLP, the same in the backward),
Transformer Math (MoE: dispatch and return all-to-alls) and the pipeline's bubble (p - 1) / (m + p - 1)."""

import pytest

from workbench.core.cost.flops import model_shapes
from workbench.core.cost.parallel import expert, pipeline, sequence, tensor
from workbench.core.cost.step_counts import StepCounts
from workbench.core.models import ModelConfig, tiny_config

from ..step_sizes import hand_step

D = 64


@pytest.fixture(scope="module")
def llama():
    return model_shapes(ModelConfig.from_hf(tiny_config("llama")))  # D 64, 2 KV heads of 16


def _runs(counts):
    """Runs by (kind, axes, bytes), summed over the layer kinds and names."""
    runs: dict = {}
    for (_, kind, axes, nbytes, _), (count, _, _) in counts.comms.items():
        runs[kind, axes, nbytes] = runs.get((kind, axes, nbytes), 0) + count
    return runs


def test_megatron_all_reduces_two_a_layer_forward_and_two_backward(llama):
    step = hand_step({"tp": 4})
    counts = StepCounts(step.sizes)
    tensor.attention_all_reduces(counts, step, llama)
    tensor.mlp_all_reduces(counts, step, llama)
    assert _runs(counts) == {("all-reduce", ("tp",), 128 * D * 2): 2 * 2 + 2 * 2}  # 2 layers x (attention + MLP)
    remat = hand_step({"tp": 4}, remat_passes=1)
    counts = StepCounts(remat.sizes)
    tensor.attention_all_reduces(counts, remat, llama)
    tensor.mlp_all_reduces(counts, remat, llama)
    assert _runs(counts) == {("all-reduce", ("tp",), 128 * D * 2): 2 * 3 + 2 * 2}  # the MLP's is not recomputed
    assert tensor.exposed_s(5.0, 3.0, hidden=True) == 2.0 and tensor.exposed_s(5.0, 3.0, hidden=False) == 5.0


def test_ring_attention_passes_kv_sp_minus_one_times_forward_and_twice_that_backward(llama):
    step = hand_step({"sp": 4}, tokens=32)
    counts = StepCounts(step.sizes)
    sequence.attention_collectives(counts, step, llama)
    kv = 2 * 2 * 16  # K and V of 2 heads of 16, a token
    assert _runs(counts) == {("collective-permute", ("sp",), 32 * kv * 2): 2 * 3 * (1 + 2)}
    assert sequence.exposed_s(5.0, 3.0, overlap=True) == 2.0 and sequence.exposed_s(5.0, 9.0, overlap=True) == 0


def test_moe_all_to_alls_dispatch_and_return(llama):
    mixtral = model_shapes(ModelConfig.from_hf(tiny_config("mixtral")))  # 4 experts, top 2
    step = hand_step({"ep": 4}, layers_moe=2, layers_dense=0, batch_axes=("fsdp", "dp", "ep"))
    counts = StepCounts(step.sizes)
    expert.moe_collectives(counts, step, mixtral)
    assert _runs(counts) == {("all-to-all", ("ep",), 128 * 2 * D * 2): 2 * 4}  # 2 layers x (2 forward + 2 backward)
    split = hand_step({"ep": 4}, layers_moe=2, layers_dense=0, task="prefill", train=False)
    assert expert.routed_tokens(split) == 128 / 4  # ep outside the batch axes: each takes 1/ep of the tokens
    counts = StepCounts(split.sizes)
    expert.moe_collectives(counts, split, mixtral)
    assert _runs(counts) == {("all-to-all", ("ep",), 32 * 2 * D * 2): 2 * 2, ("all-gather", ("ep",), 128 * D * 2): 2}


def test_pipeline_sends_and_bubble(llama):
    """GPipe / 1F1B with p = 4 stages and m = 8 microbatches idles (p - 1) / (m + p - 1) = 3/11 of the schedule,
    so 8 s of busy stages become 11 s: the bubble adds 3 s."""
    assert pipeline.bubble_s(8.0, 3 / 11) == pytest.approx(3.0)
    step = hand_step({"pp": 4}, microbatches=8, pipelined=True)
    counts = StepCounts(step.sizes)
    pipeline.stage_collectives(counts, step, llama)
    assert _runs(counts) == {("collective-permute", ("pp",), 128 // 8 * D * 2): 8 * 2}
    assert pipeline.staged_shares(llama, hand_step(stacked_layers=1, layers_attention=2))["attention"] == 0.5
