"""StreamingLLM's cache (sinks + a rolling window, positions within the cache) against independent references:
the plain forward (no cache) of the kept tokens run from position 0, the contiguous cache before anything is
evicted, and generate with a plain cache; bytes stay flat; what it cannot serve says what to change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.float32_error import assert_float32_close
from workbench.core.models import GenerationConfig, StreamingKVCache, generate, tiny

SINKS, WINDOW = 4, 4  # 8 slots
STEPS = 15
# a 1-layer model: its cached keys and values depend on the token alone (the cache rotates keys at their positions
# within it), so StreamingLLM equals re-running the kept tokens from scratch (see StreamingKVCache); windows of 5 < 8
# slots make the sliding-window layers mask within the cache
ONE_LAYER = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 5},
    "gemma3": {"sliding_window": 5, "layer_types": ["sliding_attention"]},  # the local rotary table
    "gpt_oss": {"sliding_window": 5, "layer_types": ["sliding_attention"]},  # attention sinks, YaRN, experts
}
# float32 rounding along the chain q/k/v, scores, weighted values, o, MLP in and out, head (8 contractions),
# the longest of them the 128-wide MLP
ACCUMULATION, STAGES = 128, 8


def kept(n: int, sinks: int = SINKS, window: int = WINDOW) -> list[int]:
    """Stream indices StreamingLLM holds when the token at index ``n`` is decoded: the first ``sinks`` and the
    ``window`` most recent, ``n`` included."""
    return sorted(set(range(min(sinks, n + 1))) | set(range(max(0, n + 1 - window), n + 1)))


def reference_logits(model, rows: list[np.ndarray]) -> list[np.ndarray]:
    """For each row's real token stream, the plain forward (no cache) of ``ids[kept(n)]`` from position 0, its
    last position's logits, for every ``n``. All of them run as one batch (one compiled program, not one per
    length), each right-padded to the longest: the plain forward is causal, so a sequence's last position sees
    none of the padding after it (were it not causal, the streamed logits, which never see later tokens, would
    differ and the test fail)."""
    wanted = [(b, n, row[kept(n)]) for b, row in enumerate(rows) for n in range(len(row))]
    longest = max(len(seq) for _, _, seq in wanted)
    padded = np.stack([np.pad(seq, (0, longest - len(seq))) for _, _, seq in wanted])
    logits = np.asarray(model(jnp.asarray(padded)).logits)
    out = [np.zeros((len(row), model.config.vocab_size), np.float32) for row in rows]
    for (b, n, seq), seq_logits in zip(wanted, logits, strict=True):
        out[b][n] = seq_logits[len(seq) - 1]
    return out


def streamed_logits(model, cache, ids, mask, prefill: int):
    """Logits ``(B, T, V)`` of a prefill chunk of ``prefill`` tokens, then one token per call."""
    out = model(ids[:, :prefill], mask[:, :prefill], cache=cache)
    logits = [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], mask[:, t:t + 1], cache=out.cache)
        logits.append(out.logits)
    return np.asarray(jnp.concatenate(logits, axis=1)), out.cache


def batch(pad: int = 3):
    """Two rows of ``STEPS`` tokens, the second left-padded by ``pad``."""
    ids = np.random.default_rng(0).integers(3, 264, (2, STEPS))
    mask = np.ones((2, STEPS), np.int32)
    mask[1, :pad] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


# a prefill within the slots for every family; streamed from the first token, and a prefill beyond the slots
@pytest.mark.parametrize("family, prefill", [*[(f, 6) for f in ONE_LAYER], ("llama", 1), ("llama", 11),
                                             ("gemma3", 11)])
def test_each_step_equals_the_plain_forward_of_the_kept_tokens(family, prefill):
    model = tiny(family, num_hidden_layers=1, attn_mechanism="vanilla", **ONE_LAYER[family])
    ids, mask = batch()
    rows = [np.asarray(ids[b])[np.asarray(mask[b]).astype(bool)] for b in range(2)]
    with jax.default_matmul_precision("highest"):
        got, cache = streamed_logits(model, model.init_streaming_cache(2, sinks=SINKS, window=WINDOW), ids, mask,
                                     prefill)
        want = reference_logits(model, rows)
    for b, row in enumerate(rows):
        got_b = got[b][np.asarray(mask[b]).astype(bool)]
        real_prefill = int(np.asarray(mask[b, :prefill]).sum())
        # a prefill chunk is attended whole, as the plain forward of it: beyond the slots its own logits are that
        # forward's, then the steps after it hold the sinks and the last window of it
        beyond = real_prefill > SINKS + WINDOW
        whole = np.asarray(model(jnp.asarray(row[:real_prefill][None])).logits[0]) if beyond else None
        for n in range(len(row)):
            ref = whole[n] if n < real_prefill and beyond else want[b][n]
            assert_float32_close(got_b[n], ref, accumulation=ACCUMULATION, stages=STAGES)
    assert cache.lengths_B.tolist() == [SINKS + WINDOW] * 2 and cache.seen_B.tolist() == [len(r) for r in rows]


def test_before_it_fills_it_equals_the_contiguous_cache_on_two_layers():
    """Two layers (Gemma 3: a local and a global rotary table), left padding: until the first eviction the
    streaming cache's logits are the contiguous cache's."""
    model = tiny("gemma3", attn_mechanism="vanilla", sliding_window=5)
    ids, mask = batch()
    n = SINKS + WINDOW + 3  # row 1 (3 padded) streams 8 real tokens: nothing evicted yet
    ids, mask = ids[:, :n], mask[:, :n]
    with jax.default_matmul_precision("highest"):
        got, _ = streamed_logits(model, model.init_streaming_cache(2, sinks=SINKS, window=WINDOW + 3), ids, mask, 4)
        want, _ = streamed_logits(model, model.init_cache(2, n), ids, mask, 4)
    keep = np.asarray(mask).astype(bool)
    assert_float32_close(got[keep], want[keep], accumulation=ACCUMULATION, stages=2 * STAGES)


def test_flex_attends_as_vanilla():
    model = tiny("llama", attn_mechanism="vanilla")
    ids, mask = batch()
    with jax.default_matmul_precision("highest"):
        want, _ = streamed_logits(model, model.init_streaming_cache(2, sinks=SINKS, window=WINDOW), ids, mask, 6)
        flex = model.with_attention("flex")
        got, _ = streamed_logits(flex, flex.init_streaming_cache(2, sinks=SINKS, window=WINDOW), ids, mask, 6)
    keep = np.asarray(mask).astype(bool)
    assert_float32_close(got[keep], want[keep], accumulation=ACCUMULATION, stages=2 * STAGES)


def test_generate_streams_past_max_positions_with_flat_bytes():
    model = tiny("llama", attn_mechanism="vanilla")  # 2 layers, 2 KV heads of 16, float32
    c = model.config
    sinks, window, prompt = 4, 12, 8
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 264, (1, prompt)))
    # the EOS id set to one outside the vocabulary: never generated, so every row runs to max_new_tokens
    greedy = lambda n: GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=c.vocab_size)
    stream = lambda: model.init_streaming_cache(1, sinks=sinks, window=window)
    short = generate(model, ids, greedy(10), cache=stream())
    long = generate(model, ids, greedy(c.max_position_embeddings + 40), cache=stream())
    plain = generate(model, ids, greedy(10))
    assert long.num_new_tokens == c.max_position_embeddings + 40 > 3 * (sinks + window)
    expected = c.num_hidden_layers * 1 * (sinks + window) * c.num_key_value_heads * c.head_dim * 2 * 4
    assert isinstance(long.cache, StreamingKVCache) and short.cache.nbytes == long.cache.nbytes == expected
    assert long.cache.seen_B.tolist() == [prompt + c.max_position_embeddings + 40 - 1]  # the last token not fed
    # new token k is chosen from the logits of prompt + k tokens: the same as the plain cache's while they fit
    same = sinks + window - prompt + 1
    np.testing.assert_array_equal(np.asarray(short.sequences[:, :prompt + same]),
                                  np.asarray(plain.sequences[:, :prompt + same]))
    np.testing.assert_array_equal(np.asarray(long.sequences[:, :prompt + 10]), np.asarray(short.sequences))


def test_beam_search_reorders_rows():
    model = tiny("llama", attn_mechanism="vanilla")
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 264, (1, 4)))
    config = GenerationConfig(max_new_tokens=5, num_beams=2, do_sample=False, eos_token_id=None)
    got = generate(model, ids, config, cache=model.init_streaming_cache(2, sinks=4, window=8))
    want = generate(model, ids, config)  # nothing evicted in 4 + 5 tokens
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    cache = model(jnp.concatenate([ids, ids[:, ::-1]]), cache=model.init_streaming_cache(2, sinks=1, window=2)).cache
    moved = cache.reorder(jnp.array([1, 1]))
    np.testing.assert_array_equal(np.asarray(moved.keys[:, 0]), np.asarray(cache.keys[:, 1]))


def test_what_it_cannot_serve_says_what_to_change():
    model = tiny("llama", attn_mechanism="vanilla")
    for kwargs, match in [({"sinks": -1, "window": 4}, "sinks must be a non-negative int"),
                          ({"sinks": 4, "window": 0}, "window must be a positive int"),
                          ({"sinks": 4.0, "window": 4}, "sinks must be a non-negative int"),
                          ({"sinks": 4, "window": 300}, r"sinks \+ window = 304 .*max_position_embeddings=256.*lower "
                                                        r"window")]:
        with pytest.raises(ValueError, match=match):
            model.init_streaming_cache(1, **kwargs)
    with pytest.raises(ValueError, match=r"learned absolute positions.*use init_cache\(\)"):
        tiny("gpt2", attn_mechanism="vanilla").init_streaming_cache(1, window=4)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(MLA, DeepSeek-V3\).*init_cache\(\)"):
        tiny("deepseek_v3", attn_mechanism="vanilla").init_streaming_cache(1, window=4)
    with pytest.raises(ValueError, match=r"explicit mask, which 'paged' does not take.*with_attention"):
        model.with_attention("paged").init_streaming_cache(1, window=4)
    with pytest.raises(ValueError, match=r"'ring' splits the sequence over a mesh axis"):
        model.with_attention("ring").init_streaming_cache(1, window=4)
    cache = model.init_streaming_cache(1, window=4)
    with pytest.raises(ValueError, match=r"holds 1 rows but the input has 2.*init_streaming_cache\(batch_size=2"):
        model(jnp.zeros((2, 3), jnp.int32), cache=cache)
    config = GenerationConfig(max_new_tokens=3, num_beams=2, do_sample=False, eos_token_id=None)
    with pytest.raises(ValueError, match=r"needs 2 \(batch 1 x num_beams 2\): init_streaming_cache\(2"):
        generate(model, jnp.zeros((1, 3), jnp.int32), config, cache=cache)
