"""Beam search against Hugging Face ``generate(num_beams=...)`` on the toy model twins, token for token."""

import numpy as np
import pytest

from tests.core.models.test_generation import EOS, EOS2, hf_generate, hf_kwargs, model_calls, prompts, toy_pair
from workbench.core.models.beam_search import fill_value
from workbench.core.models.generation import GenerationConfig, generate

CASES = [
    GenerationConfig(num_beams=2, max_new_tokens=10),  # no EOS: every beam runs to the end
    GenerationConfig(num_beams=3, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0),  # HF fills with eos then
    GenerationConfig(num_beams=3, max_new_tokens=12, eos_token_id=(EOS, EOS2), early_stopping=True,
                     length_penalty=2.0),
    GenerationConfig(num_beams=3, max_new_tokens=12, eos_token_id=(EOS, EOS2), early_stopping="never",
                     length_penalty=2.0),
    GenerationConfig(num_beams=3, max_new_tokens=12, eos_token_id=EOS, early_stopping="never", length_penalty=-0.5),
    GenerationConfig(num_beams=3, max_new_tokens=12, eos_token_id=EOS, pad_token_id=1, repetition_penalty=1.5),
    GenerationConfig(num_beams=2, max_new_tokens=1, eos_token_id=EOS),
]


@pytest.mark.parametrize("config", CASES, ids=range(len(CASES)))
def test_beam_search_matches_hf(config):
    jx, hf = toy_pair(scale=1.5, eos_bias=2.0)
    for seed in range(6):
        ids, mask = prompts(seed, pad_id=config.pad_id or 0)
        out = generate(jx, ids, config, attention_mask=mask)
        want = hf_generate(hf, ids, mask, **hf_kwargs(config))
        np.testing.assert_array_equal(np.asarray(out.sequences), want)
        assert out.num_new_tokens == want.shape[1] - ids.shape[1]
        assert model_calls(out, ids) == hf.calls  # the loop stops when HF's does


def test_fill_value_mirrors_hf():
    assert fill_value(GenerationConfig(eos_token_id=4, pad_token_id=0)) == 4
    assert fill_value(GenerationConfig(eos_token_id=4, pad_token_id=2)) == 2
    assert fill_value(GenerationConfig(pad_token_id=2)) == -1


def test_beam_search_needs_a_reorderable_cache_and_no_streamer():
    jx, _ = toy_pair()
    ids, _ = prompts(0)
    config = GenerationConfig(num_beams=2, max_new_tokens=4)

    class Paged:
        max_length = 64

    with pytest.raises(ValueError, match="cannot"):
        generate(jx, ids, config, cache=Paged())
    with pytest.raises(ValueError, match="streamer cannot be used with beam search"):
        generate(jx, ids, config, streamer=print)
    with pytest.raises(ValueError, match="holds 9 positions"):
        generate(jx, ids, config, cache=jx.init_cache(6, 9))
