"""``ring``: sequence-parallel attention; key/value blocks travel around the ``sp`` ring.

Query, key and value are split on their length over the mesh axis ``sp``: device ``i`` holds
query block ``i`` and, at first, key/value block ``i``. For ``sp`` steps every device folds the
key/value block it holds into an online softmax (``tile_update``) and passes the block on to
the next device with ``ppermute``, so each query block meets every key block while a device
never holds more than one of each: logits take ``T S / sp^2`` per device.

Batch is split over ``dp``/``fsdp`` and heads over ``tp`` where those axes divide the sizes;
otherwise they are replicated. No load balancing: with a causal mask, blocks that see nothing
are computed and masked like the others.
"""

from __future__ import annotations

import functools
import math
import typing as tp

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from workbench.core.axes import fit_spec
from workbench.core.operations.attention.common import (
    ALL_FEATURES,
    RETURN_WEIGHTS,
    SINKS,
    VALUE_DIM,
    AttentionCall,
    AttentionImplMixin,
    SoftmaxCarry,
    Visibility,
    keys_to_tiles,
    queries_to_tiles,
    tile_finish,
    tile_update,
)
from workbench.core.operations.base import AttentionOutput, Capabilities, OperationImpl, OperationRegistry

Array = jax.Array
AxisEntry = tuple[str, ...] | None

# sinks and a value head dim of its own (MLA): not through shard_map yet
SEQUENCE_PARALLEL_FEATURES = ALL_FEATURES - {RETURN_WEIGHTS, SINKS, VALUE_DIM}


# -- helpers shared with ulysses ------------------------------------------------------------------
def sequence_mesh(impl: str, metadata: tp.Any) -> tuple[Mesh, str, int]:
    """The mesh, the name of its sequence axis and that axis' size, or a ValueError saying what to pass."""
    mesh, axis = metadata.mesh, metadata.sequence_axis_name
    if mesh is None:
        raise ValueError(f"{impl}: sequence-parallel attention needs a device mesh with a {axis!r} axis; pass "
                         f"OperationMetadata(mesh=make_mesh(sp=...)) (workbench.core.mesh.make_mesh)")
    if axis not in mesh.axis_names:
        raise ValueError(f"{impl}: the mesh has axes {tuple(mesh.axis_names)} but no {axis!r} axis; pass a mesh "
                         f"with one (make_mesh(sp=...)) or set OperationMetadata(sequence_axis_name=...) to the "
                         f"axis that splits the sequence")
    return mesh, axis, mesh.shape[axis]


def check_lengths(impl: str, t: int, s: int, sp: int, axis: str) -> None:
    if t % sp or s % sp:
        raise ValueError(f"{impl}: query length T={t} and key length S={s} must both be divisible by the "
                         f"{axis!r} axis size {sp}; pad the sequences or use a smaller {axis!r} axis")


def fit_axes(mesh: Mesh, candidates: tp.Sequence[str], sizes: tp.Sequence[int], skip: str) -> AxisEntry:
    """The candidate mesh axes (size > 1, not ``skip``) that together divide every one of ``sizes``.

    Dividing all sizes is dividing their gcd, so :func:`fit_spec`'s rule for one dimension applies.
    """
    axes = tuple(a for a in candidates if a != skip and mesh.shape.get(a, 1) > 1)
    entry = fit_spec(P(axes), (math.gcd(*sizes),), mesh)[0] if axes else None
    return (entry,) if isinstance(entry, str) else entry


def data_axes(mesh: Mesh, call: AttentionCall, skip: str) -> tuple[AxisEntry, AxisEntry]:
    """Mesh axes for batch (``dp``, ``fsdp``) and heads (``tp``, when it divides both H and KV)."""
    b, _, _, h, kv, _ = call.shape
    return fit_axes(mesh, ("dp", "fsdp"), (b,), skip), fit_axes(mesh, ("tp",), (h, kv), skip)


