"""Tensor-parallel linear layers: one NNX layer, three ways to run the parallelism.

A column layer splits its kernel's output features over the tensor-parallel mesh axis (``tp``), a
row layer its input features; column then row is the Megatron MLP, one all-reduce per pair. The
kernel carries semantic axes (``ColumnWise`` / ``RowWise``) that a :class:`PartitionAxis` resolves
into its PartitionSpec, so :func:`shard` with edited rules moves the parameters.

``TensorParallelConfig.matmul_method`` picks how the layer runs; all give the same numbers:

- ``"gspmd"``: parameters placed with ``NamedSharding``, activations annotated with
  ``with_sharding_constraint``; XLA inserts the collectives.
- ``"shard_map"``: a per-device matmul with explicit ``psum`` / ``psum_scatter`` / ``all_gather``.
- ``"collective_matmul"``: the collective split into ``ppermute`` steps overlapped with the matmul
  (:mod:`workbench.core._collective_matmul`); a column layer's input is split over tp on its rows.

Output layout over tp, on the last (feature) dimension: ``reduce_output=True`` replicated,
``reduce_scatter_output=True`` sharded, neither the natural one: column sharded, row replicated (a
row layer's partial sums are always reduced). A row layer's reduce-scatter splits the output
*features*, giving the layout of a column layer's output.

Divisibility: shard_map and collective_matmul raise ValueError when tp does not divide a feature
dimension they split; gspmd follows :meth:`PartitionAxis.resolve` and replicates that dimension
over tp, which :meth:`ParallelLinear.explain` reports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core._collective_matmul import allgather_matmul, matmul_reducescatter
from workbench.core.axes import (
    BATCH,
    EMPTY,
    MODE_TRAIN,
    TP,
    ColumnWise,
    DimDecision,
    DynamicShardingAxes,
    PartitionAxis,
    RowWise,
    fit_spec,
)

__all__ = [
    "MATMUL_METHODS",
    "ColumnParallelLinear",
    "ParallelLinear",
    "RowParallelLinear",
    "TensorParallelConfig",
    "activation_specs",
    "get_matmul_output_sharding",
    "get_output_partition_spec",
    "get_sharding",
    "parallel_matmul",
    "shard",
]

Array = jax.Array
Direction = tp.Literal["column", "row"]
MATMUL_METHODS = ("gspmd", "shard_map", "collective_matmul")
PARAM_AXES = {
    "column": {"kernel": ColumnWise, "bias": DynamicShardingAxes((TP,), MODE_TRAIN)},
    "row": {"kernel": RowWise, "bias": DynamicShardingAxes((EMPTY,), MODE_TRAIN)},
}


@dataclasses.dataclass(frozen=True)
class TensorParallelConfig:
    """Where and how a parallel linear layer runs: mesh, tensor axis, matmul method, output layout.

    ``partition_axis`` resolves the parameters' semantic axes; by default ``PartitionAxis()`` with
    ``tensor_parallel_axis=axis_name``. One given explicitly must name the same tensor axis.
    """

    mesh: Mesh
    axis_name: str = "tp"
    matmul_method: str = "gspmd"
    reduce_output: bool = False
    reduce_scatter_output: bool = False
    partition_axis: PartitionAxis | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"TensorParallelConfig.mesh must be a jax.sharding.Mesh (make_mesh(tp=...)); "
                            f"got {type(self.mesh).__name__}")
        if self.axis_name not in self.mesh.axis_names:
            raise ValueError(f"axis_name={self.axis_name!r} is not an axis of the mesh, whose axes are "
                             f"{tuple(self.mesh.axis_names)}; pass one of those or build the mesh with it")
        if self.matmul_method not in MATMUL_METHODS:
            raise ValueError(f"unknown matmul_method {self.matmul_method!r}; use one of {MATMUL_METHODS}")
        if self.reduce_output and self.reduce_scatter_output:
            raise ValueError("reduce_output (replicated output) and reduce_scatter_output (output sharded over "
                             "the tensor axis) exclude each other; set at most one")
        pa = self.partition_axis
        if pa is None:
            pa = PartitionAxis(tensor_parallel_axis=self.axis_name)
        elif not isinstance(pa, PartitionAxis):
            raise TypeError(f"partition_axis must be a PartitionAxis; got {type(pa).__name__}")
        elif pa.tensor_parallel_axis != self.axis_name:
            raise ValueError(f"partition_axis.tensor_parallel_axis={pa.tensor_parallel_axis!r} but "
                             f"axis_name={self.axis_name!r}; both name the tensor axis: pass "
                             f"partition_axis.replace(tensor_parallel_axis={self.axis_name!r})")
        object.__setattr__(self, "partition_axis", pa)

    @property
    def tp_size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def output_sharded(self, direction: Direction) -> bool:
        """Whether a ``direction`` layer's output is sharded over the tensor axis on its last dim."""
        if self.reduce_output or self.reduce_scatter_output:
            return self.reduce_scatter_output
        return direction == "column"


