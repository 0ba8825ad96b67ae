"""sharding_layout and mesh_grid, checked against JAX's own truth: NamedSharding and device_put."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import fit_spec
from workbench.core.mesh import MESH_AXES, make_mesh, mesh_factorizations
from workbench.core.sharding.blocks import (
    axis_size_choices,
    format_spec,
    mesh_grid,
    parse_spec,
    reshape_mesh,
    set_axis_size,
    sharding_layout,
)

_PERMUTED = [jax.devices()[i] for i in (3, 0, 6, 5, 1, 7, 2, 4)]
MESHES = {
    "dp2_tp4": make_mesh(dp=2, tp=4),
    "dp2_fsdp2_tp2": make_mesh(dp=2, fsdp=2, tp=2),
    "fsdp8": make_mesh(),
    "xyz": jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Auto,) * 3),
    "permuted": jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2, devices=_PERMUTED),
}


def jax_truth(shape, spec, mesh):
    """NamedSharding's map, keyed by device id, slices normalised to start:stop."""
    s = NamedSharding(mesh, spec)
    return {d.id: tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(idx, shape, strict=True))
            for d, idx in s.devices_indices_map(shape).items()}, s.shard_shape(shape)


@st.composite
def spec_and_shape(draw):
    """A mesh, a random valid spec of rank 1-4 over it, and a shape it divides."""
    mesh = MESHES[draw(st.sampled_from(sorted(MESHES)))]
    sizes = dict(mesh.shape)
    rank = draw(st.integers(1, 4))
    free = list(mesh.axis_names)
    entries, shape = [], []
    for _ in range(rank):
        k = draw(st.integers(0, min(2, len(free))))
        axes = draw(st.permutations(free))[:k] if k else []
        for a in axes:
            free.remove(a)
        entries.append(None if not axes else axes[0] if len(axes) == 1 and draw(st.booleans()) else tuple(axes))
        shape.append(math.prod(sizes[a] for a in axes) * draw(st.integers(1, 3)))
    n_trailing_none = draw(st.integers(0, rank))  # specs shorter than the rank are padded with None
    while n_trailing_none and entries and entries[-1] is None:
        entries.pop()
        n_trailing_none -= 1
    return mesh, P(*entries), tuple(shape)


@settings(max_examples=150, deadline=None)
@given(spec_and_shape())
def test_layout_matches_named_sharding(case):
    mesh, spec, shape = case
    lay = sharding_layout(shape, jnp.float32, spec, mesh)
    indices, shard_shape = jax_truth(shape, spec, mesh)
    assert lay.devices_indices_map() == indices
    assert lay.shard_shape == tuple(shard_shape)
    assert lay.bytes_per_device == math.prod(shard_shape) * 4
    groups: dict = {}
    for d, idx in indices.items():
        groups.setdefault(tuple((s.start, s.stop) for s in idx), set()).add(d)
    assert sorted(tuple(sorted(g)) for g in lay.replica_groups) == sorted(tuple(sorted(g)) for g in groups.values())
    assert lay.replication * math.prod(lay.blocks_per_dim) == mesh.size


@pytest.mark.parametrize("mesh_name, spec, shape", [
    ("dp2_tp4", P("dp", "tp"), (4, 8)),
    ("dp2_tp4", P(None, ("dp", "tp")), (3, 16)),
    ("dp2_fsdp2_tp2", P(("tp", "dp"), None, "fsdp"), (4, 3, 2)),
    ("dp2_fsdp2_tp2", P(None, "fsdp", None, ("dp", "tp")), (2, 2, 3, 4)),
    ("xyz", P("z", ("y", "x")), (2, 4)),
    ("permuted", P("b", "a"), (8, 2)),
    ("permuted", P(None, "b"), (5, 4)),
    ("fsdp8", P(), (2, 3)),
])
def test_layout_matches_device_put_shards(mesh_name, spec, shape):
    mesh = MESHES[mesh_name]
    x = jax.device_put(np.arange(math.prod(shape), dtype=np.int32).reshape(shape), NamedSharding(mesh, spec))
    lay = sharding_layout(x)  # from the live array
    full = np.asarray(x)
    for shard in x.addressable_shards:
        want = lay.devices_indices_map()[shard.device.id]
        assert tuple(slice(*s.indices(n)[:2]) for s, n in zip(shard.index, shape, strict=True)) == want
        np.testing.assert_array_equal(np.asarray(shard.data), full[want])
        assert shard.data.nbytes == lay.bytes_per_device
    assert lay.dtype == np.int32 and lay.logical_bytes == full.nbytes


