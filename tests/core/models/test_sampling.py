"""Logits processors against the Hugging Face classes (float32 torch), and ``GenerationConfig``."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from workbench.core.models import sampling
from workbench.core.models.generation import GenerationConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
lp = pytest.importorskip("transformers.generation.logits_process")

B, V, L = 4, 64, 12


def logits(seed, scale=3.0):
    return (np.random.default_rng(seed).normal(size=(B, V)) * scale).astype(np.float32)


def history(seed):
    """Random ids (some >= V, which HF drops) and a left-padded prompt mask over the first 8 positions."""
    rng = np.random.default_rng(100 + seed)
    ids = rng.integers(0, V + 3, size=(B, L))
    mask = np.ones((B, 8), np.int64)
    for row, pad in enumerate((0, 1, 3, 8)):  # the last row is all padding: HF then ignores nothing
        mask[row, :pad] = 0
    return ids, mask


def assert_same(ours, want):
    ours, want = np.asarray(ours), want.numpy()
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(want))
    finite = ~np.isneginf(want)
    np.testing.assert_allclose(ours[finite], want[finite], rtol=1e-6, atol=1e-6)


def hf(processor, x, ids=None):
    ids = torch.zeros((B, 1), dtype=torch.long) if ids is None else torch.as_tensor(ids)
    return processor(ids, torch.as_tensor(x))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty(seed, penalty):
    x, (ids, mask) = logits(seed), history(seed)
    ignore = torch.as_tensor(mask).ne(0).int().argmax(dim=1)  # what HF generate passes as prompt_ignore_length
    want = hf(lp.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=ignore), x, ids)
    valid = sampling.history_mask(jnp.asarray(ignore.numpy()), L, L)
    assert_same(sampling.repetition_penalty(jnp.asarray(x), jnp.asarray(ids), penalty, valid), want)
    assert_same(sampling.repetition_penalty(jnp.asarray(x), jnp.asarray(ids), penalty),
                hf(lp.RepetitionPenaltyLogitsProcessor(penalty), x, ids))


@pytest.mark.parametrize("seed", range(3))
def test_temperature_top_k_top_p_min_p(seed):
    x = logits(seed)
    for t in (0.3, 1.7):
        assert_same(sampling.temperature(jnp.asarray(x), t), hf(lp.TemperatureLogitsWarper(t), x))
    tied = np.round(x)  # ties at the k-th value are all kept
    for k, keep, xs in itertools.product((1, 5, 63, 64, 100), (1, 3), (x, tied)):
        assert_same(sampling.top_k(jnp.asarray(xs), k, keep), hf(lp.TopKLogitsWarper(k, min_tokens_to_keep=keep), xs))
    for p, keep in itertools.product((0.0, 0.1, 0.5, 0.9, 0.99), (1, 3)):
        assert_same(sampling.top_p(jnp.asarray(x), p, keep), hf(lp.TopPLogitsWarper(p, min_tokens_to_keep=keep), x))
    for p, keep in itertools.product((0.0, 0.05, 0.3, 1.0), (1, 3)):
        assert_same(sampling.min_p(jnp.asarray(x), p, keep), hf(lp.MinPLogitsWarper(p, min_tokens_to_keep=keep), x))


PIPELINES = [
    dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
    dict(do_sample=True, temperature=1.5, top_k=0, top_p=0.95, repetition_penalty=0.8),
    dict(do_sample=True, temperature=1.0, top_k=50, top_p=1.0, min_p=0.2),
    dict(do_sample=False, temperature=0.5, top_k=3, repetition_penalty=1.2),  # greedy: only the penalty acts
]


@pytest.mark.parametrize("kw", PIPELINES, ids=range(len(PIPELINES)))
def test_process_logits_matches_hf_generate_pipeline(kw):
    """The processor list HF ``generate`` builds (its order, its on/off rules) against ``process_logits``."""
    from tests.core.models.test_generation import TorchToyConfig, TorchToyLM

    model = TorchToyLM(TorchToyConfig(), np.zeros((1, V), np.float32))
    hf_config = transformers.GenerationConfig(**kw)
    model._prepare_special_tokens(hf_config, True, device="cpu")
    ours = GenerationConfig.from_hf(hf_config)
    for seed in range(3):
        x, (ids, mask) = logits(seed), history(seed)
        procs = model._get_logits_processor(hf_config, input_ids_seq_length=8, device="cpu",
                                            model_kwargs={"attention_mask": torch.as_tensor(mask)})
        valid = sampling.history_mask(jnp.argmax(jnp.asarray(mask) != 0, axis=1), L, L)
        assert_same(sampling.process_logits(ours, jnp.asarray(x), jnp.asarray(ids), valid), hf(procs, x, ids))


def test_config_validation_says_what_to_change():
    with pytest.raises(ValueError, match=r"temperature must be > 0 when sampling.*do_sample=False"):
        GenerationConfig(do_sample=True, temperature=0.0)
    GenerationConfig(temperature=0.0)  # ignored without sampling, as in HF
    with pytest.raises(ValueError, match=r"beam sampling .* not supported"):
        GenerationConfig(do_sample=True, num_beams=2)
    for bad in (dict(max_new_tokens=0), dict(num_beams=0), dict(top_k=-1), dict(top_p=1.5), dict(min_p=-0.1),
                dict(repetition_penalty=0.0), dict(early_stopping="sometimes"), dict(eos_token_id=[]),
                dict(eos_token_id=-2), dict(pad_token_id=1.5), dict(max_new_tokens=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GenerationConfig(**bad)
    with pytest.raises(TypeError, match="temperature"):
        GenerationConfig(temperature="hot")


def test_config_replace_from_hf_and_pad():
    c = GenerationConfig(eos_token_id=[2, 5])
    assert c.eos_token_id == (2, 5) and c.pad_id == 2 and hash(c) == hash(GenerationConfig(eos_token_id=(2, 5)))
    assert c.replace(pad_token_id=0).pad_id == 0 and c.pad_token_id is None
    assert GenerationConfig().pad_id is None
    hf_config = transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[1, 7],
                                              max_new_tokens=12, num_beams=1)
    ours = GenerationConfig.from_hf(hf_config)
    assert ours.top_k is None  # unset: filled when generating, with HF's default of 50
    ours = ours.resolved(prompt_len=4)
    assert (ours.do_sample, ours.temperature, ours.top_p, ours.top_k, ours.eos_token_id, ours.max_new_tokens) == (
        True, 0.6, 0.9, 50, (1, 7), 12)
    assert GenerationConfig.from_hf({"num_beams": 4, "early_stopping": "never", "foo": 1}).num_beams == 4
