"""Collectives read from compiled HLO, bytes per device (the roofline: tests/core/cost/test_roofline.py)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.hlo.collectives import collectives, collectives_in, summarize
from workbench.core.hlo.graph import async_windows
from workbench.core.mesh import make_mesh
from workbench.core.sharding.memory import memory_per_device

TP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
DP_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(dp=2, tp=4)


def explicit(mesh, body, in_specs, out_specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def only(records, kind):
    assert [r.kind for r in records] == [kind], [str(r) for r in records]
    return records[0]


# -- collectives in explicit (shard_map) programs ---------------------------------------------------
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)  # local block on a (dp=2, tp=4) mesh: 4 x 4


def test_psum_over_tp_is_one_all_reduce(mesh):
    fn = explicit(mesh, lambda a: jax.lax.psum(a, "tp"), P("dp", "tp"), P("dp", None))
    r = only(collectives(fn, X), "all-reduce")
    assert (r.shape, r.dtype, r.bytes) == ((4, 4), "float32", 4 * 4 * 4)
    assert r.replica_groups == TP_GROUPS and r.group_size == 4
    assert r.mesh_axes == ("tp",)
    assert "all-reduce float32[4,4] 64 B/device over ('tp',)" in str(r)


def test_psum_over_dp(mesh):
    fn = explicit(mesh, lambda a: jax.lax.psum(a, "dp"), P("dp", "tp"), P(None, "tp"))
    r = only(collectives(fn, X), "all-reduce")
    assert r.replica_groups == DP_GROUPS and r.mesh_axes == ("dp",)


def test_psum_over_both_axes(mesh):
    fn = explicit(mesh, lambda a: jax.lax.psum(a, ("dp", "tp")), P("dp", "tp"), P())
    r = only(collectives(fn, X), "all-reduce")
    assert r.replica_groups == (tuple(range(8)),) and r.mesh_axes == ("dp", "tp")


def test_psum_scatter_is_reduce_scatter(mesh):
    body = lambda a: jax.lax.psum_scatter(a, "tp", scatter_dimension=1, tiled=True)
    r = only(collectives(explicit(mesh, body, P("dp", None), P("dp", "tp")), X), "reduce-scatter")
    assert (r.shape, r.bytes, r.mesh_axes) == ((4, 4), 64, ("tp",))  # local (4, 16) scattered 4 ways


def test_all_gather(mesh):
    body = lambda a: jax.lax.all_gather(a, "tp", axis=1, tiled=True)
    r = only(collectives(explicit(mesh, body, P("dp", "tp"), P("dp", None)), X), "all-gather")
    assert (r.shape, r.bytes, r.mesh_axes) == ((4, 16), 4 * 16 * 4, ("tp",))


def test_ppermute_is_collective_permute_with_pairs(mesh):
    body = lambda a: jax.lax.ppermute(a, "tp", [(i, (i + 1) % 4) for i in range(4)])
    r = only(collectives(explicit(mesh, body, P("dp", "tp"), P("dp", "tp")), X), "collective-permute")
    ring = [(i, (i + 1) % 4) for i in range(4)]
    assert r.source_target_pairs == tuple(ring + [(a + 4, b + 4) for a, b in ring])
    assert r.mesh_axes == ("tp",) and r.bytes == 64 and r.replica_groups == ()


def test_all_to_all(mesh):
    body = lambda a: jax.lax.all_to_all(a, "tp", 0, 1, tiled=True)
    r = only(collectives(explicit(mesh, body, P("dp", "tp"), P("dp", "tp")), X), "all-to-all")
    assert r.mesh_axes == ("tp",) and r.bytes == 64  # CPU splits it into a tuple of 4 pieces of 16 B
    assert r.shape == ((1, 4),) * 4


def test_gspmd_matmul_all_reduces_over_tp(mesh):
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("tp", None)))
    r = only(collectives(jnp.dot, x, w), "all-reduce")
    assert (r.shape, r.bytes, r.mesh_axes, r.replica_groups) == ((8, 32), 8 * 32 * 4, ("tp",), TP_GROUPS)


def test_local_program_has_none(mesh):
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("dp", "tp")))
    assert collectives(lambda a: jnp.sin(a) * 2, x) == []
    assert summarize([]) == {}


def test_hlo_ids_are_mesh_positions_not_device_ids():
    # Devices ordered across rows: mesh position 1 holds device 4. The tp groups in HLO are still
    # {0,1,2,3},{4,5,6,7}: positions in mesh.devices.flat, which is what mesh_axes relies on.
    devices = np.array(jax.devices())[[0, 4, 1, 5, 2, 6, 3, 7]]
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2, devices=list(devices))
    fn = explicit(mesh, lambda a: jax.lax.psum(a, "tp"), P("dp", "tp"), P("dp", None))
    r = only(collectives(fn, X), "all-reduce")
    assert r.replica_groups == TP_GROUPS and r.mesh_axes == ("tp",)
    np.testing.assert_allclose(fn(X), X.reshape(8, 4, 4).sum(1))  # the program does sum over tp


def test_jitted_lowered_compiled_kwargs_and_reserved_mesh(mesh):
    fn = explicit(mesh, lambda a, b: jax.lax.psum(a * b, "tp"), (P("dp", "tp"), P("dp", "tp")), P("dp", None))
    f = lambda a, *, b: fn(a, b)
    compiled = jax.jit(f).lower(X, b=X).compile()
    for target in (f, jax.jit(f), jax.jit(f).lower(X, b=X), compiled):
        records = collectives(target, X, b=X, mesh=mesh)
        assert [(r.kind, r.mesh_axes) for r in records] == [("all-reduce", ("tp",))]
    with pytest.raises(ValueError, match="runs on 8 devices but the mesh has 4"):
        collectives(compiled, mesh=make_mesh(fsdp=4, devices=jax.devices()[:4]))


def test_summarize(mesh):
    body = lambda a: jax.lax.psum(jax.lax.all_gather(a, "tp", axis=1, tiled=True), "dp")
    records = collectives(explicit(mesh, body, P("dp", "tp"), P(None, None)), X)
    assert summarize(records + records) == {"all-gather": {"count": 2, "bytes": 512},
                                               "all-reduce": {"count": 2, "bytes": 512}}


# -- HLO text forms that this CPU build does not print, written as XLA prints them -------------------
HLO = """HloModule m, is_scheduled=true, num_partitions=8
ENTRY %main {
  %ag = (bf16[4,2]{1,0}, bf16[4,8]{1,0}) all-gather-start(%p), replica_groups=[2,4]<=[8], dimensions={1}
  %ag-done = bf16[4,8]{1,0} all-gather-done(%ag)
  %ar = (f32[3]{0}, s32[]) all-reduce(%a, %b), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ars = f32[16]{0} all-reduce-start(%c), channel_id=3, replica_groups={}, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %cp = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(%d), source_target_pairs={{0,4},{4,0}}
  %cpd = f32[2]{0} collective-permute-done(%cp)
  %rs = f32[2]{0} reduce-scatter(%e), replica_groups=mesh['a'=8] {'a':(1)2}, dimensions={0}, to_apply=%add
  %rs2 = f32[2]{0} reduce-scatter(%e), replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}, dimensions={0}
  ROOT %a2a = (f32[1]{0}, /*index=1*/f32[1]{0}) all-to-all(%f, %g), replica_groups=mesh['x'=2,'y'=4], \
