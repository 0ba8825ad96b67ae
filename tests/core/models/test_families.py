"""Every family's forward pass, loss and classifier head against tiny random-weight Hugging Face models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import (
    FAMILIES,
    MAIN_FAMILIES,
    TINY,
    B,
    T,
    batch,
    hf_forward,
    hf_model,
    state_dict,
    torch,
    transformers,
)
from workbench.core.axes import ColumnWise, ExpertColumnWise, ExpertRowWise, RowWise
from workbench.core.models import CausalLM, ModelConfig, SequenceClassifier, from_hf_state_dict


def ours_from(model, **kwargs):
    config = ModelConfig.from_hf(model.config.to_dict())
    return from_hf_state_dict(config, state_dict(model), **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf_with_left_padding(family):
    model = hf_model(family)
    ours = ours_from(model)
    base = family.split("-")[0]
    assert ours.config.model_type == {"gemma3": "gemma3_text"}.get(base, base)
    ids, mask = batch()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    want = hf_forward(model, ids, mask).logits.numpy()
    assert got.shape == want.shape == (B, T, TINY["vocab_size"]) and got.dtype == np.float32
    diff = np.abs(got - want)[mask.astype(bool)].max()
    print(f"{family}: max |logits diff| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_loss_matches_hf(family):
    model = hf_model(family)
    ours = ours_from(model)
    ids, mask = batch()
    # padded positions, and the first token after padding (predicted from a padded position), do not count
    labels = np.where(mask.astype(bool) & np.pad(mask[:, :-1], ((0, 0), (1, 0)), constant_values=1), ids, -100)
    want = hf_forward(model, ids, mask, labels=torch.tensor(labels)).loss.item()
    with jax.default_matmul_precision("highest"):
        got, out = ours.compute_loss(jnp.asarray(ids), jnp.asarray(mask))
    assert out.logits.shape == (B, T, TINY["vocab_size"])
    assert abs(float(got) - want) <= 1e-5, (float(got), want)


def test_mixtral_router_logits_match_hf():
    model = hf_model("mixtral")
    ours = ours_from(model)
    ids, mask = batch()
    want = hf_forward(model, ids, mask, output_router_logits=True).router_logits
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).router_logits)
    assert got.shape == (2, B * T, 4)
    keep = mask.reshape(-1).astype(bool)
    np.testing.assert_allclose(got[:, keep], np.stack([r.numpy() for r in want])[:, keep], atol=1e-5)


def test_sequence_classifier_matches_hf():
    model = hf_model("llama", cls=transformers.AutoModelForSequenceClassification, num_labels=3, pad_token_id=0)
    ids, mask = batch()
    ids = np.where(mask.astype(bool), ids, 0)
    ids[:, -1] = np.maximum(ids[:, -1], 1)  # HF finds the last token that is not the pad id
    ours = ours_from(model, model_cls=SequenceClassifier, num_labels=3)
    assert not ours.can_generate()
    want = hf_forward(model, ids, mask).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert got.shape == (B, 3)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_family_switches_from_hf():
    llama = ModelConfig.from_hf(FAMILIES["llama"]().to_dict())
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0 and not llama.qk_norm
    mistral = ModelConfig.from_hf(FAMILIES["mistral"]().to_dict())
    assert mistral.sliding_window == 5 and mistral.layer_window(1) == 5
    qwen2 = ModelConfig.from_hf(FAMILIES["qwen2"]().to_dict())
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.layer_window(0) is None
    qwen3 = ModelConfig.from_hf(FAMILIES["qwen3"]().to_dict())
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.tie_word_embeddings
    layered = ModelConfig.from_hf(FAMILIES["qwen2-sliding-layers"]())  # a PretrainedConfig works too
    assert layered.layer_types == ("full_attention", "sliding_attention") and layered.layer_window(1) == 3
    gpt2 = ModelConfig.from_hf(FAMILIES["gpt2"]().to_dict())
    assert (gpt2.norm_type, gpt2.mlp_type, gpt2.position_embedding) == ("layer", "gelu", "learned")
    assert gpt2.tie_word_embeddings and gpt2.attention_bias and gpt2.attention_out_bias and gpt2.mlp_bias
    mixtral = ModelConfig.from_hf(FAMILIES["mixtral"]().to_dict())
    assert (mixtral.mlp_type, mixtral.num_local_experts, mixtral.num_experts_per_tok) == ("moe", 4, 2)


@pytest.mark.parametrize("family", [*MAIN_FAMILIES, "qwen2-sliding-layers", "llama-bias-tied",
                                    "deepseek_v3-no-q-lora"])
def test_config_round_trips_through_transformers(family):
    config = ModelConfig.from_hf(FAMILIES[family]().to_dict())
    again = ModelConfig.from_hf(transformers.AutoConfig.for_model(**config.to_hf()).to_dict())
    assert again == config


def test_kernels_carry_semantic_axes():
    model = CausalLM(ModelConfig.from_hf(FAMILIES["qwen2"]().to_dict()), rngs=nnx.Rngs(0))
    attn = model.layers[0].self_attn
    assert attn.q_proj.kernel.semantic_axes == ColumnWise
    assert attn.o_proj.kernel.semantic_axes == RowWise
    assert model.layers[0].mlp.down_proj.kernel.semantic_axes == RowWise
    moe = CausalLM(ModelConfig.from_hf(FAMILIES["mixtral"]().to_dict()), rngs=nnx.Rngs(0)).layers[0].mlp
    assert moe.gate_proj.semantic_axes == ExpertColumnWise and moe.down_proj.semantic_axes == ExpertRowWise


@pytest.mark.parametrize("hf, match", [
    ({**TINY, "model_type": "falcon"}, r"'falcon' is not supported.*llama.*gpt2.*mixtral"),
    ({**TINY, "model_type": "llama", "hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "vocab_size": 8,
      "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({**TINY, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
])
def test_unsupported_configs_say_what_to_change(hf, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


def test_missing_and_misshaped_parameters_are_named():
    model = hf_model("llama")
    config = ModelConfig.from_hf(model.config.to_dict())
    weights = state_dict(model)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*layers\.1\.self_attn"):
        from_hf_state_dict(config, missing)
    wrong = {**weights, "model.norm.weight": np.ones((63,), np.float32)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(63,\).*expected \(64,\)"):
        from_hf_state_dict(config, wrong)
    with pytest.raises(ValueError, match="no matching parameter"):
        from_hf_state_dict(config, {**weights, "model.extra.weight": np.ones(3)})


def test_attention_is_chosen_for_what_the_family_needs(monkeypatch):
    """GPT-OSS's sinks: "auto" skips a backend default that lacks them (sdpa on GPU), and naming such an
    implementation is refused with the error that names who can."""
    from workbench.core.models import causal_lm
    from workbench.core.models.presets import tiny_config

    config = ModelConfig.from_hf(tiny_config("gpt_oss"))
    monkeypatch.setattr(causal_lm.jax, "default_backend", lambda: "gpu")
    assert causal_lm.resolve_attention("auto", config) == "flash"
    assert causal_lm.resolve_attention("auto", ModelConfig.from_hf(tiny_config("llama"))) == "sdpa"
    with pytest.raises(ValueError, match=r"'sdpa' does not support sinks; implementations that do: .*flash"):
        causal_lm.resolve_attention("sdpa", config)
