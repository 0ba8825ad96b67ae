"""The per-device half of ``ring`` (inside ``shard_map``): the loop over key/value blocks, forward and backward.

Device ``i`` holds one query block and, at step ``s``, the key/value block of device ``i - s``. A block is
one chunk (``load_balance="contiguous"``) or two (``"zigzag"``); every (query chunk, key chunk) tile that
some query may see by position is folded, the others are skipped (``lax.cond``) and not counted.

Both directions are double-buffered: a loop trip sends the next block before computing on the one it holds,
so no permute reads or feeds the trip's computation. The backward pass (``jax.custom_vjp``) keeps the
forward's memory bound: it saves the inputs, the output and one log-sum-exp per query, and recomputes each
tile's probabilities while the key/value blocks go round the ring again, their gradients travelling with them
(``sp`` hops bring them home). Autodiff through the loop would instead keep every step's key/value block.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp

from workbench.core.operations.attention.common import (
    AttentionCall,
    SoftmaxCarry,
    Visibility,
    accumulation_dtype,
    keys_to_tiles,
    logits,
    queries_to_tiles,
    tile_finish,
    tile_update,
    tiles_to_output,
)
from workbench.core.operations.attention.flash import tile_filter

Array = jax.Array
CONTIGUOUS, ZIGZAG = "contiguous", "zigzag"
LOAD_BALANCES = (CONTIGUOUS, ZIGZAG)
_QUERY_DIM = {"q_segment_ids": 1, "mask": 2, "bias": 2}  # the query axis of the optional inputs that have one


def chunk_offsets(device: Array | int, sp: int, length: int, load_balance: str) -> list[Array | int]:
    """Global start of each chunk of a sequence of ``length`` that a device holds: ``[i L / sp]``
    contiguous (one chunk), ``[i c, (2 sp - 1 - i) c]`` zig-zag (two chunks of ``c = L / (2 sp)``)."""
    if load_balance == ZIGZAG:
        c = length // (2 * sp)
        return [device * c, (2 * sp - 1 - device) * c]
    return [device * (length // sp)]


def _key_block(x: Array | None, k_off: Array, sk: int) -> Array | None:
    """The key block ``[k_off, k_off + sk)`` of a 4-D mask or bias (unless it broadcasts over keys)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k_off, sk, axis=3)


def _split(x: Array, parts: int, dim: int) -> list[Array]:
    """``parts`` chunks of ``dim``; a broadcast dimension (size 1) is shared by all."""
    return [x] * parts if x.shape[dim] == 1 or parts == 1 else jnp.split(x, parts, axis=dim)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """What the per-device kernel needs to know statically.

    ``settings``: a call holding only the global visibility flags and lengths, soft cap and scale;
    ``varying``: the mesh axes the query shard varies over; ``bias_sum_axes``: those of them the bias shard
    is replicated over, where its gradient sums.
    """

    settings: AttentionCall
    axis: str
    sp: int
    load_balance: str
    varying: tuple[str, ...]
    bias_sum_axes: tuple[str, ...] = ()

    @property
    def parts(self) -> int:
        return 2 if self.load_balance == ZIGZAG else 1

    def tile_call(self, local: dict[str, Array], kv_seg: Array | None, q_off: Array, k_off: Array,
                  sk: int) -> AttentionCall:
        """The call for one (query chunk, key chunk) tile, indexed locally from 0 in both chunks.

        ``local`` holds the query chunk's segment ids, mask and bias rows; ``kv_seg`` the key chunk's. Positions
        are shifted into the key chunk's frame (a key at global index ``k_off + j`` sits at ``j``, a query's
        position drops by ``k_off`` too), so causal, window and length tests compare as globally while segment
        ids, mask and bias are read at local indices. Only visibility, bias, soft cap and scale are set.
        """
        vis, call = self.settings.visibility, self.settings
        lengths = local.get("kv_lengths")
        tile_vis = Visibility(vis.q_len - q_off, vis.kv_len - k_off, vis.causal, vis.sliding_window,
                              None if lengths is None else lengths - k_off, local.get("q_segment_ids"), kv_seg,
                              _key_block(local.get("mask"), k_off, sk))
        return AttentionCall(None, None, None, tile_vis, _key_block(local.get("bias"), k_off, sk),  # type: ignore[arg-type]
                             call.logits_soft_cap, call.scale, False)

    def tiles(self, q_BTHD: Array, local: dict[str, Array], kv: int, sk: int) -> Tiles:
        return Tiles(self, q_BTHD, local, kv, sk)


