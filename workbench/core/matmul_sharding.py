"""Which PartitionSpec ``X @ W`` produces, by the rules XLA's partitioner follows.

In the scaling book's notation, a subscript names the mesh axes that shard a dimension:

- ``X[B_x, D] · W[D, F_y] -> [B_x, F_y]``: non-contracting dimensions keep their axes;
- ``X[B, D_x] · W[D_x, F] -> [B, F]``: the contracting dimension's axes disappear (each
  device holds a partial sum, which XLA reduces);
- ``X[B_x, D] · W[D, F_x]``: an axis may shard only one output dimension. XLA keeps it on
  the side of the operand with more elements and all-gathers the other operand (X on a
  tie): ``[B_x, F]`` when X is at least as large as W, ``[B, F_x]`` when W is larger. From
  the specs alone (no shapes) X's batch dimensions keep it.

>>> get_matmul_output_sharding(P("x", None), P(None, "y"))
P('x', 'y')
>>> get_matmul_output_sharding(P(None, "x"), P("x", None))
P(None, None)
>>> get_matmul_output_sharding(P("x", None), P(None, "x"))
P('x', None)
>>> get_matmul_output_sharding(P("x", None), P(None, "x"), lhs_shape=(256, 1024), rhs_shape=(1024, 4096))
P(None, 'x')

The rules were checked against the shardings XLA (Shardy, the default partitioner in jax
0.10.2) chooses for ``jax.jit(lambda x, w: x @ w)``: tests/core/test_matmul_sharding.py.
"""

from __future__ import annotations

import itertools
import math
import operator
import typing as tp

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["METHODS", "get_matmul_output_sharding", "get_output_partition_spec", "get_sharding"]

METHODS = ("gspmd", "shard_map", "collective_matmul")


