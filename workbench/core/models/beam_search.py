"""Beam search, step for step Hugging Face's ``_beam_search`` (static shapes, run in ``lax.while_loop``).

Per batch row it keeps ``num_beams`` running beams and ``num_beams`` finished hypotheses scored
``sum log p / new_len ** length_penalty``. Each step takes the top ``(1 + n_eos) * num_beams``
continuations, sends those ending in EOS (or at the length limit) to the finished set, keeps the best
others running, and reorders the cache rows with ``cache.reorder``. ``early_stopping``: True stops a
row once it has ``num_beams`` finished; False / ``"never"`` stop when no running beam can still beat
the worst finished one (HF's heuristic). The ``-1e9`` float32 sentinels are HF's, so ties break alike.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.core.models.cache import index32
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.sampling import decode_loop, history_mask, is_eos, last_logits, process_logits

Array = jax.Array
NEG = -1.0e9


class BeamState(tp.NamedTuple):
    logits: Array  # (R, V) float32 for the next step, R = B * num_beams
    next_ids: Array  # (R,) the running beams' last tokens
    running_seq_BKL: Array
    running_scores_BK: Array
    running_idx_BKN: Array  # flat source row of each new token, -1 before it exists
    seq_BKL: Array  # finished hypotheses
    scores_BK: Array
    idx_BKN: Array
    finished_BK: Array
    improvable_B1: Array  # HF's is_early_stop_heuristic_unsatisfied
    cur_len: Array
    done: Array
    ignore_R: Array  # repetition-penalty prompt_ignore_length per flat row


def _gather(x: Array, idx_BK: Array) -> Array:
    """``x[b, idx_BK[b, k], ...]`` along axis 1."""
    return jnp.take_along_axis(x, idx_BK.reshape(idx_BK.shape + (1,) * (x.ndim - 2)), axis=1)


def fill_value(config: GenerationConfig) -> int:
    """HF's filler after a finished beam: ``pad or eos[0]`` (so a pad of 0 gives eos[0]), -1 without EOS."""
    if config.eos_token_id is None:
        return -1
    return config.pad_id or config.eos_token_id[0]


