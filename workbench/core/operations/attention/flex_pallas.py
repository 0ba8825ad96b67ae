"""``flex_pallas``: block-sparse flash attention for flex attention, as Pallas kernels for the Triton backend.

The caller (``flex.py``) describes which keys each query sees by blocks of ``block_q`` queries and
``block_k`` keys: for query block ``i``, ``kv_indices[i]`` lists the key blocks to visit, in order, and
``kv_kinds[i]`` what each entry is:

- ``0`` padding: skipped, nothing is loaded;
- ``1`` partial: the tile's scores go through ``mask_mod`` (False = masked out);
- ``2`` full: every query of the tile sees every key of it; no mask arithmetic.

Key blocks a row does not list are never loaded. The lists hold for every batch row and head.

Three kernels, following ``jax/experimental/pallas/ops/gpu/attention.py`` (FlashAttention-2):

- forward, grid ``(B, H, nq)``: online softmax over the listed key blocks; saves the logsumexp;
- dq, grid ``(B, H, nq)``: the same key blocks again, recomputing the probabilities from the logsumexp;
- dk/dv, grid ``(B, KV, nk)``: the query blocks that list key block ``j`` (the transposed lists, built
  with ``jnp`` outside the kernels), for each of the ``H // KV`` query heads sharing the key/value head.

``score_mod`` and ``mask_mod`` are traced once at tile shapes; the arrays they close over become kernel
inputs (a kernel may not capture arrays), and indexing a captured 1-D array by position (``doc[q_idx]``,
``slope[h]``) becomes a load from its ref: Pallas's Triton lowering has no gather or dynamic slice. Any
other use loads the captured array whole (Triton then wants its size a power of two). Those captured
arrays get no gradient; the gradient of ``score_mod`` with respect to the score does flow (its
derivative is taken on the tile inside the backward kernels).

On a GPU (``interpret=False``) Triton wants ``block_q``, ``block_k`` powers of two and at least 16
(``tl.dot``); the head dim is padded to a power of two with masked loads, as in the reference kernel.
Here (CPU) the kernels run with ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from workbench.core.checks import positive_int

Array = jax.Array

PAD, PARTIAL, FULL = 0, 1, 2  # kv_kinds values


def flex_attention_pallas(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, kv_indices_QN: Array,
                          kv_kinds_QN: Array, *, block_q: int, block_k: int, scale: float,
                          score_mod: tp.Callable | None = None, mask_mod: tp.Callable | None = None,
                          q_offset: int = 0, interpret: bool = False, num_warps: int | None = None,
                          num_stages: int = 2) -> Array:
    """Attention output BTHD over the key blocks listed per query block (module docstring).

    ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool`` are
    written for scalars with ``jnp`` ops and run on whole tiles (``q_idx (block_q, 1)``,
    ``kv_idx (1, block_k)``); ``q_idx`` is ``q_offset + row``. Scores are ``scale * q.k`` in float32,
    then ``score_mod``, then (partial tiles) the mask; without ``mask_mod`` partial tiles are seen whole.
    A query that sees no key gets 0. ``num_warps`` and ``num_stages`` go to Triton (``interpret=False``;
    ``num_warps=None`` picks as the reference kernel does). Differentiable in ``q``, ``k``, ``v`` only.
    """
    check_inputs(q_BTHD, k_BSKD, v_BSKD, kv_indices_QN, kv_kinds_QN, block_q, block_k)
    h, d, (s, kv) = q_BTHD.shape[2], q_BTHD.shape[3], k_BSKD.shape[1:3]
    indices, kinds, counts = compact_lists(kv_indices_QN, kv_kinds_QN)
    tile = (block_q, block_k)
    score = None if score_mod is None else trace_mod(score_mod, "score_mod", tile, with_score=True)
    mask = None if mask_mod is None else trace_mod(mask_mod, "mask_mod", tile, with_score=False)
    cfg = Config(block_q=block_q, block_k=block_k, scale=float(scale), q_offset=int(q_offset), nk=s // block_k,
                 groups=h // kv, head_dim=d, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                 score=score and score[0], mask=mask and mask[0])
    consts = (tuple(score[1]) if score else (), tuple(mask[1]) if mask else ())
    return _flex(cfg, q_BTHD, k_BSKD, v_BSKD, (indices, kinds, counts), consts)


# -- input checks and block lists ---------------------------------------------------------------------
def check_inputs(q: Array, k: Array, v: Array, indices: Array, kinds: Array, block_q: int, block_k: int):
    """ValueError naming what to change; list values are checked only when concrete (not under jit)."""
    name = "flex_attention_pallas"
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (q BTHD, k/v BSKD); got shape {getattr(x, 'shape', x)}")
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"{name}: k {k.shape} and v {v.shape} must both be (B, S, KV, D) with B={b} and D={d} "
                         f"from q {q.shape}")
    s, kv = k.shape[1], k.shape[2]
    if h % kv:
        raise ValueError(f"{name}: {h} query heads are not a multiple of {kv} key/value heads; H % KV must be 0")
    block_q, block_k = positive_int(f"{name}: block_q", block_q), positive_int(f"{name}: block_k", block_k)
    if t % block_q:
        raise ValueError(f"{name}: T={t} is not a multiple of block_q={block_q}; pad the queries to "
                         f"{-(-t // block_q) * block_q} or pick a block_q that divides T")
    if s % block_k:
        raise ValueError(f"{name}: S={s} is not a multiple of block_k={block_k}; pad the keys to "
                         f"{-(-s // block_k) * block_k} or pick a block_k that divides S")
    nq, nk = t // block_q, s // block_k
    for arg, x in (("kv_indices", indices), ("kv_kinds", kinds)):
        if getattr(x, "ndim", None) != 2 or x.shape[0] != nq or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: {arg} must be an int array (nq, n_max) with one row per query block, "
                             f"nq = T / block_q = {nq}; got {getattr(x, 'dtype', type(x))} "
                             f"{getattr(x, 'shape', '')}")
    if indices.shape != kinds.shape:
        raise ValueError(f"{name}: kv_indices {indices.shape} and kv_kinds {kinds.shape} must have the same shape "
                         f"(nq, n_max): one kind per listed key block")
    if isinstance(indices, jax.core.Tracer) or isinstance(kinds, jax.core.Tracer):
        return
    idx, kd = np.asarray(indices), np.asarray(kinds)
    bad = ~np.isin(kd, (PAD, PARTIAL, FULL))
    if bad.any():
        raise ValueError(f"{name}: kv_kinds must hold 0 (padding), 1 (partial) or 2 (full); got "
                         f"{sorted(set(kd[bad].tolist()))}")
    listed = kd != PAD
    out = listed & ((idx < 0) | (idx >= nk))
    if out.any():
        raise ValueError(f"{name}: kv_indices of listed blocks must lie in [0, nk) with nk = S / block_k = {nk}; "
                         f"got {sorted(set(idx[out].tolist()))}")
    for i in range(nq):
        row = idx[i][listed[i]]
        if len(np.unique(row)) != len(row):
            raise ValueError(f"{name}: query block {i} lists key blocks {row.tolist()} with repeats; list each key "
                             f"block at most once per row")


def compact_lists(indices: Array, kinds: Array) -> tuple[Array, Array, Array]:
    """The lists with each row's listed entries first (order kept) and the number of them per row.

    The kernels loop ``counts[i]`` times instead of testing every padding entry.
    """
    kinds = jnp.asarray(kinds, jnp.int32)
    order = jnp.argsort(kinds == PAD, axis=1, stable=True)
    indices = jnp.take_along_axis(jnp.asarray(indices, jnp.int32), order, axis=1)
    kinds = jnp.take_along_axis(kinds, order, axis=1)
    return indices, kinds, jnp.sum(kinds != PAD, axis=1, dtype=jnp.int32)


def transpose_lists(indices: Array, kinds: Array, nk: int) -> tuple[Array, Array, Array]:
    """For each key block, the query blocks that list it, their kinds and how many: ``(nk, nq)``,
    ``(nk, nq)``, ``(nk,)``, listed query blocks first in ascending order."""
    nq = indices.shape[0]
    rows = jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32)[:, None], indices.shape)
    # Padding entries have kind 0, so max-scattering them changes nothing (and out-of-range ones drop).
    dense_KQ = jnp.zeros((nk, nq), jnp.int32).at[indices, rows].max(kinds, mode="drop")
    order = jnp.argsort(dense_KQ == PAD, axis=1, stable=True).astype(jnp.int32)
    q_kinds = jnp.take_along_axis(dense_KQ, order, axis=1)
    return order, q_kinds, jnp.sum(q_kinds != PAD, axis=1, dtype=jnp.int32)


# -- score_mod / mask_mod inside a kernel -------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Mod:
    """A ``score_mod`` or ``mask_mod`` traced at tile shapes; its captured arrays are passed separately."""

    jaxpr: jex.Jaxpr
    n_consts: int

    def __call__(self, const_refs: tp.Sequence[tp.Any], *args: Array) -> Array:
        """Evaluate on a tile inside a kernel, reading the captured arrays from ``const_refs``."""
        refs = dict(zip(self.jaxpr.constvars, const_refs, strict=True))
        env: dict[tp.Any, tp.Any] = {}

        def read(x):
            if isinstance(x, jex.Literal):
                return x.val
            if x in refs:
                return refs[x][...].reshape(x.aval.shape)  # stored at least 1-D
            return env[x]

        for var, arg in zip(self.jaxpr.invars, args, strict=True):
            env[var] = arg
        for eqn in self.jaxpr.eqns:
            first = eqn.invars[0] if eqn.invars else None
            out = None
            if not isinstance(first, jex.Literal) and first in refs:
                out = load_from_const(eqn, refs[first], [read(x) for x in eqn.invars[1:]])
            if out is None:
                out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
            outs = out if eqn.primitive.multiple_results else [out]
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
        return read(self.jaxpr.outvars[0])


def trace_mod(fn: tp.Callable, name: str, tile: tuple[int, int], with_score: bool) -> tuple[Mod, list[Array]]:
    """Trace ``fn`` on a ``tile`` of scores/indices; the ``Mod`` and the arrays it closes over (at least 1-D)."""
    bq, bk = tile
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    args = (i32(), i32(), i32(bq, 1), i32(1, bk))
    if with_score:
        args = (jax.ShapeDtypeStruct(tile, jnp.float32), *args)
    closed = jax.make_jaxpr(fn)(*args)
    outs = closed.out_avals
    want = "a float score" if with_score else "a bool (True = attend)"
    if len(outs) != 1:
        raise ValueError(f"flex_attention_pallas: {name} must return one array ({want}); it returns {len(outs)}")
    out = outs[0]
    try:
        np.broadcast_shapes(out.shape, tile)
    except ValueError:
        raise ValueError(f"flex_attention_pallas: {name} returns shape {out.shape} on a ({bq}, {bk}) tile; write it "
                         f"for scalars with elementwise jnp ops so that it broadcasts") from None
    ok = jnp.issubdtype(out.dtype, jnp.floating) if with_score else out.dtype == jnp.bool_
    if not ok:
        raise ValueError(f"flex_attention_pallas: {name} must return {want}; it returns {out.dtype}")
    consts = [jnp.reshape(c, (-1,)) if jnp.ndim(c) == 0 else jnp.asarray(c) for c in closed.consts]
    return Mod(closed.jaxpr, len(consts)), consts


def load_from_const(eqn: tp.Any, ref: tp.Any, rest: list[Array]) -> Array | None:
    """``doc[q_idx]`` (a gather) or ``slope[h]`` (a dynamic slice) of a captured 1-D array as a ref load;
    None for anything else (then the array is loaded whole and the op runs as written)."""
    operand = eqn.invars[0].aval
    if operand.ndim != 1:
        return None
    n = operand.shape[0]
    if eqn.primitive is jax.lax.gather_p:
        p = eqn.params
        dims = p["dimension_numbers"]
        simple = (dims.offset_dims == () and dims.collapsed_slice_dims == (0,) and dims.start_index_map == (0,)
                  and not dims.operand_batching_dims and tuple(p["slice_sizes"]) == (1,))
        modes = (jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS, jax.lax.GatherScatterMode.CLIP)
        if not simple or p["mode"] not in modes:
            return None
        return ref[jnp.clip(rest[0][..., 0], 0, n - 1)]
    if eqn.primitive is jax.lax.dynamic_slice_p and tuple(eqn.params["slice_sizes"]) == (1,):
        return ref[pl.ds(jnp.clip(rest[0], 0, n - 1), 1)]
    return None


# -- kernels ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """Static parameters of one call, shared by the forward and backward kernels."""

    block_q: int
    block_k: int
    scale: float
    q_offset: int
    nk: int
    groups: int  # query heads per key/value head
    head_dim: int
    interpret: bool
    num_warps: int | None
    num_stages: int
    score: Mod | None
    mask: Mod | None

    def compiler_params(self, bwd: bool = False) -> plgpu.CompilerParams:
        warps = self.num_warps
        if warps is None:  # the reference kernel's heuristics
            warps = (4 if self.block_q * self.block_k < 128 * 128 else 8) if bwd else (4 if self.head_dim <= 64 else 8)
        return plgpu.CompilerParams(num_warps=warps, num_stages=self.num_stages)

    def tile_scores(self, q: Array, k: Array, b: Array, h: Array, q_idx: Array, kv_idx: Array,
                    kind: Array, consts: tuple[tp.Sequence, tp.Sequence], slope: bool = False):
        """Float32 scores of a tile after ``score_mod`` and (partial tiles) the mask; with ``slope``, also
        d(score_mod)/d(raw score) on the tile (None without a ``score_mod``)."""
        tile = (self.block_q, self.block_k)
        s = plgpu.dot(q, k, trans_b=True, precision=dot_precision(q.dtype)) * self.scale
        ds_draw = None
        if self.score is not None:
            mod = lambda x: jnp.broadcast_to(self.score(consts[0], x, b, h, q_idx, kv_idx), tile).astype(jnp.float32)
            if slope:  # elementwise in the score, so a JVP with ones gives the whole diagonal
                s, ds_draw = jax.jvp(mod, (s,), (jnp.ones_like(s),))
            else:
                s = mod(s)
        if self.mask is not None:
            def masked(x):
                return jnp.where(jnp.broadcast_to(self.mask(consts[1], b, h, q_idx, kv_idx), tile), x, -jnp.inf)

            s = jax.lax.cond(kind == PARTIAL, masked, lambda x: x, s)
        return s, ds_draw

    def split_consts(self, refs: tp.Sequence) -> tuple[tp.Sequence, tp.Sequence]:
        n = 0 if self.score is None else self.score.n_consts
        return refs[:n], refs[n:]


def dot_precision(dtype: tp.Any) -> jax.lax.Precision | None:
    """Float32 inputs at full precision (no TF32 on the GPU), matching the CPU implementations."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def head_mask_of(cfg: Config, padded: int) -> Array:
    return (jnp.arange(padded) < cfg.head_dim)[None, :]


