"""A model's parameters as rows (path, shape, dtype, count, semantic axes, spec, type, bytes) and totals per subtree.

What :class:`~workbench.widgets.module_tree.ModuleTree` shows, computed without a widget. A spec
comes from where the parameter sits (an array or ``ShapeDtypeStruct`` carrying a ``NamedSharding``),
or, when ``mesh=`` is given, from resolving its semantic axes as :func:`shard_model` would (with the
reason for each dimension). Nothing is allocated: abstract models from ``lazy_init`` work too.

>>> from workbench.core.models.presets import tiny
>>> rows = param_rows(tiny("llama"))
>>> rows[0].path, rows[0].shape, rows[0].axes
('embed_tokens', (264, 64), ('TP', '[FSDP, SP]'))
>>> rows[3].path, rows[3].shape, rows[3].axes  # the decoder layers are stacked: LAYERS leads
('layers/mlp/gate_proj/kernel', (2, 64, 128), ('LAYERS', '[FSDP, SP]', 'TP'))
>>> subtree_totals(rows)["layers/self_attn"].count == sum(r.count for r in rows
...                                                     if r.path.startswith("layers/self_attn/"))
True
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.axes import MODE_TRAIN, PartitionAxis, label
from workbench.core.layout import typed_notation
from workbench.core.models.sharding import Rules, explain_params, path_str

__all__ = ["ParamRow", "SubtreeTotal", "format_count", "param_rows", "subtree_totals"]


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One parameter. ``spec``/``sharding``/``shard_shape``/``bytes_per_device`` are None when it is not
    placed on a mesh and no mesh was given; ``source`` says where the spec came from ("placed" or
    "resolved"); ``reasons`` holds one line per dimension when resolved."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int
    nbytes: int
    axes: tuple[str, ...] | None
    spec: PartitionSpec | None = None
    sharding: NamedSharding | None = None
    shard_shape: tuple[int, ...] | None = None
    bytes_per_device: int | None = None
    source: str | None = None
    reasons: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The last path component (``kernel``, ``weight``)."""
        return self.path.rsplit("/", 1)[-1]

    def typed(self, *, on_mesh: bool = False) -> str | None:
        """Its type on Explicit axes, ``float32[264@tp,64@(fsdp,sp)]`` (None without a spec); ``on_mesh=True``:
        as ``jax.typeof`` prints it on its own mesh, Auto axes left out (:func:`.layout.typed_notation`)."""
        if self.spec is None:
            return None
        return typed_notation(self.shape, self.dtype, self.spec, self.sharding.mesh if on_mesh else None)


@dataclasses.dataclass(frozen=True)
class SubtreeTotal:
    """Parameters under one path prefix: how many arrays, elements and bytes (and bytes per device when
    every one of them has a spec)."""

    path: str
    depth: int
    num_arrays: int
    count: int
    nbytes: int
    bytes_per_device: int | None


def _axes_labels(var: tp.Any) -> tuple[str, ...] | None:
    axes = getattr(var, "semantic_axes", None)
    if axes is None:
        return None
    return tuple(label(a) for a in getattr(axes, "axes", axes))


def param_rows(model: nnx.Module, mesh: tp.Any = None, partition_axis: PartitionAxis | None = None,
               mode: str = MODE_TRAIN, rules: Rules | None = None) -> list[ParamRow]:
    """Every ``nnx.Param`` of ``model`` in tree order.

    ``mesh=None``: the spec is the one the parameter is placed with (a ``NamedSharding`` on the array
    or ``ShapeDtypeStruct``), else None. With a ``Mesh`` / ``AbstractMesh``: the spec
    :func:`~workbench.core.models.sharding.param_specs` resolves for it (``partition_axis``, ``mode``,
    ``rules`` as there), with the reasons.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"param_rows takes an nnx.Module (e.g. tiny('llama')); got {type(model).__name__}")
    explained = explain_params(model, mesh, partition_axis, mode, rules) if mesh is not None else {}
    rows = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path_str(path)
        value = var.get_value()
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        count = math.prod(shape)
        sharding, source, reasons = None, None, ()
        if name in explained:
            decisions = explained[name]
            sharding = NamedSharding(mesh, PartitionSpec(*(d.spec_entry for d in decisions)))
            source, reasons = "resolved", tuple(f"dim {d.dim} ({d.semantic}): {d.reason}" for d in decisions)
        elif isinstance(getattr(value, "sharding", None), NamedSharding):
            sharding, source = value.sharding, "placed"
        shard_shape = tuple(sharding.shard_shape(shape)) if sharding is not None else None
        rows.append(ParamRow(
            path=name, shape=shape, dtype=dtype, count=count, nbytes=count * dtype.itemsize, axes=_axes_labels(var),
            spec=None if sharding is None else sharding.spec, sharding=sharding, shard_shape=shard_shape,
            bytes_per_device=None if shard_shape is None else math.prod(shard_shape) * dtype.itemsize,
            source=source, reasons=reasons))
    return rows


def subtree_totals(rows: tp.Sequence[ParamRow]) -> dict[str, SubtreeTotal]:
    """Totals for every path prefix of ``rows`` (``""`` is the whole model), in tree order.

    >>> rows = [ParamRow("a/b", (2,), np.dtype("float32"), 2, 8, None),
    ...         ParamRow("a/c", (3,), np.dtype("float32"), 3, 12, None)]
    >>> {k: v.count for k, v in subtree_totals(rows).items()}
    {'': 5, 'a': 5}
    """
    acc: dict[str, list] = {}
    for row in rows:
        parts = row.path.split("/")
        for depth in range(len(parts)):  # "" then each proper prefix
            prefix = "/".join(parts[:depth])
            a = acc.setdefault(prefix, [depth, 0, 0, 0, 0])
            a[1] += 1
            a[2] += row.count
            a[3] += row.nbytes
            a[4] = None if a[4] is None or row.bytes_per_device is None else a[4] + row.bytes_per_device
    return {p: SubtreeTotal(p, d, n, c, b, per) for p, (d, n, c, b, per) in acc.items()}


def format_count(n: int) -> str:
    """A parameter count for labels: ``91392`` -> ``"91.4K"``, ``7241732096`` -> ``"7.24B"``.

    >>> format_count(999), format_count(91392), format_count(7_241_732_096)
    ('999', '91.4K', '7.24B')
    """
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