def join(*entries: AxisEntry | str) -> AxisEntry:
    """Concatenate spec entries: ``join(("tp",), "sp") == ("tp", "sp")``; all None gives None."""
    axes = tuple(a for e in entries if e for a in ((e,) if isinstance(e, str) else e))
    return axes or None


def optional_inputs(call: AttentionCall) -> dict[str, Array]:
    """The optional inputs a call uses, by name (passed through ``shard_map`` as one dict)."""
    vis = call.visibility
    arrays = {"kv_lengths": vis.kv_lengths, "q_segment_ids": vis.q_segment_ids,
              "kv_segment_ids": vis.kv_segment_ids, "mask": vis.mask, "bias": call.bias}
    return {name: x for name, x in arrays.items() if x is not None}


def broadcast_spec(shape: tuple[int, ...], entries: tuple[AxisEntry | str, ...]) -> P:
    """A spec splitting each dimension by its entry, except those of size 1 (which broadcast)."""
    return P(*(e if n > 1 else None for e, n in zip(entries, shape, strict=True)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _jitted(attention: tp.Callable[[AttentionCall, Mesh, str], Array], mesh: Mesh, axis: str,
            settings: tuple[tp.Any, ...], arrays: tuple[Array, Array, Array, dict[str, Array]]) -> Array:
    (q, k, v, local), (causal, window, soft_cap, scale) = arrays, settings
    vis = Visibility(q.shape[1], k.shape[1], causal, window, local.get("kv_lengths"), local.get("q_segment_ids"),
                     local.get("kv_segment_ids"), local.get("mask"))
    return attention(AttentionCall(q, k, v, vis, local.get("bias"), soft_cap, scale, False), mesh, axis)


def run_jitted(attention: tp.Callable[[AttentionCall, Mesh, str], Array], call: AttentionCall, mesh: Mesh,
               axis: str) -> Array:
    """``attention(call, mesh, axis)`` under ``jit``, cached per mesh and static settings.

    Outside ``jit``, ``shard_map`` runs op by op, about ten times slower than compiled.
    """
    settings = (call.visibility.causal, call.visibility.sliding_window, call.logits_soft_cap, call.scale)
    return _jitted(attention, mesh, axis, settings, (call.query, call.key, call.value, optional_inputs(call)))


# -- ring -----------------------------------------------------------------------------------
def _key_block(x: Array | None, k_off: Array, sk: int) -> Array | None:
    """The key block ``[k_off, k_off + sk)`` of a 4-D mask or bias (unless it broadcasts over keys)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k_off, sk, axis=3)


def _tile_call(call: AttentionCall, local: dict[str, Array], q_BTHD: Array, k_BSKD: Array, v_BSKD: Array,
               kv_seg: Array | None, q_off: Array, k_off: Array) -> AttentionCall:
    """The call for one (query block, key block) pair, indexed locally from 0 in both blocks.

    Positions are shifted into the key block's frame: a key at global index ``k_off + j`` sits at
    ``j`` and a query's position drops by ``k_off`` too, so causal, window and length tests compare
    as globally while segment ids, mask and bias are read at local indices.
    """
    vis, sk = call.visibility, k_BSKD.shape[1]
    lengths = local.get("kv_lengths")
    tile_vis = Visibility(vis.q_len - q_off, vis.kv_len - k_off, vis.causal, vis.sliding_window,
                          None if lengths is None else lengths - k_off, local.get("q_segment_ids"), kv_seg,
                          _key_block(local.get("mask"), k_off, sk))
    return AttentionCall(q_BTHD, k_BSKD, v_BSKD, tile_vis, _key_block(local.get("bias"), k_off, sk),
                         call.logits_soft_cap, call.scale, False)


def ring_attention(call: AttentionCall, mesh: Mesh, axis: str) -> Array:
    """Attention of a validated call with key/value blocks rotating over mesh axis ``axis``; BTHD output."""
    sp = mesh.shape[axis]
    batch, heads = data_axes(mesh, call, axis)
    seq_spec = P(batch, axis, heads, None)
    local = optional_inputs(call)
    # Masks and bias are split on queries like the query; each device slices the key block it holds.
    specs = {"kv_lengths": P(batch), "q_segment_ids": P(batch, axis), "kv_segment_ids": P(batch, axis)}
    specs |= {n: broadcast_spec(x.shape, (batch, heads, axis, None)) for n, x in local.items() if x.ndim == 4}
    perm = [(j, (j + 1) % sp) for j in range(sp)]  # device j passes its block to j + 1

    def body(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]) -> Array:
        b, tq, h, d = q_BTHD.shape
        sk, kv = k_BSKD.shape[1], k_BSKD.shape[2]
        i = jax.lax.axis_index(axis)
        q_BKGTD = queries_to_tiles(q_BTHD, kv)
        q_idx, k_idx = jnp.arange(tq), jnp.arange(sk)

        def fold(step, carry: SoftmaxCarry, blocks: tuple) -> SoftmaxCarry:
            k_BKSD, v_BKSD, kv_seg = blocks
            k_off = ((i - step) % sp) * sk  # the block held now came from device i - step
            tile = _tile_call(call, local, q_BTHD, k_BSKD, v_BSKD, kv_seg, i * tq, k_off)
            return tile_update(carry, q_BKGTD, k_BKSD, v_BKSD, tile, q_idx, k_idx)

        def pass_then_fold(step, state: tuple) -> tuple:
            carry, blocks = state
            blocks = jax.lax.ppermute(blocks, axis, perm)
            return fold(step, carry, blocks), blocks

        # A loop, not sp unrolled steps: one step's logits are live at a time (unrolled, XLA fuses the
        # row sums of all steps into one kernel and keeps every step's tile until the end). Folding the
        # device's own block first makes the carry vary over the mesh like the loop body's result.
        blocks = (keys_to_tiles(k_BSKD), keys_to_tiles(v_BSKD), local.get("kv_segment_ids"))  # tile layout
        carry = fold(0, SoftmaxCarry.init(b, kv, h // kv, tq, d, q_BTHD.dtype), blocks)
        carry, _ = jax.lax.fori_loop(1, sp, pass_then_fold, (carry, blocks))
        return tile_finish(carry, q_BTHD.dtype)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec, {n: specs[n] for n in local}),
                       out_specs=seq_spec)
    return fn(call.query, call.key, call.value, local)


class SequenceParallelAttention(AttentionImplMixin, OperationImpl):
    """Base of ``ring`` and ``ulysses``: checks the mesh and lengths, runs :attr:`kernel` under ``jit``."""

    kernel: tp.ClassVar[tp.Callable[[AttentionCall, Mesh, str], Array]]

    def forward_native(self, query, key, value, **kwargs) -> AttentionOutput:
        name = self.get_impl_name()
        mesh, axis, sp = sequence_mesh(name, self.metadata)
        call = self.prepare(query, key, value, **kwargs)
        _, t, s, *_ = call.shape
        check_lengths(name, t, s, sp, axis)
        return AttentionOutput(run_jitted(self.kernel, call, mesh, axis), None, kernel_path=f"{name}/shard_map")


@OperationRegistry.register
class RingAttention(SequenceParallelAttention):
    """Sequence-parallel attention: query blocks stay, key/value blocks rotate over ``sp`` (ppermute)."""

    kernel = staticmethod(ring_attention)
    capabilities = Capabilities(features=SEQUENCE_PARALLEL_FEATURES, mesh_axes=("sp",),
                                description="shard_map over sp; key/value blocks rotate with ppermute, online "
                                            "softmax per block; T and S divisible by sp")

    @classmethod
    def get_impl_name(cls):
        return "ring"
