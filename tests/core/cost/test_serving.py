"""The serving model (``workbench.core.cost.serving``) against hand counts: a continuous-batching step is the decode
of the running batch at its mean context, the prefill work of the requests it admits (the prompt's step without the
weights' read), and the engine's cost a layer; TTFT is a prefill step and one engine step."""

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

from workbench.core.axes import MODE_DECODE
from workbench.core.cost.ledger import ledger
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.serving import (
    engine_cost,
    kv_capacity,
    served_bytes,
    serving_frontier,
    serving_step,
    time_to_first_token,
)
from workbench.core.hardware.calibration import ENGINE_LAYER
from workbench.core.hardware.chips import H100, TPU7X
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import MESH_AXES
from workbench.core.models import CausalLM
from workbench.core.models.presets import full_config
from workbench.core.sharding.plan import Layout

LLAMA_8B = full_config("llama-3.1-8b")


def test_a_step_is_the_decode_the_admitted_prefills_and_the_engine():
    """Two replicas of tp=4 on 8 H100s, 64 requests in flight of 1,000 prompt and 500 output tokens: each replica
    decodes 32 sequences against caches of 1,000 + 250 positions and admits 32 / 500 requests a step, each a
    1,000-token prompt whose weights the decode has already read."""
    cluster, mesh = Cluster.h100(nodes=1), {"dp": 2, "tp": 4}
    step = serving_step(LLAMA_8B, cluster, mesh, concurrency=64, input_len=1000, output_len=500,
                        engine="TensorRT-LLM")
    decode = predict_step(LLAMA_8B, cluster, mesh, batch=(64, 1250), task="decode")
    prompt = predict_step(LLAMA_8B, cluster, mesh, batch=(2, 1000), task="prefill")
    weights_read = sum(t.seconds for t in prompt.terms if t.name == "matmuls bound by HBM")
    assert step.context == 1250 and step.decode.time_s == decode.time_s
    assert step.prefill_s == pytest.approx(32 / 500 * (prompt.time_s - weights_read), rel=1e-12)
    assert step.engine.seconds == pytest.approx(ENGINE_LAYER[("TensorRT-LLM", H100)].value * 32, rel=1e-12)
    assert step.time_s == pytest.approx(sum(step.parts().values()), rel=1e-12)
    assert step.tokens_per_s == pytest.approx(64 / step.time_s)
    assert step.tokens_per_s_per_chip == pytest.approx(step.tokens_per_s / 8)


def test_ttft_is_one_prefill_step_and_one_engine_step():
    cluster = Cluster.h100(nodes=1, gpus_per_node=1)
    first = time_to_first_token(LLAMA_8B, cluster, {"tp": 1}, input_len=2048, dtype="fp8", engine="TensorRT-LLM")
    prefill = predict_step(LLAMA_8B, cluster, {"tp": 1}, batch=(1, 2048), task="prefill", dtype="fp8")
    assert first.time_s == pytest.approx(prefill.time_s + 32 * ENGINE_LAYER[("TensorRT-LLM", H100)].value)


def test_a_prompt_within_the_prefill_budget_is_one_step():
    cluster = Cluster.h100(nodes=1, gpus_per_node=1)
    whole = time_to_first_token(LLAMA_8B, cluster, {"tp": 1}, input_len=2048, engine="TensorRT-LLM")
    within = time_to_first_token(LLAMA_8B, cluster, {"tp": 1}, input_len=2048, prefill_chunk=4096,
                                 engine="TensorRT-LLM")
    assert within.steps == 1 and within.time_s == pytest.approx(whole.time_s, rel=1e-9)


