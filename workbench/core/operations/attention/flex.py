"""``flex``: attention variants in two lines. A ``score_mod`` and a ``mask_mod`` written for scalars (PyTorch's
FlexAttention convention, :mod:`.block_mask`), run blockwise and block-sparse.

The mask's :class:`~.block_mask.BlockMask` lists, per query block, the key blocks that are not empty; the kernel
visits only those (a ``lax.scan`` over the list, gathered key and value blocks), skips the mask arithmetic on full
tiles and applies the mask on partial ones. Memory is O(T x block) as in ``flash``: the tile step is
``jax.checkpoint``-ed, so the backward recomputes tiles over the same lists.

The calling convention's options are built-in mods: ``causal`` and ``sliding_window`` join the mask mod (and its
block mask) when positions are static (no ``kv_lengths``); ``kv_lengths``, segment ids, a dense ``mask`` and
``bias`` apply inside each tile; ``logits_soft_cap`` and ``bias`` come before the ``score_mod``; ``sinks`` join
the softmax's denominator. A mod's ``q_idx`` is the query's position (``S - T`` added to its index, as ``causal``
aligns here; with ``kv_lengths``, ``kv_lengths[b] - T`` added, as a decode step against a cache needs, and then no
tile is known empty before the call: every tile is partial).

Kernels (option ``kernel``, default ``"auto"``; the one that ran is the output's ``kernel_path``): on CPU the
native blockwise path here; on a TPU, JAX's splash attention (:mod:`.flex_splash`) for full / causal / sliding-window
masks with ``T == S`` and no score mod, else the native path, its ``kernel_path`` saying why; on a GPU, cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) for plain causal / sliding-window / full attention in
bfloat16 or float16, else the block-sparse Pallas kernel of :mod:`.flex_pallas` (Triton), else (``kv_lengths``,
segment ids, a dense mask, a bias, sinks, ragged blocks) the native path, its ``kernel_path`` saying why.
``kernel="pallas"`` and ``kernel="splash"`` on CPU run those kernels in Pallas' interpret mode (how CI tests them);
``"cudnn"``, ``"pallas"`` and ``"splash"`` raise where they cannot serve a call.

Mods and a prebuilt ``block_mask`` come from ``OperationMetadata(options={...})`` (``with_attention("flex",
score_mod=..., mask_mod=...)``) or as call arguments, which win. A block mask built without ``B`` / ``H`` (None)
serves every batch row and head; :func:`flex_attention` builds one per batch row and head only when the mask mod
reads ``b`` or ``h``. Tiles are shared by all batch rows and heads of a call: a tile is skipped when it is empty
for every one of them.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.operations.attention import block_mask as bm
from workbench.core.operations.attention.common import (
    ALL_FEATURES,
    RETURN_WEIGHTS,
    Array,
    AttentionCall,
    AttentionImplMixin,
    SoftmaxCarry,
    Visibility,
    call_extras,
    fold_logits,
    group_heads,
    keys_to_tiles,
    logits,
    queries_to_tiles,
    tile_finish,
)
from workbench.core.operations.attention.flash import all_varying, option_block_sizes, pad_call, split_blocks
from workbench.core.operations.attention.flex_splash import flex_attention_splash, splash_mask, splash_serves
from workbench.core.operations.attention.sdpa import jax_nn_arguments
from workbench.core.operations.base import AttentionOutput, Capabilities, OperationImpl, OperationRegistry

DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = bm.DEFAULT_BLOCK_Q, bm.DEFAULT_BLOCK_K
KERNELS = ("auto", "native", "pallas", "cudnn", "splash")
_TILE_HOOK: tp.Callable[[Array, Array], None] | None = None  # tests count visited tiles through it


@OperationRegistry.register
class FlexAttention(AttentionImplMixin, OperationImpl):
    """Blockwise attention with a ``score_mod`` and a block-sparse ``mask_mod``."""

    capabilities = Capabilities(
        features=ALL_FEATURES - {RETURN_WEIGHTS},
        description="score_mod / mask_mod in plain jnp (PyTorch FlexAttention's convention), block-sparse: visits "
                    "only the key blocks its BlockMask lists; GPU: cuDNN for plain masks, else a Pallas (Triton) "
                    "kernel; TPU: splash attention for plain masks; options score_mod, mask_mod, block_mask, "
                    "block_q, block_k, kernel")

    @classmethod
    def get_impl_name(cls):
        return "flex"

    def block_sizes(self, t: int, s: int) -> tuple[int, int]:
        """``(block_q, block_k)`` from the options, clipped to ``(T, S)``."""
        return option_block_sizes("flex", self.options, t, s, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)

    def kernel(self) -> str:
        """The ``kernel`` option: ``"auto"`` (default), ``"native"``, ``"pallas"``, ``"cudnn"`` or ``"splash"``."""
        kernel = self.options.get("kernel", "auto")
        if kernel not in KERNELS:
            raise ValueError(f"flex: option kernel must be one of {KERNELS}; got {kernel!r}")
        return kernel

    def forward_native(self, query, key, value, **kwargs) -> AttentionOutput:
        return self._run("cpu", query, key, value, **kwargs)

    def forward_gpu(self, query, key, value, **kwargs) -> AttentionOutput:
        return self._run("gpu", query, key, value, **kwargs)

    def forward_tpu(self, query, key, value, **kwargs) -> AttentionOutput:
        return self._run("tpu", query, key, value, **kwargs)

    variant_options: tp.ClassVar[dict[str, tp.Any]] = {}  # a flex_variant's mods and blocks

    @property
    def options(self) -> dict[str, tp.Any]:
        """The variant's options (:func:`flex_variant`) under the metadata's."""
        return {**self.variant_options, **self.metadata.options}

    def block_mask_for(self, t: int, s: int) -> bm.BlockMask | None:
        """The block mask this implementation's mask mod gives ``t`` queries by ``s`` keys (None without one), as
        the lab draws it."""
        opts = self.options
        if opts.get("block_mask") is not None:
            return opts["block_mask"]
        if opts.get("mask_mod") is None:
            return None
        return bm.create_block_mask(opts["mask_mod"], None, None, t, s, *self.block_sizes(t, s))

    def _run(self, platform: str, query, key, value, *, score_mod=None, mask_mod=None, block_mask=None,
             **kwargs) -> AttentionOutput:
        opts = self.options
        score_mod = score_mod if score_mod is not None else opts.get("score_mod")
        mask_mod = mask_mod if mask_mod is not None else opts.get("mask_mod")
        block_mask = block_mask if block_mask is not None else opts.get("block_mask")
        kernel = self.kernel()
        call = self.prepare(query, key, value, **kwargs)
        _, t, s, *_ = call.shape
        if block_mask is not None:
            block_q, block_k = block_mask.block_q, block_mask.block_k
        else:
            block_q, block_k = self.block_sizes(t, s)
        plain = score_mod is None and mask_mod is None and block_mask is None
        if kernel == "cudnn" or (kernel == "auto" and platform == "gpu" and plain and cudnn_serves(call) is None):
            why = cudnn_serves(call) if plain else "a score_mod, mask_mod or block_mask"
            if why is not None or platform != "gpu":
                raise ValueError(f"flex: kernel='cudnn' serves plain causal / sliding-window / full attention on "
                                 f"an NVIDIA GPU; this call has {why or 'no GPU'}: use kernel='auto'")

            args, rows = jax_nn_arguments(call)
            out = jax.nn.dot_product_attention(call.query, call.key, call.value, scale=call.scale,
                                               implementation="cudnn", **args)
            return AttentionOutput(out if rows is None else jnp.where(rows, out, 0), None, kernel_path="flex/cudnn")
        if kernel == "splash" or (kernel == "auto" and platform == "tpu"):
            why = splash_serves(call, mask_mod, score_mod, block_mask)
            if why is None:
                out = flex_attention_splash(call, *splash_mask(call, mask_mod, block_mask),
                                            interpret=platform != "tpu")
                path = "flex/splash" + ("" if platform == "tpu" else " (interpret)")
                return AttentionOutput(out, None, kernel_path=path)
            if kernel == "splash":
                raise ValueError(f"flex: splash attention does not serve {why}; use kernel='native' (or 'auto')")
            path = f"flex/native (splash does not serve {why})"
        elif kernel == "pallas" or (kernel == "auto" and platform == "gpu"):
            why = pallas_serves(call, block_q, block_k)
            if why is None:
                out = flex_attention_pallas_call(call, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                                 block_q=block_q, block_k=block_k, interpret=platform != "gpu")
                path = "flex/pallas" + ("" if platform == "gpu" else " (interpret)")
                return AttentionOutput(out, None, kernel_path=path)
            if kernel == "pallas":
                raise ValueError(f"flex: the Pallas kernel does not serve {why}; use kernel='native' (or 'auto')")
            path = f"flex/native (the Pallas kernel does not serve {why})"
        else:
            path = "flex/native"
        out = flex_attention(call, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                             block_q=block_q, block_k=block_k)
        return AttentionOutput(out, None, kernel_path=path)


def flex_variant(name: str, *, score_mod: bm.ScoreMod | None = None, mask_mod: bm.MaskMod | None = None,
                 description: str | None = None, **options: tp.Any) -> type[FlexAttention]:
    """Register ``flex`` with these mods (and ``options``: ``block_q``, ``block_k``, ``kernel``) as the attention
    implementation ``name``: it appears in the registry, the attention lab's menu and ``with_attention(name)``.
    Registering the same name again replaces it (re-running a notebook cell)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"flex_variant: name must be an identifier-like string; got {name!r}")
    if name in OperationRegistry.list_implementations(include_aliases=True) and not issubclass(
            OperationRegistry.get(name), FlexAttention):
        raise ValueError(f"flex_variant: {name!r} is a built-in implementation; choose another name")
    unknown = sorted(set(options) - {"block_q", "block_k", "kernel"})
    if unknown:
        raise ValueError(f"flex_variant: unknown options {unknown}; it takes score_mod, mask_mod, block_q, block_k, "
                         f"kernel")
    for what, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"flex_variant: {what} must be a function; got {fn!r}")
    mods = " and ".join(f"{w} {bm._name(f)}" for w, f in (("score_mod", score_mod), ("mask_mod", mask_mod)) if f)
    text = description or f"flex with {mods or 'no mods'}"
    cls = type(f"Flex_{name}", (FlexAttention,), {
        "variant_options": {"score_mod": score_mod, "mask_mod": mask_mod, **options},
        "capabilities": dataclasses.replace(FlexAttention.capabilities, description=text),
        "get_impl_name": classmethod(lambda c: name),
        "__doc__": text,
    })
    return OperationRegistry.register(cls, override=True)


