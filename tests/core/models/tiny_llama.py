"""A tiny random Llama and a left-padded batch, shared by the LoRA and int8 tests."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.core.models import CausalLM, ModelConfig

TINY = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def logits(out) -> np.ndarray:
    return np.asarray(out.logits)


def tiny_model(seed=0) -> CausalLM:
    return CausalLM(ModelConfig.from_hf(TINY), rngs=nnx.Rngs(seed))


def batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, TINY["vocab_size"], (2, 8)))
    mask = jnp.asarray(np.array([[1] * 8, [0] * 3 + [1] * 5]))
    return ids, mask
