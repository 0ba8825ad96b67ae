"""The sharding explorer's view model: a model's parameter layout on a mesh, and what it costs.

A :class:`Layout` resolves every parameter of a model (live or abstract: only shapes are read,
nothing is allocated) through a :class:`PartitionAxis`, regex override rules and a runtime mode:
its PartitionSpec, shard shape, bytes per device and the reason for each dimension.
:func:`layout_memory` adds AdamW state and a KV cache (a layout's memory per device), :func:`diff` compares two layouts,
:func:`step_collectives` compiles one forward or train step from abstract inputs and lists the
collectives XLA inserted, and :func:`apply` places a live model by a layout.

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
import functools
import math
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from workbench.core import axes as ax
from workbench.core._xla_log import xla_log_lines as _xla_log_lines
from workbench.core._xla_log import xla_warnings as _xla_warnings
from workbench.core.axes import (
    BATCH,
    KV_HEAD,
    KV_HEAD_DIM,
    KV_LENGTH,
    LENGTH,
    MODE_DECODE,
    MODE_TRAIN,
    DimDecision,
    PartitionAxis,
)
from workbench.core.inspect import Collective, summarize
from workbench.core.models.cache import kv_layout
from workbench.core.models.sharding import path_str, shard_model, with_mesh
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.rules import ParamPlacement, freeze_rules, mesh_sizes, reason_text, resolve_params, shard_shape
from workbench.core.spec_text import format_axes, format_entry, parse_axes, parse_entry

__all__ = ["INPUT_AXES", "KV_CACHE_AXES", "KV_CACHE_MODE", "ROLES", "ROLE_FIELDS", "STEP_KINDS", "Layout", "LayoutDiff",
           "MemoryBreakdown", "ParamChange", "StepCollectives", "apply", "cluster_step_collectives",
           "diff", "format_axes", "format_entry", "kv_cache_spec", "layout_memory", "parse_axes", "parse_entry",
           "step_collectives"]

ROLES = (ax.DP, ax.FSDP, ax.EP, ax.TP, ax.SP)
ROLE_FIELDS = tuple(PartitionAxis().field_for(role) for role in ROLES)
# The token batch of a step, and a KV cache: what they are resolved as (the cache in decode mode:
# it exists only while generating, and prefill writes the same arrays decode reads).
INPUT_AXES = (BATCH, LENGTH)
KV_CACHE_AXES = (BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)
KV_CACHE_MODE = MODE_DECODE
KVCacheSize = tuple[int, int, tp.Any]  # (batch, max_length, dtype)


# -- the layout --------------------------------------------------------------------------------------
def _check_plan(mesh: tp.Any, remat: str | None, pipeline: PipelineConfig | None, zero_stage: int) -> None:
    from workbench.core.zero import check_zero_stage

    check_zero_stage(zero_stage)
    if remat is not None:
        from workbench.core.models.stack import check_remat

        check_remat(remat)
    if pipeline is None:
        return
    if not isinstance(pipeline, PipelineConfig):
        raise TypeError(f"pipeline must be a PipelineConfig or None; got {pipeline!r}")
    pp = mesh_sizes(mesh).get("pp", 1)
    if pipeline.num_stages != pp:
        raise ValueError(f"the pipeline has num_stages={pipeline.num_stages} but the mesh's pp axis has size {pp}; "
                         f"use PipelineConfig(num_stages={pp}, ...) or a mesh with pp={pipeline.num_stages} "
                         f"(or pipeline=None)")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every parameter of a model resolved on ``mesh`` by ``partition_axis``, ``rules`` and ``mode``.

    Build it with :meth:`of`. ``params`` are in the model's parameter order; ``layout[path]`` finds one.
    ``config`` is the model's config (it sizes a KV cache), or None. ``remat`` (a policy name),
    ``pipeline`` (a :class:`PipelineConfig` over the ``pp`` axis) and ``zero_stage`` (1: the optimizer state
    split over ``dp`` too, :mod:`workbench.core.zero`) are what a plan carries beyond the parameters' specs;
    they do not change them. :meth:`to_json` / :meth:`from_json` and :meth:`to_code` export a layout
    (:mod:`workbench.core.layout_export`).
    """

    mesh: Mesh | jax.sharding.AbstractMesh
    partition_axis: PartitionAxis
    mode: str
    rules: tuple[tuple[str, tp.Any], ...]
    params: tuple[ParamPlacement, ...]
    config: tp.Any = None
    remat: str | None = None
    pipeline: PipelineConfig | None = None
    zero_stage: int = 0

    @classmethod
    def of(cls, model: nnx.Module, mesh: Mesh | jax.sharding.AbstractMesh,
           partition_axis: PartitionAxis | None = None, rules: tp.Sequence[tuple[str, tp.Any]] | None = None,
           mode: str = MODE_TRAIN, *, remat: str | None = None, pipeline: PipelineConfig | None = None,
           zero_stage: int = 0) -> Layout:
        """Resolve ``model``'s parameters (arrays or ShapeDtypeStructs: only shapes are read).

        Raises ``ValueError`` for what a user can get wrong: a rule that does not compile or names
        the wrong number of dimensions, a field naming a mesh axis the mesh does not have (checked for
        the parameters, the token batch ``(BATCH, LENGTH)`` and a KV cache, which the explorer shows too),
        an unknown ``remat`` policy, a ``pipeline`` whose stage count is not the mesh's ``pp`` size, a
        ``zero_stage`` other than 0 or 1.
        Rules are kept with lists turned into tuples (a layout is hashable data).
        """
        pa = PartitionAxis() if partition_axis is None else partition_axis
        rules = freeze_rules(rules)
        _check_plan(mesh, remat, pipeline, zero_stage)
        params = resolve_params(model, mesh, pa, mode, rules)
        for what, names, names_mode in (("the token batch", INPUT_AXES, mode), ("a KV cache", KV_CACHE_AXES,
                                                                                KV_CACHE_MODE)):
            try:  # every mesh axis these name must exist, even before a step or a cache is sized
                pa.explain(names, names_mode, mesh=mesh)
            except ValueError as err:
                raise ValueError(f"{what} {format_axes(names)}: {err}") from None
        return cls(mesh, pa, mode, rules, params, getattr(model, "config", None), remat, pipeline,
                   int(zero_stage))

    def replace(self, model: nnx.Module, **changes: tp.Any) -> Layout:
        """The layout of ``model`` with some of ``mesh, partition_axis, rules, mode, remat, pipeline, zero_stage``
        changed."""
        settings = dict(mesh=self.mesh, partition_axis=self.partition_axis, rules=self.rules, mode=self.mode,
                        remat=self.remat, pipeline=self.pipeline, zero_stage=self.zero_stage)
        unknown = sorted(set(changes) - set(settings))
        if unknown:
            raise ValueError(f"Layout.replace takes {sorted(settings)}; got {unknown}")
        return Layout.of(model, **{**settings, **changes})

    @functools.cached_property
    def _index(self) -> dict[str, ParamPlacement]:
        return {p.path: p for p in self.params}

    def __getitem__(self, path: str) -> ParamPlacement:
        if path not in self._index:
            raise KeyError(f"no parameter {path!r}; paths look like {self.paths[:2]}")
        return self._index[path]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p.path for p in self.params)

    @property
    def specs(self) -> dict[str, PartitionSpec]:
        return {p.path: p.spec for p in self.params}

    @property
    def param_bytes(self) -> int:
        """Parameter bytes on each device (every device holds the same: specs divide their dimensions)."""
        return sum(p.bytes_per_device for p in self.params)

    def shardings(self) -> dict[str, NamedSharding]:
        return {p.path: NamedSharding(self.mesh, p.spec) for p in self.params}

    def semantic_fields(self) -> tuple[str, ...]:
        """The non-role PartitionAxis fields the parameters use in this mode, in first-use order."""
        fields: dict[str, None] = {}
        for p in self.params:
            for d in p.decisions:
                for f in (d.field or "").split(", "):
                    if f and f not in ROLE_FIELDS:
                        fields[f] = None
        return tuple(fields)

    # -- export (workbench.core.layout_export) -----------------------------------------------------------
    def to_json(self, *, cluster: tp.Any = None) -> str:
        """The layout as JSON that :meth:`from_json` reads back: mesh sizes, the cluster if given, the
        PartitionAxis fields that differ from the default, rules, mode, remat and pipeline."""
        from workbench.core import layout_export

        return layout_export.to_json(self, cluster=cluster)

    @classmethod
    def from_json(cls, text: str, model: nnx.Module, *, mesh: tp.Any = None) -> Layout:
        """The layout ``text`` (from :meth:`to_json`) describes, resolved on ``model``; ``mesh`` overrides the
        mesh it would build (same axis sizes)."""
        from workbench.core import layout_export

        return layout_export.from_json(text, model, mesh=mesh)

    def to_code(self, *, cluster: tp.Any = None, model_expr: str = "model") -> str:
        """A Python snippet that rebuilds this layout, to paste after ``import workbench as wb``."""
        from workbench.core import layout_export

        return layout_export.to_code(self, cluster=cluster, model_expr=model_expr)

    def editor_fields(self) -> dict[str, tuple[str, ...]]:
        """The PartitionAxis fields that change what this layout shows, grouped: the roles, those the
        parameters use, those of a step's token batch, and those of a KV cache."""
        pa = self.partition_axis
        by_names = lambda names, mode: tuple(dict.fromkeys(pa.field_for(n, mode) for n in names))
        return {"roles": ROLE_FIELDS, "parameters": self.semantic_fields(),
                "inputs": by_names(INPUT_AXES, self.mode), "kv_cache": by_names(KV_CACHE_AXES, KV_CACHE_MODE)}

    def table(self) -> str:
        """Plain text: one line per parameter (its type as on Explicit axes, ``float32[264@tp,64@(fsdp,sp)]``)."""
        rows = [("path", "shape", "axes", "spec", "type", "shard", "bytes/device", "reason")]
        rows += [(p.path, str(p.shape), ", ".join(p.axes), str(p.spec), p.typed, str(p.shard_shape),
                  f"{p.bytes_per_device:,}", p.reason) for p in self.params]
        widths = [max(len(r[i]) for r in rows) for i in range(7)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:7], widths, strict=True)) + "  " + r[7]
                         for r in rows)


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