def cudnn_serves(call: AttentionCall) -> str | None:
    """Why cuDNN (``jax.nn``'s) cannot run ``call`` as plain attention, or None when it can."""
    used = call_extras(call, "kv_lengths", "segment ids", "a dense mask", "a bias", "sinks", "a soft cap")
    if used:
        return ", ".join(used)
    if call.query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{call.query.dtype} inputs (cuDNN takes bfloat16 or float16)"
    return None


def pallas_serves(call: AttentionCall, block_q: int, block_k: int) -> str | None:
    """Why the Pallas kernel cannot run ``call``, or None when it can."""
    _, t, s, *_ = call.shape
    used = call_extras(call, "kv_lengths", "segment ids", "a dense mask", "a bias", "sinks",
                       "values of another head dim")
    if t % block_q or s % block_k:
        used.append(f"T={t}, S={s} not multiples of the blocks {block_q} x {block_k}")
    return ", ".join(used) or None


def flex_attention_pallas_call(call: AttentionCall, *, score_mod, mask_mod, block_mask, block_q: int, block_k: int,
                               interpret: bool) -> Array:
    """:func:`~.flex_pallas.flex_attention_pallas` on ``call``'s block mask (``causal`` / ``sliding_window`` folded
    in) with a soft cap as a score mod before ``score_mod``."""
    # Pallas and its Triton backend load only when this kernel runs (they take a second to import)
    from workbench.core.operations.attention.flex_pallas import flex_attention_pallas

    mask, _ = call_block_mask(call, mask_mod, block_mask, block_q, block_k)
    idx_QN, kind_QN = mask.kv_lists()
    cap = call.logits_soft_cap
    if cap is not None:
        user = score_mod
        capped = bm.soft_cap(cap)
        score_mod = capped if user is None else (lambda sc, b, h, q, k: user(capped(sc, b, h, q, k), b, h, q, k))
    _, t, s, *_ = call.shape
    return flex_attention_pallas(call.query, call.key, call.value, jnp.asarray(idx_QN), jnp.asarray(kind_QN),
                                 block_q=block_q, block_k=block_k, scale=call.scale, score_mod=score_mod,
                                 mask_mod=None if mask.mask_mod is _everything else mask.mask_mod, q_offset=s - t,
                                 interpret=interpret)