def forward_kernel(idx_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, *refs, cfg: Config):
    """One query block of one head: online softmax over the key blocks its list names."""
    *const_refs, o_ref, lse_ref = refs
    consts = cfg.split_consts(const_refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    head_mask = head_mask_of(cfg, q_ref.shape[-1])
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    q_idx = cfg.q_offset + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)

    def body(n, carry):
        o_prev, m_prev, l_prev = carry
        j, kind = idx_ref[i, n], kind_ref[i, n]
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k = plgpu.load(k_ref.at[keys, :], mask=head_mask, other=0.0)
        kv_idx = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        s, _ = cfg.tile_scores(q, k, b, h, q_idx, kv_idx, kind, consts)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet stay at 0
        p = jnp.exp(s - m_safe[:, None])
        correction = jnp.exp(m_prev - m_safe)
        v = plgpu.load(v_ref.at[keys, :], mask=head_mask, other=0.0)
        o_next = correction[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v, precision=dot_precision(v.dtype))
        return o_next, m_next, correction * l_prev + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, q_ref.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, count_ref[i], body, init)  # noqa: E741
    seen = l > 0
    o = o / jnp.where(seen, l, 1.0)[:, None]
    # +inf for rows that saw nothing: the backward's exp(s - lse) is then 0 there, not exp(+inf).
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=head_mask)


