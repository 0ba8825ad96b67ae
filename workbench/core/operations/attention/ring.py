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

import dataclasses
import functools
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
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
from workbench.core.operations.attention.flash import tile_filter
from workbench.core.operations.attention.zigzag import from_zigzag, to_zigzag
from workbench.core.operations.base import (
    AttentionOutput,
    Capabilities,
    OperationImpl,
    OperationMetadata,
    OperationRegistry,
)

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


Kernel = tp.Callable[..., Array]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _jitted(attention: Kernel, mesh: Mesh, axis: str, settings: tuple[tp.Any, ...],
            arrays: tuple[Array, Array, Array, dict[str, Array]]) -> Array:
    (q, k, v, local), (causal, window, soft_cap, scale, options) = arrays, settings
    vis = Visibility(q.shape[1], k.shape[1], causal, window, local.get("kv_lengths"), local.get("q_segment_ids"),
                     local.get("kv_segment_ids"), local.get("mask"))
    return attention(AttentionCall(q, k, v, vis, local.get("bias"), soft_cap, scale, False), mesh, axis,
                     **dict(options))


def run_jitted(attention: Kernel, call: AttentionCall, mesh: Mesh, axis: str,
               options: tuple[tuple[str, tp.Any], ...] = ()) -> Array:
    """``attention(call, mesh, axis, **dict(options))`` under ``jit``, cached per mesh and static settings.

    Outside ``jit``, ``shard_map`` runs op by op, about ten times slower than compiled.
    """
    settings = (call.visibility.causal, call.visibility.sliding_window, call.logits_soft_cap, call.scale, options)
    return _jitted(attention, mesh, axis, settings, (call.query, call.key, call.value, optional_inputs(call)))


# -- ring -----------------------------------------------------------------------------------
CONTIGUOUS, ZIGZAG = "contiguous", "zigzag"
LOAD_BALANCES = (CONTIGUOUS, ZIGZAG)


def _key_block(x: Array | None, k_off: Array, sk: int) -> Array | None:
    """The key block ``[k_off, k_off + sk)`` of a 4-D mask or bias (unless it broadcasts over keys)."""
    if x is None or x.shape[3] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, k_off, sk, axis=3)


def _query_chunk(local: dict[str, Array], part: int, parts: int) -> dict[str, Array]:
    """``local`` with its query axis (segment ids, mask, bias) cut to query chunk ``part`` of ``parts``."""
    def cut(x: Array, dim: int) -> Array:
        return x if x.shape[dim] == 1 or parts == 1 else jnp.split(x, parts, axis=dim)[part]

    dims = {"q_segment_ids": 1, "mask": 2, "bias": 2}
    return {n: cut(x, dims[n]) if n in dims else x for n, x in local.items()}


def _tile_call(call: AttentionCall, local: dict[str, Array], kv_seg: Array | None, q_off: Array, k_off: Array,
               sk: int) -> AttentionCall:
    """The call for one (query chunk, key chunk) tile, indexed locally from 0 in both chunks.

    ``local`` holds the query chunk's segment ids, mask and bias rows; ``kv_seg`` the key chunk's segment ids.
    Positions are shifted into the key chunk's frame: a key at global index ``k_off + j`` sits at ``j`` and a
    query's position drops by ``k_off`` too, so causal, window and length tests compare as globally while
    segment ids, mask and bias are read at local indices. Only visibility, bias, soft cap and scale are read
    (``tile_update`` takes the tile's arrays itself).
    """
    vis = call.visibility
    lengths = local.get("kv_lengths")
    tile_vis = Visibility(vis.q_len - q_off, vis.kv_len - k_off, vis.causal, vis.sliding_window,
                          None if lengths is None else lengths - k_off, local.get("q_segment_ids"), kv_seg,
                          _key_block(local.get("mask"), k_off, sk))
    return AttentionCall(None, None, None, tile_vis, _key_block(local.get("bias"), k_off, sk),  # type: ignore[arg-type]
                         call.logits_soft_cap, call.scale, False)


