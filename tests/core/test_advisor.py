"""The layout advisor: every ranked layout resolves and exports; on textbook cases the top choice is the known one
(each test cites its source); a confirmed layout's compiled memory is within 10 % of the ledger."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from workbench.core.advisor import Constraints, advise
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import span
from workbench.core.interop.published import published_runs
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.views.explore import Layout

FAMILIES = ["llama", "qwen3", "gemma3", "gpt2", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def llama_70b():
    return CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _tiny(family):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family)), dtype=jnp.bfloat16,
                              param_dtype=jnp.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_ranked_layout_resolves_and_its_export_rebuilds_the_same_shardings(family):
    model = _tiny(family)
    cluster = Cluster.h100(nodes=1)
    advice = advise(model, cluster, batch_tokens=16 * 64, seq_len=64)
    assert advice.ranked, advice.summary()
    for c in advice.ranked[:6]:
        layout = c.layout(model, cluster)
        assert Layout.from_json(layout.to_json(cluster=cluster), model).specs == layout.specs
        scope = {"model": model}
        exec(layout.to_code(cluster=cluster), scope)  # the snippet a user pastes: it defines `layout`
        assert scope["layout"].specs == layout.specs, c.label
        assert scope["layout"].remat == c.remat and scope["layout"].pipeline == c.pipeline


def test_the_parameter_counts_of_the_small_presets_are_the_published_ones():
    """meta-llama/Llama-3.2-1B: 1.24B parameters (tied embeddings); Meta-Llama-3-8B: 8.03B."""
    for name, count in (("llama-3.2-1b", 1_235_814_400), ("llama-3-8b", 8_030_261_248)):
        model = CausalLM.lazy_init(full_config(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == count


def test_a_small_model_on_many_chips_is_data_parallel():
    """A model that fits one GPU with room to spare trains fastest data parallel (pure DP or FSDP, no model
    parallelism): *How to Scale Your Model*, Part 5 "Training", section "Data Parallelism" ("pure data
    parallelism ... is the simplest and most efficient when the model fits"), and the Ultra-Scale Playbook's
    "first, data parallelism" rule. Llama-3.2-1B, 256k tokens (128 x 2048) on 4 x 8 H100."""
    advice = advise(full_config("llama-3.2-1b"), Cluster.h100(nodes=4), batch_tokens=128 * 2048, seq_len=2048)
    best = advice.best.mesh_shape
    assert best["tp"] == best["pp"] == best["sp"] == best["ep"] == 1, advice.table(5)
    assert best["dp"] * best["fsdp"] == 32
    html, rows = advice.html(top=3), advice.rows(3)  # the notebooks' table: the same rows as the text one
    assert html.count("<tr>") == 1 + len(rows) == 4 and all(row[1] in html for row in rows)


def test_a_70b_model_at_too_few_tokens_per_chip_for_fsdp_alone_mixes_in_a_little_tensor_parallelism(llama_70b):
    """*How to Scale Your Model*, Part 6 "Training LLaMA 3 on TPUs", "How to Shard LLaMA 3-70B for Training": on
    v5p, FSDP is ICI-bound below 2550 / n_axes tokens per chip (850 over 3 axes); with a per-chip batch above
    2 x 2550^2 / F = 453 mixed FSDP + tensor parallelism stays compute-bound, with model parallelism under
    F / 2550 = 11 ways. Here 1M tokens (256 x 4096) on a 2048-chip v5p slice (8x16x16): 512 tokens per chip,
    between the two bounds; tp must be a whole torus axis (8 or 16)."""
    for efficiency, slower in ((1.0, 1.2), (None, 1.1)):  # the book's ideal roofline; the measured step model
        advice = advise(llama_70b, Cluster.tpu("v5p:8x16x16"), batch_tokens=256 * 4096, seq_len=4096,
                        remat="full", efficiency=efficiency)
        best = advice.best
        assert best.mesh_shape["fsdp"] > 1 and 1 < best.mesh_shape["tp"] <= 11, advice.table(5)
        # pure FSDP with the sequence sharded too (256 rows cannot split 2048 ways): the book's "token-level" FSDP
        pure = [c for c in advice.ranked if c.mesh_shape["fsdp"] * c.mesh_shape["sp"] == 2048]
        assert pure and pure[0].time_s > slower * best.time_s
        assert "needed to hide FSDP's all-gathers" in pure[0].reason


def test_a_70b_decode_on_one_8_gpu_node_is_tensor_parallel_inside_the_node(llama_70b):
    """*How to Scale Your Model*, Part 7 "Inference" ("model parallelism for generation": decode is bound by
    reading the weights, so they are split over the chips, not gathered each step as FSDP would) and Part 12
    "GPUs" (tensor parallelism inside a node over NVLink). Llama-3-70B in bfloat16 (141 GB) does not fit one
    80 GB H100; 8 sequences at 4096 tokens of cache on one 8 x H100 node."""
    advice = advise(llama_70b, Cluster.h100(nodes=1), batch_tokens=8, seq_len=4096, task="decode")
    assert advice.best.mesh_shape["tp"] == 8, advice.table(5)


def test_a_model_too_big_for_one_node_is_never_tensor_parallel_across_nodes(llama_70b):
    """*How to Scale Your Model*, Part 12 "GPUs" (the inter-node network has a fraction of NVLink's bandwidth:
    tensor parallelism stays inside a node; across nodes, FSDP or pipelining), and the Ultra-Scale Playbook's
    "TP within a node, PP/DP across nodes". Llama-3-70B training (AdamW) does not fit one node; on 4 x 8 H100
    with tp across nodes allowed, the best layout still keeps tp inside a node."""
    cluster = Cluster.h100(nodes=4)
    advice = advise(llama_70b, cluster, batch_tokens=64 * 4096, seq_len=4096,
                    constraints=Constraints(tp_across_nodes=True))
    best = advice.best
    assert span(("tp",), best.mesh_shape, cluster).units == 1, advice.table(5)
    assert best.mesh_shape["fsdp"] * best.mesh_shape["pp"] > 1
    crossing = [c for c in advice.ranked if span(("tp",), c.mesh_shape, cluster).units > 1]
    assert crossing and all("crosses nodes" in c.reason for c in crossing)


def test_pipelines_are_1f1b_and_interleaved_at_p_2p_4p_microbatches_with_the_published_bubble(llama_70b):
    """Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21),
    section 2.2: the bubble over the ideal time is (p - 1) / m for 1F1B and (p - 1) / (v m) interleaved with v
    stages per device. Llama-3-70B (80 layers) on 8 x 8 H100 with pp=4: both schedules (interleaved with v = 2 and
    4: at least two layers per virtual stage) at m = 4, 8, 16."""
    advice = advise(llama_70b, Cluster.h100(nodes=8), batch_tokens=256 * 4096, seq_len=4096, remat="full",
                    constraints=Constraints(fixed={"pp": 4, "fsdp": 16}))
    seen = {(c.pipeline.schedule, c.pipeline.virtual_stages, c.pipeline.num_microbatches)
            for c in advice.ranked + advice.rejected}
    assert seen == {(s, v, m) for s, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)) for m in (4, 8, 16)}
    for c in advice.ranked + advice.rejected:
        p, v, m = c.pipeline.num_stages, c.pipeline.virtual_stages, c.pipeline.num_microbatches
        f = c.step.bubble_fraction
        assert f / (1 - f) == pytest.approx((p - 1) / (v * m))
    for c in advice.ranked:
        assert f"pipeline bubble {c.step.bubble_fraction:.0%}" in c.reason
    # an 8-microbatch 1F1B idles 27 % of the step: slower than the same mesh at 16 interleaved (9 %)
    by = {(c.pipeline.schedule, c.pipeline.num_microbatches): c for c in advice.ranked
          if c.pipeline.virtual_stages < 4}
    assert by[("1f1b", 8)].time_s > 1.1 * by[("interleaved", 16)].time_s, advice.table(12)
    # 4 microbatches of 4 sequences of 4096 tokens: one microbatch's logits alone overflow; more microbatches fit
    four = next(c for c in advice.rejected if c.pipeline.num_microbatches == 4)
    assert "with 16 microbatches it fits" in four.reason and "with remat" not in four.reason, four.reason


def test_mfu_counts_the_model_s_flops_not_the_recompute(llama_70b):
    """MFU (PaLM, Chowdhery et al. 2022, appendix B) excludes rematerialisation: a compute-bound step with full remat
    runs more FLOPs for the same model FLOPs, so its MFU is below its hardware FLOPs utilisation."""
    advice = advise(llama_70b, Cluster.tpu("v5p:8x8x16"), batch_tokens=4 * 2**20, seq_len=4096,
                    constraints=Constraints(fixed={"fsdp": 1024}), efficiency=1.0)
    by = {c.remat: c for c in advice.ranked + advice.rejected}
    full, none = by["full"], by["none"]
    assert full.step.compute_s > none.step.compute_s
    # nothing repeated on a device here: a device's share of the model FLOPs is the no-remat step's FLOPs
    assert full.step.mfu == pytest.approx(none.step.compute_s / full.time_s)
    assert full.step.mfu < full.step.hfu and none.step.mfu == pytest.approx(none.step.hfu)
    # no efficiency factor: the roofline's ideal, so every MFU shown is an upper bound
    assert full.step.ideal and advice.rows() and all(row[6].startswith("≤ ") for row in advice.rows())
    assert "recomputes the forward" in full.reason and "recomputes" not in none.reason
    # the measured step model (the default): predictions, not bounds, and the summary says how true they were
    measured = advise(llama_70b, Cluster.tpu("v5p:8x8x16"), batch_tokens=4 * 2**20, seq_len=4096,
                      constraints=Constraints(fixed={"fsdp": 1024}))
    assert not any(row[6].startswith("≤") for row in measured.rows())
    assert all(0.5 <= c.step.mfu <= 0.75 for c in measured.ranked)
    assert all(c.step.mfu < c.step.hfu for c in measured.ranked if c.remat == "full")
    assert "published training steps" in measured.summary() and "published" not in advice.summary()


def test_what_does_not_fit_says_by_how_much_and_which_remat_would(llama_70b):
    advice = advise(llama_70b, Cluster.h100(nodes=8), batch_tokens=16 * 2048, seq_len=2048,
                    constraints=Constraints(fixed={"fsdp": 8, "tp": 8}, grad_accumulation=(1,)))
    fits = {c.remat for c in advice.ranked}
    assert fits and "none" not in fits  # the search stops at the least recompute that fits: more only slows it
    none = next(c for c in advice.rejected if c.remat == "none")
    assert none.reason.startswith("does not fit") and any(f"with remat {r}" in none.reason for r in fits)
    # with gradient accumulation on the table, half the sequences per microbatch fit without recompute
    advice = advise(llama_70b, Cluster.h100(nodes=8), batch_tokens=16 * 2048, seq_len=2048,
                    constraints=Constraints(fixed={"fsdp": 8, "tp": 8}))
    accumulated = [c for c in advice.ranked if c.remat == "none"]
    assert accumulated and all(c.grad_accumulation > 1 for c in accumulated)
    assert "microbatches of" in accumulated[0].reason and "microbatches accumulated" in accumulated[0].label


def test_a_confirmed_layout_compiles_within_ten_percent_of_the_ledger():
    """The top layout of a tiny bfloat16 Llama on 1 x 8 H100, compiled in the worker (XLA:CPU)."""
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=512,
                                                               num_hidden_layers=4)))
    advice = advise(model, Cluster.h100(nodes=1), batch_tokens=16 * 128, seq_len=128, confirm=1,
                    constraints=Constraints(pipeline=False))
    c = advice.ranked[0] if advice.ranked[0].compiled is not None else advice.rejected[0]
    assert c.compiled is not None and c.compiled_step is not None
    assert c.ledger.total == pytest.approx(c.compiled.memory.total, rel=0.10), c.confirm_note
    assert "not held against the GPU's HBM" in c.confirm_note  # XLA:CPU's program is not an H100's


def test_bad_requests_say_what_to_change():
    model = _tiny("llama")
    with pytest.raises(ValueError, match="task must be one of"):
        advise(model, Cluster.h100(), batch_tokens=64, seq_len=8, task="serve")
    with pytest.raises(ValueError, match="not a whole number of sequences"):
        advise(model, Cluster.h100(), batch_tokens=65, seq_len=8)
    with pytest.raises(ValueError, match="no chip numbers"):
        advise(model, Cluster.cpu(8), batch_tokens=64, seq_len=8)
    with pytest.raises(ValueError, match=r"Constraints\.fixed names"):
        Constraints(fixed={"model": 2})
    with pytest.raises(TypeError, match=r"a model .* or a ModelConfig"):
        advise("llama", Cluster.h100(), batch_tokens=64, seq_len=8)


def test_the_default_accumulations_are_the_divisors_of_a_shards_sequences_up_to_16():
    assert Constraints().accumulations(16) == [1, 2, 4, 8, 16] and Constraints().accumulations(64) == [1, 2, 4, 8, 16]
    assert Constraints().accumulations(21) == [1, 3, 7] and Constraints().accumulations(9) == [1, 3, 9]
    assert Constraints(grad_accumulation=(2, 4)).accumulations(21) == []
    with pytest.raises(ValueError, match="or None for the divisors"):
        Constraints(grad_accumulation=())


def test_a_published_layout_that_fits_only_at_an_odd_accumulation_is_ranked():
    """llm-foundry's MPT-30B on 8 H100s: 168 sequences of 8,192 tokens, 21 a GPU under fsdp=8, which fit the HBM
    only in microbatches (llm-foundry ran 21 of one sequence); no power of two divides 21, so the advisor must try 3
    and 7 to rank the published layout."""
    run = next(r for r in published_runs() if r.name == "llmfoundry-mpt-30b-h100x8-fsdp-8k-bf16")
    advice = advise(run.config, run.cluster, batch_tokens=run.batch[0] * run.batch[1], seq_len=run.batch[1],
                    constraints=Constraints(**run.plan.program()))
    mine = [c for c in advice.ranked if dict(c.mesh_shape) == {**dict.fromkeys(c.mesh_shape, 1), "fsdp": 8}]
    assert mine and mine[0].fits and mine[0].grad_accumulation in (3, 7)


def test_accumulations_that_divide_no_shard_prune_the_layout_and_say_so():
    """Constraints.grad_accumulation=(3,) on 8 sequences: no data-parallel split leaves a multiple of 3 sequences
    a shard (8, 4, 2, 1), so every train layout is pruned, counted under that reason, and why_none says so."""
    advice = advise(_tiny("llama"), Cluster.h100(nodes=1), batch_tokens=8 * 64, seq_len=64,
                    constraints=Constraints(grad_accumulation=(3,), pipeline=False))
    assert not advice.ranked
    assert advice.pruned["with no allowed grad_accumulation dividing the sequences per data shard"] > 0
    assert "grad_accumulation" in advice.why_none()
