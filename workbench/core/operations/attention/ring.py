"""``ring``: sequence-parallel attention; key/value blocks travel around the ``sp`` ring.

Query, key and value are split on their length over the mesh axis ``sp``: device ``i`` holds
query block ``i`` and, at first, key/value block ``i``. For ``sp`` steps every device folds the
key/value block it holds into an online softmax (``tile_update``) while the block goes on to the
next device with ``ppermute``, so each query block meets every key block while a device never
holds more than two of them (the one it folds, the one arriving): logits take ``T S / sp^2`` per
device. Each step sends the next block before folding the current one (double buffering), so the
transfer neither waits for nor holds up the step's computation; ``workbench.core.hlo.collectives.loop_collectives``
shows it in the compiled HLO.

Under a causal mask, tiles no query sees are skipped, but with contiguous blocks device ``i`` still
folds ``i + 1`` of them, the last device all ``sp``. ``OperationMetadata(options={"load_balance":
"zigzag"})`` gives device ``i`` chunks ``i`` and ``2 sp - 1 - i`` of ``2 sp`` instead (:mod:`.zigzag`):
every device folds ``2 sp + 1`` tiles of a quarter of the size. Callers keep sequence order (two
half-shard ppermutes per array move it in and out). :func:`ring_work` counts the tiles per device.

The backward pass is a ring too (:mod:`.ring_kernel`, a ``custom_vjp``): no ``(T, S)`` logits and no
copies of the whole key/value sequence on any device. Batch is split over ``dp``/``fsdp`` and heads over
``tp`` where those axes divide the sizes; otherwise they are replicated.
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
    Visibility,
)
from workbench.core.operations.attention.ring_kernel import CONTIGUOUS, LOAD_BALANCES, ZIGZAG, RingPlan, ring_block
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


def over_sequence(body: tp.Callable, mesh: tp.Any, call: AttentionCall, local: dict[str, Array], seq_spec: P,
                  specs: dict[str, P], out_specs: tp.Any = None) -> tp.Any:
    """``body(q, k, v, local)`` under ``shard_map`` on ``mesh``: the query, key and value split by ``seq_spec``, each
    optional input in ``local`` by its spec in ``specs``, the output by ``out_specs`` (default ``seq_spec``)."""
    fn = jax.shard_map(body, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec, {n: specs[n] for n in local}),
                       out_specs=seq_spec if out_specs is None else out_specs)
    return fn(call.query, call.key, call.value, local)


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
def ring_attention(call: AttentionCall, mesh: Mesh, axis: str, load_balance: str = CONTIGUOUS,
                   count_tiles: bool = False) -> Array | tuple[Array, Array]:
    """Attention of a validated call with key/value blocks rotating over mesh axis ``axis``; BTHD output.

    ``load_balance``: ``"contiguous"`` (device ``i`` holds block ``i``) or ``"zigzag"`` (chunks ``i`` and
    ``2 sp - 1 - i`` of ``2 sp``; inputs and output stay in sequence order, moved in and out of the layout
    inside). With ``count_tiles`` it also returns the tiles each device folded, ``(batch shards, sp)``.
    """
    sp = mesh.shape[axis]
    batch, heads = data_axes(mesh, call, axis)
    seq_spec = P(batch, axis, heads, None)
    local = optional_inputs(call)
    # Masks and bias are split on queries like the query; each tile slices the key chunk it needs.
    specs = {"kv_lengths": P(batch), "q_segment_ids": P(batch, axis), "kv_segment_ids": P(batch, axis)}
    specs |= {n: broadcast_spec(x.shape, (batch, heads, axis, None)) for n, x in local.items() if x.ndim == 4}
    varying = join(batch, axis, heads) or ()  # the mesh axes the query shard (and the loop carry) varies over
    bias_axes = set(join(*specs["bias"])) if "bias" in local and any(specs["bias"]) else set()
    _, t, s, *_ = call.shape
    settings = AttentionCall(None, None, None, Visibility(t, s, call.visibility.causal,  # type: ignore[arg-type]
                                                          call.visibility.sliding_window),
                             None, call.logits_soft_cap, call.scale, False)
    plan = RingPlan(settings, axis, sp, load_balance, varying, tuple(a for a in varying if a not in bias_axes))
    block = ring_block(plan)

    def body(q_BTHD: Array, k_BSKD: Array, v_BSKD: Array, local: dict[str, Array]) -> tuple[Array, Array]:
        if load_balance == ZIGZAG:  # into the zig-zag layout: every array split on positions (kv_lengths is not)
            q_BTHD, k_BSKD, v_BSKD = (to_zigzag(x, axis, sp, 1) for x in (q_BTHD, k_BSKD, v_BSKD))
            local = {n: x if n == "kv_lengths" else to_zigzag(x, axis, sp, 2 if x.ndim == 4 else 1)
                     for n, x in local.items()}
        out_BTHD, count = block(q_BTHD, k_BSKD, v_BSKD, local)
        if load_balance == ZIGZAG:
            out_BTHD = from_zigzag(out_BTHD, axis, sp, 1)
        return out_BTHD, count.reshape(1, 1, 1)

    out, counts = over_sequence(body, mesh, call, local, seq_spec, specs, (seq_spec, P(batch, axis, heads)))
    return (out, counts[:, :, 0]) if count_tiles else out


class SequenceParallelAttention(AttentionImplMixin, OperationImpl):
    """Base of ``ring``, ``ulysses`` and ``allgather_kv``: checks the mesh and lengths, runs :attr:`kernel` under
    ``jit``."""

    kernel: tp.ClassVar[Kernel]
    load_balanced: tp.ClassVar[bool] = False  # the kernel takes the option load_balance

    def kernel_options(self, t: int, s: int, sp: int, axis: str) -> tuple[tuple[str, tp.Any], ...]:
        """The kernel's static keyword arguments, checked against the call's lengths (none by default)."""
        if not self.load_balanced:
            return ()
        return (("load_balance", load_balance_option(self.metadata, self.get_impl_name(), (t, s, sp))),)

    def forward_native(self, query, key, value, **kwargs) -> AttentionOutput:
        name = self.get_impl_name()
        mesh, axis, sp = sequence_mesh(name, self.metadata)
        call = self.prepare(query, key, value, **kwargs)
        _, t, s, *_ = call.shape
        check_lengths(name, t, s, sp, axis)
        out = run_jitted(self.kernel, call, mesh, axis, self.kernel_options(t, s, sp, axis))
        return AttentionOutput(out, None, kernel_path=f"{name}/shard_map")


def load_balance_option(metadata: tp.Any, impl: str = "ring", lengths: tuple[int, int, int] | None = None) -> str:
    """``OperationMetadata.options["load_balance"]`` (default ``"contiguous"``), or a ValueError; with
    ``lengths=(T, S, sp)`` also checks that zig-zag's ``2 sp`` chunks divide both lengths."""
    value = metadata.options.get("load_balance", CONTIGUOUS)
    if value not in LOAD_BALANCES:
        raise ValueError(f"{impl}: option load_balance must be one of {LOAD_BALANCES}; got {value!r}")
    if lengths is not None and value == ZIGZAG:
        t, s, sp = lengths
        if t % (2 * sp) or s % (2 * sp):
            raise ValueError(f"{impl}: load_balance='zigzag' cuts the sequence into 2 * sp = {2 * sp} chunks, so "
                             f"T={t} and S={s} must both be divisible by {2 * sp}; pad the sequences or use "
                             f"load_balance='contiguous'")
    return value


@OperationRegistry.register
class RingAttention(SequenceParallelAttention):
    """Sequence-parallel attention: query blocks stay, key/value blocks rotate over ``sp`` (ppermute)."""

    kernel = staticmethod(ring_attention)
    load_balanced = True
    capabilities = Capabilities(features=SEQUENCE_PARALLEL_FEATURES, mesh_axes=("sp",),
                                description="shard_map over sp; key/value blocks rotate with ppermute, sent "
                                            "one step ahead of the fold (double buffering), online softmax "
                                            "per block, fully masked tiles skipped; T and S divisible by sp; "
                                            "option load_balance='zigzag' (T and S divisible by 2 sp)")

    @classmethod
    def get_impl_name(cls):
        return "ring"


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