def _everything(b, h, q_idx, kv_idx):
    return jnp.bool_(True)


def call_block_mask(call: AttentionCall, mask_mod: bm.MaskMod | None, block_mask: bm.BlockMask | None,
                    block_q: int, block_k: int) -> tuple[bm.BlockMask, Visibility]:
    """The block mask a call runs with (the mask mod with ``causal`` / ``sliding_window`` folded in when positions
    are static) and the visibility left to apply inside tiles."""
    b, t, s, h, *_ = call.shape
    vis = call.visibility
    if block_mask is not None:
        if not isinstance(block_mask, bm.BlockMask):
            raise TypeError(f"flex: block_mask must be a BlockMask (create_block_mask(...)); got {block_mask!r}")
        bb, bh, bt, bs = block_mask.shape
        if (bt, bs) != (t, s) or bb not in (1, b) or bh not in (1, h):
            raise ValueError(f"flex: the block mask was built for (B, H, T, S) = {block_mask.shape}; this call is "
                             f"{(b, h, t, s)} (B and H may be 1): build it with create_block_mask(mod, {b}, {h}, "
                             f"{t}, {s}, ...)")
        if mask_mod is not None and mask_mod is not block_mask.mask_mod:
            raise ValueError("flex: give mask_mod or a block_mask built from it, not two different masks; combine "
                             "block masks with & or |")
        mask_mod = block_mask.mask_mod
    mods = [] if mask_mod is None else [mask_mod]
    static = vis.kv_lengths is None
    if static and vis.sliding_window is not None:
        mods.append(bm.sliding_window(vis.sliding_window))
    elif static and vis.causal:
        mods.append(bm.causal)
    if static:
        vis = dataclasses.replace(vis, causal=False, sliding_window=None)
    if not static and mods:
        # positions differ per batch row (kv_lengths): no tile can be known empty or full before the call
        (user,) = mods
        nq, nk = -(-t // block_q), -(-s // block_k)
        every = np.full((1, 1, nq, nk), bm.PARTIAL, np.int8)
        return bm.BlockMask(user, (1, 1, t, s), block_q, block_k, every), vis
    if block_mask is not None and len(mods) == 1:
        return block_mask, vis
    mod = _everything if not mods else mods[0]
    for extra in mods[1:]:
        mod = bm._Combined(jnp.logical_and, mod, extra, "&")
    per_row = bm.depends_on_batch_or_head(mod)
    built = bm.create_block_mask(mod, b if per_row else None, h if per_row else None, t, s, block_q, block_k)
    return built, vis


def flex_attention(call: AttentionCall, *, score_mod: bm.ScoreMod | None = None, mask_mod: bm.MaskMod | None = None,
                   block_mask: bm.BlockMask | None = None, block_q: int = DEFAULT_BLOCK_Q,
                   block_k: int = DEFAULT_BLOCK_K) -> Array:
    """Output BTHD of ``call`` with the mods, visiting only the tiles the block mask does not leave empty."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"flex: score_mod must be a function (score, b, h, q_idx, kv_idx) -> score; got {score_mod!r}")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"flex: mask_mod must be a function (b, h, q_idx, kv_idx) -> bool; got {mask_mod!r}")
    b, t, s, h, kv, _ = call.shape
    block_q, block_k = min(block_q, t), min(block_k, s)
    mask, vis = call_block_mask(call, mask_mod, block_mask, block_q, block_k)
    idx_QN, kind_QN = mask.kv_lists()
    masked = mask.mask_mod is not _everything and bool(np.any(kind_QN == bm.PARTIAL))
    nq, nk = -(-t // block_q), -(-s // block_k)
    call = dataclasses.replace(call, visibility=vis)
    call, varying = all_varying(call)
    call = pad_call(call, nq * block_q, nk * block_k)
    call = dataclasses.replace(call, query=call.query * jnp.asarray(call.scale, call.query.dtype), scale=1.0)
    q_NBKGtD = split_blocks(queries_to_tiles(call.query, kv), nq, axis=3)
    k_NBKsD, v_NBKsD = (split_blocks(keys_to_tiles(x), nk, axis=2) for x in (call.key, call.value))
    score = None if score_mod is None else bm.vectorize_score(score_mod)
    visible_of = bm.vectorize_mask(mask.mask_mod) if masked else None
    b_idx, h_idx = jnp.arange(b), jnp.arange(h)
    lengths = call.visibility.kv_lengths  # after padding: None, or each row's keys
    per_row = vis.kv_lengths is not None  # the caller's kv_lengths: each row's query positions differ
    # a mask the same for every batch row and head is evaluated once per tile, then broadcast
    mb_idx, mh_idx = jnp.arange(1 if not per_row else mask.shape[0]), jnp.arange(mask.shape[1])
    if per_row and mask.shape[0] == 1:
        mb_idx = jnp.zeros((b,), jnp.int32)  # one evaluation per row: positions differ, b does not matter

    def mask_tile(q_idx: Array, k_idx: Array) -> Array:
        """``(B|1, H|1, tq, tk)``: the mask mod at the tile's query positions."""
        if not per_row:
            return visible_of(mb_idx, mh_idx, q_idx + (s - t), k_idx)
        pos_Bt = lengths[:, None] - t + q_idx[None]
        return jax.vmap(lambda bi, row: visible_of(bi[None], mh_idx, row, k_idx)[0])(mb_idx, pos_Bt)

    def score_tile(logit_BHts: Array, q_idx: Array, k_idx: Array) -> Array:
        if not per_row:
            return score(logit_BHts, b_idx, h_idx, q_idx + (s - t), k_idx)
        pos_Bt = lengths[:, None] - t + q_idx[None]
        return jax.vmap(lambda x, bi, row: score(x[None], bi[None], h_idx, row, k_idx)[0])(logit_BHts, b_idx, pos_Bt)
    to_heads = lambda x: x.reshape(x.shape[0], h, *x.shape[3:])
    hook = _TILE_HOOK

    def query_block(_, xs):
        q_BKGTD, q_start, idx_N, kind_N = xs
        q_idx = q_start + jnp.arange(block_q)

        @jax.checkpoint
        def key_block(carry, ys):
            k_block, kind = ys
            k_BKSD = jax.lax.dynamic_index_in_dim(k_NBKsD, k_block, 0, keepdims=False)
            v_BKSD = jax.lax.dynamic_index_in_dim(v_NBKsD, k_block, 0, keepdims=False)
            k_idx = k_block * block_k + jnp.arange(block_k)

            def tile(c: SoftmaxCarry, apply_mask: bool) -> SoftmaxCarry:
                if hook is not None:
                    jax.debug.callback(hook, q_start // block_q, k_block)
                logit, visible = logits(q_BKGTD, k_BKSD, call, q_idx, k_idx)
                if score is not None:
                    logit = score_tile(to_heads(logit), q_idx, k_idx).reshape(logit.shape)
                if apply_mask:
                    m = group_heads(mask_tile(q_idx, k_idx), kv)
                    visible = m if visible is None else visible & m
                return fold_logits(c, logit, visible, v_BKSD)

            branches = [lambda c: c, lambda c: tile(c, masked), lambda c: tile(c, False)]
            return jax.lax.switch(kind.astype(jnp.int32), branches, carry), None

        init = SoftmaxCarry.init(b, kv, h // kv, block_q, call.value_dim, call.query.dtype)
        if varying:  # inside shard_map the carry varies as its inputs do
            init = jax.lax.pcast(init, varying, to="varying")
        carry, _ = jax.lax.scan(key_block, init, (idx_N, kind_N))
        return None, tile_finish(carry, call.query.dtype, call.sinks_tiles())

    q_starts = jnp.arange(nq) * block_q
    _, o_NBtHD = jax.lax.scan(query_block, None, (q_NBKGtD, q_starts, jnp.asarray(idx_QN), jnp.asarray(kind_QN)))
    return o_NBtHD.swapaxes(0, 1).reshape(b, nq * block_q, h, call.value_dim)[:, :t]


__all__ = ["KERNELS", "FlexAttention", "call_block_mask", "cudnn_serves", "flex_attention", "flex_variant",
           "pallas_serves"]