def beam_programs(graphdef, config: GenerationConfig, prompt_len: int):
    """``prefill(state, ids_RP, mask_RP, cache) -> (BeamState, cache)`` and ``decode(state, s, cache)``.

    Rows are flattened ``R = B * num_beams`` (row ``b * num_beams + k``); the prompt comes repeated.
    """
    k, n_new = config.num_beams, config.max_new_tokens
    length = prompt_len + n_new
    width = max(2, 1 + len(config.eos_token_id or ())) * k
    # HF divides by python-float ``n ** length_penalty``; a float64 table keeps the divisor bit-equal
    len_div_N = jnp.asarray((np.arange(1, n_new + 1, dtype=np.float64) ** config.length_penalty).astype(np.float32))
    es_true = config.early_stopping is True
    best_len_fixed = config.early_stopping == "never" and config.length_penalty > 0.0

    def step(s: BeamState, cache) -> tuple[BeamState, tp.Any]:
        r, v = s.logits.shape
        b = r // k
        lp_RV = jax.nn.log_softmax(s.logits, axis=-1)
        lp_RV = process_logits(config, lp_RV, s.running_seq_BKL.reshape(r, length),
                               history_mask(s.ignore_R, length, s.cur_len))
        lp_BX = (lp_RV.reshape(b, k, v) + s.running_scores_BK[:, :, None]).reshape(b, k * v)
        top_lp_BW, top_i_BW = jax.lax.top_k(lp_BX, width)
        beam_BW, tok_BW = top_i_BW // v, (top_i_BW % v).astype(jnp.int32)
        new = s.cur_len - prompt_len
        top_seq_BWL = jax.lax.dynamic_update_slice(_gather(s.running_seq_BKL, beam_BW), tok_BW[:, :, None],
                                                   index32(0, 0, s.cur_len))
        rows_BW = (beam_BW + jnp.arange(b)[:, None] * k).astype(jnp.int32)
        top_idx_BWN = jax.lax.dynamic_update_slice(_gather(s.running_idx_BKN, beam_BW), rows_BW[:, :, None],
                                                   index32(0, 0, new))
        hits_BW = (s.cur_len + 1 >= length) | is_eos(tok_BW, config.eos_token_id)

        # the best num_beams continuations that did not finish keep running
        run_lp_BW = top_lp_BW + hits_BW.astype(jnp.float32) * NEG
        keep_BK = jax.lax.top_k(run_lp_BW, k)[1]
        running_seq_BKL, running_scores_BK = _gather(top_seq_BWL, keep_BK), _gather(run_lp_BW, keep_BK)
        running_idx_BKN = _gather(top_idx_BWN, keep_BK)

        # finished ones among the top num_beams join the finished set if they beat it
        did_BW = hits_BW & (jnp.arange(width) < k)[None, :]
        fin_BW = top_lp_BW / len_div_N[new]
        fin_BW = fin_BW + (jnp.all(s.finished_BK, axis=-1, keepdims=True) & es_true).astype(jnp.float32) * NEG
        fin_BW = fin_BW + (~s.improvable_B1).astype(jnp.float32) * NEG
        fin_BW = fin_BW + (~did_BW).astype(jnp.float32) * NEG
        merged_scores = jnp.concatenate([s.scores_BK, fin_BW], axis=1)
        best_BK = jax.lax.top_k(merged_scores, k)[1]
        seq_BKL = _gather(jnp.concatenate([s.seq_BKL, top_seq_BWL], axis=1), best_BK)
        idx_BKN = _gather(jnp.concatenate([s.idx_BKN, top_idx_BWN], axis=1), best_BK)
        finished_BK = _gather(jnp.concatenate([s.finished_BK, did_BW], axis=1), best_BK)
        scores_BK = _gather(merged_scores, best_BK)

        cache = cache.reorder(jax.lax.dynamic_index_in_dim(running_idx_BKN, new, axis=2, keepdims=False).reshape(r))
        cur_len = s.cur_len + 1
        best_B1 = running_scores_BK[:, :1] / (len_div_N[n_new - 1] if best_len_fixed else len_div_N[cur_len - 1 -
                                                                                                  prompt_len])
        worst_BK = jnp.where(finished_BK, jnp.min(scores_BK, axis=1, keepdims=True), NEG)
        improvable_B1 = s.improvable_B1 & jnp.any(best_B1 > worst_BK, axis=-1, keepdims=True)
        going = jnp.any(improvable_B1) & ~(jnp.all(finished_BK) & es_true) & ~jnp.all(hits_BW)
        next_ids = jax.lax.dynamic_index_in_dim(running_seq_BKL, s.cur_len, axis=2, keepdims=False).reshape(r)
        return BeamState(s.logits, next_ids, running_seq_BKL, running_scores_BK, running_idx_BKN, seq_BKL, scores_BK,
                         idx_BKN, finished_BK, improvable_B1, cur_len, ~going, s.ignore_R), cache

    def prefill(state, ids_RP, mask_RP, cache):
        logits_RV, cache = last_logits(nnx.merge(graphdef, state), ids_RP, mask_RP, cache)
        b = ids_RP.shape[0] // k
        seq_BKL = jnp.full((b, k, length), fill_value(config), jnp.int32)
        seq_BKL = seq_BKL.at[:, :, :prompt_len].set(ids_RP.reshape(b, k, prompt_len))
        idx_BKN = jnp.full((b, k, n_new), -1, jnp.int32)
        s = BeamState(logits_RV, ids_RP[:, -1], seq_BKL,
                      jnp.zeros((b, k), jnp.float32).at[:, 1:].set(NEG), idx_BKN, seq_BKL,
                      jnp.full((b, k), NEG, jnp.float32), idx_BKN, jnp.zeros((b, k), bool), jnp.ones((b, 1), bool),
                      jnp.int32(prompt_len), jnp.bool_(False), jnp.argmax(mask_RP != 0, axis=1).astype(jnp.int32))
        return s, cache

    def decode(state, s: BeamState, cache):
        going = lambda s: ~s.done & (s.cur_len < length)
        return decode_loop(nnx.merge(graphdef, state), step, going, s, cache)

    return prefill, decode


def best_sequences(s: BeamState, prompt_len: int) -> tuple[Array, int]:
    """The best finished hypothesis per row, cropped like HF to the longest one: ``(B, P + n), n``."""
    n_new = int(jnp.max(jnp.sum(s.idx_BKN[:, 0] != -1, axis=-1)))
    return s.seq_BKL[:, 0, :prompt_len + n_new], n_new
