"""``generate`` with the real ``CausalLM`` and its KV cache against HF ``generate`` (float32, left padding)."""

import jax
import numpy as np
import pytest

from tests.core.models.hf_reference import batch, hf_generate, pair
from workbench.core.models.generation import GenerationConfig, generate

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def llama():
    return pair("llama")


def ours_generate(model, ids, mask, config, **kw):
    with jax.default_matmul_precision("highest"):
        return generate(model, ids, config, attention_mask=mask, **kw)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_greedy_32_tokens_match_hf(family, llama):
    hf, ours = llama if family == "llama" else pair(family)
    ids, mask = batch()
    config = GenerationConfig(max_new_tokens=32, eos_token_id=EOS, pad_token_id=PAD)
    out = ours_generate(ours, ids, mask, config)
    np.testing.assert_array_equal(np.asarray(out.sequences), hf_generate(hf, ids, mask, config))


def test_beam_search_matches_hf(llama):
    hf, ours = llama
    ids, mask = batch(seed=1)
    config = GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=EOS, pad_token_id=PAD)
    out = ours_generate(ours, ids, mask, config)
    np.testing.assert_array_equal(np.asarray(out.sequences), hf_generate(hf, ids, mask, config))


def test_paged_cache_greedy_and_no_beams(llama):
    hf, ours = llama
    ids, mask = batch()
    config = GenerationConfig(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    paged = ours.init_ragged_pages(batch_size=2, page_size=4, num_pages=16, max_model_length=32)
    out = ours_generate(ours, ids, mask, config, cache=paged)
    np.testing.assert_array_equal(np.asarray(out.sequences), hf_generate(hf, ids, mask, config))
    paged = ours.init_ragged_pages(batch_size=2, page_size=4, num_pages=16, max_model_length=32)
    with pytest.raises(ValueError, match="rows of a paged cache would share pages"):
        ours_generate(ours, ids, mask, config.replace(num_beams=2), cache=paged)
    # a page shortage cannot raise inside the compiled loop, so the whole call's need is checked first
    short = ours.init_ragged_pages(batch_size=2, page_size=4, num_pages=6, max_model_length=32)
    with pytest.raises(ValueError, match="has 6 free pages but this call needs up to"):
        ours_generate(ours, ids, mask, config, cache=short)