device_ids=([4,2]T(1,0)) {'x'}
}
"""


def test_collectives_in_reads_every_form(mesh):
    ag, ar, ars, cp, rs, rs2, a2a = collectives_in(HLO, mesh)
    assert (ag.kind, ag.asynchronous, ag.shape, ag.dtype, ag.bytes) == ("all-gather", True, (4, 8), "bfloat16", 64)
    assert ag.replica_groups == TP_GROUPS and ag.mesh_axes == ("tp",)
    # [4,2]<=[2,4]T(1,0): iota(8).reshape(2,4).T, read as 4 groups of 2.
    assert ar.replica_groups == DP_GROUPS and ar.mesh_axes == ("dp",)
    assert (ar.shape, ar.dtype, ar.bytes) == (((3,), ()), "float32,int32", 16)
    assert ars.replica_groups == (tuple(range(8)),) and ars.asynchronous and ars.bytes == 64
    assert cp.source_target_pairs == ((0, 4), (4, 0)) and cp.bytes == 8 and cp.mesh_axes == ("dp",)
    # XLA's examples for a mesh <"a"=8>: {a:(1)2} splits it [1,2,4] and groups along the 2;
    # {a:(1)2, a:(4)2} splits it [2,2,2] and groups along the first and last.
    assert rs.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert rs2.replica_groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    # device_ids [4,2]T(1,0) laid out as x=2, y=4 is [[0,2,4,6],[1,3,5,7]]; groups vary x.
    assert a2a.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and a2a.mesh_axes == ("tp",)
    assert summarize([ag, ar, ars]) == {"all-gather": {"count": 1, "bytes": 64},
                                           "all-reduce": {"count": 2, "bytes": 80}}


def test_collectives_in_without_mesh_and_with_a_wrong_one():
    assert all(r.mesh_axes is None for r in collectives_in(HLO))
    with pytest.raises(ValueError, match="runs on 8 devices"):
        collectives_in(HLO, make_mesh(fsdp=2, devices=jax.devices()[:2]))


# -- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [P(), P("dp", "tp"), P(None, "tp"), P("dp", None), P(("dp", "tp"), None)])
def test_memory_matches_numpy_and_device_put(mesh, spec):
    shape, sharding = (16, 8), NamedSharding(mesh, spec)
    ways = np.prod([mesh.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e)])
    mem = memory_per_device(jax.ShapeDtypeStruct(shape, jnp.float32), sharding)
    assert mem.per_device == {d.id: 16 * 8 * 4 // ways for d in mesh.devices.flat}
    assert (mem.logical, mem.total, mem.max) == (512, 8 * 512 // ways, 512 // ways)
    placed = jax.device_put(np.zeros(shape, np.float32), sharding)
    assert mem.per_device == {s.device.id: s.data.nbytes for s in placed.addressable_shards}
    assert memory_per_device(placed).per_device == mem.per_device  # arrays carry .sharding


def test_memory_of_a_tree(mesh):
    tree = {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), "b": jax.ShapeDtypeStruct((32,), jnp.float32),
            "layers": [jax.ShapeDtypeStruct((4, 8), jnp.int8)] * 2}
    shardings = {"w": NamedSharding(mesh, P("dp", "tp")), "b": NamedSharding(mesh, P("tp")),
                 "layers": NamedSharding(mesh, P())}  # a prefix: one sharding for the whole list
    mem = memory_per_device(tree, shardings)
    assert set(mem.per_device.values()) == {64 * 32 * 2 // 8 + 32 * 4 // 4 + 2 * 4 * 8}
    assert mem.logical == 64 * 32 * 2 + 32 * 4 + 2 * 32
    same = memory_per_device(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                             tree, {**shardings, "layers": [shardings["layers"]] * 2}))
    assert same == mem
    with pytest.raises(TypeError, match="no sharding"):
        memory_per_device(tree)


def test_collectives_in_loops_carry_their_trip_counts(mesh):
    def body(a):
        def hop(_, x):
            return jax.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)])

        def outer(_, x):
            return jax.lax.fori_loop(0, 3, hop, x)

        return jax.lax.fori_loop(0, 2, outer, a)

    records = collectives(explicit(mesh, body, P("dp", "tp"), P("dp", "tp")), X)
    permutes = [r for r in records if r.kind == "collective-permute"]
    assert permutes and all(r.trips == 6 for r in permutes)  # 3 hops in each of 2 outer trips
    once = summarize(records)["collective-permute"]
    counted = summarize(records, count_trips=True)["collective-permute"]
    assert counted == {"count": once["count"], "runs": 6 * once["count"], "bytes": 6 * once["bytes"]}


def test_matmul_flops_count_loop_bodies_once_per_trip():
    """Hand counts: a scan of 3 matmuls (8 x 64 @ 64 x 64), and a scan of 2 such scans then a 64 x 10 head.
    XLA's cost_analysis() counts a loop body once (one iteration's 65,536 FLOPs here)."""
    from workbench.core.hlo.graph import matmul_flops

    def scanned(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    def nested(ws, x):
        inner = lambda x, w2: (jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w2)[0], None)
        return jax.lax.scan(inner, x, ws)[0] @ jnp.ones((64, 10))

    one = jax.jit(scanned).lower(jnp.ones((3, 64, 64)), jnp.ones((8, 64))).compile()
    assert matmul_flops(one.as_text()) == 2 * 8 * 64 * 64 * 3
    two = jax.jit(nested).lower(jnp.ones((2, 3, 64, 64)), jnp.ones((8, 64))).compile()
    assert matmul_flops(two.as_text()) == 2 * 8 * 64 * 64 * 6 + 2 * 8 * 64 * 10


_SCHEDULED = """HloModule m, is_scheduled=true

