"""``allgather_kv``: context parallelism as Llama 3 trained long contexts (all-gather K and V over ``sp``).

Query, key and value arrive split on their length over the mesh axis ``sp``. Each device all-gathers the key
and value shards (one ``all_gather`` per tensor) and attends with its own query block to the whole sequence,
the causal mask offset by the block's position ("The Llama 3 Herd of Models", section 3.3.2). Unlike ``ring``
the transfer is not overlapped with the attention, but it is one collective per tensor, small with GQA's few
key/value heads. The backward is autodiff: the all-gather's transpose reduce-scatters dK and dV.

Locally each query chunk runs ``flash`` with key blocks of the chunk's length: tiles no query sees by position
are skipped (``lax.cond``) and checkpointed, so logits take ``T S / sp^2`` per device, the gathered keys and
values ``S KV D`` each. Causal, contiguous device ``i`` folds ``i + 1`` of ``sp`` key blocks;
``OperationMetadata(options={"load_balance": "zigzag"})`` gives device ``i`` query chunks ``i`` and
``2 sp - 1 - i`` of ``2 sp`` (:mod:`.zigzag`, as Llama 3 does): ``2 sp + 1`` tiles of a quarter the size on
every device. Only queries move (two half-shard ``ppermute`` in, two for the output back); keys and values
are gathered in sequence order. Batch is split over ``dp``/``fsdp``, heads over ``tp``, where they divide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from workbench.core.operations.attention.common import AttentionCall, Visibility
from workbench.core.operations.attention.flash import flash_attention
from workbench.core.operations.attention.ring import (
    SEQUENCE_PARALLEL_FEATURES,
    SequenceParallelAttention,
    broadcast_spec,
    data_axes,
    optional_inputs,
    over_sequence,
)
from workbench.core.operations.attention.ring_kernel import CONTIGUOUS, ZIGZAG, chunk_offsets
from workbench.core.operations.attention.zigzag import from_zigzag, to_zigzag
from workbench.core.operations.base import Capabilities, OperationRegistry

Array = jax.Array
_QUERY_DIM = {"q_segment_ids": 1, "mask": 2, "bias": 2}  # the query axis of the optional inputs that have one


def allgather_kv_attention(call: AttentionCall, mesh: Mesh, axis: str, load_balance: str = CONTIGUOUS) -> Array:
    """Attention of a validated call: keys and values all-gathered over ``axis``, queries stay; BTHD output.

    ``load_balance``: ``"contiguous"`` (device ``i`` holds query block ``i``) or ``"zigzag"`` (query chunks
    ``i`` and ``2 sp - 1 - i`` of ``2 sp``; inputs and output stay in sequence order).
    """
    sp = mesh.shape[axis]
    _, t, s, *_ = call.shape
    batch, heads = data_axes(mesh, call, axis)
    seq_spec = P(batch, axis, heads, None)
    local = optional_inputs(call)
    # Query-side inputs are split like the query; key-side ones (kv_segment_ids) are gathered like the keys.
    specs = {"kv_lengths": P(batch), "q_segment_ids": P(batch, axis), "kv_segment_ids": P(batch, axis)}
    specs |= {n: broadcast_spec(x.shape, (batch, heads, axis, None)) for n, x in local.items() if x.ndim == 4}
    parts = 2 if load_balance == ZIGZAG else 1
    vis = call.visibility

    def gather(x: Array) -> Array:  # (B, S/sp, ...) -> (B, S, ...)
        return jax.lax.all_gather(x, axis, axis=1, tiled=True)

    def body(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]) -> Array:
        if load_balance == ZIGZAG:  # queries (and their rows of segment ids, mask, bias) into the zig-zag layout
            q_BTHD = to_zigzag(q_BTHD, axis, sp, 1)
            local = {n: to_zigzag(x, axis, sp, _QUERY_DIM[n]) if n in _QUERY_DIM else x for n, x in local.items()}
        k_BSKD, v_BSKD = gather(k_BSKD), gather(v_BSKD)
        kv_seg_BS = gather(local["kv_segment_ids"]) if "kv_segment_ids" in local else None
        cq = q_BTHD.shape[1] // parts
        offsets = chunk_offsets(jax.lax.axis_index(axis), sp, t, load_balance)
        outs = []
        for p, q_off in enumerate(offsets):
            rows = {n: x if x.shape[_QUERY_DIM[n]] == 1 else
                    jax.lax.slice_in_dim(x, p * cq, (p + 1) * cq, axis=_QUERY_DIM[n])
                    for n, x in local.items() if n in _QUERY_DIM}
            # Positions: with q_len = T - q_off, local query j sits at L - T + q_off + j, as it does globally.
            chunk_vis = Visibility(t - q_off, s, vis.causal, vis.sliding_window, local.get("kv_lengths"),
                                   rows.get("q_segment_ids"), kv_seg_BS, rows.get("mask"))
            chunk = AttentionCall(q_BTHD[:, p * cq:(p + 1) * cq], k_BSKD, v_BSKD, chunk_vis, rows.get("bias"),
                                  call.logits_soft_cap, call.scale, False)
            outs.append(flash_attention(chunk, cq, s // (parts * sp)))
        out_BTHD = outs[0] if parts == 1 else jnp.concatenate(outs, axis=1)
        return from_zigzag(out_BTHD, axis, sp, 1) if load_balance == ZIGZAG else out_BTHD

    return over_sequence(body, mesh, call, local, seq_spec, specs)


@OperationRegistry.register
class AllGatherKVAttention(SequenceParallelAttention):
    """Context-parallel attention (Llama 3): keys and values all-gathered over ``sp``, local queries attend."""

    kernel = staticmethod(allgather_kv_attention)
    load_balanced = True
    capabilities = Capabilities(features=SEQUENCE_PARALLEL_FEATURES, mesh_axes=("sp",),
                                description="shard_map over sp; all_gather of keys and values, local queries "
                                            "attend to the whole sequence (flash tiles, causal offset by the "
                                            "block's position, masked tiles skipped); T and S divisible by sp; "
                                            "option load_balance='zigzag' (T and S divisible by 2 sp)")

    @classmethod
    def get_impl_name(cls):
        return "allgather_kv"