def test_abstract_mesh_numbers_devices_by_position():
    mesh = make_mesh(dp=2, tp=4)
    concrete = sharding_layout((4, 8), "bfloat16", P("dp", "tp"), mesh)
    abstract = sharding_layout((4, 8), "bfloat16", P("dp", "tp"), AbstractMesh((1, 2, 1, 1, 4, 1), MESH_AXES))
    by_position = {pos: concrete.device_blocks[d.id] for pos, d in enumerate(mesh.devices.flat)}
    assert abstract.device_blocks == by_position
    assert abstract.bytes_per_device == concrete.bytes_per_device == 2 * 2 * 2


@pytest.mark.parametrize("spec, rank, mesh_name, expected", [
    (P("fsdp", "tp"), 2, "dp2_fsdp2_tp2", "A[I_fsdp, J_tp]"),
    (P(("fsdp", "sp"), None), 2, "dp2_fsdp2_tp2", "A[I_{fsdp,sp}, J]"),
    (P("x", ("y", "z")), 2, "xyz", "A[I_x, J_yz]"),
    (P(None, None, "dp"), 3, "dp2_fsdp2_tp2", "A[I, J, K_dp]"),
    (P(), 4, "fsdp8", "A[I, J, K, L]"),
])
def test_notation(spec, rank, mesh_name, expected):
    lay = sharding_layout((8,) * rank, "float32", spec, MESHES[mesh_name])
    assert lay.notation() == expected
    assert lay.notation("W").startswith("W[")


def test_shard_shape_bytes_and_replication_by_hand():
    mesh = make_mesh(dp=2, tp=4)
    lay = sharding_layout((1024, 4096), "bfloat16", "tp", mesh)  # rows split 4 ways, copied over dp
    assert lay.notation() == "A[I_tp, J]"
    assert lay.shard_shape == (256, 4096)
    assert lay.bytes_per_device == 256 * 4096 * 2
    assert lay.replication == 2 and lay.replicated_axes == ("dp",)
    assert lay.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_fit_drops_what_fit_spec_drops():
    mesh = make_mesh(dp=2, tp=4)
    lay = sharding_layout((6, 8), "float32", P(("dp", "tp"), "tp"), mesh, fit=True)
    assert lay.spec == fit_spec(P(("dp", "tp"), "tp"), (6, 8), mesh) == P("dp", "tp")
    assert lay.shard_shape == (3, 2)


@pytest.mark.parametrize("spec, shape, message", [
    (P("tpp"), (8,), r"unknown mesh axis 'tpp' \(did you mean 'tp'\?\); the mesh has axes pp, dp, fsdp, ep, tp, sp"),
    (P("tp", "tp"), (8, 8), "'tp' shards both dim 0 and dim 1"),
    (P(("dp", "tp")), (6,), r"dim 0 has size 6, not divisible by dp×tp = 8 \(strict check.*fit_spec.*gives "
                            r"P\('dp',\)"),
    (P("dp", None, "tp"), (4, 4), "3 entries but the array has 2 dimension"),
    (P(P.UNCONSTRAINED), (4,), "UNCONSTRAINED"),
    ("fsdp, (", (4, 4), "cannot read 'fsdp, \\(' as a PartitionSpec"),
])
def test_invalid_specs_say_what_to_change(spec, shape, message):
    with pytest.raises(ValueError, match=message):
        sharding_layout(shape, "float32", spec, MESHES["dp2_tp4"])