def _check_divisible(name: str, size: int, config: TensorParallelConfig) -> None:
    n, axis = config.tp_size, config.axis_name
    if size % n:
        divisors = tuple(d for d in range(1, size + 1) if size % d == 0)
        raise ValueError(f"{name}={size} is not divisible by {axis}={n}; use a multiple of {n} such as "
                         f"{n * math.ceil(size / n)}, or a mesh with {axis} in {divisors} "
                         f"(matmul_method={config.matmul_method!r} splits it; 'gspmd' replicates it instead)")


def _split_features(direction: Direction, config: TensorParallelConfig) -> tuple[str, ...]:
    """The feature dimensions that shard_map / collective_matmul split over the tensor axis."""
    if direction == "column":
        return ("out_features",)
    scattered = config.output_sharded("row") or config.matmul_method == "collective_matmul"
    return ("in_features", "out_features") if scattered else ("in_features",)


def _batch_entry(size: int, config: TensorParallelConfig) -> tuple[str, ...]:
    """The batch mesh axes (``PartitionAxis.batch_axis``, tensor axis excluded) that divide ``size``."""
    mesh, pa = config.mesh, config.partition_axis
    axes = tuple(a for a in pa.mesh_axes_for(BATCH) if a in mesh.shape and a != config.axis_name)
    entry = fit_spec(P(axes), (size,), mesh)[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def activation_specs(shape: tuple[int, ...], out_features: int, config: TensorParallelConfig,
                     direction: Direction) -> tuple[P, P]:
    """Input and output PartitionSpecs of a layer call: batch on dim 0, tensor axis as the method needs."""
    n, axis = len(shape), config.axis_name
    rows_split = config.matmul_method == "collective_matmul" and direction == "column"
    if rows_split and (n < 2 or shape[-2] % config.tp_size):
        raise ValueError(f"collective_matmul splits a column layer's input rows (dim -2) over {axis}="
                         f"{config.tp_size}, but the input has shape {tuple(shape)}; give it a dim -2 (e.g. the "
                         f"sequence) divisible by {config.tp_size}, or use matmul_method='shard_map'")
    x_in: list[tuple[str, ...]] = [()] * n
    if n >= 2:  # with rows split on dim 0 too, the batch axes must divide what tp leaves of it
        x_in[0] = _batch_entry(shape[0] // (config.tp_size if rows_split and n == 2 else 1), config)
    y_out = list(x_in)
    if rows_split:
        x_in[-2] = (*x_in[-2], axis)
    if direction == "row":
        x_in[-1] = (axis,)
    if config.output_sharded(direction):
        y_out[-1] = (axis,)
    out_shape = (*shape[:-1], out_features)
    return fit_spec(P(*x_in), shape, config.mesh), fit_spec(P(*y_out), out_shape, config.mesh)


@functools.partial(jax.jit, static_argnames=("config", "direction", "param_specs", "precision"))
def parallel_matmul(x: Array, w_DF: Array, b_F: Array | None, *, config: TensorParallelConfig,
                    direction: Direction, param_specs: tuple[P, P | None], precision=None) -> Array:
    """``x @ w + b`` over the mesh of ``config``, run by its matmul method; ``param_specs`` place w, b."""
    x_spec, y_spec = activation_specs(x.shape, w_DF.shape[1], config, direction)
    mesh, axis, n = config.mesh, config.axis_name, config.tp_size
    if config.matmul_method == "gspmd":
        put = lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
        y = jnp.matmul(put(x, x_spec), put(w_DF, param_specs[0]), precision=precision)
        return put(y if b_F is None else y + put(b_F, param_specs[1]), y_spec)

    out_sharded, last = config.output_sharded(direction), x.ndim - 1
    collective = config.matmul_method == "collective_matmul"
    # Whether each device's result holds a slice of the output features (where the bias is added).
    features_split = direction == "column" or collective or out_sharded
    w_spec = P(None, axis) if direction == "column" else P(axis, None)
    b_spec = P(axis) if features_split else P(None)
    matmul = functools.partial(jnp.matmul, precision=precision)

    def body(x, w_DF, *b_F):
        if direction == "column":
            y = allgather_matmul(x, w_DF, axis, n, precision) if collective else matmul(x, w_DF)
        elif collective:
            y = matmul_reducescatter(x, w_DF, axis, n, precision)
        elif out_sharded:
            y = jax.lax.psum_scatter(matmul(x, w_DF), axis, scatter_dimension=last, tiled=True)
        else:
            y = jax.lax.psum(matmul(x, w_DF), axis)
        y = y + b_F[0] if b_F else y
        if features_split and not out_sharded:
            y = jax.lax.all_gather(y, axis, axis=last, tiled=True, to="invarying")
        return y

    biases = () if b_F is None else (b_F,)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, *(b_spec,) * len(biases)), out_specs=y_spec)
    return fn(x, w_DF, *biases)