def get_sharding(arr: tp.Any) -> P | None:
    """The PartitionSpec of ``arr``'s NamedSharding, or None where it has none.

    None for numpy arrays, Python scalars and single-device jax arrays. A
    ``jax.ShapeDtypeStruct`` with a NamedSharding gives its spec. A tracer (inside
    ``jit``) gives ``jax.typeof(arr).sharding.spec`` only when every axis of its mesh is
    Explicit: over Auto axes the sharding is decided later by XLA (the traced spec reads
    all-None), and inside ``shard_map`` (Manual axes) a value is one device's block.
    """
    if isinstance(arr, jax.core.Tracer):
        sharding = jax.typeof(arr).sharding
        types = sharding.mesh.axis_types
        return sharding.spec if types and all(t == AxisType.Explicit for t in types) else None
    sharding = getattr(arr, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def get_matmul_output_sharding(
    lhs_pspec: P,
    rhs_pspec: P,
    *,
    lhs_ndim: int | None = None,
    lhs_shape: tp.Sequence[int] | None = None,
    rhs_shape: tp.Sequence[int] | None = None,
) -> P:
    """The output spec XLA propagates for ``X @ W`` with X ``(..., K)`` and W ``(K, N)``.

    X has ``lhs_ndim`` dimensions, by default ``len(lhs_shape)`` if given, else
    ``len(lhs_pspec)`` but at least 2; shorter specs are padded with None at the end. The
    rule:

    - the axes of K (on X and on W) vanish: the product is a partial sum over them, and they
      never clash with the output's axes (an axis of X's K may reappear on N, one of W's K
      on X's batch dimensions);
    - X's batch dimensions and N keep their axes, except where the two use the same mesh
      axis (a *clash*: one axis cannot split two dimensions of the output). Then the
      operand with more elements wins, X on a tie: with ``lhs_shape`` and ``rhs_shape``,
      W wins when ``prod(rhs_shape) > prod(lhs_shape)`` (that is, N exceeds the product of
      X's batch dimensions); without shapes X always wins. The winner's dimensions keep all
      their axes; each dimension of the loser keeps the longest *prefix* of its axes that
      the winner does not use (``W[D, F_(y,x,z)]`` against X on ``x`` keeps ``y``): a
      prefix is a coarser tiling of the same layout, reachable without moving data. XLA
      then all-gathers the losing operand over the axes its dimensions give up.

    This is Shardy's conflict resolution (``AggressiveFactorPropagation``): the shardings
    from the larger source tensor are propagated first, so the smaller operand is the one
    resharded. Without the shapes, the answer is XLA's only when X has at least as many
    elements as W; pass them whenever W may be the larger (a wide MLP weight against few
    tokens). The legacy GSPMD partitioner (``jax_use_shardy_partitioner=False``) also lets
    the larger operand win, but the loser's dimension drops all its axes as soon as one
    clashes, not only those from the clash on.

    >>> get_matmul_output_sharding(P("x", "z"), P(None, ("y", "x", "z")))
    P('x', 'y')
    >>> get_matmul_output_sharding(P("x"), P(None, "y"), lhs_ndim=3)
    P('x', None, 'y')

    256 tokens against a 1024 x 4096 weight: W is the larger, N keeps ``x`` (XLA gathers X)
    and X's batch keeps only ``y``, the prefix before ``x``; with 8192 tokens X keeps
    ``(y, x)`` and N loses ``x``:

    >>> get_matmul_output_sharding(P(("y", "x"), None), P(None, "x"), lhs_shape=(256, 1024), rhs_shape=(1024, 4096))
    P('y', 'x')
    >>> get_matmul_output_sharding(P(("y", "x"), None), P(None, "x"), lhs_shape=(8192, 1024), rhs_shape=(1024, 4096))
    P(('y', 'x'), None)
    """
    if (lhs_shape is None) != (rhs_shape is None):
        raise ValueError("pass both lhs_shape and rhs_shape (to resolve clashes by size, as XLA does) or neither")
    if lhs_shape is not None:
        lhs_shape, rhs_shape = _shape(lhs_shape, "lhs_shape"), _shape(rhs_shape, "rhs_shape")
        if lhs_ndim is not None and lhs_ndim != len(lhs_shape):
            raise ValueError(f"lhs_ndim={lhs_ndim!r} but lhs_shape={lhs_shape} has {len(lhs_shape)} dimensions")
        if len(rhs_shape) != 2:
            raise ValueError(f"rhs_shape={rhs_shape} must be 2-D (K, N)")
        if not lhs_shape or lhs_shape[-1] != rhs_shape[0]:
            raise ValueError(f"lhs_shape={lhs_shape} and rhs_shape={rhs_shape} do not share a contracting dimension K")
        lhs_ndim = len(lhs_shape)
    lhs = _entries(lhs_pspec, "lhs_pspec", lhs_ndim)
    rhs = _entries(rhs_pspec, "rhs_pspec", 2)
    batch, n_axes = lhs[:-1], rhs[1]
    if lhs_shape is not None and math.prod(rhs_shape) > math.prod(lhs_shape):  # W wins the clashes
        batch = [_prefix_avoiding(axes, n_axes) for axes in batch]
    else:  # X wins
        n_axes = _prefix_avoiding(n_axes, [axis for axes in batch for axis in axes])
    return P(*map(_entry, batch), _entry(n_axes))


def _prefix_avoiding(axes: tuple[str, ...], taken: tp.Iterable[str]) -> tuple[str, ...]:
    """The longest prefix of ``axes`` with none of the ``taken`` mesh axes."""
    taken = set(taken)
    return tuple(itertools.takewhile(lambda axis: axis not in taken, axes))


def _shape(shape: tp.Any, name: str) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
        valid = all(not isinstance(d, bool) and operator.index(d) >= 0 for d in dims)
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"{name} must be a sequence of non-negative ints, got {shape!r}")
    return tuple(map(operator.index, dims))


