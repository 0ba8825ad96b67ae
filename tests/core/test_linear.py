"""Parallel linear layers: every matmul method and direction equals a float64 NumPy product."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import ColumnWise, PartitionAxis, RowWise
from workbench.core.linear import (
    MATMUL_METHODS,
    ColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    TensorParallelConfig,
    get_output_partition_spec,
    shard,
)
from workbench.core.matmul_sharding import METHODS
from workbench.core.mesh import make_mesh

HI = jax.lax.Precision.HIGHEST
MESHES = {
    "tp1": dict(tp=1),
    "tp2": dict(tp=2),
    "tp4": dict(tp=4),
    "tp8": dict(tp=8),
    "dp2_tp4": dict(dp=2, fsdp=1, tp=4),
    "dp2_fsdp2_tp2": dict(dp=2, fsdp=2, tp=2),
}
DIRECTIONS = ("column", "row")


def mesh_of(name):
    return make_mesh(**MESHES[name])


def make_layer(mesh, method="gspmd", direction="column", in_f=16, out_f=32, use_bias=True, **config):
    cfg = TensorParallelConfig(mesh, matmul_method=method, **config)
    return ParallelLinear(in_f, out_f, direction=direction, use_bias=use_bias, parallel_config=cfg, precision=HI,
                          bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))


def inputs(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def dense(layer, x):
    """The float64 NumPy product the layer must match."""
    y = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
    return y if layer.bias is None else y + np.asarray(layer.bias[...], np.float64)


def placed(arr, spec, mesh):
    return arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", MATMUL_METHODS)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_matches_numpy_on_every_mesh(mesh_name, method, direction):
    mesh = mesh_of(mesh_name)
    layer = make_layer(mesh, method, direction)
    x = inputs((2, 8, 16))
    y = layer(x)
    np.testing.assert_allclose(np.asarray(y), dense(layer, x), atol=1e-5, rtol=0)
    assert placed(y, layer.activation_specs(x.shape)[1], mesh)
    expected_kernel = PartitionAxis().resolve(ColumnWise if direction == "column" else RowWise, shape=(16, 32),
                                              mesh=mesh)
    specs = layer.partition_specs()
    assert specs["kernel"] == expected_kernel
    assert layer.kernel[...].sharding.spec == expected_kernel
    bias_spec = P("tp") if direction == "column" else P(None)
    assert specs["bias"] == bias_spec and placed(layer.bias[...], bias_spec, mesh)


@pytest.mark.parametrize("shape", [(16, 16), (2, 2, 8, 16)], ids=["rank2", "rank4"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", MATMUL_METHODS)
def test_leading_dims_without_bias(method, direction, shape):
    layer = make_layer(mesh_of("tp4"), method, direction, use_bias=False)
    x = inputs(shape)
    y = layer(x)
    assert y.shape == (*shape[:-1], 32) and layer.bias is None
    np.testing.assert_allclose(np.asarray(y), dense(layer, x), atol=1e-5, rtol=0)


# (direction, flag) -> whether the output's last dim stays sharded over tp
LAYOUTS = {("column", "reduce_output"): None, ("row", "reduce_scatter_output"): "tp", ("row", None): None}


@pytest.mark.parametrize("case", list(LAYOUTS), ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("method", MATMUL_METHODS)
def test_output_layout(method, case):
    direction, flag = case
    mesh = mesh_of("dp2_fsdp2_tp2")
    layer = make_layer(mesh, method, direction, **({flag: True} if flag else {}))
    x = inputs((2, 8, 16))
    y = layer(x)
    np.testing.assert_allclose(np.asarray(y), dense(layer, x), atol=1e-5, rtol=0)
    assert placed(y, P("fsdp", None, LAYOUTS[case]), mesh)  # batch 2: fsdp kept, dp would not divide


@pytest.mark.parametrize(("method", "direction", "shape", "x_spec", "y_spec"), [
    ("gspmd", "row", (2, 8, 16), P("fsdp", None, "tp"), P("fsdp", None, None)),
    ("shard_map", "column", (4, 8, 16), P(("fsdp", "dp"), None, None), P(("fsdp", "dp"), None, "tp")),
    # collective_matmul gathers a column layer's input rows (dim -2) step by step
    ("collective_matmul", "column", (2, 8, 16), P("fsdp", "tp", None), P("fsdp", None, "tp")),
    ("collective_matmul", "column", (16, 16), P(("fsdp", "dp", "tp"), None), P(("fsdp", "dp"), "tp")),
])
def test_activation_specs(method, direction, shape, x_spec, y_spec):
    layer = make_layer(mesh_of("dp2_fsdp2_tp2"), method, direction)
    assert layer.activation_specs(shape) == (x_spec, y_spec)


@pytest.mark.parametrize("method", MATMUL_METHODS)
def test_column_then_row_mlp(method):
    mesh = mesh_of("dp2_fsdp2_tp2")
    cfg = TensorParallelConfig(mesh, matmul_method=method)
    up = ColumnParallelLinear(16, 32, parallel_config=cfg, precision=HI, rngs=nnx.Rngs(1))
    down = RowParallelLinear(32, 16, parallel_config=cfg, precision=HI, bias_init=nnx.initializers.normal(1.0),
                             rngs=nnx.Rngs(2))
    x = inputs((2, 8, 16))
    y = nnx.jit(lambda up, down, x: down(jax.nn.relu(up(x))))(up, down, x)
    np.testing.assert_allclose(np.asarray(y), dense(down, np.maximum(dense(up, x), 0)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", MATMUL_METHODS)
def test_grad_matches_numpy(method):
    layer = make_layer(mesh_of("dp2_tp4"), method, "row")
    x = inputs((2, 8, 16))
    graphdef, state = nnx.split(layer)
    loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x) ** 2)
    grads, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    dy = 2 * dense(layer, x)  # d loss / d y
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(grads["kernel"][...]), np.einsum("btd,btf->df", x64, dy), rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(grads["bias"][...]), dy.sum((0, 1)), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx), dy @ np.asarray(layer.kernel[...], np.float64).T, rtol=1e-5, atol=1e-4)


def test_without_config_is_nnx_linear():
    x = inputs((2, 8, 16))
    ours = ParallelLinear(16, 32, rngs=nnx.Rngs(0))
    ref = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(ours.kernel[...]), np.asarray(ref.kernel[...]))
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(ref(x)))
    assert ours.kernel.semantic_axes == ColumnWise
    assert ours.partition_specs() == {"kernel": P(("fsdp", "sp"), "tp"), "bias": P("tp")}


def test_parameters_carry_semantic_axes_and_flax_reads_the_spec():
    mesh = mesh_of("dp2_fsdp2_tp2")
    row = make_layer(mesh, direction="row")
    assert row.kernel.semantic_axes == RowWise
    specs = nnx.get_partition_spec(nnx.state(row))
    assert specs["kernel"].get_value() == row.partition_specs()["kernel"] == P("tp", ("fsdp", "sp"))
    assert specs["bias"].get_value() == P(None)


def test_shard_moves_parameters_and_keeps_the_original():
    mesh = mesh_of("dp2_fsdp2_tp2")
    layer = make_layer(mesh, "shard_map", "column")
    before = layer.kernel[...]
    x = inputs((2, 8, 16))
    pa = layer.parallel_config.partition_axis

    by_dp = shard(layer, pa.replace(fully_sharded_data_parallel_axis="dp"))
    assert by_dp.kernel[...].sharding.spec == P(("dp", "sp"), "tp")
    renamed = shard(layer, pa.replace(tensor_parallel_axis="dp"))
    assert renamed.parallel_config.axis_name == "dp"
    assert renamed.kernel[...].sharding.spec == P(("fsdp", "sp"), "dp")
    assert renamed.bias[...].sharding.spec == P("dp")
    for new in (by_dp, renamed):
        np.testing.assert_allclose(np.asarray(new(x)), dense(layer, x), atol=1e-5, rtol=0)

    assert layer.kernel[...] is before and layer.kernel[...].sharding.spec == P(("fsdp", "sp"), "tp")
    assert layer.parallel_config.axis_name == "tp" and layer.parallel_config.partition_axis == pa


def test_gspmd_replicates_a_dimension_tp_does_not_divide():
    mesh = mesh_of("tp4")
    layer = make_layer(mesh, "gspmd", "column", out_f=6)
    assert layer.kernel[...].sharding.spec == P(("fsdp", "sp"), None)
    assert "tp dropped: 6 not divisible by 4" in layer.explain()["kernel"][1].reason
    x = inputs((2, 8, 16))
    np.testing.assert_allclose(np.asarray(layer(x)), dense(layer, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("method", "direction", "in_f", "out_f", "config", "message"), [
    ("shard_map", "column", 16, 6, {}, "out_features=6 is not divisible by tp=4; use a multiple of 4 such as 8, "
                                       "or a mesh with tp in (1, 2, 3, 6)"),
    ("collective_matmul", "row", 6, 16, {}, "in_features=6 is not divisible by tp=4"),
    ("shard_map", "row", 16, 6, {"reduce_scatter_output": True}, "out_features=6 is not divisible by tp=4"),
    ("collective_matmul", "row", 16, 6, {}, "out_features=6 is not divisible by tp=4"),
])
def test_indivisible_features_raise(method, direction, in_f, out_f, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_layer(mesh_of("tp4"), method, direction, in_f=in_f, out_f=out_f, **config)


def test_input_errors():
    mesh = mesh_of("tp4")
    with pytest.raises(ValueError, match=re.escape("collective_matmul splits a column layer's input rows")):
        make_layer(mesh, "collective_matmul", "column")(inputs((2, 6, 16)))
    with pytest.raises(ValueError, match="in_features=16"):
        make_layer(mesh)(inputs((2, 8, 12)))
    with pytest.raises(ValueError, match="needs a layer built with parallel_config"):
        shard(ParallelLinear(16, 32, rngs=nnx.Rngs(0)), PartitionAxis())


def test_config_errors():
    mesh = mesh_of("tp4")
    with pytest.raises(ValueError, match=re.escape("axis_name='model' is not an axis of the mesh, whose axes are "
                                                   "('pp', 'dp', 'fsdp', 'ep', 'tp', 'sp')")):
        TensorParallelConfig(mesh, axis_name="model")
    with pytest.raises(ValueError, match=re.escape("use one of ('gspmd', 'shard_map', 'collective_matmul')")):
        TensorParallelConfig(mesh, matmul_method="ring")
    with pytest.raises(ValueError, match="exclude each other"):
        TensorParallelConfig(mesh, reduce_output=True, reduce_scatter_output=True)
    with pytest.raises(ValueError, match="both name the tensor axis"):
        TensorParallelConfig(mesh, axis_name="dp", partition_axis=PartitionAxis())
    assert TensorParallelConfig(mesh, axis_name="dp").partition_axis.tensor_parallel_axis == "dp"
    with pytest.raises(ValueError, match="direction must be 'column' or 'row'"):
        ParallelLinear(16, 32, direction="diagonal", rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("method", "direction", "config", "collective"), [
    ("gspmd", "column", {}, "sharding_constraint"),
    ("shard_map", "row", {}, "all_reduce"),
    ("shard_map", "row", {"reduce_scatter_output": True}, "reduce_scatter"),
    ("shard_map", "column", {"reduce_output": True}, "all_gather"),
    ("collective_matmul", "column", {}, "collective_permute"),
    ("collective_matmul", "row", {}, "collective_permute"),
])
def test_each_method_lowers_to_its_collective(method, direction, config, collective):
    layer = make_layer(mesh_of("tp4"), method, direction, **config)
    text = jax.jit(lambda x: layer(x)).lower(inputs((2, 8, 16))).as_text()
    assert collective in text


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", MATMUL_METHODS)
def test_default_layout_agrees_with_get_output_partition_spec(method, direction):
    layer = make_layer(mesh_of("dp2_fsdp2_tp2"), method, direction)
    x_spec, y_spec = layer.activation_specs((2, 8, 16))
    assert get_output_partition_spec(x_spec, layer.partition_specs()["kernel"], method, "tp", lhs_ndim=3) == y_spec
    assert MATMUL_METHODS == METHODS
