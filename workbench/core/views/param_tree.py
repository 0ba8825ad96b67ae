"""A model's parameters as rows (path, shape, dtype, count, semantic axes, spec, type, bytes) and totals per subtree.

What :class:`~workbench.widgets.module_tree.ModuleTree` shows, computed without a widget. A row is a
:class:`~workbench.core.sharding.placement.ParamPlacement`, the record the explorer's layout holds too: its spec comes
from where the parameter sits (an array or ``ShapeDtypeStruct`` carrying a ``NamedSharding``), or, when
``mesh=`` is given, from resolving its semantic axes as :func:`shard_model` would (with the reason).
Nothing is allocated: abstract models from ``lazy_init`` work too.

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
import typing as tp

from flax import nnx

from workbench.core.axes import MODE_TRAIN, PartitionAxis
from workbench.core.models.sharding import Rules
from workbench.core.sharding.placement import ParamPlacement, resolve_params

__all__ = ["SubtreeTotal", "param_rows", "subtree_totals"]


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


def param_rows(model: nnx.Module, mesh: tp.Any = None, partition_axis: PartitionAxis | None = None,
               mode: str = MODE_TRAIN, rules: Rules | None = None) -> list[ParamPlacement]:
    """Every ``nnx.Param`` of ``model`` in tree order (:func:`~workbench.core.sharding.placement.resolve_params`).

    ``mesh=None``: the spec is the one the parameter is placed with (a ``NamedSharding`` on the array
    or ``ShapeDtypeStruct``), else None. With a ``Mesh`` / ``AbstractMesh``: the spec resolved for it
    (``partition_axis``, ``mode``, ``rules`` as :func:`~workbench.core.models.sharding.param_specs` take
    them), with the reason.
    """
    return list(resolve_params(model, mesh, partition_axis, mode, rules))


def subtree_totals(rows: tp.Sequence[ParamPlacement]) -> dict[str, SubtreeTotal]:
    """Totals for every path prefix of ``rows`` (``""`` is the whole model), in tree order.

    >>> import numpy as np
    >>> rows = [ParamPlacement("a/b", (2,), np.dtype("float32")), ParamPlacement("a/c", (3,), np.dtype("float32"))]
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
