"""The sharding explorer's view model: a model's parameter layout on a mesh, and what it costs.

A :class:`Layout` (from :mod:`workbench.core.sharding.plan`) resolves every parameter of a model (live or
abstract: only shapes are read, nothing is allocated) through a :class:`PartitionAxis`, regex override
rules and a runtime mode: its PartitionSpec, shard shape, bytes per device and the reason
(:class:`~workbench.core.sharding.placement.ParamPlacement`). :func:`layout_memory` counts a layout's memory per device
between steps (parameters, optimizer state, a KV cache: a memory ledger's record), :func:`diff` compares two
layouts, :func:`step_collectives` compiles one forward or train step (the one abstract step of
:mod:`workbench.core.compile.steps`) from abstract inputs and lists the collectives XLA inserted, and
:func:`apply` places a live model by a layout.

A layout of the tiny Llama on ``dp=2 x fsdp=2 x tp=2`` (:mod:`workbench.core.sharding.plan` shows its specs) holds
its parameters in 108,800 bytes on each of the 8 devices:

>>> from workbench.core.mesh import make_mesh
>>> from workbench.core.models import CausalLM, ModelConfig, tiny_config
>>> model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))  # shapes only
>>> layout_memory(Layout.of(model, make_mesh(dp=2, fsdp=2, tp=2)), optimizer=None).params
108800
"""

from __future__ import annotations

import dataclasses
import time
import typing as tp

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from workbench.core.compile.steps import STEP_KINDS, layout_step
from workbench.core.compile.virtual import compile_step
from workbench.core.cost.ledger import Ledger, kv_cache_bytes, optimizer_bytes
from workbench.core.hlo.collectives import Collective, collectives_in, summarize
from workbench.core.hlo.graph import matmul_flops
from workbench.core.models.sharding import path_str, shard_model
from workbench.core.sharding.plan import INPUT_AXES, KVCacheSize, Layout, kv_cache_spec
from workbench.core.sharding.spec_text import format_axes, format_entry, parse_axes, parse_entry
from workbench.core.xla_log import xla_log_lines as _xla_log_lines
from workbench.core.xla_log import xla_warnings as _xla_warnings

# Layout and the text forms of axes live in layout_plan and spec_text; the explorer's face re-exports them.
__all__ = ["INPUT_AXES", "STEP_KINDS", "Layout", "LayoutDiff", "ParamChange", "StepCollectives",
           "apply", "cluster_step_collectives", "diff", "format_axes", "format_entry", "kv_cache_spec", "layout_memory",
           "parse_axes", "parse_entry", "step_collectives"]


# -- memory ------------------------------------------------------------------------------------------
def layout_memory(layout: Layout, *, optimizer: str | None = "adamw", kv_cache: KVCacheSize | None = None) -> Ledger:
    """The ledger's record of what each device holds between steps (``kind="state"``): the parameters, an
    optimizer's state and a KV cache, counted without allocating (the same on every device).

    ``optimizer`` (``"adamw"``, ``"adafactor"``, ``"sgd"`` or None): optax's state for the parameters with their
    shardings (AdamW: two moments in the parameters' dtype plus an int32 count;
    :func:`workbench.core.cost.ledger.optimizer_bytes`, the count the ledger's train step uses too).
    ``kv_cache=(batch, max_length, dtype)``: keys and values of every layer
    (:func:`workbench.core.cost.ledger.kv_cache_bytes`), sharded by :func:`~workbench.core.sharding.plan.kv_cache_spec`.
    A step's gradients, activations and temporaries are :func:`workbench.core.cost.ledger.ledger`'s.
    """
    opt = 0 if optimizer is None else optimizer_bytes(layout, optimizer)
    kv = 0 if kv_cache is None else kv_cache_bytes(layout, *kv_cache)
    return Ledger("state", "none", layout.param_bytes, optimizer=opt, kv_cache=kv)


# -- differences -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamChange:
    path: str
    old_spec: PartitionSpec
    new_spec: PartitionSpec
    old_bytes: int
    new_bytes: int


