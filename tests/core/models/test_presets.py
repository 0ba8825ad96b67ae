"""Tiny presets: every family builds, and its config dict builds the matching transformers model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.core.models import ModelConfig
from workbench.core.models.presets import FAMILIES, TINY_VOCAB, tiny, tiny_config
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
