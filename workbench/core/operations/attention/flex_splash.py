"""``flex_splash``: flex attention on JAX's TPU splash-attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``), for the masks splash's own mask types say exactly.

Splash serves a flex call with no ``score_mod`` whose mask is full, causal or a sliding window (the
``causal`` / ``sliding_window=`` options, or the mods :func:`~.block_mask.causal` and
:func:`~.block_mask.sliding_window`, combined with ``&``), ``T == S`` (splash's masks are built here with offset 0,
top-left aligned; ours are bottom-right: the same when ``T == S``), ``T`` a multiple of 128, float32 or bfloat16
inputs, and none of
``kv_lengths``, a dense mask, a bias, sinks or values of another head dim (:func:`splash_serves` says why not).
A soft cap goes to splash's ``attn_logits_soft_cap`` (``cap * tanh(s / cap)`` on the scaled logits, as ours),
segment ids to its ``SegmentIds`` (a query sees keys of equal id, as ours).

Layout: splash takes one batch row, ``q (H, T, D)``, ``k``/``v`` ``(KV, S, D)``; the batch is a ``vmap``.
GQA runs in splash's grouped layout (query head ``h`` reads key/value head ``h // (H // KV)``, as ours, no
repeated heads); ``KV == 1`` in its MQA layout (``k``/``v`` ``(S, D)``). Splash does not scale: the query is
scaled first. Splash gives a query that sees no key the mean of the values it visited; we give 0, so with
segment ids (the only way a query here sees nothing, as every mask holds the diagonal) such rows are zeroed,
found by a ``T x S`` compare of the ids reduced per row.

Block sizes: the largest of 512, 256, 128 dividing ``T``, forward and backward (flex's ``block_q`` /
``block_k`` options tune the native path, not this one). On CPU the kernels run in Pallas' interpret mode
(how CI tests them), forward and backward (splash's ``custom_vjp``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from workbench.core.operations.attention import block_mask as bm
from workbench.core.operations.attention.common import Array, AttentionCall, Visibility, call_extras

MASK_KINDS = ("full", "causal", "window")
BLOCKS = (512, 256, 128)  # splash wants key blocks a multiple of 128 (TPU lanes)


def splash_mask(call: AttentionCall, mask_mod: bm.MaskMod | None, block_mask: bm.BlockMask | None
                ) -> tuple[str, int | None] | str:
    """``(kind, window)`` of the call's mask (kind one of :data:`MASK_KINDS`, ``window`` for ``"window"``), or
    a string saying which part of it splash's masks do not express."""
    if block_mask is not None:
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            return "a mask_mod and a block_mask built from another"
        mask_mod = block_mask.mask_mod
    vis = call.visibility
    causal, windows = vis.causal, [] if vis.sliding_window is None else [vis.sliding_window]
    mods = [] if mask_mod is None else [mask_mod]
    while mods:
        mod = mods.pop()
        if isinstance(mod, bm._Combined) and mod.fn is jnp.logical_and:
            mods += [mod.a, mod.b]
        elif mod is bm.causal:
            causal = True
        elif isinstance(getattr(mod, "window", None), int) and bm._name(mod).startswith("sliding_window("):
            windows.append(mod.window)
        else:
            return f"the mask_mod {bm._name(mod)} (splash takes full, causal and sliding-window masks)"
    if windows:
        return "window", min(windows)
    return ("causal" if causal else "full"), None


def splash_serves(call: AttentionCall, mask_mod: bm.MaskMod | None, score_mod: bm.ScoreMod | None,
                  block_mask: bm.BlockMask | None) -> str | None:
    """Why splash attention cannot run ``call`` with these mods, or None when it can."""
    _, t, s, *_ = call.shape
    used = (["a score_mod"] if score_mod is not None else []) + call_extras(
        call, "kv_lengths", "a dense mask", "a bias", "sinks", "values of another head dim")
    if t != s:
        used.append(f"T={t} != S={s} (splash aligns its masks top-left, ours bottom-right)")
    elif t % BLOCKS[-1]:
        used.append(f"T=S={t}, not a multiple of {BLOCKS[-1]}")
    if call.query.dtype not in (jnp.float32, jnp.bfloat16):
        used.append(f"{call.query.dtype} inputs (splash takes float32 or bfloat16)")
    if block_mask is not None and block_mask.shape[2:] != (t, s):
        used.append(f"a block mask built for (T, S) = {block_mask.shape[2:]}")
    mask = splash_mask(call, mask_mod, block_mask)
    if isinstance(mask, str):
        used.append(mask)
    return ", ".join(used) or None