@dataclasses.dataclass(frozen=True)
class LayoutDiff:
    """Parameters whose spec (or block per device) changed, and the memory per device before and after."""

    changed: tuple[ParamChange, ...]
    old_memory: Ledger
    new_memory: Ledger

    @property
    def delta(self) -> int:
        """Change of the bytes on each device (new - old), all parts counted."""
        return self.new_memory.total - self.old_memory.total


def diff(old: Layout, new: Layout, *, optimizer: str | None = None, kv_cache: KVCacheSize | None = None
         ) -> LayoutDiff:
    """What changed from ``old`` to ``new`` (layouts of the same model), memory counted as
    :func:`layout_memory` with ``optimizer`` and ``kv_cache``."""
    if old.paths != new.paths:
        raise ValueError("diff compares two layouts of the same model; their parameter paths differ")
    changed = tuple(ParamChange(a.path, a.spec, b.spec, a.bytes_per_device, b.bytes_per_device)
                    for a, b in zip(old.params, new.params, strict=True)
                    if a.spec != b.spec or a.shard_shape != b.shard_shape)
    memory = lambda layout: layout_memory(layout, optimizer=optimizer, kv_cache=kv_cache)
    return LayoutDiff(changed, memory(old), memory(new))


# -- collectives -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepCollectives:
    """The collectives of one compiled step: each record, and per kind their count and bytes per device.

    ``warnings``: what XLA logged while compiling, e.g. the SPMD partitioner's "Involuntary full
    rematerialization" (a tensor replicated, then re-partitioned, because no cheap resharding exists);
    a compile on another thread at the same moment can add its own (XLA's log does not say whose).
    ``matmul_flops``: FLOPs per device of the step's matmuls (every dot of the compiled program, a dot in
    the layer scan once per layer; :func:`workbench.core.hlo.graph.matmul_flops`). XLA's own
    ``cost_analysis()`` counts a loop body once, so it would show about one layer's worth.
    """

    kind: str
    batch: tuple[int, int]
    input_spec: PartitionSpec
    records: tuple[Collective, ...]
    compile_seconds: float
    warnings: tuple[str, ...] = ()
    matmul_flops: float = 0.0
    analysis: tp.Any = dataclasses.field(default=None, repr=False, compare=False)  # on a virtual cluster

    @property
    def summary(self) -> dict[str, dict[str, int]]:
        """Per kind: instructions (``count``), times they run in one step (``runs``: a collective in the
        layer scan runs once per layer) and bytes per device over the whole step."""
        return summarize(self.records, count_trips=True)

    @property
    def runs(self) -> int:
        """Collectives run in one step (each instruction times its loop trips)."""
        return sum(r.trips for r in self.records)

    @property
    def bytes_per_device(self) -> int:
        """Result bytes per device of every collective run in one step."""
        return sum(r.bytes * r.trips for r in self.records)

    def by_axes(self) -> list[tuple[str, tuple[str, ...], int, int]]:
        """``(kind, mesh axes, runs, bytes per device)`` per kind and mesh axes, largest bytes first; a
        collective inside the layer scan counts once per layer it runs for."""
        groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        for r in self.records:
            entry = groups.setdefault((r.kind, r.mesh_axes or ()), [0, 0])
            entry[0] += r.trips
            entry[1] += r.bytes * r.trips
        return sorted(((k, a, n, b) for (k, a), (n, b) in groups.items()), key=lambda g: (-g[3], g[0], g[1]))


