"""Next-token cross-entropy, as Hugging Face's ``ForCausalLMLoss`` computes it.

``logits_BTV[:, t]`` predicts ``labels_BT[:, t + 1]``; targets equal to ``ignore_index`` (-100)
do not count, and the loss is the mean over the rest, in float32:

>>> import jax.numpy as jnp
>>> logits_BTV = jnp.zeros((1, 3, 4))                  # uniform over 4 tokens
>>> loss, n = causal_lm_loss(logits_BTV, jnp.array([[0, 1, -100]]))
>>> round(float(loss), 4), int(n)                      # log(4); one target counts
(1.3863, 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from workbench.core.mesh import call_on_auto_axes, explicit_mesh_of

Array = jax.Array


def causal_lm_loss(logits_BTV: Array, labels_BT: Array, *, ignore_index: int = -100,
                   num_items_in_batch: int | Array | None = None) -> tuple[Array, Array]:
    """``(loss, num_tokens)``: mean next-token cross-entropy over targets that are not ``ignore_index``.

    Matches ``transformers.loss.loss_utils.ForCausalLMLoss`` except when no target counts:
    Hugging Face returns nan (0 / 0), this returns loss 0 with ``num_tokens`` 0 (and zero
    gradients), so an all-padding batch cannot poison a training run; check ``num_tokens``.
    With ``num_items_in_batch`` the summed loss is divided by it instead (gradient
    accumulation, as in Hugging Face). Labels outside ``[0, V)`` other than ``ignore_index``
    are not checked under jit (their loss is meaningless); Hugging Face raises.
    """
    logits_BTV, labels_BT = jnp.asarray(logits_BTV), jnp.asarray(labels_BT)
    mesh = explicit_mesh_of((logits_BTV, labels_BT, num_items_in_batch))
    if mesh is not None:  # the target lookup is a gather Explicit axes call ambiguous: run it as on Auto axes
        fn = lambda lg, lb, n: causal_lm_loss(lg, lb, ignore_index=ignore_index, num_items_in_batch=n)
        return call_on_auto_axes(fn, (logits_BTV, labels_BT, num_items_in_batch), mesh,
                                 lambda out: (jax.sharding.PartitionSpec(),) * 2)
    if logits_BTV.ndim != 3 or labels_BT.shape != logits_BTV.shape[:2]:
        raise ValueError(f"logits must be (B, T, V) and labels (B, T) with the same B, T; got logits "
                         f"{logits_BTV.shape} and labels {labels_BT.shape}")
    if not jnp.issubdtype(labels_BT.dtype, jnp.integer):
        raise ValueError(f"labels must be integer token ids; got dtype {labels_BT.dtype}")
    logits_BSV = logits_BTV[:, :-1].astype(jnp.promote_types(logits_BTV.dtype, jnp.float32))  # S = T - 1
    targets_BS = labels_BT[:, 1:]
    keep_BS = targets_BS != ignore_index
    safe_BS = jnp.where(keep_BS, targets_BS, 0)
    target_logit_BS = jnp.take_along_axis(logits_BSV, safe_BS[..., None], axis=-1)[..., 0]
    nll_BS = jax.nn.logsumexp(logits_BSV, axis=-1) - target_logit_BS  # -log_softmax at the target
    total = jnp.sum(jnp.where(keep_BS, nll_BS, 0.0))
    num_tokens = jnp.sum(keep_BS, dtype=jnp.int32)
    if num_items_in_batch is None:
        loss = total / jnp.maximum(num_tokens, 1).astype(total.dtype)
    else:
        loss = total / jnp.asarray(num_items_in_batch, total.dtype)
    return loss, num_tokens


def labels_from(input_ids_BT: Array, attention_mask_BT: Array | None = None, *, ignore_index: int = -100) -> Array:
    """Training labels (int32): ``input_ids`` with padded positions (mask 0) set to ``ignore_index``.

    >>> labels_from(jnp.array([[5, 6, 7]]), jnp.array([[0, 1, 1]])).tolist()
    [[-100, 6, 7]]
    """
    input_ids_BT = jnp.asarray(input_ids_BT).astype(jnp.int32)
    if attention_mask_BT is None:
        return input_ids_BT
    attention_mask_BT = jnp.asarray(attention_mask_BT)
    if attention_mask_BT.shape != input_ids_BT.shape:
        raise ValueError(f"attention_mask {attention_mask_BT.shape} must have the shape of input_ids "
                         f"{input_ids_BT.shape}")
    return jnp.where(attention_mask_BT.astype(bool), input_ids_BT, ignore_index)