class Tiles:
    """One device's query chunks and the tiles it folds at each step, skipping those no query sees."""

    def __init__(self, plan: RingPlan, q_BTHD: Array, local: dict[str, Array], kv: int, sk: int):
        vis, parts = plan.settings.visibility, plan.parts
        self.plan, self.i = plan, jax.lax.axis_index(plan.axis)
        self.cq, self.ck = q_BTHD.shape[1] // parts, sk // parts
        self.q_offs = chunk_offsets(self.i, plan.sp, vis.q_len, plan.load_balance)
        self.q_BKGTD = jnp.split(queries_to_tiles(q_BTHD, kv), parts, axis=3)
        chunks = {n: _split(x, parts, _QUERY_DIM[n]) for n, x in local.items() if n in _QUERY_DIM}
        self.local = [{n: chunks[n][p] if n in chunks else x for n, x in local.items()} for p in range(parts)]
        self.may_see = tile_filter(Visibility(vis.q_len, vis.kv_len, vis.causal, vis.sliding_window,
                                              local.get("kv_lengths")), self.cq, self.ck)
        self.q_idx, self.k_idx = jnp.arange(self.cq), jnp.arange(self.ck)

    def fold(self, step: Array | int, state: tp.Any, blocks: tuple, update: tp.Callable[..., tp.Any]) -> tp.Any:
        """``update(state, p, r, key_chunk_arrays, tile_call, k_off)`` for each tile of step ``step`` that may be seen;
        ``blocks`` are the held block's arrays split on keys (``r`` indexes the chunk)."""
        plan = self.plan
        k_offs = chunk_offsets((self.i - step) % plan.sp, plan.sp, plan.settings.visibility.kv_len, plan.load_balance)
        for r, k_off in enumerate(k_offs):
            key_chunk = tuple(None if x is None else jnp.split(x, plan.parts, axis=x.ndim - 2 if x.ndim == 4 else 1)[r]
                              for x in blocks)
            for p, q_off in enumerate(self.q_offs):
                tile = plan.tile_call(self.local[p], key_chunk[-1], q_off, k_off, self.ck)
                run = lambda st, p=p, r=r, c=key_chunk, tile=tile, k_off=k_off: update(st, p, r, c, tile, k_off)
                if self.may_see is None:
                    state = run(state)
                else:
                    state = jax.lax.cond(self.may_see(q_off, k_off), run, lambda st: st, state)
        return state


def _permute(plan: RingPlan, x: tp.Any) -> tp.Any:
    return jax.lax.ppermute(x, plan.axis, [(j, (j + 1) % plan.sp) for j in range(plan.sp)])


def _varying(plan: RingPlan, x: tp.Any) -> tp.Any:
    return jax.lax.pcast(x, plan.varying, to="varying")