def _kv_decisions(layout: Layout, batch: int, max_length: int) -> tuple[tuple[int, ...], list[DimDecision]]:
    if layout.config is None:
        raise ValueError("a KV cache is sized from the model's config; this layout has none (pass the model, "
                         "not just its parameters)")
    for name, value in (("batch", batch), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"KV cache {name} must be a positive int; got {value!r}")
    kv = kv_layout(layout.config)  # MLA: one head of [latent ; rope key]
    shape = (batch, max_length, kv.kv_heads, kv.key_dim)
    return shape, layout.partition_axis.explain(KV_CACHE_AXES, KV_CACHE_MODE, shape=shape, mesh=layout.mesh)


def kv_cache_spec(layout: Layout, batch: int, max_length: int) -> tuple[tuple[int, ...], PartitionSpec, str]:
    """Shape ``(B, S, KV, D)`` of one layer's keys (or values), its spec and the reason.

    The cache is resolved as ``(BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)`` in decode mode: by default
    the batch over ``(fsdp, dp)``, the cached length over ``sp``, the key/value heads over ``tp``.
    """
    shape, decisions = _kv_decisions(layout, batch, max_length)
    return shape, PartitionSpec(*(d.spec_entry for d in decisions)), reason_text(decisions)


def layout_memory(layout: Layout, *, optimizer: str | None = "adamw",
                  kv_cache: KVCacheSize | None = None) -> MemoryBreakdown:
    """Bytes each device holds for the parameters, AdamW state and a KV cache, without allocating.

    ``optimizer="adamw"``: optax's AdamW state, two moments per parameter in the parameters' dtype with
    their shardings, plus its int32 step count (:func:`workbench.core.ledger.optimizer_bytes`, the one count
    the ledger uses too). ``kv_cache=(batch, max_length, dtype)``: keys and values
    of every layer, ``layers x 2 x (B, S, KV, D)`` (MLA: ``layers x (B, S, 1, C + R)``, values inside the
    keys), sharded by :func:`kv_cache_spec`.
    """
    if optimizer not in ("adamw", None):
        raise ValueError(f"optimizer must be 'adamw' or None; got {optimizer!r}")
    opt = 0
    if optimizer == "adamw":
        from workbench.core.ledger import optimizer_bytes

        opt = optimizer_bytes(layout, "adamw")
    kv, kv_spec, kv_reason = 0, None, ""
    if kv_cache is not None:
        batch, max_length, dtype = kv_cache
        _, decisions = _kv_decisions(layout, batch, max_length)
        kv_spec, kv_reason = PartitionSpec(*(d.spec_entry for d in decisions)), reason_text(decisions)
        block = shard_shape(decisions, mesh_sizes(layout.mesh))
        arrays = 1 if layout.config.mla else 2  # MLA's values are the first channels of its keys
        kv = arrays * layout.config.num_hidden_layers * math.prod(block) * np.dtype(dtype).itemsize
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
    the layer scan once per layer; :func:`workbench.core.inspect.matmul_flops`). XLA's own
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
    from workbench.core.inspect import collectives_in, matmul_flops
    from workbench.core.models.loss import causal_lm_loss, labels_from

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
        from workbench.core import pipeline

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
    ``.analysis`` keeps the whole :class:`~workbench.core.virtual.CompiledAnalysis` (memory, cost, HLO)."""
    from workbench.core.virtual import compile_step

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