class ParallelLinear(nnx.Module):
    """``nnx.Linear`` with a tensor-parallel kernel: ``direction`` "column" splits output features over
    the tensor axis, "row" input features. Without ``parallel_config`` it is a plain ``nnx.Linear``
    (same initialisation for the same ``rngs``), its parameters still tagged with semantic axes.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, dtype=None,
                 param_dtype=jnp.float32, precision=None, kernel_init=default_kernel_init,
                 bias_init=default_bias_init, parallel_config: TensorParallelConfig | None = None,
                 direction: Direction = "column", rngs: nnx.Rngs):
        if direction not in PARAM_AXES:
            raise ValueError(f"direction must be 'column' or 'row'; got {direction!r}")
        axes = PARAM_AXES[direction]
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                semantic_axes=axes["kernel"])
        self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), semantic_axes=axes["bias"])
                     if use_bias else nnx.data(None))
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.direction = direction
        self.parallel_config = None
        if parallel_config is not None:
            self._place(parallel_config)

    def _params(self) -> dict[str, nnx.Param]:
        return {"kernel": self.kernel} | ({"bias": self.bias} if self.bias is not None else {})

    def _place(self, config: TensorParallelConfig) -> None:
        """Put kernel and bias on ``config.mesh`` by their semantic axes (only on a new or fresh layer)."""
        if config.matmul_method != "gspmd":
            for name in _split_features(self.direction, config):
                _check_divisible(name, getattr(self, name), config)
        self.parallel_config = config
        for name, spec in self.partition_specs().items():
            var = getattr(self, name)
            value = jax.device_put(var[...], NamedSharding(config.mesh, spec))
            # out_sharding is the metadata nnx.get_partition_spec reads; the value is already placed.
            setattr(self, name, nnx.Param(value, semantic_axes=var.semantic_axes, out_sharding=tuple(spec),
                                          eager_sharding=False))

    def explain(self) -> dict[str, list[DimDecision]]:
        """Per parameter, how each dimension was resolved and why (``axes.explain_table`` prints one)."""
        config = self.parallel_config
        pa, mesh = (PartitionAxis(), None) if config is None else (config.partition_axis, config.mesh)
        return {name: pa.explain(var.semantic_axes, shape=var.shape, mesh=mesh)
                for name, var in self._params().items()}

    def partition_specs(self) -> dict[str, P]:
        """Per parameter, the PartitionSpec its semantic axes resolve to under the layer's config."""
        return {name: P(*(d.spec_entry for d in decisions)) for name, decisions in self.explain().items()}

    def activation_specs(self, shape: tuple[int, ...]) -> tuple[P, P]:
        """Input and output PartitionSpecs for an input of ``shape`` (needs a parallel_config)."""
        if self.parallel_config is None:
            raise ValueError("this layer has no parallel_config; pass one, or shard() it")
        return activation_specs(tuple(shape), self.out_features, self.parallel_config, self.direction)

    def __call__(self, x: Array) -> Array:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"input shape {x.shape}: the last dimension must be in_features={self.in_features}")
        bias = None if self.bias is None else self.bias[...]
        x, w_DF, b_F = dtypes.promote_dtype((x, self.kernel[...], bias), dtype=self.dtype)
        if self.parallel_config is None:
            y = jnp.matmul(x, w_DF, precision=self.precision)
            return y if b_F is None else y + b_F
        specs = self.partition_specs()
        return parallel_matmul(x, w_DF, b_F, config=self.parallel_config, direction=self.direction,
                               param_specs=(specs["kernel"], specs.get("bias")), precision=self.precision)


class ColumnParallelLinear(ParallelLinear):
    """A :class:`ParallelLinear` splitting output features over the tensor axis (kernel ``ColumnWise``)."""

    def __init__(self, in_features: int, out_features: int, **kwargs: tp.Any):
        super().__init__(in_features, out_features, direction="column", **kwargs)


class RowParallelLinear(ParallelLinear):
    """A :class:`ParallelLinear` splitting input features over the tensor axis (kernel ``RowWise``)."""

    def __init__(self, in_features: int, out_features: int, **kwargs: tp.Any):
        super().__init__(in_features, out_features, direction="row", **kwargs)


def shard(layer: ParallelLinear, partition_axis: PartitionAxis) -> ParallelLinear:
    """A copy of ``layer`` with parameters placed by ``partition_axis``; ``layer`` itself is unchanged.

    The tensor axis follows ``partition_axis.tensor_parallel_axis``, so renaming it moves the
    collectives too.
    """
    config = layer.parallel_config
    if config is None:
        raise ValueError("shard() needs a layer built with parallel_config=TensorParallelConfig(mesh, ...), "
                         "which gives the mesh")
    config = dataclasses.replace(config, axis_name=partition_axis.tensor_parallel_axis,
                                 partition_axis=partition_axis)
    new = nnx.merge(*nnx.split(layer))
    new._place(config)
    return new


# Re-exported: the PartitionSpec helpers the DESIGN contract places in workbench.core.linear.
from workbench.core.matmul_sharding import get_matmul_output_sharding, get_output_partition_spec, get_sharding  # noqa: E402
