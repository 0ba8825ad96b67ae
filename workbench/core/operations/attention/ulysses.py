"""``ulysses``: sequence-parallel attention by swapping the split from positions to heads.

Inputs arrive split on their length over the mesh axis ``sp``. One ``all_to_all`` per tensor
regroups them so each device holds every position of ``H / sp`` heads; attention is then local
(``dense_attention``) and a last ``all_to_all`` restores the split on positions. Heads must
divide by ``sp``. Key/value heads too: when ``KV % sp != 0`` they are repeated (GQA group by
group, as ``repeat_kv_heads`` does) up to ``lcm(KV, sp)``, which divides ``H``, so each device
still gets the key/value heads its query heads read.

Batch is split over ``dp``/``fsdp`` and heads over ``tp`` where those axes divide the sizes
(heads over ``tp`` only if ``H / tp`` still splits over ``sp``).
Local attention is dense: ``(T, S)`` logits for ``H / sp`` heads per device.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from workbench.core.operations.attention.common import AttentionCall, Visibility, dense_attention
from workbench.core.operations.attention.ring import (
    SEQUENCE_PARALLEL_FEATURES,
    SequenceParallelAttention,
    broadcast_spec,
    data_axes,
    join,
    optional_inputs,
    over_sequence,
)
from workbench.core.operations.base import Capabilities, OperationImpl, OperationRegistry

Array = jax.Array


def kv_repeats(h: int, kv: int, sp: int, tp: int = 1) -> int:
    """How many times to repeat each key/value head so that a device's ``H / tp`` heads split over ``sp``."""
    h_local, kv_local = h // tp, kv // tp
    if h_local % sp:
        raise ValueError(f"ulysses: H={h} query heads and KV={kv} key/value heads cannot be split over "
                         f"sp={sp} devices; the query heads must be divisible by sp. Use 'ring', which splits "
                         f"positions instead of heads")
    return sp // math.gcd(kv_local, sp)  # lcm(kv, sp) heads; it divides h since kv and sp both do


def ulysses_attention(call: AttentionCall, mesh: Mesh, axis: str) -> Array:
    """Attention of a validated call, heads split over ``axis`` between two all_to_alls; BTHD output."""
    sp = mesh.shape[axis]
    _, t, s, h, kv, _ = call.shape
    batch, heads = data_axes(mesh, call, axis)
    tp = math.prod(mesh.shape[a] for a in heads or ())
    if (h // tp) % sp:  # splitting heads over tp would leave too few to split over sp: keep them whole
        heads, tp = None, 1
    reps = kv_repeats(h, kv, sp, tp)
    seq_spec = P(batch, axis, heads, None)
    local = optional_inputs(call)
    # After the all_to_all, device (tp k, sp j) holds head block j of tp block k: heads split over (tp, sp).
    specs = {"kv_lengths": P(batch), "q_segment_ids": P(batch), "kv_segment_ids": P(batch)}
    specs |= {n: broadcast_spec(x.shape, (batch, join(heads, axis), None, None))
              for n, x in local.items() if x.ndim == 4}

    def to_heads(x: Array) -> Array:  # (B, T/sp, H, D) -> (B, T, H/sp, D)
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    def body(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]) -> Array:
        if reps > 1:
            k_BSKD, v_BSKD = OperationImpl.repeat_kv_heads(k_BSKD, v_BSKD, reps)
        vis = call.visibility
        vis = Visibility(t, s, vis.causal, vis.sliding_window, local.get("kv_lengths"), local.get("q_segment_ids"),
                         local.get("kv_segment_ids"), local.get("mask"))
        head_call = AttentionCall(to_heads(q_BTHD), to_heads(k_BSKD), to_heads(v_BSKD), vis, local.get("bias"),
                                  call.logits_soft_cap, call.scale, False)
        out_BTHD, _ = dense_attention(head_call)
        return jax.lax.all_to_all(out_BTHD, axis, split_axis=1, concat_axis=2, tiled=True)

    return over_sequence(body, mesh, call, local, seq_spec, specs)


@OperationRegistry.register
class UlyssesAttention(SequenceParallelAttention):
    """Sequence-parallel attention: all_to_all from split positions to split heads, local attention, back."""

    kernel = staticmethod(ulysses_attention)
    capabilities = Capabilities(features=SEQUENCE_PARALLEL_FEATURES, mesh_axes=("sp",),
                                description="shard_map over sp; all_to_all positions -> heads, dense local "
                                            "attention, all_to_all back; H divisible by sp")

    @classmethod
    def get_impl_name(cls):
        return "ulysses"
