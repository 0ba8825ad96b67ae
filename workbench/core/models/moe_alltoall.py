"""Expert parallelism as GShard, Switch and DeepSeek run it: tokens travel to their experts and back.

Inside ``jax.shard_map`` over the mesh, each device:

1. takes its own tokens (those of its batch / sequence shard; when the batch is not split over ``ep``,
   the ``ep`` devices holding the same tokens each take ``1/ep`` of them);
2. packs every routed token copy into a fixed-capacity buffer ``(E, C, D)`` per destination expert
   (:func:`dispatch_slots`: copies are taken in token order, ``n * k + j`` for token ``n``'s ``j``-th
   choice, and a copy past its expert's ``C`` slots is dropped);
3. sends expert ``e``'s rows to the device that holds ``e`` with one ``all_to_all`` over ``ep``;
4. runs its ``E / ep`` local experts on what it received (``tp`` splits the experts' width: the down
   projection is summed over ``tp``);
5. sends the results back with a second ``all_to_all`` and combines each token's copies with its routing
   weights (a dropped copy adds nothing), then all-gathers the ``ep`` split of step 1.

``capacity_factor`` sets ``C = ceil(capacity_factor * n * k / E)`` slots per expert for ``n`` local tokens;
``None`` sizes ``C = n`` (a token picks an expert at most once), so nothing is ever dropped and the
output equals the ``dense`` strategy's. FLOPs per device are those of ``E * C`` rows per layer instead of
``dense``'s ``E * n``.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from workbench.core.shapes import capacity

Array = jax.Array


class Experts(tp.NamedTuple):
    """Stacked expert weights ``(E, ...)``, optional biases, and ``act(gate, up)`` (the gated activation)."""

    gate_EDF: Array
    up_EDF: Array
    down_EFD: Array
    gate_bias_EF: Array | None
    up_bias_EF: Array | None
    down_bias_ED: Array | None
    act: tp.Callable[[Array, Array], Array]


def dispatch_slots(experts_NK: Array, num_experts: int, slots: int, valid_N: Array | None = None
                   ) -> tuple[Array, Array]:
    """Each copy's slot in its expert's buffer ``(N, K)`` and whether it is kept (slot < ``slots``).

    Copies are ranked in token order (copy ``n * K + j``): a copy's slot is the number of earlier copies
    routed to the same expert. Tokens with ``valid_N`` False (padding) take no slot and are not kept."""
    n, k = experts_NK.shape
    onehot_ME = jax.nn.one_hot(experts_NK.reshape(n * k), num_experts, dtype=jnp.int32)
    if valid_N is not None:
        onehot_ME = onehot_ME * jnp.repeat(valid_N, k)[:, None].astype(jnp.int32)
    slot_M = (jnp.cumsum(onehot_ME, axis=0) * onehot_ME).sum(-1) - 1
    slot_NK = slot_M.reshape(n, k)
    keep_NK = slot_NK < slots
    if valid_N is not None:
        keep_NK &= valid_N[:, None]
    return slot_NK, keep_NK


def token_split(token_spec: P | None, sizes: tp.Mapping[str, int], ep_axis: str) -> tuple[tuple[str, ...], int]:
    """The mesh axes a ``(B, T, ...)`` token layout ``token_spec`` splits the tokens over, and how many ways
    each device's tokens are split again over ``ep_axis`` (its size when the tokens repeat over it, else 1)."""
    bt_spec = (*tuple(token_spec or ())[:2], None, None)[:2]
    axes = tuple(a for entry in bt_spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry))
    ep = sizes.get(ep_axis, 1)
    return axes, ep if ep > 1 and ep_axis not in axes else 1


class Dispatch(tp.NamedTuple):
    """What the all-to-all strategy did: tokens routed to each expert (before drops) and copies dropped,
    summed over the devices (global counts)."""

    tokens_per_expert_E: Array
    dropped: Array


def _local(x_ND, weights_NK, experts_NK, ex: Experts, *, num_experts: int, capacity_factor: float | None,
           ep_axis: str | None, ep: int, tp_axis: str | None, precision, valid_N: Array | None = None,
           share: int | None = None) -> tuple[Array, Array, Array]:
    """One device's dispatch, expert compute and combine (the body of the shard_map). ``valid_N`` marks
    real tokens when the device's share was padded to split evenly over ``ep`` (a share of ``share`` tokens
    sizes the capacity)."""
    n, d = x_ND.shape
    k = experts_NK.shape[1]
    c = capacity(n if share is None else share, k, num_experts, capacity_factor)
    slot_NK, keep_NK = dispatch_slots(experts_NK, num_experts, c, valid_N)
    # dropped copies aim at slot c: out of range, so the scatter drops them
    target_NK = jnp.where(keep_NK, slot_NK, c)
    buf_ECD = jnp.zeros((num_experts, c, d), x_ND.dtype)
    buf_ECD = buf_ECD.at[experts_NK, target_NK].set(jnp.broadcast_to(x_ND[:, None], (n, k, d)), mode="drop")
    e_local = num_experts // ep
    if ep_axis is not None:  # rows for expert e go to device e // e_local; we get ours from every device
        buf_ECD = jax.lax.all_to_all(buf_ECD.reshape(ep, e_local, c, d), ep_axis, 0, 0, tiled=True)
    rows_LRD = buf_ECD.reshape(ep, e_local, c, d).swapaxes(0, 1).reshape(e_local, ep * c, d)
    g_LRF = jnp.einsum("lrd,ldf->lrf", rows_LRD, ex.gate_EDF, precision=precision)
    u_LRF = jnp.einsum("lrd,ldf->lrf", rows_LRD, ex.up_EDF, precision=precision)
    if ex.gate_bias_EF is not None:
        g_LRF, u_LRF = g_LRF + ex.gate_bias_EF[:, None], u_LRF + ex.up_bias_EF[:, None]
    y_LRD = jnp.einsum("lrf,lfd->lrd", ex.act(g_LRF, u_LRF), ex.down_EFD, precision=precision)
    if tp_axis is not None:
        y_LRD = jax.lax.psum(y_LRD, tp_axis)
    if ex.down_bias_ED is not None:
        y_LRD = y_LRD + ex.down_bias_ED[:, None]
    y_ECD = y_LRD.reshape(e_local, ep, c, d).swapaxes(0, 1)
    if ep_axis is not None:  # each device's results back to it
        y_ECD = jax.lax.all_to_all(y_ECD, ep_axis, 0, 0, tiled=True)
    y_ECD = y_ECD.reshape(num_experts, c, d)
    y_NKD = y_ECD[experts_NK, jnp.minimum(slot_NK, c - 1)]
    w_NK = jnp.where(keep_NK, weights_NK, 0).astype(y_NKD.dtype)
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, w_NK, precision=precision)
    real_NK = jnp.ones_like(keep_NK) if valid_N is None else jnp.broadcast_to(valid_N[:, None], keep_NK.shape)
    counts_E = jnp.einsum("nke,nk->e", jax.nn.one_hot(experts_NK, num_experts, dtype=jnp.int32),
                          real_NK.astype(jnp.int32))
    return y_ND, counts_E, (real_NK & ~keep_NK).sum(dtype=jnp.int32)