@functools.lru_cache(maxsize=64)
def _kernel(kind: str, window: int | None, h: int, t: int, block: int, mqa: bool, cap: float | None,
            interpret: bool):
    """Splash's kernel for one batch row (its mask info is built with NumPy here, once per configuration)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if kind == "full":
        mask = sa.FullMask((t, t))
    elif kind == "causal":
        mask = sa.CausalMask((t, t))
    else:
        mask = sa.LocalMask((t, t), window_size=(window - 1, 0), offset=0)  # keys in (p - w, p]
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    make = sa.make_splash_mqa if mqa else sa.make_splash_mha
    with jax.ensure_compile_time_eval():  # concrete mask info even when built inside a jit trace: it is cached
        return make(sa.MultiHeadMask([mask] * h), block_sizes=sizes, attn_logits_soft_cap=cap, head_shards=1,
                    q_seq_shards=1, interpret=interpret)


def flex_attention_splash(call: AttentionCall, mask_kind: str, window: int | None, *, interpret: bool,
                          block: int | None = None) -> Array:
    """Output BTHD of ``call`` under mask ``mask_kind`` (:func:`splash_mask`) on splash attention; the caller
    checks :func:`splash_serves` first. ``block``: splash's block size (default: the largest of
    :data:`BLOCKS` dividing ``T``)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    _, t, s, h, kv, _ = call.shape
    if mask_kind not in MASK_KINDS or (mask_kind == "window") != (window is not None):
        raise ValueError(f"flex_attention_splash: mask_kind must be one of {MASK_KINDS}, with a window only for "
                         f"'window'; got {mask_kind!r}, window={window!r}")
    block = block or next((n for n in BLOCKS if t % n == 0), None)
    if t != s or block is None or t % block or block % BLOCKS[-1]:
        raise ValueError(f"flex_attention_splash: needs T == S, a multiple of a block that is a multiple of "
                         f"{BLOCKS[-1]}; got T={t}, S={s}, block={block} (check splash_serves first)")
    mqa = kv == 1
    kernel = _kernel(mask_kind, window, h, t, block, mqa, call.logits_soft_cap, interpret)
    q_BHTD = (call.query * jnp.asarray(call.scale, call.query.dtype)).transpose(0, 2, 1, 3)
    k_BKSD, v_BKSD = (x[:, :, 0] if mqa else x.transpose(0, 2, 1, 3) for x in (call.key, call.value))
    vis = call.visibility
    if vis.q_segment_ids is None:
        o_BHTD = jax.vmap(kernel)(q_BHTD, k_BKSD, v_BKSD)
        return o_BHTD.transpose(0, 2, 1, 3)
    ids = sa.SegmentIds(vis.q_segment_ids.astype(jnp.int32), vis.kv_segment_ids.astype(jnp.int32))
    o_BHTD = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg))(q_BHTD, k_BKSD, v_BKSD, ids)
    seen = Visibility(t, s, causal=mask_kind != "full", sliding_window=window, q_segment_ids=vis.q_segment_ids,
                      kv_segment_ids=vis.kv_segment_ids)
    rows_B1T1 = jnp.any(seen.block(jnp.arange(t), jnp.arange(s)), axis=-1, keepdims=True)
    return jnp.where(rows_B1T1, o_BHTD, 0).transpose(0, 2, 1, 3)


__all__ = ["MASK_KINDS", "flex_attention_splash", "splash_mask", "splash_serves"]