def step_collectives(model: nnx.Module, layout: Layout, *, kind: str = "forward",
                     batch: tuple[int, int] = (8, 64), optimizer: str = "adamw") -> StepCollectives:
    """Compile one step of ``model`` placed as ``layout`` says, from abstract inputs, and list its collectives.

    The step is :func:`workbench.core.compile.steps.layout_step`'s: ``kind="forward"``, the logits of a
    ``batch = (B, T)`` of token ids; ``kind="train"``, the causal LM loss, its gradients and the ``optimizer``
    update (its state split over ``dp`` too with the layout's ``zero_stage=1``). On a mesh with ``pp > 1`` the
    step is the layout's pipeline (default 1F1B, up to ``2 pp`` microbatches:
    :func:`workbench.core.pipeline.default_config`). The ids are placed by resolving ``(BATCH, LENGTH)`` in the
    layout's mode. Nothing is allocated: ``jax.jit(...).lower(ShapeDtypeStructs).compile()``.
    """
    if not isinstance(layout.mesh, Mesh):
        raise ValueError("compiling needs a concrete jax.sharding.Mesh (make_mesh(...)), not an AbstractMesh")
    step = layout_step(model, layout, kind=kind, batch=batch, optimizer_name=optimizer)
    # Never run, only read: on CPU, LLVM's -O0 compiles 3-4x faster, after the same HLO passes.
    options = {"xla_backend_optimization_level": 0} if layout.mesh.devices.flat[0].platform == "cpu" else None
    start = time.perf_counter()
    with _xla_log_lines() as log:  # other output, from any thread, goes on to stderr meanwhile
        compiled = step.jit().lower(*step.args).compile(compiler_options=options)
    seconds = time.perf_counter() - start
    warnings = tuple(_xla_warnings(log))
    hlo = compiled.as_text()
    spec = step.args[-1].sharding.spec
    return StepCollectives(kind, tuple(batch), spec, tuple(collectives_in(hlo, layout.mesh)), seconds, warnings,
                           matmul_flops(hlo))


def cluster_step_collectives(model: nnx.Module, layout: Layout, cluster: tp.Any, *, kind: str = "forward",
                             batch: tuple[int, int] = (8, 64), optimizer: str = "adamw") -> StepCollectives:
    """:func:`step_collectives` for a virtual ``cluster`` (``workbench.core.hardware.cluster``): the step compiled for
    the cluster's devices on ``layout``'s mesh shape (TPU ahead of time, others in a worker process), so the
    layout may sit on an ``AbstractMesh`` of any size the cluster has. A train step updates with ``optimizer``
    (its state split over ``dp`` too with the layout's ``zero_stage=1``);
    ``.analysis`` keeps the whole :class:`~workbench.core.compile.virtual.CompiledAnalysis` (memory, cost, HLO)."""
    if layout.mesh.size != cluster.num_devices:
        raise ValueError(f"the layout's mesh has {layout.mesh.size} devices but {cluster.name} has "
                         f"{cluster.num_devices}; resolve the layout on cluster_mesh(cluster, ...)")
    analysis = compile_step(model, cluster, dict(layout.mesh.shape), kind=kind, batch=batch, optimizer=optimizer,
                            partition_axis=layout.partition_axis, rules=layout.rules or None,
                            pipeline=layout.pipeline, zero_stage=layout.zero_stage)
    spec = layout.partition_axis.resolve(INPUT_AXES, layout.mode, shape=batch, mesh=layout.mesh)
    return StepCollectives(kind, tuple(batch), spec, tuple(analysis.collectives), analysis.compile_seconds,
                           tuple(analysis.warnings), analysis.matmul_flops, analysis)


# -- placing -----------------------------------------------------------------------------------------
def apply(model: nnx.Module, layout: Layout) -> tuple[nnx.Module, float]:
    """A copy of the live ``model`` placed as ``layout`` says, and the seconds it took (arrays ready)."""
    if not isinstance(layout.mesh, Mesh):
        raise ValueError("apply needs a concrete jax.sharding.Mesh (make_mesh(...)), not an AbstractMesh")
    if tuple(path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))) != layout.paths:
        raise ValueError("this layout was resolved for another model: the parameter paths differ")
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    if any(not isinstance(x, jax.Array) for x in leaves):
        raise ValueError("apply needs a live model (arrays); this one is abstract (ShapeDtypeStructs): build it "
                         "with real weights (e.g. workbench.models.tiny(...)) to place it")
    start = time.perf_counter()
    placed = shard_model(model, layout.mesh, layout.partition_axis, layout.mode, layout.rules)
    jax.block_until_ready(jax.tree.leaves(nnx.state(placed, nnx.Param)))
    return placed, time.perf_counter() - start
