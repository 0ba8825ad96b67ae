"""Greedy / sampling decoding: logits processors equal to Hugging Face's, and the compiled decode loop.

Each processor is a pure function over float32 ``logits_BV`` mirroring one ``transformers`` class
(filter value ``-inf``, ``min_tokens_to_keep=1`` as ``generate`` uses them without beams);
:func:`process_logits` applies them in ``generate``'s order: repetition penalty, then (sampling
only) temperature, top-k, top-p, min-p. :func:`sample_programs` builds the prefill and the
``lax.while_loop`` that :func:`workbench.core.models.generation.generate` compiles.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback

from workbench.core.models.cache import index32

Array = jax.Array
NEG_INF = -jnp.inf


def repetition_penalty(logits_BV: Array, tokens_BL: Array, penalty: float, valid_BL: Array | None = None) -> Array:
    """``RepetitionPenaltyLogitsProcessor``: seen tokens' logits ``l`` become ``l * p`` if ``l < 0`` else ``l / p``.

    ``tokens_BL`` is the history; ``valid_BL`` (default all True) marks which positions count. Hugging
    Face counts every prompt token from the first attended one on (``prompt_ignore_length`` = left
    padding length), so pad tokens after it and generated pads count too. Ids >= V are ignored.
    """
    b, v = logits_BV.shape
    ids_BL = jnp.clip(tokens_BL.astype(jnp.int32), 0, v)
    if valid_BL is not None:
        ids_BL = jnp.where(valid_BL, ids_BL, v)
    seen_BV = jnp.zeros((b, v + 1), bool).at[jnp.arange(b)[:, None], ids_BL].set(True)[:, :v]
    penalised_BV = jnp.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return jnp.where(seen_BV, penalised_BV, logits_BV)


def temperature(logits_BV: Array, t: float) -> Array:
    """``TemperatureLogitsWarper``: ``logits / t``."""
    return logits_BV / t


def top_k(logits_BV: Array, k: int, min_tokens_to_keep: int = 1) -> Array:
    """``TopKLogitsWarper``: logits below the k-th largest become -inf (ties with it are kept)."""
    k = min(max(k, min_tokens_to_keep), logits_BV.shape[-1])
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    return jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)


def top_p(logits_BV: Array, p: float, min_tokens_to_keep: int = 1) -> Array:
    """``TopPLogitsWarper``: keep the smallest top set whose probability exceeds ``p``; the rest become -inf."""
    order_BV = jnp.argsort(logits_BV, axis=-1)  # ascending, like torch.sort(descending=False)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    cum_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
    remove_sorted_BV = cum_BV <= (1 - p)
    remove_sorted_BV = remove_sorted_BV.at[:, logits_BV.shape[-1] - min_tokens_to_keep:].set(False)
    rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
    remove_BV = jnp.zeros_like(remove_sorted_BV).at[rows_B1, order_BV].set(remove_sorted_BV)
    return jnp.where(remove_BV, NEG_INF, logits_BV)


def min_p(logits_BV: Array, p: float, min_tokens_to_keep: int = 1) -> Array:
    """``MinPLogitsWarper``: tokens with probability below ``p * max probability`` become -inf."""
    probs_BV = jax.nn.softmax(logits_BV, axis=-1)
    remove_BV = probs_BV < p * jnp.max(probs_BV, axis=-1, keepdims=True)
    keep_BK = jax.lax.top_k(probs_BV, min(min_tokens_to_keep, logits_BV.shape[-1]))[1]
    remove_BV = remove_BV.at[jnp.arange(logits_BV.shape[0])[:, None], keep_BK].set(False)
    return jnp.where(remove_BV, NEG_INF, logits_BV)


class _Config(tp.Protocol):
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None


def process_logits(config: _Config, logits_BV: Array, tokens_BL: Array | None = None,
                   valid_BL: Array | None = None) -> Array:
    """Apply the processors ``config`` (a ``GenerationConfig``) switches on, in Hugging Face's order.

    ``tokens_BL`` / ``valid_BL`` are the history for the repetition penalty (see
    :func:`repetition_penalty`); they are needed only when it is on.
    """
    logits_BV = logits_BV.astype(jnp.float32)
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        if tokens_BL is None:
            raise ValueError("repetition_penalty needs the token history: pass tokens_BL to process_logits")
        logits_BV = repetition_penalty(logits_BV, tokens_BL, config.repetition_penalty, valid_BL)
    if not config.do_sample:
        return logits_BV
    if config.temperature != 1.0:
        logits_BV = temperature(logits_BV, config.temperature)
    if config.top_k:
        logits_BV = top_k(logits_BV, config.top_k)
    if config.top_p is not None and config.top_p < 1.0:
        logits_BV = top_p(logits_BV, config.top_p)
    if config.min_p is not None:
        logits_BV = min_p(logits_BV, config.min_p)
    return logits_BV


def next_tokens(config: _Config, scores_BV: Array, key: Array | None) -> Array:
    """Greedy ``argmax`` or, with ``do_sample``, a categorical draw from processed scores ``(B,)`` int32."""
    if config.do_sample:
        return jax.random.categorical(key, scores_BV, axis=-1).astype(jnp.int32)
    return jnp.argmax(scores_BV, axis=-1).astype(jnp.int32)


def is_eos(tok: Array, eos: tuple[int, ...] | None) -> Array:
    """True where ``tok`` is one of ``eos`` (always False for None)."""
    hit = jnp.zeros(tok.shape, bool)
    for e in eos or ():
        hit = hit | (tok == e)
    return hit


def history_mask(ignore_R: Array, length: int, cur_len: Array) -> Array:
    """Positions the repetition penalty counts, ``ignore_R <= position < cur_len``: ``(R, length)``."""
    pos_1L = jnp.arange(length)[None, :]
    return (pos_1L >= ignore_R[:, None]) & (pos_1L < cur_len)


def last_logits(model, ids_BT: Array, mask_BT: Array, cache) -> tuple[Array, tp.Any]:
    """The last position's logits ``(B, V)`` float32 and the updated cache. Where the model can
    (``last_token_logits``, a ``CausalLM``) only that position goes through the LM head, as transformers'
    ``generate`` does (``logits_to_keep=1``): a prompt's other logits are never needed."""
    last = getattr(model, "last_token_logits", None)
    out = last(ids_BT, mask_BT, cache=cache) if callable(last) else model(ids_BT, mask_BT, cache=cache)
    return out.logits[:, -1].astype(jnp.float32), out.cache