def alltoall(x_BTD: Array, weights_BTK: Array, experts_BTK: Array, ex: Experts, *, mesh: jax.sharding.Mesh | None,
             token_spec: P | None = None, ep_axis: str = "ep", tp_axis: str = "tp",
             capacity_factor: float | None = None, precision=None) -> tuple[Array, Dispatch]:
    """The MoE output ``(B, T, D)`` by all-to-all expert parallelism, and the dispatch counts.

    ``token_spec`` is how ``x_BTD``'s batch and sequence dims are split over ``mesh`` (the model's
    activation layout); the experts' dim is split over ``ep_axis`` and their width over ``tp_axis`` when
    those are mesh axes of size > 1. Without a mesh the same dispatch runs on one device (capacity and
    drops included, no collectives)."""
    num_experts = ex.gate_EDF.shape[0]
    b, t, d = x_BTD.shape
    sizes = {} if mesh is None else dict(mesh.shape)
    ep = sizes.get(ep_axis, 1)
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over {ep_axis}={ep}; use an ep size that divides them")
    body = dict(num_experts=num_experts, capacity_factor=capacity_factor, precision=precision)
    if mesh is None:
        y_ND, counts_E, dropped = _local(x_BTD.reshape(b * t, d), weights_BTK.reshape(b * t, -1),
                                         experts_BTK.reshape(b * t, -1), ex, ep_axis=None, ep=1, tp_axis=None, **body)
        return y_ND.reshape(b, t, d), Dispatch(counts_E, dropped)
    bt_spec = (*tuple(token_spec or ())[:2], None, None)[:2]
    token_axes, split = token_split(token_spec, sizes, ep_axis)
    split_ep = split > 1  # tokens repeat over ep: each ep device takes 1/ep
    tp_size = sizes.get(tp_axis, 1)
    e = ep_axis if ep > 1 else None
    f = tp_axis if tp_size > 1 and ex.gate_EDF.shape[2] % tp_size == 0 else None
    distinct = token_axes + ((ep_axis,) if split_ep else ())  # axes over which devices hold different tokens
    tok = P(*bt_spec, None)
    arrays = {name: value for name, value in ex._asdict().items() if name != "act" and value is not None}
    specs = {"gate_EDF": P(e, None, f), "up_EDF": P(e, None, f), "down_EFD": P(e, f, None),
             "gate_bias_EF": P(e, f), "up_bias_EF": P(e, f), "down_bias_ED": P(e, None)}

    def per_device(x_BTD, w_BTK, e_BTK, arrays):
        bl, tl, _ = x_BTD.shape
        x_ND, w_NK, e_NK = x_BTD.reshape(bl * tl, d), w_BTK.reshape(bl * tl, -1), e_BTK.reshape(bl * tl, -1)
        n = x_ND.shape[0]
        valid_N = part = None
        if split_ep:  # this device's 1/ep of the tokens, the last share padded when ep does not divide them
            part = -(-n // ep)
            pad = part * ep - n
            x_ND, w_NK, e_NK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_ND, w_NK, e_NK))
            i = jax.lax.axis_index(ep_axis)
            x_ND, w_NK, e_NK = (jax.lax.dynamic_slice_in_dim(a, i * part, part) for a in (x_ND, w_NK, e_NK))
            valid_N = i * part + jnp.arange(part) < n
        local = ex._replace(**{name: arrays.get(name) for name in specs})
        y_ND, counts_E, dropped = _local(x_ND, w_NK, e_NK, local, ep_axis=e, ep=ep, tp_axis=f, valid_N=valid_N,
                                         share=part, **body)
        if split_ep:
            y_ND = jax.lax.all_gather(y_ND, ep_axis, tiled=True)[:n]
        if distinct:
            counts_E, dropped = jax.lax.psum(counts_E, distinct), jax.lax.psum(dropped, distinct)
        return y_ND.reshape(bl, tl, d), counts_E, dropped

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(tok, tok, tok, {n: specs[n] for n in arrays}),
                        out_specs=(tok, P(), P()), check_vma=False)
    y_BTD, counts_E, dropped = run(x_BTD, weights_BTK, experts_BTK, arrays)
    return y_BTD, Dispatch(counts_E, dropped)