def test_a_chunked_prefill_reads_the_weights_and_pays_the_engine_every_chunk():
    """8 prompts of 1,024 tokens in chunks of 64 on one H100: 128 steps. A 64-token chunk of Llama-3.1-8B multiplies
    in 64 x 2 x 8.0e9 / 989e12 = 1.0 ms and reads 16 GB of bfloat16 weights in 4.8 ms at the full 3.35 TB/s, so
    every step takes at least the read: at least 128 x 4.8 ms, and 128 engine steps of 32 layers."""
    cluster = Cluster.h100(nodes=1, gpus_per_node=1)
    first = time_to_first_token(LLAMA_8B, cluster, {"tp": 1}, input_len=1024, prompts=8, prefill_chunk=64,
                                engine="TensorRT-LLM")
    weights, _ = served_bytes(LLAMA_8B, 1)
    engine_s = 128 * 32 * ENGINE_LAYER[("TensorRT-LLM", H100)].value
    assert first.steps == 128 and weights == pytest.approx(16.06e9, rel=0.01)
    assert first.time_s - engine_s >= 128 * weights / H100.hbm_bandwidth


def test_a_tpu7x_chip_is_two_devices_when_throughput_is_counted_per_chip():
    """tp=8 over a tpu7x 2x2x1 slice: 8 TensorCores, 4 chips."""
    step = serving_step(LLAMA_8B, Cluster.tpu("tpu7x:2x2x1"), {"tp": 8}, concurrency=16, input_len=512,
                        output_len=512)
    assert step.tokens_per_s_per_chip == pytest.approx(step.tokens_per_s / 4)


def test_an_engine_without_a_measurement_on_the_chip_costs_nothing_and_says_so():
    cost = engine_cost("vLLM", Cluster.tpu("tpu7x:2x2x1"), LLAMA_8B)
    assert cost.seconds == 0 and "not priced" in cost.note and TPU7X.name in cost.note
    assert engine_cost(None, Cluster.h100(nodes=1), LLAMA_8B).seconds == 0
    with pytest.raises(ValueError, match="engine"):
        engine_cost("Triton", Cluster.h100(nodes=1), LLAMA_8B)