def decode_loop(model, select: tp.Callable, going: tp.Callable, carry, cache):
    """``while going(carry)``: ``select`` consumes ``carry.logits`` (and may reorder the cache), then, unless
    that was the last step, the model runs on ``carry.next_ids`` for the next logits (never one step too many).
    """

    def body(c):
        carry, cache = select(*c)

        def forward(cache):
            ids_R1 = carry.next_ids[:, None]
            return last_logits(model, ids_R1, jnp.ones_like(ids_R1), cache)

        logits, cache = jax.lax.cond(going(carry), forward, lambda cache: (carry.logits, cache), cache)
        return carry._replace(logits=logits), cache

    return jax.lax.while_loop(lambda c: going(c[0]), body, (carry, cache))


class SampleState(tp.NamedTuple):
    logits: Array  # (B, V) float32, for the next token
    seq_BL: Array  # prompt then generated tokens, pad-filled
    next_ids: Array  # (B,) last token
    unfinished_B: Array
    step: Array  # tokens generated so far
    key: Array
    ignore_B: Array  # HF's prompt_ignore_length for the repetition penalty (left padding length)
    stop: Array  # the streamer asked to stop


def sample_programs(graphdef, config, prompt_len: int, on_tokens: tp.Callable | None = None):
    """``prefill(state, ids_BP, mask_BP, cache, key) -> (SampleState, cache)`` and ``decode(state, s, cache)``.

    ``on_tokens(tokens_B) -> bool`` (a host callback, e.g. a streamer) runs after every step; True stops.
    """
    n_new = config.max_new_tokens
    fill = config.pad_id if config.pad_id is not None else 0

    def select(s: SampleState, cache):
        pos = prompt_len + s.step
        scores_BV = process_logits(config, s.logits, s.seq_BL, history_mask(s.ignore_B, s.seq_BL.shape[1], pos))
        tok_B = next_tokens(config, scores_BV, jax.random.fold_in(s.key, s.step))
        if config.eos_token_id is not None:
            tok_B = jnp.where(s.unfinished_B, tok_B, config.pad_id)
        s = s._replace(seq_BL=jax.lax.dynamic_update_slice(s.seq_BL, tok_B[:, None], index32(0, pos)), next_ids=tok_B,
                       unfinished_B=s.unfinished_B & ~is_eos(tok_B, config.eos_token_id), step=s.step + 1)
        if on_tokens is not None:
            stop = io_callback(on_tokens, jax.ShapeDtypeStruct((), jnp.bool_), tok_B, ordered=True)
            s = s._replace(stop=stop)
        return s, cache

    def going(s: SampleState):
        return (s.step < n_new) & jnp.any(s.unfinished_B) & ~s.stop

    def prefill(state, ids_BP, mask_BP, cache, key):
        logits_BV, cache = last_logits(nnx.merge(graphdef, state), ids_BP, mask_BP, cache)
        b = ids_BP.shape[0]
        seq_BL = jnp.full((b, prompt_len + n_new), fill, jnp.int32).at[:, :prompt_len].set(ids_BP)
        s = SampleState(logits_BV, seq_BL, jnp.zeros((b,), jnp.int32),
                        jnp.ones((b,), bool), jnp.int32(0), key, jnp.argmax(mask_BP != 0, axis=1).astype(jnp.int32),
                        jnp.bool_(False))
        return s, cache

    def decode(state, s: SampleState, cache):
        return decode_loop(nnx.merge(graphdef, state), select, going, s, cache)

    return prefill, decode