# -- forward ----------------------------------------------------------------------------------------
def ring_forward(plan: RingPlan, q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]
                 ) -> tuple[Array, list[Array], Array]:
    """Output ``(B, T/sp, H, D)``, log-sum-exp per query chunk ``(B, KV, G, c, 1)`` and the tiles folded."""
    b, _, h, d = q_BTHD.shape
    kv, sk = k_BSKD.shape[2], k_BSKD.shape[1]
    tiles = plan.tiles(q_BTHD, local, kv, sk)

    def update(state, p, _r, key_chunk, tile, _k_off):
        carries, count = state
        k_BKSD, v_BKSD, _ = key_chunk
        carries = list(carries)
        carries[p] = tile_update(carries[p], tiles.q_BKGTD[p], k_BKSD, v_BKSD, tile, tiles.q_idx, tiles.k_idx)
        return tuple(carries), count + 1

    def send_then_fold(step, state_blocks):
        state, blocks = state_blocks
        incoming = _permute(plan, blocks)  # leaves before this step's fold, which does not feed it
        return tiles.fold(step, state, blocks, update), incoming

    init = SoftmaxCarry.init(b, kv, h // kv, tiles.cq, d, q_BTHD.dtype)
    state = _varying(plan, ((init,) * plan.parts, jnp.zeros((), jnp.int32)))
    blocks = (keys_to_tiles(k_BSKD), keys_to_tiles(v_BSKD), local.get("kv_segment_ids"))  # tile layout
    state, blocks = jax.lax.fori_loop(0, plan.sp - 1, send_then_fold, (state, blocks))
    carries, count = tiles.fold(plan.sp - 1, state, blocks, update)  # the last block: nothing left to send
    out_BTHD = jnp.concatenate([tile_finish(c, q_BTHD.dtype) for c in carries], axis=1)
    lse = [jnp.where(c.l > 0, c.m + jnp.log(jnp.where(c.l > 0, c.l, 1.0)), -jnp.inf) for c in carries]
    return out_BTHD, lse, count


# -- backward ---------------------------------------------------------------------------------------
def ring_backward(plan: RingPlan, q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array],
                  out_BTHD: Array, lse: list[Array], dout_BTHD: Array) -> tuple[Array, Array, Array, Array | None]:
    """``(dq, dk, dv, dbias)`` of one device's shard, recomputing each tile's probabilities from ``lse``."""
    b, _, h, d = q_BTHD.shape
    kv, sk = k_BSKD.shape[2], k_BSKD.shape[1]
    acc = accumulation_dtype(q_BTHD.dtype)
    tiles = plan.tiles(q_BTHD, local, kv, sk)
    do_BKGTD = jnp.split(queries_to_tiles(dout_BTHD.astype(acc), kv), plan.parts, axis=3)
    o_BKGTD = jnp.split(queries_to_tiles(out_BTHD.astype(acc), kv), plan.parts, axis=3)
    delta = [jnp.sum(do * o, axis=-1, keepdims=True) for do, o in zip(do_BKGTD, o_BKGTD, strict=True)]
    has_bias = "bias" in local
    # The bias shard may be the same on devices whose tiles differ (replicated over some mesh axes): made
    # varying here, its per-tile gradients stay per device and are summed once at the end, not by a psum
    # hidden in every tile's transpose (a collective inside a per-device lax.cond).
    bias_varying = [jax.lax.pcast(x["bias"], plan.bias_sum_axes, to="varying") if plan.bias_sum_axes else x["bias"]
                    for x in tiles.local] if has_bias else []

    def update(state, p, r, key_chunk, tile, k_off):
        dq, dbias, (dk, dv) = state
        k_BKSD, v_BKSD, _ = key_chunk

        def scores(q, k, bias_rows):
            call = tile if bias_rows is None else dataclasses.replace(
                tile, bias=_key_block(bias_rows, k_off, tiles.ck))
            return logits(q, k, call, tiles.q_idx, tiles.k_idx)

        bias_rows = bias_varying[p] if has_bias else None
        s, pull, visible = jax.vjp(scores, tiles.q_BKGTD[p], k_BKSD, bias_rows, has_aux=True)
        finite = jnp.isfinite(lse[p])
        prob = jnp.exp(s - jnp.where(finite, lse[p], 0.0))
        prob = jnp.where(finite if visible is None else visible & finite, prob, 0.0)
        dv_r = jnp.einsum("bkgts,bkgtd->bksd", prob, do_BKGTD[p])
        dprob = jnp.einsum("bkgtd,bksd->bkgts", do_BKGTD[p], v_BKSD.astype(acc))
        dq_p, dk_r, dbias_p = pull(prob * (dprob - delta[p]))
        dq, dk, dv, dbias = list(dq), list(dk), list(dv), list(dbias)
        dq[p] = dq[p] + dq_p.astype(acc)
        dk[r], dv[r] = dk[r] + dk_r.astype(acc), dv[r] + dv_r
        if has_bias:
            dbias[p] = dbias[p] + dbias_p.astype(acc)
        return tuple(dq), tuple(dbias), (tuple(dk), tuple(dv))

    def contribution(step, dq, dbias, blocks):
        zeros = tuple(jnp.zeros((b, kv, tiles.ck, d), acc) for _ in range(plan.parts))
        dq, dbias, (dk, dv) = tiles.fold(step, (dq, dbias, _varying(plan, (zeros, zeros))), blocks, update)
        return dq, dbias, (jnp.concatenate(dk, axis=2), jnp.concatenate(dv, axis=2))

    def trip(step, state):
        dq, dbias, blocks, dkv = state
        incoming = _permute(plan, blocks)  # the next block, sent ahead
        arrived = _permute(plan, dkv)  # the gradients of the block held now, from the device that held it before
        dq, dbias, mine = contribution(step, dq, dbias, blocks)
        return dq, dbias, incoming, jax.tree.map(jnp.add, arrived, mine)

    dq = _varying(plan, tuple(jnp.zeros((b, kv, h // kv, tiles.cq, d), acc) for _ in range(plan.parts)))
    dbias = _varying(plan, tuple(jnp.zeros(x["bias"].shape, acc) for x in tiles.local)) if has_bias else ()
    blocks = (keys_to_tiles(k_BSKD), keys_to_tiles(v_BSKD), local.get("kv_segment_ids"))
    if plan.sp == 1:
        dq, dbias, dkv = contribution(0, dq, dbias, blocks)
    else:
        incoming = _permute(plan, blocks)
        dq, dbias, dkv = contribution(0, dq, dbias, blocks)  # the device's own block
        dq, dbias, blocks, dkv = jax.lax.fori_loop(1, plan.sp - 1, trip, (dq, dbias, incoming, dkv))
        arrived = _permute(plan, dkv)
        dq, dbias, mine = contribution(plan.sp - 1, dq, dbias, blocks)
        dkv = _permute(plan, jax.tree.map(jnp.add, arrived, mine))  # one more hop: home
    dq_BTHD = tiles_to_output(jnp.concatenate(dq, axis=3)).astype(q_BTHD.dtype)
    dk_BSKD, dv_BSKD = (x.transpose(0, 2, 1, 3) for x in dkv)
    bias_grad = None
    if has_bias:
        bias = local["bias"]
        bias_grad = sum(dbias) if bias.shape[2] == 1 else jnp.concatenate(dbias, axis=2)
        if plan.bias_sum_axes:
            bias_grad = jax.lax.psum(bias_grad, plan.bias_sum_axes)
        bias_grad = bias_grad.astype(bias.dtype)
    return dq_BTHD, dk_BSKD.astype(k_BSKD.dtype), dv_BSKD.astype(v_BSKD.dtype), bias_grad


def ring_block(plan: RingPlan) -> tp.Callable[[Array, Array, Array, dict[str, Array]], tuple[Array, Array]]:
    """``f(q, k, v, local) -> (out, tiles folded)`` on one device's shards, with the ring backward as its VJP."""

    @jax.custom_vjp
    def block(q_BTHD, k_BSKD, v_BSKD, local):
        out, _, count = ring_forward(plan, q_BTHD, k_BSKD, v_BSKD, local)
        return out, count

    def forward(q_BTHD, k_BSKD, v_BSKD, local):
        out, lse, count = ring_forward(plan, q_BTHD, k_BSKD, v_BSKD, local)
        return (out, count), (q_BTHD, k_BSKD, v_BSKD, local, out, lse)

    def backward(residuals, cotangents):
        q_BTHD, k_BSKD, v_BSKD, local, out, lse = residuals
        dq, dk, dv, dbias = ring_backward(plan, q_BTHD, k_BSKD, v_BSKD, local, out, lse, cotangents[0])
        return dq, dk, dv, {n: dbias if n == "bias" else None for n in local}

    block.defvjp(forward, backward)
    return block
