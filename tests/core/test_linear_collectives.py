"""Which collectives the parallel linear layers compile to, read by ``inspect.collectives`` from the optimised HLO.

Megatron's accounting: a column layer needs none (input replicated over tp), a row layer one all-reduce
over tp of its output (or one reduce-scatter), a column -> row MLP one all-reduce; the collective
matmuls trade those for tp - 1 collective-permutes. Bytes are per device: the row layer's all-reduce
carries that device's batch rows of the full output, ``B * T * out_features * 4 / batch shards``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from workbench.core.hlo.collectives import collectives, summarize
from workbench.core.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear, TensorParallelConfig
from workbench.core.mesh import make_mesh

MESHES = {"dp2_tp4": dict(dp=2, tp=4), "tp8": dict(tp=8, fsdp=1)}
B, T, D, F = 4, 16, 64, 128  # batch, sequence, in / out features
F32 = 4  # bytes


@pytest.fixture(params=list(MESHES))
def mesh(request):
    return make_mesh(**MESHES[request.param])


def layer_of(mesh, method, direction, **config):
    cfg = TensorParallelConfig(mesh, matmul_method=method, **config)
    return ParallelLinear(D, F, direction=direction, parallel_config=cfg, rngs=nnx.Rngs(0))


def module_collectives(module, x_spec, mesh, apply=lambda module, x: module(x)):
    """The collectives of ``jit(lambda state, x: apply(merge(state), x))``, x abstract (B, T, D) placed by x_spec."""
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: apply(nnx.merge(graphdef, state), x))
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(mesh, x_spec))
    return collectives(forward, state, x)


def forward_collectives(layer):
    """The collectives of one layer's forward, its input placed as the layer expects it."""
    mesh = layer.parallel_config.mesh
    return module_collectives(layer, layer.activation_specs((B, T, D))[0], mesh)


def batch_shards(mesh):
    """Into how many pieces the batch dimension is split (PartitionAxis puts BATCH on fsdp and dp)."""
    return mesh.shape["dp"] * mesh.shape["fsdp"]


def kinds(records):
    return [r.kind for r in records]


def ring_shifts(records, mesh):
    """For collective-permutes: the set of tp-coordinate steps (target - source) mod tp; other coordinates kept."""
    shifts = set()
    tp_dim, n = mesh.axis_names.index("tp"), mesh.shape["tp"]
    for r in records:
        for src, dst in r.source_target_pairs:
            a, b = np.unravel_index(src, mesh.devices.shape), np.unravel_index(dst, mesh.devices.shape)
            assert [x for i, x in enumerate(a) if i != tp_dim] == [x for i, x in enumerate(b) if i != tp_dim], r
            shifts.add(int(b[tp_dim] - a[tp_dim]) % n)
    return shifts


