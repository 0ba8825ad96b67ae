"""``generate`` (greedy, sampling, streaming, compile cache) on a toy model, against Hugging Face ``generate``.

The toy's next-token logits are a random table row picked by a hash of the attended tokens so far, so
its JAX version (with a per-row cache) and its torch twin (a ``transformers`` model recomputing the hash
without a cache) give bit-identical logits and the token streams are non-trivial.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workbench.core.models.generation import GenerationConfig, GenerationOutput, generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOD, ROWS, VOCAB, EOS, EOS2 = 1000003, 64, 16, 3, 7
TRACES = collections.Counter()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyCache:
    h_B: jax.Array
    length_B: jax.Array  # positions written, to check generate never overruns max_length
    max_length: int = dataclasses.field(metadata=dict(static=True))

    def reorder(self, index_B):
        return ToyCache(self.h_B[index_B], self.length_B[index_B], self.max_length)


@dataclasses.dataclass
class ToyOut:
    logits: jax.Array
    cache: ToyCache


class ToyLM(nnx.Module):
    """logits = table[hash(attended tokens) % ROWS]; the cache carries the hash."""

    def __init__(self, table):
        self.table = nnx.Param(jnp.asarray(table))

    def init_cache(self, batch_size, max_length):
        z = jnp.zeros((batch_size,), jnp.int32)
        return ToyCache(z, z, max_length)

    def __call__(self, input_ids_BT, attention_mask_BT=None, cache=None):
        TRACES["call"] += 1
        b, t = input_ids_BT.shape
        cache = self.init_cache(b, t) if cache is None else cache
        mask_BT = jnp.ones_like(input_ids_BT) if attention_mask_BT is None else attention_mask_BT

        def f(h_B, xs):
            tok_B, m_B = xs
            return jnp.where(m_B != 0, (h_B * 31 + tok_B + 1) % MOD, h_B), None

        h_B, _ = jax.lax.scan(f, cache.h_B, (input_ids_BT.T.astype(jnp.int32), mask_BT.T))
        logits_BV = self.table[...][h_B % ROWS]
        return ToyOut(jnp.broadcast_to(logits_BV[:, None], (b, t, logits_BV.shape[-1])),
                      ToyCache(h_B, cache.length_B + t, cache.max_length))


class TorchToyConfig(transformers.PretrainedConfig):
    model_type = "workbench_toy_hash"


class TorchToyLM(transformers.PreTrainedModel, transformers.GenerationMixin):
    """The torch twin: same hash, recomputed over the whole sequence (HF runs it with use_cache=False)."""

    config_class = TorchToyConfig

    def __init__(self, config, table):
        super().__init__(config)
        self.table = torch.nn.Parameter(torch.as_tensor(table), requires_grad=False)
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        b, t = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        h = torch.zeros(b, dtype=torch.long)
        for j in range(t):
            h = torch.where(mask[:, j] != 0, (h * 31 + input_ids[:, j] + 1) % MOD, h)
        logits = self.table[h % ROWS]
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits[:, None].expand(b, t, -1))


def toy_pair(seed=0, scale=2.0, eos_bias=0.0):
    table = (np.random.default_rng(seed).normal(size=(ROWS, VOCAB)) * scale).astype(np.float32)
    table[:, [EOS, EOS2]] += eos_bias  # more EOS: rows and beams finish at different steps
    return ToyLM(table), TorchToyLM(TorchToyConfig(), table).eval()


def prompts(seed=0, b=3, p=6, pads=(0, 2, 4), pad_id=0):
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(b, p)).astype(np.int32)
    mask = np.ones((b, p), np.int32)
    for row, n in enumerate(pads[:b]):
        ids[row, :n], mask[row, :n] = pad_id, 0
    return ids, mask


def hf_generate(hf, ids, mask, **kw):
    hf.calls = 0
    with torch.no_grad():
        out = hf.generate(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                          use_cache=False, **kw)
    return out.numpy()


def model_calls(out, ids):
    """Forward passes our loop ran: the prefill, then one per cached decode token."""
    return 1 + int(out.cache.length_B[0]) - ids.shape[1]


def hf_kwargs(config: GenerationConfig) -> dict:
    """The fields ``config`` sets, as ``generate`` kwargs: HF fills the rest by its own rules, we by ours."""
    return {"do_sample": False, **config.to_hf()}


GREEDY_CASES = [
    GenerationConfig(max_new_tokens=20, eos_token_id=EOS, pad_token_id=0),
    GenerationConfig(max_new_tokens=12),  # no EOS: every row runs to the end
    GenerationConfig(max_new_tokens=20, eos_token_id=(EOS, EOS2)),  # pad defaults to eos[0]
    GenerationConfig(max_new_tokens=20, eos_token_id=EOS, pad_token_id=0, repetition_penalty=1.7),
    GenerationConfig(max_new_tokens=16, eos_token_id=5, pad_token_id=1, repetition_penalty=0.6),
]


@pytest.mark.parametrize("config", GREEDY_CASES, ids=range(len(GREEDY_CASES)))
def test_greedy_matches_hf(config):
    jx, hf = toy_pair()
    for seed in range(3):
        ids, mask = prompts(seed, pad_id=config.pad_id or 0)
        out = generate(jx, ids, config, attention_mask=mask)
        want = hf_generate(hf, ids, mask, **hf_kwargs(config))
        np.testing.assert_array_equal(np.asarray(out.sequences), want)
        assert out.num_new_tokens == want.shape[1] - ids.shape[1]
        assert model_calls(out, ids) == hf.calls  # the loop stops when HF's does
        assert int(jnp.max(out.cache.length_B)) <= out.cache.max_length


def test_greedy_stops_when_all_rows_finish_and_pads_after_eos():
    jx, _ = toy_pair()
    ids, mask = prompts(1)
    out = generate(jx, ids, GenerationConfig(max_new_tokens=40, eos_token_id=EOS, pad_token_id=0), attention_mask=mask)
    new = np.asarray(out.sequences)[:, ids.shape[1]:]
    assert out.num_new_tokens < 40 and (new == EOS).any(axis=1).all()  # trimmed: every row hit EOS
    for row in new:
        first = int(np.argmax(row == EOS))
        assert (row[first + 1:] == 0).all()
    assert out.sequences.dtype == jnp.int32 and isinstance(out, GenerationOutput)
    assert set(out.timings) == {"compile", "prefill", "decode"}


def test_no_recompile_for_same_shapes_and_mask_none_is_all_ones():
    jx, _ = toy_pair(seed=5)
    ids, _ = prompts(2, pads=(0, 0, 0))
    config = GenerationConfig(max_new_tokens=9, eos_token_id=EOS)
    first = generate(jx, ids, config)
    before = TRACES["call"]
    again = generate(jx, ids + 1, config, attention_mask=np.ones_like(ids))
    assert TRACES["call"] == before and again.timings["compile"] == 0.0
    assert first.timings["compile"] > 0.0
    same = generate(jx, ids, config, attention_mask=np.ones_like(ids))
    np.testing.assert_array_equal(first.sequences, same.sequences)


def test_cache_too_short_and_user_cache():
    jx, hf = toy_pair()
    ids, mask = prompts(0)
    config = GenerationConfig(max_new_tokens=10)
    with pytest.raises(ValueError, match=r"holds 12 positions .* prompt \(6\) .* max_new_tokens \(10\) needs 16"):
        generate(jx, ids, config, attention_mask=mask, cache=jx.init_cache(3, 12))
    with pytest.raises(ValueError, match="holds 4 positions"):
        generate(jx, ids, config, cache=jx.init_cache(3, 4))
    out = generate(jx, ids, config, attention_mask=mask, cache=jx.init_cache(3, 30))
    assert out.cache.max_length == 30
    np.testing.assert_array_equal(out.sequences, hf_generate(hf, ids, mask, **hf_kwargs(config)))


def test_bad_inputs():
    jx, _ = toy_pair()
    with pytest.raises(ValueError, match="input_ids must be an int array"):
        generate(jx, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        generate(jx, np.zeros((2, 3), np.int32), attention_mask=np.ones((2, 4)))
    with pytest.raises(TypeError, match="GenerationConfig"):
        generate(jx, np.zeros((2, 3), np.int32), {"max_new_tokens": 3})


class Recorder:
    def __init__(self, stop_after=None):
        self.puts, self.ended, self.stop_after = [], False, stop_after

    def put(self, tokens):
        self.puts.append(np.asarray(tokens))

    def end(self):
        self.ended = True

    def should_stop(self):
        return self.stop_after is not None and len(self.puts) - 1 >= self.stop_after


def test_streamer_object_gets_prompt_then_tokens_and_can_stop():
    jx, _ = toy_pair()
    ids, mask = prompts(0)
    config = GenerationConfig(max_new_tokens=8)
    rec = Recorder()
    out = generate(jx, ids, config, attention_mask=mask, streamer=rec)
    np.testing.assert_array_equal(rec.puts[0], ids)
    np.testing.assert_array_equal(np.stack(rec.puts[1:], axis=1), np.asarray(out.sequences)[:, ids.shape[1]:])
    assert rec.ended and len(rec.puts) == 9
    stopper = Recorder(stop_after=3)
    out = generate(jx, ids, config, attention_mask=mask, streamer=stopper)
    assert out.num_new_tokens == 3 and len(stopper.puts) == 4 and stopper.ended
    stop_first = Recorder(stop_after=1)
    assert generate(jx, ids, config, attention_mask=mask, streamer=stop_first).num_new_tokens == 1


def test_callable_streamer_and_no_callback_without_streamer():
    jx, _ = toy_pair()
    ids, mask = prompts(0)
    seen = []
    out = generate(jx, ids, GenerationConfig(max_new_tokens=8), attention_mask=mask,
                   streamer=lambda t: seen.append(t) or len(seen) == 4)
    assert len(seen) == 4 and out.num_new_tokens == 4
    np.testing.assert_array_equal(np.stack(seen, 1), np.asarray(out.sequences)[:, ids.shape[1]:])
    with pytest.raises(TypeError, match="streamer"):
        generate(jx, ids, GenerationConfig(max_new_tokens=6), streamer=3)


def test_hf_text_streamer_works():
    tokenizer = type("Tok", (), {"decode": lambda self, ids, **kw: " ".join(map(str, ids))})()
    printed = []
    streamer = transformers.TextStreamer(tokenizer)
    streamer.on_finalized_text = lambda text, stream_end=False: printed.append(text)
    jx, _ = toy_pair()
    ids, _ = prompts(0, b=1, pads=(0,))
    out = generate(jx, ids, GenerationConfig(max_new_tokens=5), streamer=streamer)
    assert "".join(printed).split() == [str(t) for t in np.asarray(out.sequences)[0]]


def test_sampling_is_keyed_and_filters_act():
    jx, _ = toy_pair(scale=0.5)
    ids, mask = prompts(0)
    greedy = generate(jx, ids, GenerationConfig(max_new_tokens=10), attention_mask=mask).sequences
    sample = GenerationConfig(max_new_tokens=10, do_sample=True)
    a = generate(jx, ids, sample, attention_mask=mask, prng_key=jax.random.key(1)).sequences
    b = generate(jx, ids, sample, attention_mask=mask, prng_key=jax.random.key(1)).sequences
    c = generate(jx, ids, sample, attention_mask=mask, prng_key=jax.random.key(2)).sequences
    default = generate(jx, ids, sample, attention_mask=mask).sequences
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, greedy)
    np.testing.assert_array_equal(default, generate(jx, ids, sample, attention_mask=mask,
                                                    prng_key=jax.random.key(0)).sequences)
    for narrow in (dict(top_k=1), dict(temperature=0.5, top_p=0.0, min_p=1.0)):
        out = generate(jx, ids, sample.replace(**narrow), attention_mask=mask, prng_key=jax.random.key(3))
        np.testing.assert_array_equal(out.sequences, greedy)


def test_sampled_tokens_lie_in_top_k():
    jx, hf = toy_pair(scale=0.3)
    ids, mask = prompts(4)
    out = generate(jx, ids, GenerationConfig(max_new_tokens=12, do_sample=True, top_k=3), attention_mask=mask,
                   prng_key=jax.random.key(7))
    seq = torch.as_tensor(np.array(out.sequences), dtype=torch.long)
    full_mask = torch.cat([torch.as_tensor(mask), torch.ones(seq.shape[0], seq.shape[1] - ids.shape[1],
                                                            dtype=torch.int32)], 1)
    with torch.no_grad():
        for t in range(ids.shape[1], seq.shape[1]):
            logits = hf(seq[:, :t], full_mask[:, :t]).logits[:, -1]
            top3 = torch.topk(logits, 3).indices
            assert (top3 == seq[:, t:t + 1]).any(dim=1).all()
