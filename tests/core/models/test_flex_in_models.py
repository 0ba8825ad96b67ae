"""``flex`` inside models: ``with_attention("flex", ...)`` in every layer, against ``vanilla`` (float32, left padding
through segment ids and kv_lengths, GQA), a sliding-window mask mod against the model's own sliding window, and
generation with a KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.core.operations.attention import block_mask as mods
from workbench.models import GenerationConfig, tiny


def batch(model, b=2, t=48):
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (b, t)), jnp.int32)
    return ids, jnp.ones_like(ids).at[1, :5].set(0)


def max_diff(got, want, mask):
    return float(jnp.max(jnp.abs(got - want) * mask[..., None]))  # padded rows' logits mean nothing


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_flex_in_every_layer_equals_vanilla(family):
    model = tiny(family)
    ids, mask = batch(model)
    with jax.default_matmul_precision("highest"):
        want = model.with_attention("vanilla")(ids, mask).logits
        got = model.with_attention("flex", block_q=16, block_k=16)(ids, mask).logits
    assert max_diff(got, want, mask) <= 2e-5


def test_a_score_mod_reaches_every_layer():
    """A soft cap of 0.1 as a score mod: the logits move (the cap bites) and stay finite. Its numbers are checked
    against the float64 reference in tests/core/operations/attention/test_flex.py."""
    model = tiny("llama")
    ids, mask = batch(model)
    plain = model.with_attention("flex")(ids, mask).logits
    capped = model.with_attention("flex", score_mod=mods.soft_cap(0.1))(ids, mask).logits
    assert np.isfinite(np.asarray(capped)).all() and max_diff(capped, plain, mask) > 1e-3


def test_greedy_generation_with_flex_equals_vanilla():
    model = tiny("llama")
    ids, mask = batch(model, t=16)
    cfg = GenerationConfig(max_new_tokens=6, do_sample=False)
    want = model.with_attention("vanilla").generate(ids, cfg, attention_mask=mask)
    got = model.with_attention("flex", mask_mod=mods.causal).generate(ids, cfg, attention_mask=mask)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