# -- row: one all-reduce (or one reduce-scatter) over tp ------------------------------------------
@pytest.mark.parametrize("method", ["gspmd", "shard_map"])
def test_row_is_one_all_reduce_over_tp(mesh, method):
    records = forward_collectives(layer_of(mesh, method, "row"))
    expected_bytes = B * T * F * F32 // batch_shards(mesh)
    assert kinds(records) == ["all-reduce"], [str(r) for r in records]
    (r,) = records
    assert r.mesh_axes == ("tp",) and r.group_size == mesh.shape["tp"]
    assert (r.shape, r.dtype) == ((B // batch_shards(mesh), T, F), "float32")
    assert r.bytes == expected_bytes
    assert summarize(records) == {"all-reduce": {"count": 1, "bytes": expected_bytes}}


def test_row_reduce_scatter_shard_map_is_one_reduce_scatter(mesh):
    records = forward_collectives(layer_of(mesh, "shard_map", "row", reduce_scatter_output=True))
    tp = mesh.shape["tp"]
    assert kinds(records) == ["reduce-scatter"], [str(r) for r in records]
    (r,) = records
    assert r.mesh_axes == ("tp",) and r.group_size == tp
    assert r.shape == (B // batch_shards(mesh), T, F // tp)
    assert r.bytes == B * T * F * F32 // batch_shards(mesh) // tp


def test_row_reduce_scatter_gspmd_on_cpu_is_an_all_reduce_then_a_local_slice(mesh):
    """What XLA's CPU pipeline makes of ``reduce_scatter_output=True`` under gspmd: NOT a reduce-scatter.

    The sharding constraint P(batch, None, 'tp') on the summed output is compiled to one all-reduce of the
    whole output over tp followed by a dynamic-slice at the device's partition id: XLA:CPU runs no pass that
    fuses the pair into a reduce-scatter (as XLA:GPU's ReduceScatterCreator does). So it moves tp times the
    bytes of the shard_map reduce-scatter, and each device then keeps its 1/tp feature slice.
    """
    layer = layer_of(mesh, "gspmd", "row", reduce_scatter_output=True)
    records = forward_collectives(layer)
    assert kinds(records) == ["all-reduce"], [str(r) for r in records]
    (r,) = records
    assert r.mesh_axes == ("tp",) and r.shape == (B // batch_shards(mesh), T, F)
    assert r.bytes == B * T * F * F32 // batch_shards(mesh)
    # ... and the output is nevertheless sharded over tp on its features.
    x_spec, y_spec = layer.activation_specs((B, T, D))
    assert y_spec[-1] == "tp"
    x = jax.device_put(jnp.ones((B, T, D)), NamedSharding(mesh, x_spec))
    y = layer(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), 3)
    assert y.addressable_shards[0].data.shape == (B // batch_shards(mesh), T, F // mesh.shape["tp"])


# -- column: nothing -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["gspmd", "shard_map"])
def test_column_with_input_replicated_over_tp_has_no_collectives(mesh, method):
    layer = layer_of(mesh, method, "column")
    x_spec = layer.activation_specs((B, T, D))[0]
    assert "tp" not in jax.tree.leaves(tuple(x_spec))  # input replicated over tp
    assert forward_collectives(layer) == []


# -- collective matmul: collective-permutes --------------------------------------------------------
def test_collective_matmul_column_is_tp_minus_one_permutes(mesh):
    tp = mesh.shape["tp"]
    records = forward_collectives(layer_of(mesh, "collective_matmul", "column"))
    assert kinds(records) == ["collective-permute"] * (tp - 1), [str(r) for r in records]
    assert all(r.mesh_axes == ("tp",) for r in records)
    # Each step passes one block of input rows (T / tp of them) to the previous device of the tp ring.
    assert {r.shape for r in records} == {(B // batch_shards(mesh), T // tp, D)}
    assert {r.bytes for r in records} == {B * T * D * F32 // batch_shards(mesh) // tp}
    assert ring_shifts(records, mesh) == {tp - 1}


def test_collective_matmul_row_reduce_scatter_is_only_permutes(mesh):
    tp = mesh.shape["tp"]
    records = forward_collectives(layer_of(mesh, "collective_matmul", "row", reduce_scatter_output=True))
    assert kinds(records) == ["collective-permute"] * (tp - 1), [str(r) for r in records]
    # Each step passes a partial sum of one output-feature block to the next device of the tp ring.
    assert {r.shape for r in records} == {(B // batch_shards(mesh), T, F // tp)}
    assert {r.bytes for r in records} == {B * T * F * F32 // batch_shards(mesh) // tp}
    assert ring_shifts(records, mesh) == {1}


def test_collective_matmul_row_replicated_output_adds_one_all_gather(mesh):
    """The default row output is replicated over tp: the permute ring reduce-scatters, one all-gather follows."""
    tp = mesh.shape["tp"]
    records = forward_collectives(layer_of(mesh, "collective_matmul", "row"))
    assert kinds(records) == ["collective-permute"] * (tp - 1) + ["all-gather"], [str(r) for r in records]
    assert records[-1].mesh_axes == ("tp",) and records[-1].bytes == B * T * F * F32 // batch_shards(mesh)


# -- column -> row MLP: one all-reduce -------------------------------------------------------------
def mlp_collectives(mesh, method, hidden=4 * D):
    """Collectives of ``down(relu(up(x)))``: ColumnParallelLinear D -> hidden, RowParallelLinear hidden -> D."""
    cfg = TensorParallelConfig(mesh, matmul_method=method)
    up = ColumnParallelLinear(D, hidden, parallel_config=cfg, rngs=nnx.Rngs(1))
    down = RowParallelLinear(hidden, D, parallel_config=cfg, rngs=nnx.Rngs(2))
    return module_collectives((up, down), up.activation_specs((B, T, D))[0], mesh,
                              apply=lambda mlp, x: mlp[1](jax.nn.relu(mlp[0](x))))


@pytest.mark.parametrize("method", ["gspmd", "shard_map"])
def test_column_row_mlp_is_one_all_reduce(mesh, method):
    records = mlp_collectives(mesh, method)
    assert kinds(records) == ["all-reduce"], [str(r) for r in records]
    (r,) = records
    assert r.mesh_axes == ("tp",) and r.bytes == B * T * D * F32 // batch_shards(mesh)


def test_column_row_mlp_collective_matmul_is_two_permute_rings_and_one_all_gather(mesh):
    """No all-reduce: tp - 1 permutes gather the input rows, tp - 1 reduce-scatter the output, one all-gather."""
    tp = mesh.shape["tp"]
    records = mlp_collectives(mesh, "collective_matmul")
    assert kinds(records) == ["collective-permute"] * (2 * (tp - 1)) + ["all-gather"], [str(r) for r in records]
    assert all(r.mesh_axes == ("tp",) for r in records)
