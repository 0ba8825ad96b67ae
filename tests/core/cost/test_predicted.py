"""A layout's step time predicted from shapes (``layout_cost.predict_step``), against independent references:
hand counts from the models' parameter shapes (``CausalLM.lazy_init``), the worked examples of "How to Scale Your
Model" (Austin et al., https://jax-ml.github.io/scaling-book/; each test cites its chapter and example), and a
step compiled for a cluster (its dots and collectives)."""

import importlib.util
import math

import pytest
from flax import nnx

from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import transfer
from workbench.core.models import CausalLM, ModelConfig, tiny_config
from workbench.core.models.presets import full_config
from workbench.core.pipeline_schedule import PipelineConfig, pipeline_schedule

TRANSFORMERS = "https://jax-ml.github.io/scaling-book/transformers/"
TRAINING = "https://jax-ml.github.io/scaling-book/training/"
APPLIED_TRAINING = "https://jax-ml.github.io/scaling-book/applied-training/"
INFERENCE = "https://jax-ml.github.io/scaling-book/inference/"
APPLIED_INFERENCE = "https://jax-ml.github.io/scaling-book/applied-inference/"
GPUS = "https://jax-ml.github.io/scaling-book/gpus/"
BF16 = 2


def _params(name: str) -> dict[str, int]:
    """Parameter elements by path, from the model's own shapes (nothing allocated)."""
    model = CausalLM.lazy_init(full_config(name))
    return {"/".join(map(str, path)): math.prod(var.shape)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _total_flops(step) -> float:
    return step.roofline.flops * step.cluster.num_devices


# -- FLOPs: 6 N tokens (Transformer Math) ---------------------------------------------------------------------
@pytest.mark.parametrize("remat", ["none", "dots_saveable", "full"])
def test_a_dense_train_step_is_6_n_tokens_plus_attention(remat):
    """TRANSFORMERS, "Global FLOPs and Params Calculation": a train step is 6 FLOPs per matmul parameter per token
    (forward 2, backward 4) plus the attention dot products, 12 B T^2 N H a layer (dense: the causal mask is not
    credited). N counts the kernels of ``CausalLM.lazy_init(llama-3-70b)`` (the embedding is a lookup, no
    FLOPs). Full remat recomputes each layer's forward (8 N) except the MLP's down projection, whose output the
    backward never reads (XLA drops it; the compiled test below sees it); dots_saveable recomputes no matmul."""
    params = _params("llama-3-70b")
    layers = sum(n for p, n in params.items() if p.startswith("layers/") and p.endswith("kernel"))
    down = params["layers/mlp/down_proj/kernel"]
    head = params["lm_head/kernel"]
    c = full_config("llama-3-70b")
    b, t = 64, 4096
    tokens = b * t
    attention = 12 * b * t * t * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    step = predict_step(c, Cluster.h100(nodes=8), {"fsdp": 64}, batch=(b, t), remat=remat)
    if remat == "full":
        expected = (8 * layers - 2 * down + 6 * head) * tokens + attention * 4 / 3
    else:
        expected = 6 * (layers + head) * tokens + attention
    assert _total_flops(step) == pytest.approx(expected, rel=1e-12)
    assert 6 * (layers + head) == pytest.approx(6 * 70.55e9 - 6 * params["embed_tokens"], rel=1e-3)


def test_a_mixture_of_experts_counts_its_active_parameters():
    """TRANSFORMERS, "Mixture of Experts": a token runs only its top-k experts (plus the shared ones and the
    router), so the FLOPs are 6 N_active per token. DeepSeek-V3 from its parameter shapes: routed experts
    weigh k / E of their size; multi-head latent attention in its absorbed form uses each kernel once a token,
    and its dot products contract over the latent: QK^T over C + R, PV over C (12 B T^2 H (2C + R) / 2 a layer)."""
    params = _params("deepseek-v3")
    c = full_config("deepseek-v3")
    k, e = c.num_experts_per_tok, c.num_local_experts
    routed = ("layers/mlp/gate_proj", "layers/mlp/up_proj", "layers/mlp/down_proj")
    active = sum(n * (k / e if p in routed else 1) for p, n in params.items()
                 if p.endswith("kernel") or p in routed or p.startswith("layers/mlp/shared_"))
    b, t = 64, 2048
    per_token_layer = 2 * t * c.num_attention_heads * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    attention = 3 * b * t * per_token_layer * c.num_hidden_layers
    step = predict_step(c, Cluster.h100(nodes=8), {"fsdp": 8, "ep": 8}, batch=(b, t), remat="none",
                        batch_axes=("fsdp", "dp", "ep"))
    assert _total_flops(step) == pytest.approx(6 * active * b * t + attention, rel=1e-12)
    assert active + params["embed_tokens"] == pytest.approx(37e9, rel=0.02)  # DeepSeek-V3's "37B activated"


# -- the training chapters: FSDP and TP on TPU v5p -------------------------------------------------------------
def test_llama_70b_fsdp_needs_850_tokens_per_chip_on_three_axes():
    """APPLIED_TRAINING, "How to Shard LLaMA 3-70B for Training", second question: with batch and sequence
    sharding ("token-level" FSDP) over a full 3D v5p torus we are ICI-bound below 2550 / n_axes = 850 tokens
    per chip (TRAINING: C / W_ici with W_ici = 1.8e11 per axis). Here fsdp x sp = 256 x 16 covers the three
    axes of v5p:16x16x16: each layer's weights gathered forward and backward and their gradients
    reduce-scattered (3 passes; the embedding 2: a gather and its gradient). The crossing is the book's 850 times
    the ring's (N - 1) / N and the ratio of those passes to the matmul FLOPs (attention's dot products add
    FLOPs, the embedding adds bytes but no FLOPs)."""
    params = _params("llama-3-70b")
    c = full_config("llama-3-70b")
    p_layers = sum(n for p, n in params.items() if p.startswith("layers/") and p.endswith("kernel"))
    p_head, p_embed = params["lm_head/kernel"], params["embed_tokens"]
    v5p = Cluster.tpu("v5p:16x16x16")
    b, t = 1024, 4096
    tokens_per_chip = b * t / v5p.num_devices  # 1024
    step = predict_step(c, v5p, {"fsdp": 256, "sp": 16}, batch=(b, t), remat="none")
    fsdp_s = sum(x.total_s for x in step.collectives if x.axes == ("fsdp", "sp"))
    n = v5p.num_devices
    book = 4.59e14 / (3 * 1.8e11)
    assert book == pytest.approx(850, rel=1e-3)
    attention = 2 * t * c.num_attention_heads * c.head_dim * c.num_hidden_layers  # per token, in units of "params"
    expected = book * (n - 1) / n * (3 * (p_layers + p_head) + 2 * p_embed) / (3 * (p_layers + p_head + attention))
    crossing = tokens_per_chip * fsdp_s / step.compute_s
    assert crossing == pytest.approx(expected, rel=1e-3)
    assert crossing == pytest.approx(850, rel=0.07)  # 797: attention's dot products at T = 4096 add 6 % FLOPs
    # the book's 4M-token batch on a full pod leaves 468 tokens per chip: below the crossing, comms-bound
    below = predict_step(c, v5p, {"fsdp": 256, "sp": 16}, batch=(512, 4096), remat="none")
    assert sum(x.total_s for x in below.collectives if x.axes == ("fsdp", "sp")) > below.compute_s
    assert step.bound == "compute"


def test_llama_70b_fsdp_with_tp_stays_compute_bound_where_fsdp_with_sp_does_not():
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    APPLIED_TRAINING, takeaway of "How to Shard LLaMA 3-70B for Training": at ~500 tokens per chip "we will be
    comms-bound if we try to do pure FSDP or FSDP + sequence parallelism", while FSDP with 4-way tensor
    parallelism is not ICI-bound (the FSDP + TP discriminant 2 * 2550^2 / F = 453 tokens per chip is below it).
    On a v5p:4x16x16 slice at 512 tokens per chip."""
    c = full_config("llama-3-70b")
    v5p = Cluster.tpu("v5p:4x16x16")
    batch = (256, 2048)
    assert batch[0] * batch[1] / v5p.num_devices == 512
    fsdp_tp = predict_step(c, v5p, {"fsdp": 256, "tp": 4}, batch=batch, remat="none", efficiency=1.0)
    fsdp_sp = predict_step(c, v5p, {"fsdp": 256, "sp": 4}, batch=batch, remat="none", efficiency=1.0)
    assert fsdp_tp.bound == "compute" and fsdp_sp.bound == "communication"
    assert fsdp_tp.compute_s == pytest.approx(fsdp_sp.compute_s)  # the same work, split differently
    assert 2 * 2550**2 / c.intermediate_size == pytest.approx(453, abs=1)


# -- the inference chapters: decode reads weights and KV caches -------------------------------------------------
@pytest.mark.parametrize("sequences", [1, 16, 64])
def test_llama_70b_decode_is_bound_by_reading_weights_and_kv_cache(sequences):
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    APPLIED_INFERENCE, "Visualizing the Latency Throughput Tradeoff": LLaMA 3-70B with 16-way tensor
    parallelism on a TPU v5e 4x4; a generate step loads the parameters and the KV caches from HBM (8.1e11 B/s a
    chip): "we are strongly KV cache memory bandwidth-bound ... in almost all of these configurations". KV
    cache in bf16: 2 K H L x 2 bytes = 324 kB a token (the chapter's table). The embedding table is looked up,
    not read: its rows only. The chapter counts weights and caches only; we also count the activations, whose
    hidden dimension tp does not split (some 17 D-sized reads and writes a token and layer): under 1 % at one
    sequence, 8 % at 64. The chapter also divides the caches by all 16 chips; 8 KV heads split at most 8 ways, so
    each head is kept on 16 / 8 = 2 chips (one head per chip, as vLLM and MaxText serve it) and a chip reads 1/8
    of the caches: the chapter's bound is below the prediction, ``served`` equal to it."""
    params = _params("llama-3-70b")
    c = full_config("llama-3-70b")
    context = 8192
    kv_per_token = 2 * c.num_key_value_heads * c.head_dim * c.num_hidden_layers * BF16
    assert kv_per_token == 327_680
    step = predict_step(c, Cluster.tpu("v5e:4x4"), {"tp": 16}, batch=(sequences, context), task="decode",
                        efficiency=1.0)
    weights = BF16 * (sum(params.values()) - params["embed_tokens"])
    book = (weights + sequences * context * kv_per_token) / (16 * 8.1e11)
    served = (weights / 16 + sequences * context * kv_per_token / c.num_key_value_heads) / 8.1e11
    assert book <= served <= step.memory_s <= served * (1.01 if sequences == 1 else 1.1)
    assert step.bound == "memory"
    attention = 4 * context * c.num_attention_heads * c.head_dim * c.num_hidden_layers  # QK^T and PV, a token
    matmuls = sum(n for p, n in params.items() if p.endswith("kernel"))
    assert step.roofline.flops * 16 == pytest.approx((2 * matmuls + attention) * sequences, rel=1e-12)
    if sequences == 1:  # the chapter's lower bound: parameters / (chips x HBM bandwidth), ~11 ms in bf16
        assert round(step.time_s * 1e3) == 11


def test_decode_mlp_turns_compute_bound_past_the_critical_batch():
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    APPLIED_INFERENCE, "bulk inference": "FFW blocks are compute bound when B > 240" (C / W_hbm of a v5e,
    bf16 weights). The book counts weight bytes only; we also count the activations' reads and writes
    (about 8 D and 6 F / tp elements a token), which move the crossing up to about 400."""
    c = full_config("llama-3-70b")

    def ratio(b):
        mlp = predict_step(c, Cluster.tpu("v5e:4x4"), {"tp": 16}, batch=(b, 16), task="decode",
                           efficiency=1.0).by_kind()["mlp"]
        return mlp["compute_s"] / mlp["memory_s"]

    assert ratio(240) < 1 < ratio(480)
    weights_only = 2 * 3 * c.hidden_size * c.intermediate_size * 240 / 1.97e14 / (3 * c.hidden_size *
                                                                                  c.intermediate_size * 2 / 8.1e11)
    assert weights_only == pytest.approx(1, rel=0.02)


def test_fsdp_is_infeasible_for_decode():
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    APPLIED_INFERENCE, "Can we actually serve on a 4x8?": "FSDP is totally infeasible because of its high
    cost at small batch sizes (basically, moving weights ... is very expensive compared to moving
    activations)": gathering every layer's weights each step is communication-bound, far slower than tensor
    parallelism's activation all-reduces."""
    c = full_config("llama-3-70b")
    v5e = Cluster.tpu("v5e:4x4")
    fsdp = predict_step(c, v5e, {"fsdp": 16}, batch=(16, 4096), task="decode", efficiency=1.0)
    tensor = predict_step(c, v5e, {"tp": 16}, batch=(16, 4096), task="decode", efficiency=1.0)
    assert fsdp.bound == "communication" and tensor.bound == "memory"
    assert fsdp.time_s > 5 * tensor.time_s


def test_decode_reads_only_the_experts_its_tokens_reach():
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    INFERENCE, "Mixture of Experts" (and "Serving LLaMA 3"'s takeaway, decode time is the bytes loaded): a
    decode step reads only the routed experts some token picked, on average 1 - (1 - 1/E)^(tokens k) of them,
    plus the shared experts and the router. DeepSeek-V3 at one sequence on 8 x 8 H100 (ep=64, 4 of the 256
    experts a device): 8 of 256 picked, 3 %; at 64 sequences most of them."""
    params = _params("deepseek-v3")
    c = full_config("deepseek-v3")
    cluster = Cluster.h100(nodes=8)
    routed = sum(params[f"layers/mlp/{w}_proj"] for w in ("gate", "up", "down")) * BF16 / 64
    always = sum(params[f"layers/mlp/{w}"] for w in ("shared_gate", "shared_up", "shared_down", "router_kernel"))

    def experts_bytes(sequences):
        step = predict_step(c, cluster, {"ep": 64}, batch=(sequences, 4096), task="decode", efficiency=1.0)
        return step.by_kind()["experts"]["memory_s"] * cluster.chip.hbm_bandwidth

    picked = 1 - (1 - 1 / 256) ** 8
    assert experts_bytes(1) == pytest.approx(always * BF16 + picked * routed, rel=0.01)
    picked = 1 - (1 - 1 / 256) ** (64 * 8)
    assert picked > 0.8 and experts_bytes(64) == pytest.approx(always * BF16 + picked * routed, rel=0.03)


# -- a served model: weights and KV cache stored in their own dtypes ---------------------------------------------
@pytest.mark.parametrize("weight_dtype, weight_bytes", [("bf16", 2), ("fp8", 1), ("int8", 1), ("int4", 0.5 + 2 / 128)])
def test_decode_reads_weights_as_stored(weight_dtype, weight_bytes):
    """A decode step reads each stored weight once (the Inference chapter's bound): Llama-3-70B on two H100s
    (tp=2), one sequence. The layers' weights in ``weight_dtype`` (int4: AWQ / GPTQ's half byte and a 16-bit
    scale a group of 128), the head in bfloat16 (ModelOpt's fp8 and AWQ leave it out), the embedding looked up.
    Counted from the model's parameter shapes; the roofline (efficiency=1.0) gives bytes over bandwidth."""
    params = _params("llama-3-70b")
    c = full_config("llama-3-70b")
    cluster = Cluster.h100(nodes=1, gpus_per_node=2)
    step = predict_step(c, cluster, {"tp": 2}, batch=(1, 4096), task="decode", weight_dtype=weight_dtype,
                        efficiency=1.0)
    layers = sum(n for p, n in params.items() if p.startswith("layers/") and p.endswith("kernel"))
    per_kind = step.by_kind()
    read = sum(per_kind[k]["memory_s"] for k in ("attention", "mlp")) * cluster.chip.hbm_bandwidth
    kv = 4096 * 2 * c.num_key_value_heads * c.head_dim * c.num_hidden_layers * BF16 / 2  # bf16 cache, 4 heads a GPU
    assert read == pytest.approx(layers * weight_bytes / 2 + kv, rel=0.01)
    head = per_kind["embedding+head"]["memory_s"] * cluster.chip.hbm_bandwidth
    assert head == pytest.approx(params["lm_head/kernel"] * BF16 / 2, rel=0.01)


def test_decode_reads_the_kv_cache_as_stored():
    """The KV cache in fp8 (TensorRT-LLM's and vLLM's ``kv_cache_dtype``) halves the cache a step reads: Llama-3-70B
    on two H100s, 32 sequences of 8,192 positions, where the cache outweighs the weights."""
    c = full_config("llama-3-70b")
    cluster = Cluster.h100(nodes=1, gpus_per_node=2)

    def attention_bytes(kv_dtype):
        step = predict_step(c, cluster, {"tp": 2}, batch=(32, 8192), task="decode", kv_dtype=kv_dtype, efficiency=1.0)
        return step.by_kind()["attention"]["memory_s"] * cluster.chip.hbm_bandwidth

    cache = 32 * 8192 * 2 * c.num_key_value_heads * c.head_dim * c.num_hidden_layers / 2  # elements a GPU
    assert attention_bytes("bf16") - attention_bytes("fp8") == pytest.approx(cache, rel=0.01)


def test_fp8_weights_served_are_not_cast_every_step():
    """A training step casts each bfloat16 weight to fp8 (dynamic scaling: read for its amax, written as fp8); a
    served model stores them in fp8, so a decode step casts only its activations. Llama-3-70B, fp8, two H100s,
    one sequence at 5,000 positions: the step is its weights' read (about 35 GB a GPU at 0.87 of 3.35 TB/s, 12 ms),
    not 83 ms of casts."""
    c = full_config("llama-3-70b")
    step = predict_step(c, Cluster.h100(nodes=1, gpus_per_node=2), {"tp": 2}, batch=(1, 5000), task="decode",
                        dtype="fp8")
    terms = {t.name: t.seconds for t in step.terms}
    assert terms["memory-bound fusions"] < 0.01 * step.time_s
    assert 0.011 < terms["matmuls bound by HBM"] < 0.013
    with pytest.raises(ValueError, match="served model"):
        predict_step(c, Cluster.h100(nodes=1, gpus_per_node=2), {"tp": 2}, batch=(2, 512), weight_dtype="fp8")
    with pytest.raises(ValueError, match="weight_dtype"):
        predict_step(c, Cluster.h100(nodes=1, gpus_per_node=2), {"tp": 2}, batch=(2, 512), task="decode",
                     weight_dtype="int2")


# -- the GPU chapter: what crosses nodes ----------------------------------------------------------------------
def test_tensor_parallelism_across_nodes_runs_on_the_slower_network():
    """GPUS, "Rooflines for LLM Scaling on GPUs", tensor parallelism: keep it inside a node (NVLink, 450 GB/s a
    GPU), not across nodes (400 GB/s a node, 50 GB/s a GPU). The workbench mesh is ordered (pp, dp, fsdp, ep,
    tp, sp): sp takes the 8 GPUs of a node, so tp=8 beside sp=8 spans nodes."""
    c = full_config("llama-3-70b")
    cluster = Cluster.h100(nodes=8)
    inside = predict_step(c, cluster, {"fsdp": 8, "tp": 8}, batch=(64, 4096))
    across = predict_step(c, cluster, {"tp": 8, "sp": 8}, batch=(64, 4096))
    level = lambda step: {x.level for x in step.collectives if x.axes == ("tp",) and x.bound == "bandwidth"}
    assert level(inside) == {"nvlink"} and level(across) == {"inter-node"}
    tp_s = lambda step: sum(x.total_s for x in step.collectives if x.axes == ("tp",))
    assert tp_s(across) > 5 * tp_s(inside)


# -- pipelines ------------------------------------------------------------------------------------------------
def test_a_pipeline_adds_its_bubble_to_the_step():
    """The book's ideal roofline (efficiency=1.0), the form its chapters derive.

    The bubble is the schedules' closed form (p - 1) / (v m + p - 1) (Narayanan et al. 2021), what the
    schedule's own table measures; it idles that share of the ticks, f / (1 - f) times the pipelined layers'
    busy time added to the step. Without FSDP the busy time does not depend on m: twice the microbatches,
    about half the bubble; interleaving (v = 2) halves it too."""
    c = full_config("llama-3-70b")
    cluster = Cluster.h100(nodes=8)
    mesh = {"pp": 4, "dp": 2, "tp": 8}

    def step(m, schedule="1f1b"):
        return predict_step(c, cluster, mesh, batch=(64, 4096), pipeline=PipelineConfig(4, m, schedule),
                            efficiency=1.0)

    one = step(8)
    assert one.bubble_fraction == pytest.approx(3 / 11)
    assert one.bubble_fraction == pytest.approx(pipeline_schedule(PipelineConfig(4, 8)).bubble_fraction)
    busy = max(one.roofline.time_s, one.comm_s)
    assert one.time_s == pytest.approx(busy + one.bubble_s)
    layers = one.by_kind()
    stage_compute = layers["attention"]["compute_s"] + layers["mlp"]["compute_s"]
    assert stage_compute * 3 / 8 <= one.bubble_s <= busy * 3 / 8
    assert one.bubble_s / step(16).bubble_s == pytest.approx(2, rel=0.02)
    assert one.bubble_s / step(8, "interleaved").bubble_s == pytest.approx(2, rel=0.02)  # (3/8) / (3/16)
    sends = [x for x in one.collectives if x.axes == ("pp",)]
    assert [(x.kind, x.runs) for x in sends] == [("collective-permute", 16)]  # 8 microbatches, forward and back
    assert "pipeline bubble" in one.summary()


def test_layer_kinds_share_out_the_step():
    c = full_config("deepseek-v3")
    step = predict_step(c, Cluster.h100(nodes=32), {"fsdp": 8, "ep": 32}, batch=(256, 4096),
                        batch_axes=("fsdp", "dp", "ep"))
    kinds = step.by_kind()
    assert set(kinds) == {"attention", "mlp", "experts", "embedding+head", "optimizer"}
    assert sum(k["compute_s"] for k in kinds.values()) == pytest.approx(step.compute_s)
    assert sum(k["memory_s"] for k in kinds.values()) == pytest.approx(step.memory_s)
    assert sum(k["comm_s"] for k in kinds.values()) == pytest.approx(step.comm_s)
    assert {x.kind for x in step.collectives if x.part == "experts"} >= {"all-to-all", "all-gather"}
    assert kinds["optimizer"]["compute_s"] == 0 and kinds["optimizer"]["memory_s"] > 0


def test_mistakes_raise_with_what_to_change():
    c = full_config("llama-3-70b")
    h100 = Cluster.h100(nodes=8)
    with pytest.raises(ValueError, match="task must be one of"):
        predict_step(c, h100, {"fsdp": 64}, batch=(64, 128), task="generate")
    with pytest.raises(ValueError, match="do not split over the batch axes"):
        predict_step(c, h100, {"fsdp": 64}, batch=(32, 128))
    with pytest.raises(ValueError, match="has 32 devices"):
        predict_step(c, h100, {"fsdp": 32}, batch=(64, 128))
    with pytest.raises(ValueError, match="pass pipeline=PipelineConfig"):
        predict_step(c, h100, {"pp": 2, "fsdp": 32}, batch=(64, 128))
    with pytest.raises(ValueError, match="do not split into"):
        predict_step(c, h100, {"pp": 64}, batch=(64, 128), pipeline=PipelineConfig(64, 64))
    with pytest.raises(ValueError, match="no peak FLOP/s"):
        predict_step(c, h100, {"fsdp": 64}, batch=(64, 128), dtype="float32")


# -- against a compiled step ------------------------------------------------------------------------------------
# The compiled program (XLA:CPU, 8 simulated devices for one H100 node) against the prediction, per (kind, axes),
# collectives inside the layer loop (trips = layers), bytes x runs:
# - FSDP all-gathers: x2: XLA:CPU computes bfloat16 as float32. Under full remat XLA gathers the MLP's gate and
#   up kernels once more for the recompute (16 gathers a layer against 14): x2.53;
# - TP all-reduces: x2 (float32) x 7/4: the backward all-reduces each column-parallel input gradient alone
#   (q, k, v and gate, up: 5 a layer) where Megatron sums them before one (2 a layer); under full remat
#   8 against 5: x3.2;
# - gradients: XLA (CPU and TPU alike, below) all-reduces the scanned layers' gradients over fsdp, then slices,
#   where the prediction reduce-scatters: on the network an all-reduce of the whole gradient costs twice the
#   reduce-scatter, x2 float32 again: x4.
COMPILED_FACTORS = {"none": {"all-gather": 2.0, "all-reduce": 3.5, "gradients": 4.0},
                    "full": {"all-gather": 2.533, "all-reduce": 3.2, "gradients": 4.0}}


@pytest.mark.parametrize("remat", ["none", "full"])
def test_prediction_against_the_compiled_step(remat):
    import jax.numpy as jnp

    from workbench.core.compile.virtual import compile_step

    config = ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                                             num_key_value_heads=4, num_hidden_layers=4, vocab_size=512))
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).with_options(remat=remat)
    cluster, mesh, batch = Cluster.h100(), {"fsdp": 4, "tp": 2}, (8, 128)
    compiled = step_time(compile_step(model, cluster, mesh, batch=batch))
    predicted = predict_step(config, cluster, mesh, batch=batch, remat=remat)
    # the dots: the same, to the FLOP (remat "full": less the MLP down projection XLA does not recompute)
    assert predicted.roofline.flops == compiled.roofline.flops

    layers = config.num_hidden_layers
    loop = [x for x in compiled.collectives if x.runs == layers]
    ours = [x for x in predicted.collectives if x.part in ("attention", "mlp")]
    volume = lambda xs, kind, axes: sum(x.nbytes * x.runs for x in xs if x.kind == kind and x.axes == axes)
    factors = COMPILED_FACTORS[remat]
    assert volume(loop, "all-gather", ("fsdp",)) / volume(ours, "all-gather", ("fsdp",)) == pytest.approx(
        factors["all-gather"], rel=0.01)
    assert volume(loop, "all-reduce", ("tp",)) / volume(ours, "all-reduce", ("tp",)) == pytest.approx(
        factors["all-reduce"], rel=0.01)
    # gradients on the network, by bandwidth (these small ones are latency-bound: a few us either way)
    network = lambda xs, kind: sum(transfer(kind, x.nbytes, x.axes, mesh, cluster).bandwidth_s * x.runs
                                   for x in xs if x.kind == kind and x.axes == ("fsdp",))
    assert network(loop, "all-reduce") / network(ours, "reduce-scatter") == pytest.approx(factors["gradients"],
                                                                                         rel=0.01)
    # what the test prints (pytest -s) is what the report quotes
    print(f"\nremat={remat}: FLOPs {predicted.roofline.flops:.4g} both; communication predicted "
          f"{predicted.comm_s * 1e6:.0f} us, compiled {compiled.comm_s * 1e6:.0f} us")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