def dq_kernel(idx_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: Config):
    """dq of one query block of one head: the same key blocks as the forward."""
    *const_refs, dq_ref = refs
    consts = cfg.split_consts(const_refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    head_mask = head_mask_of(cfg, q_ref.shape[-1])
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    do = plgpu.load(do_ref, mask=head_mask, other=0.0)
    lse, delta = lse_ref[...], delta_ref[...]
    q_idx = cfg.q_offset + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)

    def body(n, dq):
        j, kind = idx_ref[i, n], kind_ref[i, n]
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k = plgpu.load(k_ref.at[keys, :], mask=head_mask, other=0.0)
        v = plgpu.load(v_ref.at[keys, :], mask=head_mask, other=0.0)
        kv_idx = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ds = score_grad(cfg, q, k, v, do, lse, delta, b, h, q_idx, kv_idx, kind, consts)[1]
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=dot_precision(k.dtype))

    dq = jax.lax.fori_loop(0, count_ref[i], body, jnp.zeros((bq, q_ref.shape[-1]), jnp.float32))
    plgpu.store(dq_ref, (dq * cfg.scale).astype(dq_ref.dtype), mask=head_mask)


def dkdv_kernel(idx_ref, kind_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: Config):
    """dk, dv of one key block of one key/value head: every query head of its group, over the query
    blocks that list this key block."""
    *const_refs, dk_ref, dv_ref = refs
    consts = cfg.split_consts(const_refs)
    b, kvh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    padded = k_ref.shape[-1]
    head_mask = head_mask_of(cfg, padded)
    k = plgpu.load(k_ref, mask=head_mask, other=0.0)
    v = plgpu.load(v_ref, mask=head_mask, other=0.0)
    kv_idx = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)

    def head(g, carry):
        h = kvh * cfg.groups + g

        def body(n, carry):
            dk, dv = carry
            i, kind = idx_ref[j, n], kind_ref[j, n]
            rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
            q = plgpu.load(q_ref.at[rows, g, :], mask=head_mask, other=0.0)
            do = plgpu.load(do_ref.at[rows, g, :], mask=head_mask, other=0.0)
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            q_idx = cfg.q_offset + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
            p, ds = score_grad(cfg, q, k, v, do, lse, delta, b, h, q_idx, kv_idx, kind, consts)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=dot_precision(do.dtype))
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=dot_precision(q.dtype))
            return dk, dv

        return jax.lax.fori_loop(0, count_ref[j], body, carry)

    zeros = jnp.zeros((bk, padded), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, cfg.groups, head, (zeros, zeros))
    plgpu.store(dk_ref, (dk * cfg.scale).astype(dk_ref.dtype), mask=head_mask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=head_mask)