%fused_dot (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,16], b: f32[16,4], c: f32[8,4]) -> f32[16,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %c = f32[8,4]{1,0} parameter(2)
  %cp-start = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%c), source_target_pairs={{0,1}}
  %copy-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[]) copy-start(%a)
  %fusion = f32[8,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %cp-done = f32[8,4]{1,0} collective-permute-done(%cp-start)
  %copy-done = f32[8,16]{1,0} copy-done(%copy-start)
  %add = f32[8,4]{1,0} add(%fusion, %cp-done)
  %ag-start = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%add), replica_groups={{0,1}}, dimensions={0}
  ROOT %ag-done = f32[16,4]{1,0} all-gather-done(%ag-start)
}
"""


def test_async_windows_read_what_the_schedule_puts_in_flight():
    """A hand-written scheduled module: the permute has a dot (2 * 8 * 4 * 16 FLOPs, in a fusion) and the start of a
    memory copy between its start and done, the all-gather nothing; the copy is no collective."""
    windows = {w.kind: w for w in async_windows(_SCHEDULED)}
    assert set(windows) == {"collective-permute", "all-gather"}
    permute, gather = windows["collective-permute"], windows["all-gather"]
    assert (permute.between, permute.matmul_flops, permute.overlapped) == (2, 2 * 8 * 4 * 16, True)
    assert (gather.between, gather.matmul_flops, gather.overlapped) == (0, 0.0, False)
    assert permute.runs == gather.runs == 1 and permute.computation == "main"
    with pytest.raises(ValueError, match="not scheduled"):
        async_windows(_SCHEDULED.replace(", is_scheduled=true", ""))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu missing (make test installs it)")
def test_xla_tpu_runs_a_collective_matmuls_blocks_while_its_permutes_travel():
    """The shard_map collective matmul (workbench.core._collective_matmul: each step's ppermute independent of
    that step's matmul), compiled by XLA:TPU: its 3 permutes are asynchronous, each with a matmul in flight."""
    from jax.sharding import PartitionSpec as P

    from workbench.core._collective_matmul import allgather_matmul
    from workbench.core.compile.virtual import compile_on
    from workbench.core.hardware.cluster import Cluster, cluster_mesh

    cluster = Cluster.tpu("v5p:2x2x1")
    mesh = cluster_mesh(cluster, (4,), ("tp",))
    fn = jax.shard_map(lambda x, w: allgather_matmul(x, w, "tp", 4), mesh=mesh, in_specs=(P("tp"), P()),
                       out_specs=P(), check_vma=False)  # every device ends with every row
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    w = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    windows = async_windows(compile_on(cluster, fn, x, w).hlo_text)
    permutes = [w for w in windows if w.kind == "collective-permute"]
    assert len(permutes) == 3 and all(w.overlapped for w in permutes), windows
    assert all(w.matmul_flops == 2 * 256 * 512 * 2048 for w in permutes)  # one block: 256 rows of x @ w