def get_output_partition_spec(
    lhs: tp.Any, rhs: tp.Any, method: str, axis_name: str = "tp", *, lhs_ndim: int | None = None
) -> P:
    """The spec of a tensor-parallel linear layer's output ``lhs @ rhs``.

    ``lhs`` and ``rhs`` are arrays or PartitionSpecs (an array without a NamedSharding
    counts as replicated; ``lhs_ndim`` is taken from an array). By ``method``:

    - ``"gspmd"``: XLA partitions the plain matmul: :func:`get_matmul_output_sharding`,
      given both shapes when ``lhs`` and ``rhs`` are both arrays, so that a mesh axis on
      both X's batch and W's N is resolved by size as XLA does (from specs alone X keeps it).
    - ``"shard_map"`` / ``"collective_matmul"``: an explicit-collective kernel over
      ``axis_name``, whose direction the weight's spec implies. Column-parallel (``rhs``
      sharded over ``axis_name`` on N): X is gathered over ``axis_name``, so the output is
      X's batch specs without ``axis_name`` and the last dim sharded exactly over
      ``axis_name``. Row-parallel (``rhs`` sharded over ``axis_name`` on K): the partial
      sums are psum-ed, so the output is X's batch specs without ``axis_name`` and the
      last dim replicated. Other axes of ``rhs`` are gathered by the kernel.

    >>> get_output_partition_spec(P("dp", None), P(None, "tp"), "shard_map", "tp")
    P('dp', 'tp')
    >>> get_output_partition_spec(P("dp", "tp"), P("tp", None), "collective_matmul", "tp")
    P('dp', None)
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    lhs_spec, ndim = _spec_and_ndim(lhs, "lhs", lhs_ndim)
    rhs_spec, rhs_ndim = _spec_and_ndim(rhs, "rhs", None)
    if rhs_ndim not in (None, 2):
        raise ValueError(f"rhs must be a 2-D weight (K, N), got an array of {rhs_ndim} dims")
    if method == "gspmd":
        if isinstance(lhs, P) or isinstance(rhs, P):
            return get_matmul_output_sharding(lhs_spec, rhs_spec, lhs_ndim=ndim)
        return get_matmul_output_sharding(lhs_spec, rhs_spec, lhs_ndim=ndim, lhs_shape=lhs.shape, rhs_shape=rhs.shape)
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a mesh axis name (a str), got {axis_name!r}")
    lhs_axes = _entries(lhs_spec, "lhs", ndim)
    k_axes, n_axes = _entries(rhs_spec, "rhs", 2)
    if axis_name not in k_axes + n_axes:
        raise ValueError(
            f"method={method!r} needs rhs sharded over {axis_name!r} on N (column-parallel) or on K "
            f"(row-parallel), got {rhs_spec}; shard the weight, or use method='gspmd'"
        )
    batch = [tuple(a for a in axes if a != axis_name) for axes in lhs_axes[:-1]]
    return P(*map(_entry, batch), axis_name if axis_name in n_axes else None)


def _spec_and_ndim(value: tp.Any, name: str, ndim: int | None) -> tuple[P, int | None]:
    if isinstance(value, P):
        return value, ndim
    if not hasattr(value, "ndim"):
        raise ValueError(f"{name} must be an array or a PartitionSpec, got {type(value).__name__}")
    spec = get_sharding(value)
    if spec is None and isinstance(value, jax.core.Tracer):
        raise ValueError(f"the sharding of traced {name} is not known while tracing; pass its PartitionSpec instead")
    return (P() if spec is None else spec), value.ndim


def _entries(spec: P, name: str, ndim: int | None) -> list[tuple[str, ...]]:
    """``spec`` as one tuple of mesh axes per dimension, padded to ``ndim`` (default: at least 2), validated."""
    if not isinstance(spec, P):
        raise ValueError(f"{name} must be a jax.sharding.PartitionSpec, got {type(spec).__name__}: {spec!r}")
    ndim = max(len(spec), 2) if ndim is None else ndim
    if not isinstance(ndim, int) or ndim < 1:
        raise ValueError(f"{name}: the array needs at least 1 dimension, got ndim={ndim!r}")
    if len(spec) > ndim:
        raise ValueError(f"{name}={spec} has {len(spec)} entries but the array has only {ndim} dimensions")
    entries = []
    for entry in (*spec, *(None,) * (ndim - len(spec))):
        if entry is None:
            axes = ()
        elif isinstance(entry, str):
            axes = (entry,)
        elif isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry):
            axes = tuple(entry)
        else:
            raise ValueError(f"{name}={spec}: entry {entry!r} is not None, a mesh axis name, or a tuple of them")
        entries.append(axes)
    seen = [axis for axes in entries for axis in axes]
    if len(set(seen)) < len(seen):
        twice = sorted({axis for axis in seen if seen.count(axis) > 1})
        raise ValueError(f"{name}={spec} uses mesh axis {', '.join(map(repr, twice))} more than once")
    return entries


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes
