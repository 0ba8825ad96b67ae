"""One sharded matmul as a step on a cluster: the scaling book's three cases ("Sharded Matrices and How to
Multiply Them", https://jax-ml.github.io/scaling-book/sharding/) as FLOPs, HBM bytes and collectives per device,
timed by :func:`~workbench.core.cost.compiled_step.step_time` (the roofline and the network model).
"""

from __future__ import annotations

import math
import typing as tp

import jax.numpy as jnp
import numpy as np

from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.step import StepTime
from workbench.core.hardware.cluster import Cluster


def _pair(spec: tp.Sequence[tp.Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes of each of a 2-D spec's entries (a missing entry is unsplit)."""
    entries = (*spec, None, None)[:2]
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def sharded_matmul(B: int, D: int, F: int, cluster: Cluster, mesh_shape: tp.Mapping[str, int] | None = None, *,
                   lhs: tp.Sequence[tp.Any] = (None, None), rhs: tp.Sequence[tp.Any] = (None, None),
                   dtype: tp.Any = jnp.bfloat16) -> StepTime:
    """The step ``x[B, D] @ w[D, F]`` on ``cluster``, ``x`` split by ``lhs`` and ``w`` by ``rhs``: two-entry specs
    (a ``PartitionSpec`` works) over the axes of ``mesh_shape`` (name -> size, all the cluster's devices).

    The collectives follow the book's cases: the contracting dimension D split alike on both -> a local matmul,
    then an AllReduce of the output over D's axes; split on one side only -> AllGather that side first; B and F
    split over the same axes -> AllGather ``w``. ``dtype`` gives the bytes and the peak FLOP/s. Priced as the
    book prices it, the ideal roofline (matmuls at peak, the step the longest of its parts).
    """
    mesh_shape = dict(mesh_shape or {})
    (b_ax, dl_ax), (dr_ax, f_ax) = _pair(lhs), _pair(rhs)
    missing = {a for a in (*b_ax, *dl_ax, *dr_ax, *f_ax) if a not in mesh_shape}
    if missing:
        raise ValueError(f"sharded_matmul: axes {sorted(missing)} are not in mesh_shape={mesh_shape}; pass their "
                         f"sizes")
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    item = np.dtype(dtype).itemsize
    comms: list[tuple[str, int, tuple[str, ...]]] = []  # (kind, bytes per device of the result, axes)
    d_ax: tuple[str, ...] = ()
    if dl_ax and dl_ax == dr_ax:
        d_ax = dl_ax
        comms.append(("all-reduce", B // size(b_ax) * F // size(f_ax) * item, d_ax))
    else:
        if dl_ax:
            comms.append(("all-gather", B // size(b_ax) * D * item, dl_ax))
        if dr_ax:
            comms.append(("all-gather", D * F // size(f_ax) * item, dr_ax))
    if set(b_ax) & set(f_ax):
        comms.append(("all-gather", D // size(d_ax) * F * item, f_ax))
        f_ax = ()
    b, d, f = B // size(b_ax), D // size(d_ax), F // size(f_ax)
    return step_time(cluster=cluster, mesh_shape=mesh_shape, efficiency=1.0, flops=2 * b * d * f,
                     hbm_bytes=(b * d + d * f + b * f) * item, collectives=comms, dtype=dtype)