def chunk_offsets(device: Array | int, sp: int, length: int, load_balance: str) -> list[Array | int]:
    """Global start of each chunk of a sequence of ``length`` that a device holds: ``[i L / sp]``
    contiguous (one chunk), ``[i c, (2 sp - 1 - i) c]`` zig-zag (two chunks of ``c = L / (2 sp)``)."""
    if load_balance == ZIGZAG:
        c = length // (2 * sp)
        return [device * c, (2 * sp - 1 - device) * c]
    return [device * (length // sp)]


def ring_attention(call: AttentionCall, mesh: Mesh, axis: str, load_balance: str = CONTIGUOUS,
                   count_tiles: bool = False) -> Array | tuple[Array, Array]:
    """Attention of a validated call with key/value blocks rotating over mesh axis ``axis``; BTHD output.

    ``load_balance``: ``"contiguous"`` (device ``i`` holds block ``i``) or ``"zigzag"`` (chunks ``i`` and
    ``2 sp - 1 - i`` of ``2 sp``; inputs and output stay in sequence order, moved in and out of the layout
    inside). With ``count_tiles`` it also returns the tiles each device computed, ``(batch shards, sp)``.
    """
    sp = mesh.shape[axis]
    zigzag = load_balance == ZIGZAG
    parts = 2 if zigzag else 1  # query (and key) chunks per device
    batch, heads = data_axes(mesh, call, axis)
    seq_spec = P(batch, axis, heads, None)
    local = optional_inputs(call)
    # Masks and bias are split on queries like the query; each tile slices the key chunk it needs.
    specs = {"kv_lengths": P(batch), "q_segment_ids": P(batch, axis), "kv_segment_ids": P(batch, axis)}
    specs |= {n: broadcast_spec(x.shape, (batch, heads, axis, None)) for n, x in local.items() if x.ndim == 4}
    perm = [(j, (j + 1) % sp) for j in range(sp)]  # device j passes its block to j + 1
    _, t, s, *_ = call.shape
    varying = join(batch, axis, heads)  # the mesh axes q (so the loop's carry) varies over

    def body(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]) -> tuple[Array, Array]:
        if zigzag:  # into the zig-zag layout: every array split on positions (kv_lengths is not)
            q_BTHD, k_BSKD, v_BSKD = (to_zigzag(x, axis, sp, 1) for x in (q_BTHD, k_BSKD, v_BSKD))
            local = {n: x if n == "kv_lengths" else to_zigzag(x, axis, sp, 2 if x.ndim == 4 else 1)
                     for n, x in local.items()}
        b, tq, h, d = q_BTHD.shape
        sk, kv = k_BSKD.shape[1], k_BSKD.shape[2]
        cq, ck = tq // parts, sk // parts
        i = jax.lax.axis_index(axis)
        q_offs = chunk_offsets(i, sp, t, load_balance)
        q_chunks = [(q_BKGTD, _query_chunk(local, p, parts), q_offs[p])
                    for p, q_BKGTD in enumerate(jnp.split(queries_to_tiles(q_BTHD, kv), parts, axis=3))]
        q_idx, k_idx = jnp.arange(cq), jnp.arange(ck)
        # Tiles no query sees by position (causal future, outside the window, padding) are skipped.
        may_see = tile_filter(Visibility(t, s, call.visibility.causal, call.visibility.sliding_window,
                                         local.get("kv_lengths")), cq, ck)

        def fold(step, state: tuple, blocks: tuple) -> tuple:
            """Fold the key/value block held at ``step`` (from device ``i - step``) into every query chunk."""
            carries, count = state
            k_BKSD, v_BKSD, kv_seg = blocks
            k_offs = chunk_offsets((i - step) % sp, sp, s, load_balance)
            k_parts, v_parts = jnp.split(k_BKSD, parts, axis=2), jnp.split(v_BKSD, parts, axis=2)
            seg_parts = [None] * parts if kv_seg is None else jnp.split(kv_seg, parts, axis=1)
            new = list(carries)
            for k_BKSD, v_BKSD, kv_seg, k_off in zip(k_parts, v_parts, seg_parts, k_offs, strict=True):
                for p, (q_BKGTD, q_local, q_off) in enumerate(q_chunks):
                    tile = _tile_call(call, q_local, kv_seg, q_off, k_off, ck)
                    update = jax.checkpoint(  # the backward pass recomputes the tile, never stores it
                        lambda c, q=q_BKGTD, k=k_BKSD, v=v_BKSD, tile=tile: tile_update(c, q, k, v, tile, q_idx, k_idx))
                    if may_see is None:
                        new[p], count = update(new[p]), count + 1
                    else:
                        see = may_see(q_off, k_off)
                        new[p] = jax.lax.cond(see, update, lambda c: c, new[p])
                        count = count + see.astype(count.dtype)
            return tuple(new), count

        def send_then_fold(step, state: tuple) -> tuple:
            carry, blocks = state
            # Double buffering: the next block leaves before this one is folded, and nothing of this step's
            # fold feeds the permute, so XLA may run the transfer while the tile computes.
            incoming = jax.lax.ppermute(blocks, axis, perm)
            return fold(step, carry, blocks), incoming

        init = SoftmaxCarry.init(b, kv, h // kv, cq, d, q_BTHD.dtype)
        state = jax.lax.pcast(((init,) * parts, jnp.zeros((), jnp.int32)), varying, to="varying")
        blocks = (keys_to_tiles(k_BSKD), keys_to_tiles(v_BSKD), local.get("kv_segment_ids"))  # tile layout
        state, blocks = jax.lax.fori_loop(0, sp - 1, send_then_fold, (state, blocks))
        (carries, count) = fold(sp - 1, state, blocks)  # the last block: nothing left to send
        out_BTHD = jnp.concatenate([tile_finish(c, q_BTHD.dtype) for c in carries], axis=1)
        if zigzag:
            out_BTHD = from_zigzag(out_BTHD, axis, sp, 1)
        return out_BTHD, count.reshape(1, 1, 1)

    count_spec = P(batch, axis, heads)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec, {n: specs[n] for n in local}),
                       out_specs=(seq_spec, count_spec))
    out, counts = fn(call.query, call.key, call.value, local)
    return (out, counts[:, :, 0]) if count_tiles else out