def test_input_errors():
    mesh = MESHES["dp2_tp4"]
    with pytest.raises(TypeError, match="needs a mesh"):
        sharding_layout((4,), "float32", P("dp"))
    with pytest.raises(TypeError, match="not a NamedSharding"):
        sharding_layout(jnp.ones(4))
    with pytest.raises(TypeError, match="needs a dtype"):
        sharding_layout((4,), None, P("dp"), mesh)
    with pytest.raises(ValueError, match="brings its own mesh"):
        sharding_layout((4,), "float32", NamedSharding(mesh, P("dp")), MESHES["fsdp8"])
    ns = sharding_layout((4,), "float32", NamedSharding(mesh, P("dp")))
    assert ns.mesh == mesh and ns.named_sharding() == NamedSharding(mesh, P("dp"))


@pytest.mark.parametrize("text, spec", [
    ("fsdp, tp", P("fsdp", "tp")),
    ("(fsdp, sp), None", P(("fsdp", "sp"), None)),
    ("[fsdp,sp] , _", P(("fsdp", "sp"), None)),
    ("P('dp', None, 'tp')", P("dp", None, "tp")),
    ("PartitionSpec(\"dp\")", P("dp")),
    ("(tp,), None", P("tp", None)),
    ("", P()),
    ("  None  ", P(None)),
])
def test_parse_spec(text, spec):
    assert parse_spec(text) == spec
    assert parse_spec(format_spec(spec)) == spec


@pytest.mark.parametrize("text, message", [
    ("fsdp tp", "expected ',' before 'tp'"),
    ("((dp, tp), sp)", "a group holds mesh axis names only"),
    ("3", "unexpected '3'"),
    ("fsdp;tp", "unexpected ';'"),
    ("(fsdp, sp", "a group is not closed"),
    ("'fsdp", "unclosed quote"),
])
def test_parse_spec_rejects(text, message):
    with pytest.raises(ValueError, match=f"cannot read .* as a PartitionSpec: {message}"):
        parse_spec(text)


def test_panels_facet_leading_dims():
    mesh = MESHES["dp2_fsdp2_tp2"]
    lay = sharding_layout((4, 6, 8, 2), "float32", P("dp", None, ("fsdp", "tp")), mesh)
    panels = lay.panels()
    assert len(panels) == 2  # dim 0 split in 2, dim 1 not split
    assert [p.title for p in panels] == [(("I", "0:2"),), (("I", "2:4"),)]
    assert all(len(p.cells) == 4 and len(p.cells[0]) == 1 for p in panels)  # K: 4 blocks, L: 1
    seen = {c.block: c for p in panels for row in p.cells for c in row}
    assert set(seen) == set(lay.block_devices)
    for cell in seen.values():
        assert cell.device_ids == lay.block_devices[cell.block]
        assert cell.index == lay.index(cell.block) and cell.replicas == lay.replication == 1
    one_d = sharding_layout((8,), "float32", P("tp"), mesh).panels()
    assert len(one_d) == 1 and len(one_d[0].cells) == 1 and len(one_d[0].cells[0]) == 2
    assert one_d[0].cells[0][0].replicas == 4
    scalar = sharding_layout((), "float32", P(), mesh)
    assert scalar.notation() == "A[]" and scalar.panels()[0].cells[0][0].device_ids == tuple(range(8))


# ------------------------------------------------------------------------------------------- mesh grid
def test_mesh_grid_two_axes():
    mesh = make_mesh(dp=2, tp=4)
    grid = mesh_grid(mesh)
    assert (grid.rows, grid.cols, grid.facet_axes, grid.shape) == ("dp", "tp", (), (1, 2, 4))
    for cell in grid.cells:
        index = tuple(cell.coord(a) for a in mesh.axis_names)
        assert mesh.devices[index].id == cell.device_id
        assert cell.platform == "cpu" and cell.process_index == 0
    assert sorted(c.device_id for c in grid.cells) == list(range(8))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_mesh_grid_any_mesh(mesh_name):
    mesh = MESHES[mesh_name]
    grid = mesh_grid(mesh)
    assert len(grid.cells) == mesh.size
    assert sorted(c.device_id for c in grid.cells) == sorted(d.id for d in mesh.devices.flat)
    for cell in grid.cells:
        assert mesh.devices.flat[cell.position].id == cell.device_id
        assert mesh.devices[tuple(cell.coord(a) for a in mesh.axis_names)].id == cell.device_id
    big = [a for a, n in mesh.shape.items() if n > 1]
    assert len(grid.facets) == math.prod(mesh.shape[a] for a in grid.facet_axes)
    assert set(grid.facet_axes) | {grid.rows, grid.cols} - {None} == set(big)


