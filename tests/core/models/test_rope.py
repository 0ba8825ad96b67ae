"""Rotary frequencies and YaRN's attention factor against transformers' own ``ROPE_INIT_FUNCTIONS``
(the reference each family's model calls), for every scaling the configs can name."""

import numpy as np
import pytest

from tests.core.models.hf_reference import transformers
from workbench.core.models.config import ModelConfig
from workbench.core.models.rope import attention_factor, inv_frequencies

HEAD_DIM = 64
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    # GPT-OSS: no truncation of the correction range
    "yarn-gpt-oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    # DeepSeek-V3: mscale = mscale_all_dim, so the cos/sin factor is 1
    "yarn-deepseek": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    "yarn-plain": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = SCALINGS[name]
    hf_config = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                         max_position_embeddings=131072, rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        want_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
        want_factor = 1.0
    else:
        want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
        want_freq = want.numpy()
    config = ModelConfig.from_hf(hf_config)
    got = inv_frequencies(HEAD_DIM, config.rope_theta, config.rope_scaling)
    np.testing.assert_allclose(got, want_freq, rtol=1e-6)
    assert attention_factor(config.rope_scaling) == pytest.approx(want_factor, rel=1e-12)
    assert ModelConfig.from_hf(config.to_hf()) == config  # the scaling round-trips through config.json