class SequenceParallelAttention(AttentionImplMixin, OperationImpl):
    """Base of ``ring`` and ``ulysses``: checks the mesh and lengths, runs :attr:`kernel` under ``jit``."""

    kernel: tp.ClassVar[Kernel]

    def kernel_options(self, t: int, s: int, sp: int, axis: str) -> tuple[tuple[str, tp.Any], ...]:
        """The kernel's static keyword arguments, checked against the call's lengths (none by default)."""
        return ()

    def forward_native(self, query, key, value, **kwargs) -> AttentionOutput:
        name = self.get_impl_name()
        mesh, axis, sp = sequence_mesh(name, self.metadata)
        call = self.prepare(query, key, value, **kwargs)
        _, t, s, *_ = call.shape
        check_lengths(name, t, s, sp, axis)
        out = run_jitted(self.kernel, call, mesh, axis, self.kernel_options(t, s, sp, axis))
        return AttentionOutput(out, None, kernel_path=f"{name}/shard_map")


def load_balance_option(metadata: tp.Any) -> str:
    """``OperationMetadata.options["load_balance"]`` (default ``"contiguous"``), or a ValueError."""
    value = metadata.options.get("load_balance", CONTIGUOUS)
    if value not in LOAD_BALANCES:
        raise ValueError(f"ring: option load_balance must be one of {LOAD_BALANCES}; got {value!r}")
    return value


@OperationRegistry.register
class RingAttention(SequenceParallelAttention):
    """Sequence-parallel attention: query blocks stay, key/value blocks rotate over ``sp`` (ppermute)."""

    kernel = staticmethod(ring_attention)
    capabilities = Capabilities(features=SEQUENCE_PARALLEL_FEATURES, mesh_axes=("sp",),
                                description="shard_map over sp; key/value blocks rotate with ppermute, sent "
                                            "one step ahead of the fold (double buffering), online softmax "
                                            "per block, fully masked tiles skipped; T and S divisible by sp; "
                                            "option load_balance='zigzag' (T and S divisible by 2 sp)")

    @classmethod
    def get_impl_name(cls):
        return "ring"

    def kernel_options(self, t: int, s: int, sp: int, axis: str) -> tuple[tuple[str, tp.Any], ...]:
        load_balance = load_balance_option(self.metadata)
        if load_balance == ZIGZAG and (t % (2 * sp) or s % (2 * sp)):
            raise ValueError(f"ring: load_balance='zigzag' cuts the sequence into 2 * sp = {2 * sp} chunks, so T={t} "
                             f"and S={s} must both be divisible by {2 * sp}; pad the sequences or use "
                             f"load_balance='contiguous'")
        return (("load_balance", load_balance),)


# -- work per device --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RingWork:
    """The tiles of logits each device along ``sp`` computed in one ``ring`` call (skipped ones not counted).

    ``tile`` is ``(queries, keys)`` per tile: ``(T / sp, S / sp)`` contiguous, ``(T / 2sp, S / 2sp)`` zig-zag.
    """

    load_balance: str
    tile: tuple[int, int]
    tiles: tuple[int, ...]

    @property
    def pairs(self) -> tuple[int, ...]:
        """Query-key logits computed per device, per batch row and head."""
        return tuple(n * self.tile[0] * self.tile[1] for n in self.tiles)


def ring_work(mesh: Mesh, length: int, kv_length: int | None = None, *, causal: bool = False,
              sliding_window: int | None = None, load_balance: str = CONTIGUOUS, axis: str = "sp") -> RingWork:
    """Run ``ring`` on zeros of ``length`` queries and ``kv_length`` keys (default: ``length``) and count the
    tiles each device along ``axis`` computed: the kernel's own counter, incremented where it folds a tile.

    >>> ring_work(make_mesh(fsdp=2, sp=4), 64, causal=True).tiles  # doctest: +SKIP
    (1, 2, 3, 4)
    """
    metadata = OperationMetadata(mesh=mesh, sequence_axis_name=axis, options={"load_balance": load_balance})
    op = RingAttention(metadata)
    _, _, sp = sequence_mesh("ring", metadata)
    s = length if kv_length is None else kv_length
    check_lengths("ring", length, s, sp, axis)
    options = dict(op.kernel_options(length, s, sp, axis))

    def count(q_BTHD: Array, k_BSKD: Array) -> Array:
        call = op.prepare(q_BTHD, k_BSKD, k_BSKD, causal=causal, sliding_window=sliding_window)
        return ring_attention(call, mesh, axis, count_tiles=True, **options)[1]

    q = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, s, 1, 8), jnp.float32)
    counts = jax.jit(count).lower(q, k).compile()(jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype))
    parts = 2 if options["load_balance"] == ZIGZAG else 1
    return RingWork(options["load_balance"], (length // (parts * sp), s // (parts * sp)),
                    tuple(int(n) for n in np.asarray(counts)[0]))
