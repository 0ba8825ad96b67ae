"""Keeping a mixture of experts balanced: the auxiliary losses and DeepSeek-V3's bias update.

- :func:`load_balancing_loss`: Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) as
  transformers' ``load_balancing_loss_func`` computes it for Mixtral, Qwen3-MoE and GPT-OSS:
  ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of (top-k) assignments to expert ``e`` and ``P_e`` its
  mean router probability, both pooled over every layer and every real (unpadded) token. Minimal (``k``)
  when routing is uniform.
- :func:`router_z_loss`: ST-MoE's router z-loss (Zoph et al. 2022, eq. 5), the mean over layers and real
  tokens of ``logsumexp(router logits) ** 2``; it keeps router logits small.
- :func:`update_correction_bias`: DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-V3 report,
  section 2.1.2): after a step, each expert's selection bias moves by ``rate`` against its load:
  down if the expert got more than the mean number of tokens, up if fewer.
- :func:`expert_counts`: tokens each expert received per layer, for load-balance views.

Router logits are the model output's stacked ``router_logits (L, N, E)`` (``N = B * T``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _token_weights(router_logits_LNE: Array, attention_mask_BT: Array | None) -> Array:
    n = router_logits_LNE.shape[1]
    if attention_mask_BT is None:
        return jnp.ones((n,), jnp.float32)
    mask_N = jnp.asarray(attention_mask_BT).reshape(-1).astype(jnp.float32)
    if mask_N.shape[0] != n:
        raise ValueError(f"attention_mask has {mask_N.shape[0]} tokens but the router logits have {n} (B * T)")
    return mask_N


def _check(router_logits_LNE: Array) -> Array:
    router_logits_LNE = jnp.asarray(router_logits_LNE)
    if router_logits_LNE.ndim != 3:
        raise ValueError(f"router logits must be stacked (layers, tokens, experts); got shape {router_logits_LNE.shape}"
                         f" (a model's output.router_logits is; None means the model has no MoE layers)")
    return router_logits_LNE


def expert_counts(router_logits_LNE: Array, top_k: int, attention_mask_BT: Array | None = None) -> Array:
    """``(L, E)`` real tokens routed to each expert per layer, by the top ``k`` router logits (the softmax
    keeps their order; for DeepSeek-V3's biased choice use ``MoE.dispatch``'s counts)."""
    logits_LNE = _check(router_logits_LNE)
    weights_N = _token_weights(logits_LNE, attention_mask_BT)
    _, experts_LNK = jax.lax.top_k(logits_LNE, top_k)
    onehot_LNKE = jax.nn.one_hot(experts_LNK, logits_LNE.shape[-1], dtype=jnp.float32)
    return jnp.einsum("lnke,n->le", onehot_LNKE, weights_N)


def load_balancing_loss(router_logits_LNE: Array, top_k: int, attention_mask_BT: Array | None = None) -> Array:
    """Switch Transformer's auxiliary loss over all layers (transformers' ``load_balancing_loss_func``)."""
    logits_LNE = _check(router_logits_LNE)
    num_experts = logits_LNE.shape[-1]
    weights_N = _token_weights(logits_LNE, attention_mask_BT)
    probs_LNE = jax.nn.softmax(logits_LNE.astype(jnp.promote_types(logits_LNE.dtype, jnp.float32)), axis=-1)
    rows = weights_N.sum() * logits_LNE.shape[0]
    f_E = expert_counts(logits_LNE, top_k, attention_mask_BT).sum(0) / rows
    p_E = jnp.einsum("lne,n->e", probs_LNE, weights_N.astype(probs_LNE.dtype)) / rows
    return num_experts * jnp.sum(f_E * p_E)


def router_z_loss(router_logits_LNE: Array, attention_mask_BT: Array | None = None) -> Array:
    """ST-MoE's z-loss: mean over layers and real tokens of ``logsumexp(logits) ** 2``."""
    logits_LNE = _check(router_logits_LNE)
    weights_N = _token_weights(logits_LNE, attention_mask_BT)
    z_LN = jax.nn.logsumexp(logits_LNE.astype(jnp.promote_types(logits_LNE.dtype, jnp.float32)), axis=-1)
    return jnp.sum(jnp.square(z_LN) * weights_N) / (weights_N.sum() * logits_LNE.shape[0])


def update_correction_bias(bias_E: Array, tokens_per_expert_E: Array, rate: float = 1e-3) -> Array:
    """DeepSeek-V3's balancing step: ``bias - rate * sign(load - mean load)`` (an expert at the mean stays)."""
    load_E = jnp.asarray(tokens_per_expert_E, jnp.float32)
    if load_E.shape != jnp.shape(bias_E):
        raise ValueError(f"tokens_per_expert {load_E.shape} must have the bias's shape {jnp.shape(bias_E)}")
    if not rate > 0:
        raise ValueError(f"rate (DeepSeek-V3's gamma) must be > 0; got {rate!r}")
    return (bias_E - rate * jnp.sign(load_E - load_E.mean())).astype(jnp.asarray(bias_E).dtype)
