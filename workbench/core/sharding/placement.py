"""A model's parameters resolved on a mesh (regex overrides, reasons): the one record every view uses.

:func:`resolve_params` turns every ``nnx.Param`` of a model (live or abstract: only shapes are read) into a
:class:`ParamPlacement`. Given a mesh, each parameter's semantic axes, or the axes of the first regex rule
matching its path, are resolved through a :class:`~workbench.core.axes.PartitionAxis` in a runtime mode
(:func:`~workbench.core.models.sharding.explain_params`): its spec, the block each device holds, the bytes
per device, one :class:`~workbench.core.axes.DimDecision` per dimension and one reason text from them
(:func:`reason_text`). Without a mesh a record says how the parameter is placed, or that it is not.
The explorer's :class:`~workbench.core.sharding.plan.Layout` and the module tree's rows are these records.

>>> from workbench.core.mesh import make_mesh
>>> from workbench.core.models.presets import tiny
>>> params = {p.path: p for p in resolve_params(tiny("llama"), make_mesh(fsdp=2, tp=4))}
>>> q = params["layers/self_attn/q_proj/kernel"]
>>> q.axes, q.spec, q.shard_shape
(('LAYERS', '[FSDP, SP]', 'TP'), P(None, ('fsdp', 'sp'), 'tp'), (2, 32, 16))
>>> print(q.reason.replace(" | ", "\\n"))
dim0 LAYERS: layer_axis = None: replicated
dim1 [FSDP, SP]: sharded 2 ways over fsdp×sp, 32 per shard
dim2 TP: sharded 4 ways over tp, 16 per shard
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing as tp

import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from workbench.core import axes as ax
from workbench.core.axes import MODE_TRAIN, DimDecision, PartitionAxis, shard_shape
from workbench.core.models.sharding import Rules, explain_params, flat_params, path_str
from workbench.core.sharding.blocks import typed_notation

__all__ = ["ParamPlacement", "freeze_rules", "reason_text", "resolve_params", "shard_shape"]

@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """One parameter: its shape and semantic axes, and where it lives on a mesh and why.

    ``source`` says where the spec came from: ``"resolved"`` (semantic axes, or a rule's, resolved on ``mesh``;
    ``decisions`` has one per dimension, :attr:`reason` says them in one line), ``"placed"`` (the
    ``NamedSharding`` the array carries) or None (not on a mesh: ``spec``, ``shard_shape``,
    ``bytes_per_device`` and ``mesh`` are None). ``axes``: semantic axis labels per dimension (a matching
    rule's when resolved), None for a parameter tagged with none.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str, ...] | None = None
    spec: PartitionSpec | None = None
    shard_shape: tuple[int, ...] | None = None
    bytes_per_device: int | None = None
    decisions: tuple[DimDecision, ...] = ()
    mesh: Mesh | AbstractMesh | None = dataclasses.field(default=None, repr=False)
    source: str | None = None

    @property
    def name(self) -> str:
        """The last path component (``kernel``, ``weight``)."""
        return self.path.rsplit("/", 1)[-1]

    @property
    def count(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Unsharded size in bytes."""
        return self.count * self.dtype.itemsize

    @property
    def reason(self) -> str:
        """Why each dimension is split as it is, in one line (:func:`reason_text`); empty unless resolved."""
        return reason_text(self.decisions)

    @property
    def sharding(self) -> NamedSharding | None:
        return None if self.spec is None else NamedSharding(self.mesh, self.spec)

    @property
    def typed(self) -> str | None:
        """Its type on Explicit axes, ``float32[264@tp,64@(fsdp,sp)]`` (None without a spec;
        :func:`.layout.typed_notation`)."""
        return None if self.spec is None else typed_notation(self.shape, self.dtype, self.spec)

    @property
    def typed_on_mesh(self) -> str | None:
        """Its type as ``jax.typeof`` prints it on its own mesh: Auto axes left out."""
        return None if self.spec is None else typed_notation(self.shape, self.dtype, self.spec, self.mesh)


def reason_text(decisions: tp.Sequence[DimDecision]) -> str:
    """The per-dimension reasons in one line, ``dim0 TP: ... | dim1 [FSDP, SP]: ...``; a rule suffix common to
    every dimension is said once, at the end."""
    if not decisions:
        return ""
    rule = re.search(r" \(rule '.*'\)$", decisions[0].reason)
    suffix = rule.group() if rule and all(d.reason.endswith(rule.group()) for d in decisions) else ""
    strip = lambda r: r[: len(r) - len(suffix)] if suffix else r
    if all(not d.chosen and d.semantic == "EMPTY" for d in decisions):
        text = "replicated: no dimension is named for sharding (EMPTY)"
    else:
        text = " | ".join(f"dim{d.dim} {d.semantic}: {strip(d.reason)}" for d in decisions)
    return text + suffix


def freeze_rules(rules: Rules | None) -> tuple[tuple[str, tp.Any], ...]:
    """``(pattern, axes)`` rules as hashable data: lists turned into tuples (a preset stays a DynamicShardingAxes)."""
    return tuple((pattern, _frozen_axes(axes)) for pattern, axes in rules or ())


def _frozen_axes(axes: tp.Any) -> tp.Any:
    if isinstance(axes, ax.DynamicShardingAxes):
        return ax.DynamicShardingAxes(_frozen_axes(axes.axes), axes.mode)
    if isinstance(axes, list | tuple):
        return tuple(_frozen_axes(a) if isinstance(a, list | tuple) else a for a in axes)
    return axes


def resolve_params(model: nnx.Module, mesh: Mesh | AbstractMesh | None = None,
                   partition_axis: PartitionAxis | None = None, mode: str = MODE_TRAIN,
                   rules: Rules | None = None) -> tuple[ParamPlacement, ...]:
    """Every ``nnx.Param`` of ``model`` in tree order, as a :class:`ParamPlacement`.

    With a ``Mesh`` / ``AbstractMesh``: resolved as :func:`~workbench.core.models.sharding.shard_model` would
    place it (``partition_axis``, ``mode``, ``rules`` as there; a ``ValueError`` for a rule that does not
    compile or fit, or a mesh axis the mesh lacks). ``mesh=None``: the ``NamedSharding`` an array or
    ``ShapeDtypeStruct`` carries, else not placed.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"resolving parameters takes an nnx.Module (e.g. tiny('llama')); got {type(model).__name__}")
    explained = explain_params(model, mesh, partition_axis, mode, rules) if mesh is not None else {}
    sizes = dict(mesh.shape) if mesh is not None else {}
    out = []
    for path, var in flat_params(model):
        name = path_str(path)
        shape, dtype = tuple(var.shape), np.dtype(var.dtype)
        if name in explained:
            dims = tuple(explained[name])
            block = shard_shape(dims, sizes)
            out.append(ParamPlacement(
                name, shape, dtype, tuple(d.semantic for d in dims), PartitionSpec(*(d.spec_entry for d in dims)),
                block, math.prod(block) * dtype.itemsize, dims, mesh, "resolved"))
            continue
        sharding = getattr(var.get_value(), "sharding", None)
        if isinstance(sharding, NamedSharding):
            block = tuple(sharding.shard_shape(shape))
            out.append(ParamPlacement(name, shape, dtype, _axes_labels(var), sharding.spec, block,
                                      math.prod(block) * dtype.itemsize, (), sharding.mesh, "placed"))
        else:
            out.append(ParamPlacement(name, shape, dtype, _axes_labels(var)))
    return tuple(out)


def _axes_labels(var: tp.Any) -> tuple[str, ...] | None:
    axes = getattr(var, "semantic_axes", None)
    return None if axes is None else tuple(ax.label(a) for a in getattr(axes, "axes", axes))
