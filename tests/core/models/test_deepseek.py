"""DeepSeek-V3's multi-head latent attention beyond the shared family harness (logits, loss, greedy, cached
decode, save/load and sharding run there): the cache holds the latent and the rope key once per token,
implementations that cannot serve MLA are refused naming who can, the interleaved rope channels are honoured
both ways, and the full-size config builds abstractly."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import FAMILIES, batch, hf_forward, hf_model, state_dict, transformers
from workbench.core.axes import ColumnWise, ExpertColumnWise, ExpertRowWise, RowWise
from workbench.core.models import CausalLM, ModelConfig, from_hf_state_dict
from workbench.core.models.cache import cache_footprint, kv_layout
from workbench.core.models.hf_convert import hf_state_dict
from workbench.core.models.mla import LatentDown, MLAttention
from workbench.core.models.presets import full_config, full_config_dict
from workbench.core.operations.attention.common import VALUE_DIM

B, S = 3, 10


def config_of(family="deepseek_v3", **changes):
    return ModelConfig.from_hf(FAMILIES[family]().to_dict()).replace(**changes)


def test_the_cache_holds_latent_and_rope_key_once_per_token():
    config = config_of()
    model = CausalLM(config, rngs=nnx.Rngs(0), attn_mechanism="vanilla")
    c, r, layers = config.kv_lora_rank, config.qk_rope_head_dim, config.num_hidden_layers
    cache = model.init_cache(B, S, dtype=jnp.bfloat16)
    assert cache.keys.shape == (layers, B, S, 1, c + r) and cache.values is None and cache.value_dim == c
    per_token_layer = cache.keys.nbytes // (layers * B * S)
    footprint = cache_footprint(config, jnp.bfloat16)
    assert per_token_layer == footprint.cached == (c + r) * 2 and cache.nbytes == cache.keys.nbytes
    assert footprint.expanded == config.num_attention_heads * (config.qk_nope_head_dim + r + config.v_head_dim) * 2
    pages = model.init_ragged_pages(batch_size=B, page_size=4, num_pages=6, max_model_length=16, dtype=jnp.float32)
    assert pages.key_pages.shape == (layers, 6, 4, 1, c + r) and pages.value_pages is None
    assert pages.nbytes // (layers * 6 * 4) == cache_footprint(config, jnp.float32).cached == (c + r) * 4
    assert model.create_cache_metadata(B, S)["nbytes"] == model.init_cache(B, S).nbytes
    assert kv_layout(config_of("llama")).value_dim is None  # other families keep keys and values
    print(footprint)


def test_full_size_config_builds_abstractly_and_its_cache_is_71x_smaller():
    config = full_config("deepseek-v3")
    start = time.perf_counter()
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    print(f"lazy_init of DeepSeek-V3 671B: {time.perf_counter() - start:.2f} s")  # measured, not asserted
    params = sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert round(params / 1e9, 1) == 671.0  # without the multi-token-prediction layer (transformers skips it)
    assert (len(model.dense_layers), len(model.layers)) == (3, 58)
    footprint = cache_footprint(config, jnp.bfloat16)
    assert (footprint.cached, footprint.expanded) == ((512 + 64) * 2, 128 * (192 + 128) * 2)
    print(footprint)
    meta = model.create_cache_metadata(1, 4096)
    assert meta["keys_shape"] == (1, 4096, 1, 576) and meta["nbytes"] == 61 * 4096 * 576 * 2  # bfloat16
    again = ModelConfig.from_hf(transformers.DeepseekV3Config(**config.to_hf()).to_dict())
    assert again == config and config.mla and config.q_lora_rank == 1536


@pytest.mark.parametrize("name", ["sdpa", "ring", "ulysses"])
def test_implementations_without_a_value_head_dim_are_refused_naming_who_can(name, monkeypatch):
    config = config_of()
    with pytest.raises(ValueError, match=rf"'{name}' does not support {VALUE_DIM}; implementations that do: "
                                         r".*flash.*paged.*vanilla"):
        CausalLM(config, rngs=nnx.Rngs(0), attn_mechanism=name)
    model = CausalLM(config, rngs=nnx.Rngs(0), attn_mechanism="vanilla")
    with pytest.raises(ValueError, match=f"does not support {VALUE_DIM}"):
        model.with_attention(name)
    from workbench.core.models import causal_lm

    monkeypatch.setattr(causal_lm.jax, "default_backend", lambda: "gpu")  # sdpa's home: "auto" skips it
    assert causal_lm.resolve_attention("auto", config) == "flash"


def test_attention_implementations_switch_inside_the_model():
    hf = hf_model("deepseek_v3")
    ours = from_hf_state_dict(config_of(), state_dict(hf))
    ids, mask = batch()
    with jax.default_matmul_precision("highest"):
        want = np.asarray(ours.with_attention("vanilla")(jnp.asarray(ids), jnp.asarray(mask)).logits)
        got = np.asarray(ours.with_attention("flash")(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert isinstance(ours.layers.self_attn, MLAttention)
    np.testing.assert_allclose(got[mask.astype(bool)], want[mask.astype(bool)], atol=1e-5)


def test_interleaved_rope_channels_are_permuted_at_load_and_back_at_save():
    hf = hf_model("deepseek_v3")
    weights = state_dict(hf)
    ours = from_hf_state_dict(config_of(), weights)
    saved = hf_state_dict(ours)
    attn = [k for k in weights if ".self_attn." in k]
    assert any("q_b_proj" in k for k in attn) and any("kv_a_proj_with_mqa" in k for k in attn)
    for name in attn:
        np.testing.assert_array_equal(saved[name], weights[name], err_msg=name)
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()[mask.astype(bool)]
    with jax.default_matmul_precision("highest"):
        unpermuted = from_hf_state_dict(config_of(rope_interleave=False), weights)
        wrong = np.asarray(unpermuted(jnp.asarray(ids), jnp.asarray(mask)).logits)[mask.astype(bool)]
    assert np.abs(wrong - want).max() > 1e-3  # the permutation is what makes it exact


def test_semantic_axes_of_the_new_parameters():
    model = CausalLM(config_of(), rngs=nnx.Rngs(0))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.q_a_proj.kernel.semantic_axes == attn.kv_a_proj_with_mqa.kernel.semantic_axes == LatentDown
    assert attn.q_b_proj.kernel.semantic_axes == attn.kv_b_proj.kernel.semantic_axes == ColumnWise
    assert attn.o_proj.kernel.semantic_axes == RowWise
    assert mlp.gate_proj.semantic_axes == ExpertColumnWise and mlp.down_proj.semantic_axes == ExpertRowWise
    assert mlp.shared_gate.semantic_axes == ColumnWise and mlp.shared_down.semantic_axes == RowWise
    assert model.dense_layers[0].mlp.down_proj.kernel.semantic_axes == RowWise


def test_contiguous_mla_cache_reorders_rows():
    model = CausalLM(config_of(), rngs=nnx.Rngs(0), attn_mechanism="vanilla")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (B, 4)))
    cache = model(ids, cache=model.init_cache(B, 8)).cache
    moved = cache.reorder(jnp.asarray([2, 0, 1]))
    assert moved.values is None and moved.value_dim == cache.value_dim
    np.testing.assert_array_equal(np.asarray(moved.keys[:, 0]), np.asarray(cache.keys[:, 2]))


@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="softmax"), r"scoring_func='softmax' is not supported"),
    (dict(first_k_dense_replace=2), r"every one of the 2 layers dense"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
])
def test_unsupported_deepseek_configs_say_what_to_change(change, match):
    hf = {**full_config_dict("deepseek-v3"), "num_hidden_layers": 2, **change}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_mla_config_checks():
    config = config_of()
    with pytest.raises(ValueError, match="head_dim=qk_rope_head_dim=8"):
        config.replace(head_dim=16)
    with pytest.raises(ValueError, match="q_lora_rank must be a positive int or None"):
        config.replace(q_lora_rank=0)
    with pytest.raises(ValueError, match=r"ModelConfig\.v_head_dim to be a positive int"):
        config.replace(v_head_dim=0)


def test_lora_and_int8_reach_the_absorbed_up_projection():
    """kv_b_proj is used through its kernel; wrapped by LoRA or int8 quantization its effective weight is used."""
    model = CausalLM(config_of(), rngs=nnx.Rngs(0), attn_mechanism="vanilla")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 6)))
    with jax.default_matmul_precision("highest"):
        base = np.asarray(model(ids).logits)
        lora = model.apply_lora_to_layers(4, "kv_b_proj")
        np.testing.assert_allclose(np.asarray(lora(ids).logits), base, atol=1e-6)  # lora_b starts at zero
        graphdef, state = nnx.split(lora)
        state = jax.tree.map(lambda x: x, state)
        b = state["layers"]["self_attn"]["kv_b_proj"]["lora_b"]
        b.set_value(jnp.full(b.shape, 0.05, b.dtype))
        assert np.abs(np.asarray(nnx.merge(graphdef, state)(ids).logits) - base).max() > 1e-3
        quantized = np.asarray(model.quantize()(ids).logits)
    assert 0 < np.abs(quantized - base).max() < 0.05
