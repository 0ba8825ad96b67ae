"""Virtual clusters: presets against published numbers, topologies and meshes against JAX / libtpu, compiling
on a TPU slice ahead of time (XLA's TPU compiler) and in a worker with N simulated CPU devices."""

import functools
import importlib.metadata
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from packaging.requirements import Requirement

from workbench.core.compile.virtual import ANALYSES, compile_on, compile_step, workers
from workbench.core.hardware.cluster import Cluster, cluster_mesh, parse_topology

ROOT = Path(__file__).resolve().parents[3]
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')


def test_presets_carry_published_chip_numbers():
    # Scaling book, "How to Think About TPUs", chip table: v5p 4.59e14 bf16 / 9.18e14 int8 FLOP/s, 96 GB HBM,
    # 2.8e12 B/s; v5e 1.97e14 / 3.94e14, 16 GB, 8.1e11; ICI table: v5p 9e10 B/s per link one way.
    v5p, v5e = Cluster.tpu("v5p:4x4x4"), Cluster.tpu("v5e:8x8")
    assert (v5p.chip.peak_flops("bf16"), v5p.chip.peak_flops("int8"), v5p.chip.hbm_capacity) == (4.59e14, 9.18e14, 96e9)
    assert v5p.level("ici").bandwidth == 9e10 and v5p.chip.hbm_bandwidth == 2.8e12
    assert (v5e.chip.peak_flops("int8"), v5e.hbm_per_device, v5e.num_devices) == (3.94e14, 16e9, 64)
    # Google Cloud v6e page: 918 TFLOP/s bf16 (the book rounds to 9.2e14), 32 GB HBM; 4 x 200 Gbps NICs per 8 chips
    v6e = Cluster.tpu("v6e:16x16", slices=2)
    assert v6e.num_devices == 512 and v6e.hbm_per_device == 32e9 and v6e.level("dcn").bandwidth == 4 * 200e9 / 8
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 1979 dense fp8, 80 GB at 3.35 TB/s; DGX H100: 8 GPUs
    # and 8 x 400 Gb/s InfiniBand per node
    h100 = Cluster.h100(nodes=8)
    assert (h100.num_devices, h100.gpus_per_node, h100.nodes) == (64, 8, 8)
    assert (h100.chip.peak_flops("bf16"), h100.chip.peak_flops("fp8"), h100.hbm_per_device) == (989e12, 1979e12, 80e9)
    assert h100.level("inter-node").bandwidth == 400e9 and h100.level("nvlink").bandwidth == 450e9
    assert Cluster.h200(nodes=2).hbm_per_device == 141e9
    with pytest.raises(ValueError, match="no published peak for 'fp8'"):
        v5p.chip.peak_flops("fp8")
    assert Cluster.h100().levels[-1].name == "nvlink"  # one node: no inter-node network


def test_wraparound_follows_the_slice_shape():
    # v4 / v5p: whole 4x4x4 cubes are tori, smaller slices are not; v5e / v6e: only a full 16-chip axis wraps
    assert all(a.wraparound for a in Cluster.tpu("v5p:4x4x8").torus)
    assert not any(a.wraparound for a in Cluster.tpu("v5p:2x2x4").torus)
    assert [a.wraparound for a in Cluster.tpu("v5e:8x16").torus] == [False, True]


@pytest.mark.parametrize("bad", ["v5p:8x8", "v5e:3x3", "v7:2x2x1", "v5litepod-16", "v5p:4x4x5", "v5p:32x32x32"])
def test_a_bad_topology_string_lists_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"unknown TPU topology.*v5p:4x4x4.*v5e:16x16"):
        Cluster.tpu(bad)


