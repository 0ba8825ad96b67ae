"""The sharding explorer's view model: a model's parameter layout on a mesh, and what it costs.

A :class:`Layout` (from :mod:`workbench.core.sharding.plan`) resolves every parameter of a model (live or
abstract: only shapes are read, nothing is allocated) through a :class:`PartitionAxis`, regex override
rules and a runtime mode: its PartitionSpec, shard shape, bytes per device and the reason
(:class:`~workbench.core.sharding.placement.ParamPlacement`). :func:`layout_memory` counts a layout's memory per device
(parameters, AdamW state, a KV cache), :func:`diff` compares two layouts, :func:`step_collectives` compiles
one forward or train step from abstract inputs and lists the collectives XLA inserted, and :func:`apply`
places a live model by a layout.

>>> from workbench.core.mesh import make_mesh
>>> from workbench.core.models import CausalLM, ModelConfig, tiny_config
>>> model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))  # shapes only
>>> layout = Layout.of(model, make_mesh(dp=2, fsdp=2, tp=2))
>>> layout["lm_head/kernel"].spec, layout["lm_head/kernel"].shard_shape
(P(('fsdp', 'sp'), 'tp'), (32, 132))
>>> layout_memory(layout, optimizer=None).params   # bytes on each of the 8 devices
108800
"""

from __future__ import annotations

import dataclasses
import time
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from workbench.core import pipeline
from workbench.core.compile.virtual import compile_step
from workbench.core.compile.xla_log import xla_log_lines as _xla_log_lines
from workbench.core.compile.xla_log import xla_warnings as _xla_warnings
from workbench.core.cost.ledger import kv_cache_bytes, optimizer_bytes
from workbench.core.hlo.collectives import Collective, collectives_in, summarize
from workbench.core.hlo.graph import matmul_flops
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.sharding import path_str, shard_model, with_mesh
from workbench.core.sharding.plan import INPUT_AXES, KVCacheSize, Layout, kv_cache_spec
from workbench.core.sharding.spec_text import format_axes, format_entry, parse_axes, parse_entry

# Layout and the text forms of axes live in layout_plan and spec_text; the explorer's face re-exports them.
__all__ = ["INPUT_AXES", "STEP_KINDS", "Layout", "LayoutDiff", "MemoryBreakdown", "ParamChange", "StepCollectives",
           "apply", "cluster_step_collectives", "diff", "format_axes", "format_entry", "kv_cache_spec", "layout_memory",
           "parse_axes", "parse_entry", "step_collectives"]


# -- memory ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on each device (the same on every device): parameters, optimizer state, KV cache."""

    params: int
    optimizer: int = 0
    kv_cache: int = 0
    kv_spec: PartitionSpec | None = None
    kv_reason: str = ""

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.kv_cache


def layout_memory(layout: Layout, *, optimizer: str | None = "adamw",
                  kv_cache: KVCacheSize | None = None) -> MemoryBreakdown:
    """Bytes each device holds for the parameters, AdamW state and a KV cache, without allocating.

    ``optimizer="adamw"``: optax's AdamW state, two moments per parameter in the parameters' dtype with
    their shardings, plus its int32 step count (:func:`workbench.core.cost.ledger.optimizer_bytes`, the one count
    the ledger uses too). ``kv_cache=(batch, max_length, dtype)``: keys and values of every layer
    (:func:`workbench.core.cost.ledger.kv_cache_bytes`), sharded by :func:`~workbench.core.sharding.plan.kv_cache_spec`.
    """
    if optimizer not in ("adamw", None):
        raise ValueError(f"optimizer must be 'adamw' or None; got {optimizer!r}")
    opt = optimizer_bytes(layout, "adamw") if optimizer == "adamw" else 0
    kv, kv_spec, kv_reason = 0, None, ""
    if kv_cache is not None:
        batch, max_length, dtype = kv_cache
        _, kv_spec, kv_reason = kv_cache_spec(layout, batch, max_length)
        kv = kv_cache_bytes(layout, batch, max_length, dtype)
    return MemoryBreakdown(layout.param_bytes, opt, kv, kv_spec, kv_reason)


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
    old_memory: MemoryBreakdown
    new_memory: MemoryBreakdown

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


STEP_KINDS = ("forward", "train")