def test_bad_loads_say_what_to_give():
    cluster = Cluster.h100(nodes=1)
    with pytest.raises(ValueError, match="concurrency"):
        serving_step(LLAMA_8B, cluster, {"tp": 8}, concurrency=0, input_len=10, output_len=10)
    with pytest.raises(ValueError, match="sequences do not split"):
        serving_step(LLAMA_8B, cluster, {"dp": 2, "tp": 4}, concurrency=3, input_len=10, output_len=10)
    with pytest.raises(ValueError, match="prompts"):
        time_to_first_token(LLAMA_8B, cluster, {"tp": 8}, input_len=10, prompts=-1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        time_to_first_token(LLAMA_8B, cluster, {"tp": 8}, input_len=10, prefill_chunk=0)


# -- the latency-throughput frontier: hand counts -----------------------------------------------------------------
def _params(name):
    """Parameter elements by path, from the model's own shapes (nothing allocated)."""
    import math

    from flax import nnx

    from workbench.core.models import CausalLM

    model = CausalLM.lazy_init(full_config(name))
    return {"/".join(map(str, path)): math.prod(v.shape) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("weight_dtype, weight_bytes, kv_dtype, kv_bytes",
                         [(None, 2, None, 2), ("fp8", 1, "fp8", 1), ("int4", 0.5 + 2 / 128, None, 2)])
def test_a_device_holds_its_weights_once_and_a_token_s_kv_heads(weight_dtype, weight_bytes, kv_dtype, kv_bytes):
    """Llama-3-70B at tp=8: the layers' matmul weights over 8 devices in their stored dtype, the head and the
    embedding over 8 in bfloat16, the norms' scales whole on every device in bfloat16; a token's cache is 80 layers
    x K and V x one of the 8 KV heads x 128 dims."""
    params = _params("llama-3-70b")
    layers = sum(n for p, n in params.items() if p.startswith("layers/") and p.endswith("kernel"))
    head_and_embedding = params["lm_head/kernel"] + params["embed_tokens"]
    norms = sum(params.values()) - layers - head_and_embedding
    assert norms == (2 * 80 + 1) * 8192
    weights, kv = served_bytes(full_config("llama-3-70b"), 8, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    assert weights == pytest.approx((layers * weight_bytes + head_and_embedding * 2) / 8 + norms * 2, rel=1e-12)
    assert kv == 80 * 2 * 1 * 128 * kv_bytes


def test_a_bfloat16_replica_holds_what_the_ledger_counts():
    """The frontier's KV capacity rests on served_bytes; in bfloat16 its weights and cache are the memory ledger's
    parameters and KV cache for a decode step of the same layout (Llama-3.1-70B, tp=8, 16 sequences of 2,000)."""
    config = full_config("llama-3.1-70b")
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    shape = tuple(8 if name == "tp" else 1 for name in MESH_AXES)
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))
    counted = ledger(model, Layout.of(model, mesh, mode=MODE_DECODE), kind="decode", batch=(16, 1), kv_length=2000)
    weights, kv = served_bytes(config, 8)
    assert weights == counted.params and kv * 16 * 2000 == counted.kv_cache


def test_kv_capacity_is_the_hbm_left_after_the_weights():
    cluster = Cluster.h100(nodes=1)
    weights, kv = served_bytes(full_config("llama-3-70b"), 8)
    assert kv_capacity(full_config("llama-3-70b"), cluster, 8) == int((0.9 * cluster.hbm_per_device - weights) // kv)
    assert kv_capacity(full_config("llama-3-70b"), cluster, 1) == 0  # 141 GB of bf16 weights on one 80 GB GPU
    with pytest.raises(ValueError, match="memory_fraction"):
        kv_capacity(full_config("llama-3-70b"), cluster, 8, memory_fraction=1.5)


def test_decode_turns_compute_bound_where_the_matmuls_outlast_the_weights_read():
    """The Inference chapter's critical batch: a decode matmul reads ``2`` bytes a weight and does ``2B`` FLOPs with
    it, so it is compute-bound past ``B* = C e / (W h)`` rows (C the peak, e the GEMM efficiency, W the HBM
    bandwidth, h its attained share): 989e12 x 0.70 / (3.35e12 x 0.87) = 238 on an H100 in bf16. Llama-3-70B at
    tp=8: no matmul time is compute-bound at 128 sequences, most of it at 512."""
    c, cluster = full_config("llama-3-70b"), Cluster.h100(nodes=1)

    def compute_share(b):
        terms = {t.name: t.seconds for t in predict_step(c, cluster, {"tp": 8}, batch=(b, 2048), task="decode").terms}
        return terms["matmuls"] / (terms["matmuls"] + terms["matmuls bound by HBM"])

    assert round(989e12 * 0.70 / (3.35e12 * 0.87)) == 238
    assert compute_share(128) == 0 and compute_share(512) > 0.5


def test_the_front_is_every_point_no_other_beats_on_both():
    c, cluster = full_config("llama-3-70b"), Cluster.h100(nodes=1)
    points = serving_frontier(c, cluster, input_len=1000, output_len=1000, engine="TensorRT-LLM")
    # tp=1 holds no 141 GB of weights; tp=2 leaves 0.9 x 80 - 70.55 GB a GPU, 8,835 tokens of 163,840 B (4 KV heads
    # a GPU): four requests of 2,000 a replica, 16 over its 4 replicas
    assert {tuple(p.mesh.items()) for p in points} == {(("dp", 4), ("tp", 2)), (("dp", 2), ("tp", 4)), (("tp", 8),)}
    assert max(p.step.concurrency for p in points if p.mesh["tp"] == 2) == 16
    for p in points:
        capacity = kv_capacity(c, cluster, p.mesh["tp"]) // 2000 * p.mesh.get("dp", 1)
        assert p.step.concurrency <= capacity
        beaten = any(q.ms_per_token <= p.ms_per_token and q.tokens_per_s_per_chip >= p.tokens_per_s_per_chip
                     and (q.ms_per_token, q.tokens_per_s_per_chip) != (p.ms_per_token, p.tokens_per_s_per_chip)
                     for q in points)
        assert p.on_front == (not beaten), p.label
    front = sorted((p for p in points if p.on_front), key=lambda p: p.ms_per_token)
    assert front[0].step.concurrency == 1 and front[0].mesh == {"tp": 8}  # the fastest token: one request, tp=8
