"""The clusters people plan on in 2026: TPU7x (Ironwood), DGX B200 and GB200 NVL72, held against their datasheets,
against libtpu's own description of an Ironwood slice, and their collectives against counts by hand in the scaling
book's forms (https://jax-ml.github.io/scaling-book/gpus/, "AllToAlls"; /sharding/, all-gather on a ring)."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.compile.steps import full_mesh_shape
from workbench.core.compile.virtual import TPU_HBM_ONLY, compile_on, compile_step
from workbench.core.cost.ledger import ledger, libtpu_version
from workbench.core.hardware.calibration import calibration
from workbench.core.hardware.cluster import DIE_TO_DIE, Cluster, cluster_mesh, tpu_devices
from workbench.core.hardware.network import collective_time, span, transfer
from workbench.core.mesh import MESH_AXES
from workbench.core.sharding.export import _cluster_code, cluster_from_spec, cluster_spec
from workbench.core.views.explore import Layout
from workbench.models import CausalLM, ModelConfig, tiny_config

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
GiB = 2**30


def test_the_new_chips_carry_their_datasheet_numbers():
    # Google Cloud TPU7x page: 2,307 / 4,614 TFLOP/s bf16 / fp8 a chip, 192 GiB of HBM a chip, two TensorCores
    # (JAX devices) a chip; Google's announcement: 7.37 TB/s of HBM
    ironwood = Cluster.tpu("tpu7x:4x4x4")
    assert ironwood.num_devices == 128 and ironwood.devices_per_chip == 2
    assert (ironwood.chip.peak_flops("bf16"), ironwood.chip.peak_flops("fp8")) == (2.307e15, 4.614e15)
    assert ironwood.hbm_per_device == 96 * GiB and ironwood.chip.hbm_bandwidth == 7.37e12
    assert all(a.wraparound for a in ironwood.torus)  # a whole 4x4x4 cube: a torus, as v5p's
    assert not any(a.wraparound for a in Cluster.tpu("tpu7x:2x2x1").torus)
    # DGX B200: 1,440 GB over 8 GPUs at 64 TB/s; 4.5 PFLOP/s fp8 and 2.25 bf16 dense (half the sparse figures)
    b200 = Cluster.b200(nodes=4)
    assert (b200.num_devices, b200.gpus_per_node, b200.hbm_per_device) == (32, 8, 180e9)
    assert (b200.chip.peak_flops("bf16"), b200.chip.peak_flops("fp8"), b200.chip.peak_flops("fp4")) == (
        2.25e15, 4.5e15, 9e15)
    assert b200.chip.hbm_bandwidth * 8 == 64e12 and b200.level("inter-node").bandwidth == 400e9
    # GB200 NVL72: 72 GPUs on one NVLink domain at 1.8 TB/s each (130 TB/s), 13.4 TB and 576 TB/s of HBM a rack,
    # 360 / 720 PFLOP/s bf16 / fp8 a rack with sparsity; one 400 Gb/s NIC per GPU
    nvl72 = Cluster.gb200_nvl72(racks=2)
    assert (nvl72.num_devices, nvl72.gpus_per_node, nvl72.nodes) == (144, 72, 2)
    assert 72 * 2 * nvl72.level("nvlink").bandwidth == pytest.approx(130e12, rel=0.01)
    assert 72 * nvl72.chip.hbm_capacity == pytest.approx(13.4e12, rel=0.01)
    assert 72 * nvl72.chip.hbm_bandwidth == 576e12
    assert 72 * 2 * nvl72.chip.peak_flops("fp8") == 720e15 and 72 * 2 * nvl72.chip.peak_flops("bf16") == 360e15
    assert nvl72.level("inter-node").bandwidth == 72 * 400e9 / 8


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="a GB200 NVL72 rack has 72 GPUs"):
        Cluster.gb200_nvl72(gpus_per_rack=80)
    with pytest.raises(ValueError, match="tpu7x:AxBxC"):
        Cluster.tpu("tpu7x:3x3x3")
    with pytest.raises(ValueError, match="whole nodes"):
        Cluster.gb200_nvl72(racks=2).part(100)


def test_an_all_to_all_inside_one_nvl72_rack_against_eight_dgx_nodes():
    """GPUS, "AllToAlls": each of N GPUs holds S and sends S / N to every other. Inside one NVLink domain the
    (N - 1) S / N leave over each GPU's NVLink (900 GB/s a direction on NVLink 5); over M nodes of 8, the
    (N - 8) S / N bound for other nodes share the node's 8 NICs of 50 GB/s each: per GPU 50 GB/s. 64 GPUs, S = 1 GiB
    (expert parallelism's dispatch): 1.17 ms in a rack (64 of its 72 GPUs), 18.8 ms over 8 DGX B200, 16x."""
    s = GiB
    rack = Cluster.gb200_nvl72(racks=1, gpus_per_rack=64)
    nodes = Cluster.b200(nodes=8)
    in_rack = transfer("all-to-all", s, ("ep",), {"ep": 64}, rack)
    over_nodes = transfer("all-to-all", s, ("ep",), {"ep": 64}, nodes)
    assert (in_rack.level, over_nodes.level) == ("nvlink", "inter-node")
    assert in_rack.seconds == pytest.approx(63 / 64 * s / 900e9)
    assert over_nodes.seconds == pytest.approx(56 / 64 * s / (400e9 / 8))
    assert over_nodes.seconds / in_rack.seconds == pytest.approx(16.0, rel=0.02)
    # two racks: the 8 GPUs of the other rack are reached over that GPU's own 400 Gb/s NIC
    two = Cluster.gb200_nvl72(racks=2)
    t = transfer("all-to-all", s, ("ep",), {"dp": 18, "ep": 8}, two)
    assert t.level == "nvlink" and t.seconds == pytest.approx(7 / 8 * s / 900e9)  # 8 consecutive GPUs: one rack
    across = transfer("all-to-all", s, ("ep",), {"ep": 144}, two)
    assert across.level == "inter-node" and across.seconds == pytest.approx(72 / 144 * s / 50e9)


def test_tensor_parallelism_up_to_the_rack_stays_on_nvlink():
    """An all-gather of V over tp = 16: on GB200 NVL72 a ring inside the NVLink domain, 15/16 V / 900 GB/s; on
    DGX B200 the same 16 GPUs span two nodes and the inter-node NICs bound it: the book's two-level form, the node's
    (M - 1) / M = 1/2 of V over the 8 GPUs' share of its network, 8 x 50 GB/s."""
    v = 256 * 2**20
    rack = collective_time("all-gather", v, ("tp",), {"fsdp": 4, "tp": 16}, Cluster.gb200_nvl72(gpus_per_rack=64))
    dgx = transfer("all-gather", v, ("tp",), {"fsdp": 4, "tp": 16}, Cluster.b200(nodes=8))
    assert rack == pytest.approx(15 / 16 * v / 900e9)
    assert dgx.level == "inter-node" and dgx.seconds == pytest.approx(1 / 2 * v / (8 * 50e9))


def test_ironwood_collectives_on_its_torus_and_between_its_cores():
    """tpu7x:4x4x4, 128 devices laid (x, y, z, core) as jax's mesh_utils lays TPU7x (the core axis innermost).
    fsdp = 64 over the three 4-chip rings (each ring two links of 9e10 B/s a direction): 63/64 V / (3 x 2 x 9e10).
    tp = 2 over a chip's two TensorCores: 1/2 V over the die-to-die link (assumed at the chip's six links)."""
    cluster = Cluster.tpu("tpu7x:4x4x4")
    mesh = {"fsdp": 64, "tp": 2}
    v = GiB
    fsdp, tp = transfer("all-gather", v, ("fsdp",), mesh, cluster), transfer("all-gather", v, ("tp",), mesh, cluster)
    assert fsdp.seconds == pytest.approx(63 / 64 * v / (3 * 2 * 9e10)) and fsdp.level == "ici"
    assert tp.seconds == pytest.approx(v / 2 / DIE_TO_DIE.bandwidth) and tp.level == "die-to-die"
    assert DIE_TO_DIE.bandwidth == 6 * 9e10
    assert span(("tp",), mesh, cluster).torus[0].die_to_die
    # both: the group spans the torus and the cores; the slowest of the parallel rings bounds it
    both = span(("fsdp", "tp"), mesh, cluster)
    assert both.size == 128 and [p.die_to_die for p in both.torus] == [False, False, False, True]


def test_the_new_clusters_export_and_read_back():
    for cluster in (Cluster.b200(nodes=4), Cluster.gb200_nvl72(racks=2), Cluster.gb200_nvl72(gpus_per_rack=64),
                    Cluster.tpu("tpu7x:4x4x8", slices=2)):
        spec = cluster_spec(cluster)
        assert cluster_from_spec(spec) == cluster
    assert _cluster_code(cluster_spec(Cluster.gb200_nvl72(gpus_per_rack=64))) == \
        "Cluster.gb200_nvl72(racks=1, gpus_per_rack=64)"
    with pytest.raises(ValueError, match="gb200"):
        cluster_from_spec({"gpu": "gb300", "nodes": 1})


def test_constants_carried_over_say_so():
    for cluster in (Cluster.b200(), Cluster.gb200_nvl72(), Cluster.tpu("tpu7x:2x2x1")):
        cal = calibration(cluster.chip)
        assert not cal.gemm.sourced and "carried over" in cal.gemm.source


@needs_libtpu
def test_libtpu_describes_an_ironwood_slice_as_two_devices_a_chip():
    """libtpu's own topology: 4 chips of tpu7x:2x2x1 as 8 devices, cores 0 and 1 of each chip at one coordinate."""
    devices = tpu_devices("tpu7x:2x2x1")
    assert len(devices) == Cluster.tpu("tpu7x:2x2x1").num_devices == 8
    assert {d.device_kind for d in devices} == {"TPU7x"}
    assert sorted((tuple(d.coords), d.core_on_chip) for d in devices) == sorted(
        ((x, y, 0), c) for x in range(2) for y in range(2) for c in range(2))


@needs_libtpu
def test_a_program_compiles_for_an_ironwood_slice():
    """test_cluster.py's sharded matmul, compiled by XLA's TPU compiler for tpu7x:2x2x1 (fsdp=4 over the chips,
    tp=2 over each chip's cores): each device's argument bytes by hand, and the collectives over the axes the
    shardings name."""
    cluster = Cluster.tpu("tpu7x:2x2x1")
    mesh = cluster_mesh(cluster, (4, 2), ("fsdp", "tp"))
    assert mesh.devices.flat[0].device_kind == "TPU7x"
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    a = compile_on(cluster, lambda w, x: jnp.sum((x @ w).astype(jnp.float32) ** 2), w, x)
    assert a.memory.argument == (1024 // 4 * 4096 // 2 + 64 // 4 * 1024) * 2
    # the contraction is split over fsdp: XLA:TPU for TPU7x reduce-scatters the partial products over fsdp (for v5p
    # it gathers w instead); the loss's scalar is summed over every device
    kinds = {c.kind: c.mesh_axes for c in a.collectives}
    assert kinds["reduce-scatter"] == ("fsdp",) and kinds["all-reduce"] == ("fsdp", "tp")


@needs_libtpu
def test_the_ledger_holds_an_ironwood_train_step():
    """A 4-layer bf16 Llama with 128-wide heads on tpu7x:2x2x1, fsdp=4 x tp=2 (tp between a chip's cores): XLA's
    TPU compiler's HBM peak with memory-space assignment off (TPU_HBM_ONLY: TPU7x reads the "gf" flag), within
    10 % of the ledger (measured -2.9 %)."""
    cluster = Cluster.tpu("tpu7x:2x2x1", libtpu=libtpu_version())
    config = ModelConfig.from_hf(tiny_config("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=2048))
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    compiled = compile_step(model, cluster, {"fsdp": 4, "tp": 2}, batch=(16, 256), compiler_options=TPU_HBM_ONLY)
    mesh = cluster_mesh(cluster, full_mesh_shape({"fsdp": 4, "tp": 2}, cluster), MESH_AXES)
    predicted = ledger(model, Layout.of(model, mesh), batch=(16, 256), cluster=cluster)
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)