def test_mesh_grid_facets_rows_cols_and_collapse():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    grid = mesh_grid(mesh)
    assert (grid.rows, grid.cols, grid.facet_axes) == ("fsdp", "tp", ("dp",))
    assert [f.title for f in grid.facets] == ["dp=0", "dp=1"]
    assert all(c.coord("dp") == 1 for row in grid.facets[1].cells for c in row)
    chosen = mesh_grid(mesh, rows="tp", cols="dp")
    assert chosen.facet_axes == ("fsdp",) and chosen.shape == (2, 2, 2)
    single = mesh_grid(make_mesh(devices=jax.devices()[:1]))
    assert single.shape == (1, 1, 1) and (single.rows, single.cols) == (None, None)
    line = mesh_grid(make_mesh(fsdp=1, sp=-1))
    assert (line.rows, line.cols, line.shape) == (None, "sp", (1, 1, 8))
    abstract = mesh_grid(AbstractMesh((2, 2, 2), ("a", "b", "c")))
    assert [c.device_id for c in abstract.cells] == list(range(8)) and abstract.cells[0].platform == "abstract"
    with pytest.raises(ValueError, match="mesh has axes"):
        mesh_grid(mesh, rows="model")
    with pytest.raises(ValueError, match="both 'tp'"):
        mesh_grid(mesh, rows="tp", cols="tp")


# ------------------------------------------------------------------------------------------ mesh shapes
@pytest.mark.parametrize("n", [8, 12])
def test_axis_choices_keep_a_valid_factorization(n):
    shapes = mesh_factorizations(n)
    valid = {tuple(s.values()) for s in shapes}
    for sizes, axis, rest in itertools.product(shapes, MESH_AXES, MESH_AXES):
        choices = axis_size_choices(n, sizes, axis, rest)
        others = [a for a in MESH_AXES if a not in (axis, rest)]
        expected = sorted({s[axis] for s in shapes if all(s[a] == sizes[a] for a in others)})
        assert choices == expected
        assert sizes[axis] in choices
        if axis != rest:
            for size in choices:
                new = set_axis_size(n, sizes, axis, size, rest)
                assert tuple(new.values()) in valid and new[axis] == size
                assert all(new[a] == sizes[a] for a in others)


def test_set_axis_size_errors():
    sizes = {"dp": 2, "fsdp": 4, "tp": 1}
    with pytest.raises(ValueError, match=r"tp=3 leaves no valid mesh.*tp may be 1, 2, 4"):
        set_axis_size(8, sizes, "tp", 3, "fsdp")
    with pytest.raises(ValueError, match="takes the rest"):
        set_axis_size(8, sizes, "fsdp", 2, "fsdp")


def test_reshape_mesh_keeps_devices_names_and_types():
    mesh = make_mesh(dp=2, tp=4)
    new = reshape_mesh(mesh, {"fsdp": 2, "tp": 2, "sp": 2})
    assert dict(new.shape) == {"pp": 1, "dp": 1, "fsdp": 2, "ep": 1, "tp": 2, "sp": 2}
    assert new == make_mesh(fsdp=2, tp=2, sp=2)
    assert reshape_mesh(mesh, dict(mesh.shape)) == mesh
    explicit = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2, devices=_PERMUTED)
    other = reshape_mesh(explicit, {"x": 4, "y": 2})
    assert other.axis_names == ("x", "y") and tuple(other.axis_types) == (AxisType.Explicit,) * 2
    assert sorted(d.id for d in other.devices.flat) == list(range(8))
    with pytest.raises(ValueError, match="multiply to the device count"):
        reshape_mesh(mesh, {"dp": 3})
    with pytest.raises(ValueError, match="unknown axes"):
        reshape_mesh(mesh, {"model": 8})
