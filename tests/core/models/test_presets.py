"""Tiny presets: every family builds, and its config dict builds the matching transformers model. Full-size presets:
each builds abstractly with the parameter count its publisher states."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import (
    FAMILIES,
    FULL_SIZE,
    TINY_VOCAB,
    full_config,
    full_config_dict,
    tiny,
    tiny_config,
)
from workbench.core.models.tokenizer import ByteTokenizer, CharTokenizer

B, T = 2, 24


def inputs(vocab=TINY_VOCAB):
    ids = np.random.default_rng(0).integers(0, vocab, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, :5] = 0  # left padding
    return ids, mask


def hf_reference(family, model, directory):
    """The transformers model that ``tiny_config(family)`` describes, holding ``model``'s weights (on-disk format)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file

    from workbench.core.models.hf_convert import hf_state_dict

    save_file({k: np.ascontiguousarray(v) for k, v in hf_state_dict(model).items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(tiny_config(family)))
    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_builds_and_matches_the_transformers_model_of_its_config(family, tmp_path):
    model = tiny(family, attn_mechanism="vanilla", seed=3)
    assert model.config.model_type == {"gemma3": "gemma3_text"}.get(family, family)
    ids, mask = inputs()
    with jax.default_matmul_precision("highest"):
        out = model(jnp.asarray(ids), jnp.asarray(mask))
    logits = getattr(out, "logits", out)
    assert logits.shape == (B, T, TINY_VOCAB) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())

    torch = pytest.importorskip("torch")
    reference = hf_reference(family, model, tmp_path)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)  # what HF generate() passes for left padding
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                         position_ids=torch.tensor(positions)).logits.numpy()
    keep = mask.astype(bool)
    assert np.abs(np.asarray(logits) - want)[keep].max() <= 1e-4


def test_family_switches():
    assert TINY_VOCAB >= ByteTokenizer.vocab_size and TINY_VOCAB % 8 == 0
    assert tiny_config("mistral")["sliding_window"] == 16
    assert ModelConfig.from_hf(tiny_config("mistral")).sliding_window == 16
    assert ModelConfig.from_hf(tiny_config("qwen2")).attention_bias
    qwen3 = ModelConfig.from_hf(tiny_config("qwen3"))
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_attention_heads
    assert tiny_config("gpt2")["n_positions"] == 256
    mixtral = tiny_config("mixtral")
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"]) == (4, 2)
    for family in FAMILIES:
        config = ModelConfig.from_hf(tiny_config(family))
        assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (64, 4, TINY_VOCAB)
        assert config.num_key_value_heads == (4 if family in ("gpt2", "deepseek_v3") else 2)


def test_unknown_family_and_vocab_override():
    with pytest.raises(ValueError, match=r"llama.*mixtral"):
        tiny("gpt5")
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_config("llama", vocab_size=0)
    tok = CharTokenizer.from_text("abc")
    model = tiny("llama", vocab_size=tok.vocab_size, attn_mechanism="vanilla", seed=1)
    assert model.config.vocab_size == 7
    assert tiny_config("llama", num_hidden_layers=1)["num_hidden_layers"] == 1
    with pytest.raises(ValueError, match="no key"):
        tiny_config("llama", num_layers=1)
    config = tiny_config("llama")
    config["hidden_size"] = 8  # a fresh copy each call
    assert tiny_config("llama")["hidden_size"] == 64


def test_config_dict_reads_the_same_through_transformers():
    transformers = pytest.importorskip("transformers")
    for family in FAMILIES:
        hf_config = transformers.AutoConfig.for_model(**tiny_config(family))
        assert type(hf_config).__name__.lower().startswith(family.replace("_", ""))
        assert ModelConfig.from_hf(hf_config.to_dict()) == ModelConfig.from_hf(tiny_config(family))


# -- full-size presets: their parameter counts against the published ones -------------------------------------------
def _param_count(name: str) -> int:
    """The parameters of the preset built abstractly, as a planner builds it (nothing allocated)."""
    model = CausalLM.lazy_init(full_config(name), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# Exact counts: the Hugging Face model API's safetensors.total (https://huggingface.co/api/models/<repo>), the number of
# values the checkpoint stores, at the revision named (as recorded with the revision on 2026-10-01).
HUB_TOTALS = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "d04e592b", 8_030_261_248),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "349b2ddb", 70_553_706_496),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", "b906e4dc", 405_853_388_800),
    # The Llama 2 conversion (transformers 4.32) also stores each layer's rotary_emb.inv_freq buffer, head_dim / 2 =
    # 64 values that are not parameters, as HF's Llama conversions of that time did (their model.safetensors.index.json
    # lists model.layers.<i>.self_attn.rotary_emb.inv_freq): 80 x 64 of the total.
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", "3aba440b", 68_976_653_312 - 80 * 64),
}


@pytest.mark.parametrize("name", sorted(HUB_TOTALS))
def test_full_size_preset_has_the_hubs_parameter_count(name):
    assert _param_count(name) == HUB_TOTALS[name][2], HUB_TOTALS[name][:2]


# Rounded counts as their publishers state them: (total, its rounding in billions, non-embedding or None, source).
# Qwen3 model cards (huggingface.co/Qwen/<model>, "Model Overview"): "Number of Parameters" and "Number of Paramaters
# (Non-Embedding)", the latter without the embedding and the untied head. Mistral AI's announcements
# (mistral.ai/news/mixtral-of-experts: "Mixtral has 46.7B total parameters"; mistral.ai/news/mixtral-8x22b: "39B
# active parameters out of 141B").
STATED_COUNTS = {
    "qwen3-8b": (8.2e9, 0.05e9, 6.95e9, 0.005e9),
    "qwen3-32b": (32.8e9, 0.05e9, 31.2e9, 0.05e9),
    "qwen3-30b-a3b": (30.5e9, 0.05e9, 29.9e9, 0.05e9),  # "30.5B in total and 3.3B activated"
    "qwen3-235b-a22b": (235e9, 0.5e9, 234e9, 0.5e9),  # "235B in total and 22B activated"
    "mixtral-8x7b": (46.7e9, 0.05e9, None, None),
    "mixtral-8x22b": (141e9, 0.5e9, None, None),
}


@pytest.mark.parametrize("name", sorted(STATED_COUNTS))
def test_full_size_preset_has_its_published_parameter_count(name):
    total, half_step, non_embedding, ne_half_step = STATED_COUNTS[name]
    count = _param_count(name)
    assert abs(count - total) <= half_step, f"{name}: {count:,} parameters, published {total:.4g}"
    if non_embedding is not None:
        c = full_config(name)
        embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        assert abs(count - embeddings - non_embedding) <= ne_half_step, f"{name}: {count - embeddings:,} non-embedding"


def test_full_size_configs_read_the_same_through_transformers():
    """Each preset's dict, read by transformers' own config class, gives the same ModelConfig: no key misspelt."""
    transformers = pytest.importorskip("transformers")
    for name in FULL_SIZE:
        config = full_config_dict(name)
        hf_config = transformers.AutoConfig.for_model(**config)
        assert ModelConfig.from_hf(hf_config.to_dict()) == ModelConfig.from_hf(config), name


def test_unknown_full_size_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"llama-3\.1-8b.*qwen3-30b-a3b.*mixtral-8x22b"):
        full_config("llama-3.1-8")
