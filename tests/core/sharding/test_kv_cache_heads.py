"""A KV cache on a mesh whose tp outnumbers the KV heads keeps one head per tp device, each head repeated (as vLLM
and MaxText serve GQA), instead of the whole cache on every device: the spec, the ledger's bytes, the predicted
decode step and the advisor, against hand counts."""

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from workbench.core.advisor import advise
from workbench.core.cost.ledger import kv_cache_bytes
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import MESH_AXES
from workbench.core.models import CausalLM, ModelConfig, tiny_config
from workbench.core.models.cache import stored_kv_heads
from workbench.core.models.presets import full_config
from workbench.core.sharding.plan import Layout, kv_cache_spec

B, S = 8, 8192  # 8 sequences of 8k context
LAYERS, KV, HEAD_DIM = 80, 8, 128  # Llama-3-70B: 64 query heads, 8 KV heads of 128


def _mesh(**sizes):
    shape = tuple(sizes.get(name, 1) for name in MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


@pytest.fixture(scope="module")
def llama_70b():
    return CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _hand_bytes(heads_per_device: int) -> int:
    """Keys and values of every layer, bf16, rows and length whole: layers x 2 x B x S x heads x D x 2 bytes."""
    return LAYERS * 2 * B * S * heads_per_device * HEAD_DIM * 2


def test_tp_16_over_8_kv_heads_repeats_each_head_to_one_per_device(llama_70b):
    layout = Layout.of(llama_70b, _mesh(tp=16))
    shape, spec, reason = kv_cache_spec(layout, B, S)
    assert shape == (B, S, 16, HEAD_DIM)
    assert spec == P(("fsdp", "dp"), "sp", "tp", None)
    assert ("dim2 KV_HEAD: 8 KV heads repeated 2x to one per tp device (as serving engines do); sharded 16 ways "
            "over tp, 1 per shard") in reason
    assert kv_cache_bytes(layout, B, S, jnp.bfloat16) == _hand_bytes(1) == 2_684_354_560


def test_tp_4_splits_the_8_heads_as_before(llama_70b):
    layout = Layout.of(llama_70b, _mesh(fsdp=4, tp=4))
    shape, spec, reason = kv_cache_spec(layout, B, S)
    assert shape == (B, S, KV, HEAD_DIM) and spec[2] == "tp"
    assert "repeated" not in reason and "dim2 KV_HEAD: sharded 4 ways over tp, 2 per shard" in reason
    assert kv_cache_bytes(layout, B, S, jnp.bfloat16) == _hand_bytes(2) // 4  # the batch split 4 ways over fsdp


@pytest.mark.parametrize("tp, why", [(12, "8 KV heads do not repeat to one per tp device (12 is not a multiple of "
                                          "them); tp dropped: 8 not divisible by 12; replicated"),
                                     (3, "tp dropped: 8 not divisible by 3; replicated")])
def test_tp_that_neither_divides_nor_repeats_the_heads_replicates_them_and_says_why(llama_70b, tp, why):
    layout = Layout.of(llama_70b, _mesh(tp=tp))
    shape, spec, reason = kv_cache_spec(layout, B, S)
    assert shape == (B, S, KV, HEAD_DIM) and spec[2] is None
    assert f"dim2 KV_HEAD: {why}" in reason
    assert kv_cache_bytes(layout, B, S, jnp.bfloat16) == _hand_bytes(KV)


def test_heads_repeat_only_where_the_query_heads_split_as_far():
    """Tiny Llama: 4 query heads, 2 KV heads. tp=4 keeps one KV head per device (2 query heads each); tp=8 would
    leave half a query head per device, so the KV heads are not repeated."""
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    four = kv_cache_spec(Layout.of(model, _mesh(tp=4, fsdp=2)), 4, 16)
    assert four[0] == (4, 16, 4, 16) and four[1] == P(("fsdp", "dp"), "sp", "tp", None)
    eight_shape, eight_spec, eight_reason = kv_cache_spec(Layout.of(model, _mesh(tp=8)), 4, 16)
    assert eight_shape == (4, 16, 2, 16) and eight_spec[2] is None
    assert "2 KV heads do not repeat to one per tp device (the 4 query heads do not split 8 ways)" in eight_reason


def test_mla_keeps_its_one_latent_head_replicated_and_says_so():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("deepseek_v3")))
    shape, spec, reason = kv_cache_spec(Layout.of(model, _mesh(tp=4, fsdp=2)), 4, 16)
    assert shape == (4, 16, 1, 32 + 8) and spec[2] is None
    assert "MLA caches one latent head, replicated over tp as MaxText and vLLM keep it" in reason


def test_stored_heads_by_hand():
    assert [stored_kv_heads(8, 64, tp) for tp in (1, 2, 4, 8, 16, 32, 64, 128, 3, 12, 24)] == \
        [8, 8, 8, 8, 16, 32, 64, 8, 8, 8, 8]  # 128, 24: the 64 query heads do not split that far
    assert stored_kv_heads(64, 64, 16) == 64  # MHA: the heads split, nothing repeats


def test_a_decode_step_reads_one_cache_head_per_device_at_tp_16():
    """Predicted HBM bytes of the attention at tp=16 less those at tp=8 (the weights and the split activations halve,
    the cache read stays one head per device: 8 heads over 8, or 16 stored heads over 16), against the same
    difference by hand. Before, tp=16 was credited with half a head per device."""
    c = full_config("llama-3-70b")

    def attention_bytes(tp):
        v5e = Cluster.tpu({8: "v5e:2x4", 16: "v5e:4x4"}[tp])  # bytes a device moves: the chip does not matter
        step = predict_step(c, v5e, {"tp": tp}, batch=(B, S), task="decode", efficiency=1.0)
        return next(p.hbm_bytes for p in step.parts if p.kind == "attention")

    head_bytes = 2 * B * (S + 1) * HEAD_DIM * 2 * LAYERS  # one K and V head: read the cache, write the new token
    weights = 2 * c.hidden_size * (c.num_attention_heads + KV) * HEAD_DIM * 2 * LAYERS  # q, k, v, o
    # activations tp splits, a token: q, k, v out and o in (2 (H + KV) h), Q read and O written in the kernel (2 H h)
    acts = B * (2 * (c.num_attention_heads + KV) * HEAD_DIM + 2 * c.num_attention_heads * HEAD_DIM) * 2 * LAYERS
    per_tp = lambda tp: (weights + acts) / tp + head_bytes
    assert attention_bytes(16) - attention_bytes(8) == pytest.approx(per_tp(16) - per_tp(8), rel=1e-9)


def test_the_advisor_serves_llama_3_70b_16_way_tensor_parallel_on_a_v5e_4x4():
    """The issue's case: 8 sequences of 8k on a v5e 4x4 (16 GiB chips). Before, tp=16 kept the whole 20 GiB cache on
    every chip and did not fit; with one KV head per chip it fits and is the fastest decode layout."""
    advice = advise(full_config("llama-3-70b"), Cluster.tpu("v5e:4x4"), batch_tokens=B, seq_len=S, task="decode")
    tp16 = [c for c in advice.ranked if c.mesh_shape["tp"] == 16 and c.mesh_shape["fsdp"] == 1]
    assert tp16 and tp16[0] is advice.ranked[0], advice.table(5)
    best = tp16[0]
    assert best.ledger.kv_cache == _hand_bytes(1)
    assert best.ledger.total < 0.9 * 16 * 2**30
    print(f"tp=16: {best.time_s * 1e3:.1f} ms a token, {best.ledger.total / 2**30:.1f} GiB a chip")