def score_grad(cfg: Config, q, k, v, do, lse, delta, b, h, q_idx, kv_idx, kind, consts) -> tuple[Array, Array]:
    """Probabilities ``p`` of a tile and the gradient of the loss w.r.t. its raw scores ``q.k`` (before
    ``scale``, which the callers apply once to dq and dk)."""
    s, ds_draw = cfg.tile_scores(q, k, b, h, q_idx, kv_idx, kind, consts, slope=True)
    p = jnp.exp(s - lse[:, None])  # 0 where masked (s = -inf) and on rows that saw nothing (lse = +inf)
    dp = plgpu.dot(do, v, trans_b=True, precision=dot_precision(do.dtype))
    ds = p * (dp - delta[:, None])
    if ds_draw is not None:
        ds = jnp.where(p > 0, ds * ds_draw, 0.0)  # where masked, d(score_mod) may be anything, even NaN
    return p, ds


# -- the three pallas_calls and their custom_vjp ------------------------------------------------------
def whole(x: Array) -> pl.BlockSpec:
    """A BlockSpec handing every program the whole array (block lists, captured arrays)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def forward(cfg: Config, q, k, v, lists, consts) -> tuple[Array, Array]:
    """Output BTHD and logsumexp ``(B, H, T)`` float32."""
    b, t, h, d = q.shape
    padded = pl.next_power_of_2(d)
    g, s = cfg.groups, k.shape[1]
    flat = (*consts[0], *consts[1])
    q_spec = pl.BlockSpec((None, cfg.block_q, None, padded), lambda bi, hi, i: (bi, i, hi, 0))
    kv_spec = pl.BlockSpec((None, s, None, padded), lambda bi, hi, i: (bi, 0, hi // g, 0))
    return pl.pallas_call(
        functools.partial(forward_kernel, cfg=cfg),
        grid=(b, h, t // cfg.block_q),
        in_specs=[*map(whole, lists), q_spec, kv_spec, kv_spec, *map(whole, flat)],
        out_specs=[q_spec, pl.BlockSpec((None, None, cfg.block_q), lambda bi, hi, i: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="flex_forward",
    )(*lists, q, k, v, *flat)


def backward(cfg: Config, q, k, v, lists, consts, o, lse, do) -> tuple[Array, Array, Array]:
    """dq, dk, dv: the FlashAttention-2 backward over the same block lists."""
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    padded = pl.next_power_of_2(d)
    g, bq, bk = cfg.groups, cfg.block_q, cfg.block_k
    flat = (*consts[0], *consts[1])
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))

    q_spec = pl.BlockSpec((None, bq, None, padded), lambda bi, hi, i: (bi, i, hi, 0))
    kv_all = pl.BlockSpec((None, s, None, padded), lambda bi, hi, i: (bi, 0, hi // g, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i))
    dq = pl.pallas_call(
        functools.partial(dq_kernel, cfg=cfg),
        grid=(b, h, t // bq),
        in_specs=[*map(whole, lists), q_spec, kv_all, kv_all, q_spec, row_spec, row_spec, *map(whole, flat)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.compiler_params(bwd=True),
        interpret=cfg.interpret,
        name="flex_backward_dq",
    )(*lists, q, k, v, do, lse, delta, *flat)

    t_lists = transpose_lists(lists[0], lists[1], cfg.nk)
    q_group = pl.BlockSpec((None, t, g, padded), lambda bi, ki, j: (bi, 0, ki, 0))  # heads ki*g .. ki*g+g-1
    kv_spec = pl.BlockSpec((None, bk, None, padded), lambda bi, ki, j: (bi, j, ki, 0))
    rows_group = pl.BlockSpec((None, g, t), lambda bi, ki, j: (bi, ki, 0))
    dk, dv = pl.pallas_call(
        functools.partial(dkdv_kernel, cfg=cfg),
        grid=(b, kv, s // bk),
        in_specs=[*map(whole, t_lists), q_group, kv_spec, kv_spec, q_group, rows_group, rows_group,
                  *map(whole, flat)],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cfg.compiler_params(bwd=True),
        interpret=cfg.interpret,
        name="flex_backward_dkdv",
    )(*t_lists, q, k, v, do, lse, delta, *flat)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(cfg: Config, q, k, v, lists, consts):
    return forward(cfg, q, k, v, lists, consts)[0]


def _flex_fwd(cfg: Config, q, k, v, lists, consts):
    o, lse = forward(cfg, q, k, v, lists, consts)
    return o, (q, k, v, lists, consts, o, lse)


def _flex_bwd(cfg: Config, res, do):
    q, k, v, lists, consts, o, lse = res
    dq, dk, dv = backward(cfg, q, k, v, lists, consts, o, lse, do)
    # The block lists and score_mod/mask_mod's captured arrays get no gradient.
    return dq, dk, dv, None, jax.tree.map(lambda _: None, consts)


_flex.defvjp(_flex_fwd, _flex_bwd)