def _abstract(model: nnx.Module, layout: Layout) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model split into graphdef, ShapeDtypeStruct params placed as ``layout`` says, and other state."""
    if not isinstance(layout.mesh, Mesh):
        raise ValueError("compiling needs a concrete jax.sharding.Mesh (make_mesh(...)), not an AbstractMesh")
    graphdef, params, other = nnx.split(with_mesh(model, layout.mesh, layout.partition_axis), nnx.Param, ...)
    if tuple(path_str(p) for p, _ in nnx.to_flat_state(params)) != layout.paths:
        raise ValueError("this layout was resolved for another model: the parameter paths differ")
    shardings = layout.shardings()
    params = nnx.map_state(lambda path, var: var.replace(jax.ShapeDtypeStruct(
        var.shape, var.dtype, sharding=shardings[path_str(path)])), params)
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), other)
    return graphdef, params, other


def step_collectives(model: nnx.Module, layout: Layout, *, kind: str = "forward",
                     batch: tuple[int, int] = (8, 64)) -> StepCollectives:
    """Compile one step of ``model`` placed as ``layout`` says, from abstract inputs, and list its collectives.

    ``kind="forward"``: logits of a ``batch = (B, T)`` of token ids. ``kind="train"``: the causal LM
    loss and its gradient, the gradients placed like their parameters (as a train step feeds them to
    the optimizer). On a mesh with ``pp > 1`` the step is the pipeline's (1F1B, up to ``2 pp``
    microbatches: :func:`workbench.core.pipeline.default_config`). The ids are placed by resolving
    ``(BATCH, LENGTH)`` in the layout's mode.
    Nothing is allocated: ``jax.jit(...).lower(ShapeDtypeStructs).compile()``.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}; got {kind!r}")
    b, t = batch
    graphdef, params, other = _abstract(model, layout)
    spec = layout.partition_axis.resolve(INPUT_AXES, layout.mode, shape=(b, t), mesh=layout.mesh)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(layout.mesh, spec))

    def forward(params, other, ids):
        return nnx.merge(graphdef, params, other)(ids).logits

    def loss_and_grad(params, other, ids):
        loss = lambda p: causal_lm_loss(forward(p, other, ids), labels_from(ids))[0]
        return jax.value_and_grad(loss)(params)

    sizes = dict(zip(layout.mesh.axis_names, layout.mesh.axis_sizes, strict=True))
    if sizes.get("pp", 1) > 1:  # a pp axis: the step runs as a pipeline (1F1B), its ppermutes over pp
        config = pipeline.default_config(layout.mesh, b)
        forward = lambda params, other, ids: pipeline.pipeline_logits(graphdef, params, other, ids, None, config,
                                                                      layout.mesh)

        def loss_and_grad(params, other, ids):
            loss, _, grads = pipeline.pipeline_loss_and_grads(graphdef, params, other, {"input_ids": ids}, config,
                                                              layout.mesh)
            return loss, grads

    if kind == "forward":
        fn = jax.jit(forward)
    else:
        grads = jax.tree.map(lambda s: s.sharding, params)
        fn = jax.jit(loss_and_grad, out_shardings=(NamedSharding(layout.mesh, PartitionSpec()), grads))
    # Never run, only read: on CPU, LLVM's -O0 compiles 3-4x faster, after the same HLO passes.
    options = {"xla_backend_optimization_level": 0} if layout.mesh.devices.flat[0].platform == "cpu" else None
    start = time.perf_counter()
    with _xla_log_lines() as log:  # other output, from any thread, goes on to stderr meanwhile
        compiled = fn.lower(params, other, ids).compile(compiler_options=options)
    seconds = time.perf_counter() - start
    warnings = tuple(_xla_warnings(log))
    hlo = compiled.as_text()
    return StepCollectives(kind, (b, t), spec, tuple(collectives_in(hlo, layout.mesh)), seconds, warnings,
                           matmul_flops(hlo))


def cluster_step_collectives(model: nnx.Module, layout: Layout, cluster: tp.Any, *, kind: str = "forward",
                             batch: tuple[int, int] = (8, 64), optimizer: str = "adamw") -> StepCollectives:
    """:func:`step_collectives` for a virtual ``cluster`` (``workbench.core.cluster``): the step compiled for
    the cluster's devices on ``layout``'s mesh shape (TPU ahead of time, others in a worker process), so the
    layout may sit on an ``AbstractMesh`` of any size the cluster has. A train step updates with ``optimizer``
    (its state split over ``dp`` too with the layout's ``zero_stage=1``);
    ``.analysis`` keeps the whole :class:`~workbench.core.compile.virtual.CompiledAnalysis` (memory, cost, HLO)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}; got {kind!r}")
    if layout.mesh.size != cluster.num_devices:
        raise ValueError(f"the layout's mesh has {layout.mesh.size} devices but {cluster.name} has "
                         f"{cluster.num_devices}; resolve the layout on cluster_mesh(cluster, ...)")
    analysis = compile_step(model, cluster, dict(layout.mesh.shape), kind=kind, batch=batch, optimizer=optimizer,
                            partition_axis=layout.partition_axis, rules=layout.rules or None,
                            pipeline=layout.pipeline if kind == "train" else None,
                            zero_stage=layout.zero_stage if kind == "train" else 0)
    spec = layout.partition_axis.resolve(INPUT_AXES, layout.mode, shape=batch, mesh=layout.mesh)
    return StepCollectives(kind, tuple(batch), spec, tuple(analysis.collectives), analysis.compile_seconds,
                           tuple(analysis.warnings), analysis.matmul_flops, analysis)


# -- placing -----------------------------------------------------------------------------------------
def apply(model: nnx.Module, layout: Layout) -> tuple[nnx.Module, float]:
    """A copy of the live ``model`` placed as ``layout`` says, and the seconds it took (arrays ready)."""
    if not isinstance(layout.mesh, Mesh):
        raise ValueError("apply needs a concrete jax.sharding.Mesh (make_mesh(...)), not an AbstractMesh")
    _abstract(model, layout)  # the same model
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    if any(not isinstance(x, jax.Array) for x in leaves):
        raise ValueError("apply needs a live model (arrays); this one is abstract (ShapeDtypeStructs): build it "
                         "with real weights (e.g. workbench.models.tiny(...)) to place it")
    start = time.perf_counter()
    placed = shard_model(model, layout.mesh, layout.partition_axis, layout.mode, layout.rules)
    jax.block_until_ready(jax.tree.leaves(nnx.state(placed, nnx.Param)))
    return placed, time.perf_counter() - start
