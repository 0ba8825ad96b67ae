"""price(plan, ...) is predict_step with the plan's fields: the same step, whichever record the plan came from."""

import pytest

from workbench.core.cost.kernels import gemm_efficiency, memory_seconds
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.price import price
from workbench.core.hardware.cluster import Cluster
from workbench.core.models.presets import full_config
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import Plan


@pytest.mark.parametrize("plan, batch, task", [
    (Plan({"fsdp": 16, "tp": 4}, remat="full", zero_stage=0), (256, 4096), "train"),
    (Plan({"dp": 8, "fsdp": 8}, remat="dots_saveable", zero_stage=1, grad_accumulation=4), (512, 4096), "train"),
    (Plan({"pp": 4, "fsdp": 16}, remat="none", recompute=0.3, pipeline=PipelineConfig(4, 16)), (256, 4096), "train"),
    (Plan({"tp": 8, "dp": 8}, dtype="fp8", tp_overlap=True), (64, 4096), "decode"),
])
def test_price_is_predict_step_with_the_plan_s_fields(plan, batch, task):
    config, cluster = full_config("llama-3-70b"), Cluster.h100(nodes=8)
    expected = predict_step(config, cluster, dict(plan.mesh_shape), batch=batch, task=task, remat=plan.remat,
                            pipeline=plan.pipeline, dtype=plan.dtype, batch_axes=plan.batch_axes,
                            zero_stage=plan.zero_stage, grad_accumulation=plan.grad_accumulation,
                            recompute=plan.recompute, tp_overlap=plan.tp_overlap)
    assert price(plan, config, cluster, batch, task).time_s == expected.time_s


def test_price_takes_a_plan():
    with pytest.raises(TypeError, match=r"plan is a workbench\.core\.plan\.Plan"):
        price({"fsdp": 8}, full_config("llama-3-8b"), Cluster.h100(nodes=1), (8, 4096))


def test_the_plans_attention_kernel_sets_the_attention_terms_rate_and_nothing_else():
    """The 2022 Triton flash kernel at its own long-sequence rate (0.19 of peak on an H100 against cuDNN's 0.59):
    the attention term grows by their ratio, every other term is the same; "xla" is priced as "flash"."""
    config, cluster, batch = full_config("llama-3-8b"), Cluster.h100(nodes=1), (8, 32768)
    steps = {k: price(Plan({"fsdp": 8}, attention=k), config, cluster, batch) for k in ("xla", "flash", "flash_triton")}
    terms = {k: {t.name: t.seconds for t in s.terms} for k, s in steps.items()}
    assert terms["xla"] == terms["flash"]
    name = "attention kernels"
    assert terms["flash_triton"][name] / terms["flash"][name] == pytest.approx(0.59 / 0.19, rel=1e-9)
    others = [n for n in terms["flash"] if n not in (name, "FSDP and gradient communication, exposed")]
    assert {n: terms["flash_triton"][n] for n in others} == {n: terms["flash"][n] for n in others}
    assert "the 2022 Triton flash attention" in next(t.note for t in steps["flash_triton"].terms if t.name == name)
    with pytest.raises(ValueError, match="no measured rate for the 'flash_triton' attention kernel on TPU v5p"):
        price(Plan({"fsdp": 8}, attention="flash_triton"), config, Cluster.tpu("v5p:2x2x2"), batch)


def test_vocabulary_tiling_recomputes_the_heads_forward_in_the_backward():
    """MaxText's num_vocab_tiling: its custom VJP runs each tile's logits again in the backward, so a tiled loss
    costs one more forward of the LM head's GEMM (2 x tokens x d x V) and one more float32 pass over the logits."""
    config, cluster, batch = full_config("llama-3-8b"), Cluster.h100(nodes=1), (8, 8192)
    whole, tiled = (price(Plan({"fsdp": 8}, vocab_tiles=k), config, cluster, batch) for k in (1, 4))
    terms = lambda st: {t.name: t.seconds for t in st.terms}
    tokens, d, vocab = batch[0] * batch[1] / 8, config.hidden_size, config.vocab_size
    peak = cluster.chip.peak_flops("bf16")
    head_s = 2 * tokens * d * vocab / (peak * gemm_efficiency(tokens, d, vocab, cluster.chip))
    assert terms(tiled)["matmuls"] - terms(whole)["matmuls"] == pytest.approx(head_s, rel=1e-9)
    logits_s = memory_seconds(4 * tokens * vocab, cluster.chip, cluster.chip.hbm_bandwidth)
    fusions = "memory-bound fusions"
    assert terms(tiled)[fusions] - terms(whole)[fusions] == pytest.approx(logits_s, rel=1e-9)
    inference = {k: price(Plan({"fsdp": 8}, vocab_tiles=k), config, cluster, batch, "prefill").time_s for k in (1, 4)}
    assert inference[1] == inference[4]  # no backward, nothing recomputed
