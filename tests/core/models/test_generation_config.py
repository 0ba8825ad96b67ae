"""A checkpoint's generation_config.json drives ``generate()`` as it drives transformers' ``generate()``:
unset fields come from the model's config, then transformers' defaults. Reference: transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.models.hf_reference import batch, hf_model, torch
from workbench.core.models.auto import from_pretrained
from workbench.core.models.generation_config import HF_DEFAULTS, GenerationConfig


def hf_generate(hf, ids, mask, **kwargs):
    with torch.no_grad():
        return hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs).numpy()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose generation_config.json sets an EOS it emits early, a pad id and a max_length."""
    hf = hf_model("llama")
    ids, mask = batch()
    free = hf_generate(hf, ids, mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 3])  # a token row 0 emits after 3 steps: generation must stop there
    hf.generation_config.update(eos_token_id=eos, pad_token_id=0, max_length=ids.shape[1] + 9, do_sample=False)
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    hf.save_pretrained(path)
    return path, hf, eos


def test_generate_without_a_config_follows_the_checkpoint_like_transformers(checkpoint):
    path, hf, eos = checkpoint
    ours = from_pretrained(path, progress=False)
    assert ours.generation_config.eos_token_id == (eos,) and ours.generation_config.max_length == 21
    ids, mask = batch()
    want = hf_generate(hf, ids, mask)  # no arguments: the checkpoint's generation_config.json
    got = np.asarray(ours.generate(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).sequences)
    np.testing.assert_array_equal(got, want)
    assert (want[0, ids.shape[1]:] == eos).sum() >= 1  # row 0 stopped at the EOS and was padded after it


def test_fields_left_unset_take_the_checkpoints_values(checkpoint):
    path, hf, eos = checkpoint
    ours = from_pretrained(path, progress=False)
    ids, mask = batch()
    config = GenerationConfig(max_new_tokens=5)  # eos, pad, greedy from the file
    got = np.asarray(ours.generate(jnp.asarray(ids), config, attention_mask=jnp.asarray(mask)).sequences)
    np.testing.assert_array_equal(got, hf_generate(hf, ids, mask, max_new_tokens=5))
    assert GenerationConfig.from_pretrained(path).eos_token_id == (eos,)
    on_disk = json.loads((path / "generation_config.json").read_text())
    assert GenerationConfig.from_pretrained(path).max_length == on_disk["max_length"]


def test_resolution_order_and_defaults():
    base = GenerationConfig(eos_token_id=2, max_length=50, do_sample=True, temperature=0.7)
    mine = GenerationConfig(max_new_tokens=4, temperature=0.9).merged(base).resolved(prompt_len=10)
    assert (mine.eos_token_id, mine.max_new_tokens, mine.do_sample, mine.temperature) == ((2,), 4, True, 0.9)
    assert mine.top_k == HF_DEFAULTS["top_k"] == 50
    assert GenerationConfig().merged(base).resolved(prompt_len=10).max_new_tokens == 40  # max_length counts the prompt
    assert GenerationConfig().resolved(prompt_len=10).max_new_tokens == 20  # transformers' default
    assert GenerationConfig().resolved(prompt_len=10, max_positions=16).max_new_tokens == 6
    with pytest.raises(ValueError, match="max_length=5 leaves no room after the 10-token prompt"):
        GenerationConfig(max_length=5).resolved(prompt_len=10)
    with pytest.raises(ValueError, match="does not exist"):
        GenerationConfig.from_pretrained("/nonexistent")


def test_a_real_chat_model_stops_at_its_eos_like_transformers(smollm2_dir):
    """SmolLM2-Instruct's first generate() without a config: the answer, then <|im_end|>, nothing after."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="np")
    ids = np.asarray(getattr(ids, "input_ids", ids) if not isinstance(ids, dict) else ids["input_ids"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    want = hf_generate(hf, ids, np.ones_like(ids), max_new_tokens=40)
    ours = from_pretrained(smollm2_dir, progress=False)
    got = np.asarray(ours.generate(jnp.asarray(ids), GenerationConfig(max_new_tokens=40)).sequences)
    np.testing.assert_array_equal(got, want)
    new = got[0, ids.shape[1]:].tolist()
    assert tok.eos_token_id in new and new.index(tok.eos_token_id) == len(new) - 1  # stopped at <|im_end|>
    assert "Paris" in tok.decode(new)