def test_topology_strings_parse():
    assert parse_topology("v5p:4x4x4") == ("v5p", (4, 4, 4))
    assert Cluster.tpu("v4:2x2x2").num_devices == 8  # one device per chip: v4's two TensorCores as a megacore


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5p:4x4x4", "v4:2x2x2", "v5e:4x8", "tpu7x:2x2x2", "tpu7x:4x4x4"])
def test_valid_mesh_shapes_agree_with_jax_on_the_topology(topology):
    """The reference: what jax's mesh_utils accepts for libtpu's devices of that topology, every 2-axis
    factorisation of the device count tried."""
    from jax.experimental import mesh_utils

    from workbench.core.hardware.cluster import tpu_devices

    cluster = Cluster.tpu(topology)
    devices = tpu_devices(cluster.topology)
    assert len(devices) == cluster.num_devices
    accepted = set()
    for a in range(1, cluster.num_devices + 1):
        if cluster.num_devices % a == 0:
            try:
                mesh_utils.create_device_mesh((a, cluster.num_devices // a), devices)
                accepted.add((a, cluster.num_devices // a))
            except (NotImplementedError, ValueError, AssertionError):
                pass
    assert set(cluster.valid_mesh_shapes(2)) == accepted


def test_a_mesh_of_another_device_count_is_refused_with_the_valid_shapes():
    cluster = Cluster.tpu("v5p:4x4x4")
    with pytest.raises(ValueError, match=r"\(8, 16\) does not map onto v5p:4x4x4: it has 128 devices.*\[\(1, 64\), "
                                         r"\(4, 16\), \(16, 4\), \(64, 1\)\]"):
        cluster_mesh(cluster, (8, 16), ("fsdp", "tp"))
    # (8, 8) splits a physical axis: create_device_mesh(..., allow_split_physical_axes=True) lays it out
    assert cluster.check_mesh_shape((8, 8)) == (8, 8) and (8, 8) not in cluster.valid_mesh_shapes(2)
    with pytest.raises(ValueError, match="has 32 devices"):
        Cluster.h100(nodes=8).check_mesh_shape((4, 8))
    assert (8, 8) in Cluster.h100(nodes=8).valid_mesh_shapes(2)  # NVSwitch: any factorisation
    # the axis sizes of a workbench mesh: each axis named or 1, and all of them the cluster's devices
    assert Cluster.h100(nodes=8).axis_sizes({"fsdp": 8, "tp": 8}) == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 8,
                                                                      "sp": 1}
    with pytest.raises(ValueError, match=r"mesh \{'fsdp': 4\} has 4 devices; 8 x 8 H100 SXM has 64"):
        Cluster.h100(nodes=8).axis_sizes({"fsdp": 4})


def test_slices_go_to_the_outermost_mesh_axes_that_can_hold_them():
    """MaxText's dcn_* x ici_* axes: walking the mesh axes in order, each takes gcd(its size, slices left).
    Hand-worked: {"fsdp": 512} on 2 slices: pp, dp take gcd(1, 2) = 1, fsdp gcd(512, 2) = 2 (dcn) x 256 (ici);
    {"dp": 2, "fsdp": 256}: dp takes both; {"dp": 2, "fsdp": 512} on 4 slices: dp gcd(2, 4) = 2, fsdp
    gcd(512, 2) = 2 x 256."""
    two, four = Cluster.tpu("v6e:16x16", slices=2), Cluster.tpu("v6e:16x16", slices=4)
    assert two.dcn_split((1, 1, 512, 1, 1, 1)) == ((1, 1, 2, 1, 1, 1), (1, 1, 256, 1, 1, 1))
    assert two.dcn_split((1, 2, 256, 1, 1, 1)) == ((1, 2, 1, 1, 1, 1), (1, 1, 256, 1, 1, 1))
    assert four.dcn_split((1, 2, 512, 1, 1, 1)) == ((1, 2, 2, 1, 1, 1), (1, 1, 256, 1, 1, 1))
    assert two.check_mesh_shape((1, 1, 512, 1, 1, 1)) == (1, 1, 512, 1, 1, 1)  # refused before: fsdp spans slices
    assert (1, 1, 512, 1, 1, 1) in two.valid_mesh_shapes(6)  # whole axes inside each slice
    assert Cluster.tpu("v6e:16x16").dcn_split((4, 64)) == ((1, 1), (4, 64))  # one slice: all ICI


@needs_libtpu
@pytest.mark.parametrize("topology, slices", [("v5p:4x4x4", 1), ("v5p:4x4x4", 2), ("v6e:4x8", 2), ("tpu7x:4x4x4", 1)])
def test_every_2_axis_shape_is_laid_out_as_jax_lays_it(topology, slices):
    """The reference: jax's own mesh_utils on libtpu's devices of the cluster, for every 2-axis factorisation of
    the device count: create_device_mesh (one slice) or create_hybrid_device_mesh (the slices given out by the
    hand rule, gcd walk) without splitting a physical axis; where that fails, with allow_split_physical_axes
    (then the shape is not among the whole-axis valid_mesh_shapes, but still maps)."""
    from jax.experimental import mesh_utils

    from workbench.core.hardware.cluster import tpu_devices

    cluster = Cluster.tpu(topology, slices=slices)
    devices = tpu_devices(cluster.topology, slices)
    whole = set()
    for a in (a for a in range(1, cluster.num_devices + 1) if cluster.num_devices % a == 0):
        shape = (a, cluster.num_devices // a)
        first = math.gcd(a, slices)
        dcn, ici = (first, slices // first), (a // first, shape[1] // (slices // first))

        build = (functools.partial(mesh_utils.create_device_mesh, shape, devices) if slices == 1 else
                 functools.partial(mesh_utils.create_hybrid_device_mesh, ici, dcn, devices))
        try:
            reference = build()
            whole.add(shape)
        except (NotImplementedError, ValueError, AssertionError):
            reference = build(allow_split_physical_axes=True)
        assert cluster.dcn_split(shape) == ((first, slices // first), ici)
        ours = cluster_mesh(cluster, shape, ("fsdp", "tp")).devices
        assert [[d.id for d in row] for row in ours] == [[d.id for d in row] for row in reference], shape
    assert set(cluster.valid_mesh_shapes(2)) == whole


@needs_libtpu
@pytest.mark.parametrize("topology, slices, sizes, dcn, ici", [
    ("v6e:16x16", 2, {"fsdp": 512}, (1, 1, 2, 1, 1, 1), (1, 1, 256, 1, 1, 1)),
    ("v6e:16x16", 1, {"fsdp": 64, "ep": 4}, None, None),
    ("v5p:4x4x8", 1, {"dp": 2, "fsdp": 8, "tp": 8}, None, None),
    ("v5p:4x4x4", 2, {"fsdp": 16, "tp": 8}, (1, 1, 2, 1, 1, 1), (1, 1, 8, 1, 8, 1)),
])
def test_six_axis_meshes_that_span_slices_or_split_axes_are_built_as_jax_builds_them(topology, slices, sizes,
                                                                                      dcn, ici):
    """The reference: mesh_utils.create_hybrid_device_mesh(ici, dcn) with the dcn / ici shapes written by hand,
    or create_device_mesh(..., allow_split_physical_axes=True), on libtpu's devices."""
    from jax.experimental import mesh_utils

    from workbench.core.hardware.cluster import tpu_devices
    from workbench.core.mesh import MESH_AXES

    cluster = Cluster.tpu(topology, slices=slices)
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    devices = tpu_devices(cluster.topology, slices)
    if slices > 1:
        reference = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        reference = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    mesh = cluster_mesh(cluster, shape, MESH_AXES)
    ids = lambda grid: [d.id for d in grid.flat]
    assert mesh.devices.shape == shape and ids(mesh.devices) == ids(reference)


def _matmul_args(mesh):
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    return w, x


def _loss(w, x):
    return jnp.sum((x @ w).astype(jnp.float32) ** 2)


@needs_libtpu
def test_tpu_compiles_ahead_of_time_with_xla_tpu_analyses():
    cluster = Cluster.tpu("v5p:4x4x4")
    mesh = cluster_mesh(cluster, (16, 4), ("fsdp", "tp"))
    assert mesh.devices.flat[0].platform == "tpu" and mesh.devices.flat[0].device_kind == "TPU v5"
    ANALYSES.clear()
    a, again = (compile_on(cluster, _loss, *_matmul_args(mesh)) for _ in range(2))
    # arguments per device: w's block 1024/16 x 4096/4 and x's 64/16 x 1024, bf16 (hand count)
    assert a.memory.argument == (64 * 1024 + 4 * 1024) * 2
    assert a.flops >= 2 * 4 * 1024 * 1024  # this device's share of x @ w, at least
    assert a.xla_seconds is not None and a.xla_seconds > 0  # XLA's own time estimate, TPU only
    kinds = {c.kind: c.mesh_axes for c in a.collectives}
    assert kinds["all-gather"] == ("fsdp",)  # w gathered over fsdp for the local rows of x
    assert {"trace_lower", "compile", "analysis"} <= set(a.seconds) and a.seconds["compile"] == a.compile_seconds
    assert again.cached and again == a  # the same program: its analysis, not a second compile


def test_gpu_cluster_compiles_in_a_reused_worker_with_its_device_count():
    cluster = Cluster.h100(nodes=2)  # 16 devices, more than this process's 8
    mesh = cluster_mesh(cluster, (4, 4), ("fsdp", "tp"))
    a = compile_on(cluster, _loss, *_matmul_args(mesh))
    assert a.memory.argument == (1024 // 4 * 4096 // 4 + 64 // 4 * 1024) * 2
    assert {c.mesh_axes for c in a.collectives if c.kind == "all-gather"} == {("fsdp",)}
    pid = workers()[16]
    ANALYSES.clear()  # else the same program's analysis comes from the cache, not the worker
    again = compile_on(cluster, _loss, *_matmul_args(cluster.mesh((4, 4), ("fsdp", "tp"))))
    assert again.memory == a.memory and not again.cached
    assert workers()[16] == pid  # reused
    assert jax.device_count() == 8  # this process is untouched
    # where the time went: this process traced, the worker lowered, compiled and analysed
    assert {"trace_lower", "worker_start", "worker_lower", "compile", "analysis", "transfer"} <= set(again.seconds)
    assert again.seconds["compile"] == again.compile_seconds


def test_the_same_program_compiled_again_returns_its_analysis_from_the_cache():
    cluster = Cluster.h100(nodes=2)
    ANALYSES.clear()
    # from one line: the program's source locations (its HLO's metadata) are part of it
    first, again = (compile_on(cluster, _loss, *_matmul_args(cluster_mesh(cluster, (4, 4), ("fsdp", "tp"))))
                    for _ in range(2))
    assert not first.cached and again.cached and set(again.seconds) == {"trace_lower", "lookup"}
    assert again == first and again.hlo_text == first.hlo_text  # the analysis as it was
    other = compile_on(cluster, _loss, *_matmul_args(cluster_mesh(cluster, (2, 8), ("fsdp", "tp"))))
    assert not other.cached  # another layout: another program
    donated = compile_on(cluster, _loss, *_matmul_args(cluster_mesh(cluster, (4, 4), ("fsdp", "tp"))),
                         donate_argnums=(1,))
    assert not donated.cached  # donation changes the program too


def test_a_worker_exits_when_its_parent_dies(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys\n"
        "from workbench.core.hardware.cluster import Cluster\n"
        "from workbench.core.compile.virtual import _worker\n"
        "print(_worker(4).process.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    for _ in range(40):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        import time

        time.sleep(0.25)
    os.kill(pid, 9)
    pytest.fail("the compile worker outlived its killed parent")


def test_compile_step_train_on_a_cpu_cluster_counts_params_and_adam_state():
    from workbench.models import CausalLM, ModelConfig, tiny_config

    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    a = compile_step(model, Cluster.cpu(16), {"fsdp": 8, "tp": 2}, batch=(16, 32))
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model.split_params()[1]))
    # donated params and AdamW moments come back as outputs: alias = params + 2 moments (+ the count), float32;
    # at most the per-device share, at least that share when each parameter splits 16 ways
    assert a.memory.alias >= 3 * n_params * 4 / 16
    assert any(c.trips == 2 for c in a.collectives)  # inside the 2-layer scan


def test_tpu_aot_extra_brings_the_libtpu_jax_names():
    """The reference: jax's own metadata, its `tpu` extra. The extra asks for that extra rather than pinning
    libtpu, so the libtpu is right for whichever jax pip picks (0.10.2 on Python 3.11, newer on 3.12+)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["tpu-aot"]]
    assert [(r.name, r.extras, str(r.specifier)) for r in extra] == [("jax", {"tpu"}, "")]
    assert pyproject["project"]["name"] == "jax-workbench"
    wanted = [Requirement(r.split(";")[0]) for r in importlib.metadata.requires("jax")
              if r.startswith("libtpu") and 'extra == "tpu"' in r]
    assert len(wanted) == 1, wanted
    if importlib.util.find_spec("libtpu") is not None:  # installed: the version this jax names
        assert importlib.metadata.version("libtpu") in wanted[0].specifier


def test_without_libtpu_a_tpu_cluster_says_what_to_install(monkeypatch):
    from workbench.core.hardware.cluster import tpu_devices

    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu raises ImportError
    tpu_devices.cache_clear()
    with pytest.raises(ImportError, match=r'pip install "jax-workbench\[tpu-aot\]"'):
        tpu_devices("v5e:2x2")
    tpu_devices.cache_clear()


def test_a_part_of_a_cluster_is_whole_nodes_or_a_box_of_the_torus_when_one_holds_it():
    """Cluster.part: GPU parts are whole nodes on the same networks; a TPU part is a box of the slice's torus where
    one holds that many chips (an axis kept whole keeps its wraparound), else the most balanced box, no
    wraparound, and its name says so."""
    gpu = Cluster.h100(nodes=5).part(32)
    assert (gpu.nodes, gpu.num_devices, gpu.levels) == (4, 32, Cluster.h100(nodes=4).levels)
    box = Cluster.tpu("v5p:16x20x28").part(4096)
    assert [a.size for a in box.torus] == [16, 16, 16] and box.topology == "v5p:16x16x16"
    assert [a.wraparound for a in box.torus] == [True, False, False]  # only the 16 kept whole closes its ring
    loose = Cluster.tpu("v5p:16x20x28").part(8192)
    assert sorted(a.size for a in loose.torus) == [16, 16, 32] and not any(a.wraparound for a in loose.torus)
    assert loose.topology is None and "not a box" in loose.name
    with pytest.raises(ValueError, match="whole nodes"):
        Cluster.h100(nodes=2).part(12)
    with pytest.raises(ValueError, match="cannot have"):
        Cluster.h100(nodes=2).part(32)
