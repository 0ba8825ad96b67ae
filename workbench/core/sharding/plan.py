"""A layout: every parameter of a model resolved on a mesh, and what a plan carries beyond the specs.

:meth:`Layout.of` resolves a model's parameters (live or abstract: only shapes are read, nothing is
allocated) through a :class:`PartitionAxis`, regex override rules and a runtime mode into
:class:`~workbench.core.sharding.placement.ParamPlacement` records, and checks the rest of the plan: a remat
policy, a pipeline over the ``pp`` axis, a ZeRO stage, the gradient-accumulation microbatches. It also knows how a
step's token batch (:data:`INPUT_AXES`) and a KV cache (:data:`KV_CACHE_AXES`, :func:`kv_cache_spec`) are placed.
What a layout costs lives elsewhere: :mod:`workbench.core.views.explore` (memory, collectives),
:mod:`workbench.core.cost.ledger`, :mod:`workbench.core.cost.predicted`; :mod:`workbench.core.sharding.export`
writes it out. ``workbench.core.views.explore.Layout`` is this class.

>>> from workbench.core.mesh import make_mesh
>>> from workbench.core.models import CausalLM, ModelConfig, tiny_config
>>> model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))  # shapes only
>>> layout = Layout.of(model, make_mesh(dp=2, fsdp=2, tp=2))
>>> layout["lm_head/kernel"].spec, layout["lm_head/kernel"].shard_shape
(P(('fsdp', 'sp'), 'tp'), (32, 132))
>>> kv_cache_spec(layout, batch=8, max_length=128)[1]
P(('fsdp', 'dp'), 'sp', 'tp', None)
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from workbench.core import axes as ax
from workbench.core.axes import BATCH, LENGTH, MODE_TRAIN, DimDecision, PartitionAxis
from workbench.core.checks import positive_int
from workbench.core.models.cache import KV_CACHE_AXES, KV_CACHE_MODE, cache_decisions
from workbench.core.models.stack import check_remat
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.sharding import export as layout_export
from workbench.core.sharding.placement import ParamPlacement, freeze_rules, reason_text, resolve_params
from workbench.core.sharding.spec_text import format_axes
from workbench.core.zero import check_zero_stage

__all__ = ["INPUT_AXES", "KV_CACHE_AXES", "KV_CACHE_MODE", "ROLES", "ROLE_FIELDS", "KVCacheSize", "Layout",
           "kv_cache_spec"]

ROLES = (ax.DP, ax.FSDP, ax.EP, ax.TP, ax.SP)
ROLE_FIELDS = tuple(PartitionAxis().field_for(role) for role in ROLES)
# The token batch of a step, and a KV cache: what they are resolved as (the cache, KV_CACHE_AXES, in decode mode
# KV_CACHE_MODE: it exists only while generating, and prefill writes the same arrays decode reads).
INPUT_AXES = (BATCH, LENGTH)
KVCacheSize = tuple[int, int, tp.Any]  # (batch, max_length, dtype)


# -- the layout --------------------------------------------------------------------------------------
def _check_plan(mesh: tp.Any, remat: str | None, pipeline: PipelineConfig | None, zero_stage: int,
                grad_accumulation: int) -> None:
    check_zero_stage(zero_stage)
    positive_int("grad_accumulation", grad_accumulation, what="a positive int (microbatches per step)")
    if remat is not None:
        check_remat(remat)
    if pipeline is None:
        return
    if not isinstance(pipeline, PipelineConfig):
        raise TypeError(f"pipeline must be a PipelineConfig or None; got {pipeline!r}")
    pp = dict(mesh.shape).get("pp", 1)
    if pipeline.num_stages != pp:
        raise ValueError(f"the pipeline has num_stages={pipeline.num_stages} but the mesh's pp axis has size {pp}; "
                         f"use PipelineConfig(num_stages={pp}, ...) or a mesh with pp={pipeline.num_stages} "
                         f"(or pipeline=None)")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every parameter of a model resolved on ``mesh`` by ``partition_axis``, ``rules`` and ``mode``.

    Build it with :meth:`of`. ``params`` are in the model's parameter order; ``layout[path]`` finds one.
    ``config`` is the model's config (it sizes a KV cache), or None. ``remat`` (a policy name), ``pipeline`` (a
    :class:`PipelineConfig` over the ``pp`` axis), ``zero_stage`` (1: the optimizer state split over ``dp`` too,
    :mod:`workbench.core.zero`) and ``grad_accumulation`` (microbatches a train step runs one after another,
    summing their gradients) are what a plan (:class:`~workbench.core.plan.Plan`) carries beyond the parameters'
    specs; they do not change them. :meth:`to_json` / :meth:`from_json` and :meth:`to_code` export a layout
    (:mod:`workbench.core.sharding.export`).
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
    grad_accumulation: int = 1

    @classmethod
    def of(cls, model: nnx.Module, mesh: Mesh | jax.sharding.AbstractMesh,
           partition_axis: PartitionAxis | None = None, rules: tp.Sequence[tuple[str, tp.Any]] | None = None,
           mode: str = MODE_TRAIN, *, remat: str | None = None, pipeline: PipelineConfig | None = None,
           zero_stage: int = 0, grad_accumulation: int = 1) -> Layout:
        """Resolve ``model``'s parameters (arrays or ShapeDtypeStructs: only shapes are read).

        Raises ``ValueError`` for what a user can get wrong: a rule that does not compile or names
        the wrong number of dimensions, a field naming a mesh axis the mesh does not have (checked for
        the parameters, the token batch ``(BATCH, LENGTH)`` and a KV cache, which the explorer shows too),
        an unknown ``remat`` policy, a ``pipeline`` whose stage count is not the mesh's ``pp`` size, a
        ``zero_stage`` other than 0 or 1, a ``grad_accumulation`` that is not a positive int.
        Rules are kept with lists turned into tuples (a layout is hashable data).
        """
        pa = PartitionAxis() if partition_axis is None else partition_axis
        rules = freeze_rules(rules)
        _check_plan(mesh, remat, pipeline, zero_stage, grad_accumulation)
        params = resolve_params(model, mesh, pa, mode, rules)
        for what, names, names_mode in (("the token batch", INPUT_AXES, mode), ("a KV cache", KV_CACHE_AXES,
                                                                                KV_CACHE_MODE)):
            try:  # every mesh axis these name must exist, even before a step or a cache is sized
                pa.explain(names, names_mode, mesh=mesh)
            except ValueError as err:
                raise ValueError(f"{what} {format_axes(names)}: {err}") from None
        return cls(mesh, pa, mode, rules, params, getattr(model, "config", None), remat, pipeline,
                   int(zero_stage), int(grad_accumulation))

    def replace(self, model: nnx.Module, **changes: tp.Any) -> Layout:
        """The layout of ``model`` with some of ``mesh, partition_axis, rules, mode, remat, pipeline, zero_stage,
        grad_accumulation`` changed."""
        settings = dict(mesh=self.mesh, partition_axis=self.partition_axis, rules=self.rules, mode=self.mode,
                        remat=self.remat, pipeline=self.pipeline, zero_stage=self.zero_stage,
                        grad_accumulation=self.grad_accumulation)
        unknown = sorted(set(changes) - set(settings))
        if unknown:
            raise ValueError(f"Layout.replace takes {sorted(settings)}; got {unknown}")
        return Layout.of(model, **{**settings, **changes})

    @functools.cached_property
    def _index(self) -> dict[str, ParamPlacement]:
        return {p.path: p for p in self.params}

    @functools.cached_property
    def _token_decisions(self) -> dict[tuple, list[DimDecision]]:
        return {}

    def token_decisions(self, batch: tuple[int, int] | None = None, mode: str | None = None) -> list[DimDecision]:
        """How a token batch ``(rows, positions)`` resolves on this layout's mesh in ``mode`` (default the
        layout's; ``batch=None``: without its sizes), remembered: a layout search asks for each one many times."""
        key = (batch, mode or self.mode)
        if key not in self._token_decisions:
            self._token_decisions[key] = self.partition_axis.explain((BATCH, LENGTH), key[1], shape=batch,
                                                                     mesh=self.mesh)
        return self._token_decisions[key]

    def __getitem__(self, path: str) -> ParamPlacement:
        if path not in self._index:
            raise KeyError(f"no parameter {path!r}; paths look like {self.paths[:2]}")
        return self._index[path]

    @functools.cached_property
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

    # -- export (workbench.core.sharding.export) -----------------------------------------------------------
    def to_json(self, *, cluster: tp.Any = None) -> str:
        """The layout as JSON that :meth:`from_json` reads back: mesh sizes, the cluster if given, the
        PartitionAxis fields that differ from the default, rules, mode, remat, pipeline, ZeRO stage and
        gradient accumulation."""
        return layout_export.to_json(self, cluster=cluster)

    @classmethod
    def from_json(cls, text: str, model: nnx.Module, *, mesh: tp.Any = None) -> Layout:
        """The layout ``text`` (from :meth:`to_json`) describes, resolved on ``model``; ``mesh`` overrides the
        mesh it would build (same axis sizes)."""
        return cls.of(model, **layout_export.plan_from_json(text, mesh=mesh))

    def to_code(self, *, cluster: tp.Any = None, model_expr: str = "model") -> str:
        """A Python snippet that rebuilds this layout, to paste after ``import workbench as wb``."""
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

    def kv_cache_decisions(self, batch: int, max_length: int) -> tuple[tuple[int, ...], list[DimDecision]]:
        """Shape ``(B, S, KV, D)`` of one layer's keys (or values) and how each dimension is resolved.

        ``KV`` is the heads the cache stores (:func:`workbench.core.shapes.stored_kv_heads`): the model's KV
        heads, or, where the head dimension's mesh axes outnumber them (``tp=16`` for 8 KV heads), each head repeated
        to one per device, as serving engines keep it; the reason of that dimension says so."""
        if self.config is None:
            raise ValueError("a KV cache is sized from the model's config; this layout has none (pass the model, "
                             "not just its parameters)")
        batch, max_length = positive_int("KV cache batch", batch), positive_int("KV cache max_length", max_length)
        return cache_decisions(self.config, batch, max_length, self.mesh, self.partition_axis)


# -- a KV cache on the layout's mesh ------------------------------------------------------------------
def kv_cache_spec(layout: Layout, batch: int, max_length: int) -> tuple[tuple[int, ...], PartitionSpec, str]:
    """Shape ``(B, S, KV, D)`` of one layer's keys (or values), its spec and the reason.

    The cache is resolved as ``(BATCH, KV_LENGTH, KV_HEAD, KV_HEAD_DIM)`` in decode mode: by default
    the batch over ``(fsdp, dp)``, the cached length over ``sp``, the key/value heads over ``tp`` (repeated
    to one per ``tp`` device where ``tp`` is a multiple of them above their count, see
    :meth:`Layout.kv_cache_decisions`).
    """
    shape, decisions = layout.kv_cache_decisions(batch, max_length)
    return shape, PartitionSpec(*(d.spec_entry for d in decisions)), reason_text(decisions)