@pytest.mark.parametrize("remat", ["none", "full"])
def test_prediction_against_a_step_compiled_by_xla_tpu(remat):
    """The same step compiled by XLA's TPU compiler for a v5e:2x4 slice (bfloat16 kept): the TP all-reduces are
    Megatron's to the byte (XLA:TPU sums the column-parallel input gradients before reducing them); the dots
    agree within 0.01 %; the gradients are all-reduced whole over fsdp, as on CPU (twice our reduce-scatter on
    the network). Its FSDP gathers are 3.3-3.5x ours on this small model: XLA:TPU gathers a weight again for
    each use in the backward rather than once a layer."""
    import jax.numpy as jnp

    from workbench.core.compile.virtual import compile_step

    config = ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=1024, num_attention_heads=8,
                                             num_key_value_heads=4, num_hidden_layers=4, vocab_size=512))
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).with_options(remat=remat)
    cluster, mesh, batch = Cluster.tpu("v5e:2x4"), {"fsdp": 4, "tp": 2}, (8, 128)
    compiled = step_time(compile_step(model, cluster, mesh, batch=batch))
    predicted = predict_step(config, cluster, mesh, batch=batch, remat=remat)
    assert predicted.roofline.flops == pytest.approx(compiled.roofline.flops, rel=1e-4)
    loop = [x for x in compiled.collectives if x.runs == config.num_hidden_layers]
    ours = [x for x in predicted.collectives if x.part in ("attention", "mlp")]
    volume = lambda xs, kind: sum(x.nbytes * x.runs for x in xs if x.kind == kind)
    assert volume(loop, "all-reduce") - volume([x for x in loop if x.axes == ("fsdp",)], "all-reduce") == volume(
        ours, "all-reduce")
    assert volume([x for x in loop if x.axes == ("fsdp",)], "all-reduce") == 4 * volume(ours, "reduce-scatter")
    assert 3.2 < volume(loop, "all-gather") / volume(ours, "all-gather") < 3.6
