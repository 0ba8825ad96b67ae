"""The step-time model against the worked examples of "How to Scale Your Model" (Austin et al., the scaling book,
https://jax-ml.github.io/scaling-book/), each test citing its chapter. The book keeps a collective's
``(N - 1) / N`` factor in its formulas and often drops it in its worked numbers ("-> V / W_ici"); where it does,
the test says so and puts the factor back. Then the model on programs compiled for a cluster."""

import importlib.util
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.roofline import rate_dtype, roofline
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import collective_time, span, torus_assignment, transfer

SHARDING = "https://jax-ml.github.io/scaling-book/sharding/"
TRAINING = "https://jax-ml.github.io/scaling-book/training/"
INFERENCE = "https://jax-ml.github.io/scaling-book/inference/"
TPUS = "https://jax-ml.github.io/scaling-book/tpus/"
GPUS = "https://jax-ml.github.io/scaling-book/gpus/"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
BF16 = 2


# -- TPU collectives (chapter "Sharded Matrices and How to Multiply Them") -----------------------------------
def test_all_gather_over_a_v5e_axis_without_wraparound():
    """SHARDING, Pop Quiz 2: AllGather_Y([E_Y, F]) on a TPU v5e mesh {'X': 8, 'Y': 4}, E=2048, F=8192, bf16. v5e
    wraps only a 16-chip axis, so Y is a line: 3 hops of the 8.4 MB shard at 4.5e10 B/s one way, 560 us (the
    bidirectional-ring estimate 34e6 / 9e10 = 377 us does not apply). With E = F = 256: latency-bound, 3 hops
    of ~1 us, 3 us."""
    v5e, mesh = Cluster.tpu("v5e:4x8"), {"X": 8, "Y": 4}
    big = transfer("all-gather", 2048 * 8192 * BF16, ("Y",), mesh, v5e)
    assert big.seconds == pytest.approx(3 * 512 * 8192 * BF16 / 4.5e10)  # 559 us
    assert (big.level, big.bound) == ("ici", "bandwidth")
    small = transfer("all-gather", 256 * 256 * BF16, ("Y",), mesh, v5e)
    assert small.seconds == pytest.approx(3e-6) and small.bound == "latency"


def test_all_gather_over_one_and_two_axes_of_a_v4_cube():
    """SHARDING, Question 2 [AllGather latency]: a TPU v4p 4x4x4 slice (wraparound on every axis, 9e10 B/s
    bidirectional per axis), mesh {'X': 4, 'Y': 4, 'Z': 4}, B=1024, D=4096 bf16. AllGather_X([B_X, D_Y]) gathers
    2BD/Y bytes: the book's 2BD / (9e10 Y) = 23 us; AllGather_XY([B_X, D_Y]) has two axes' bandwidth:
    max(4 T_min, 2BD / (2 * 9e10)) = 46 us, bandwidth-bound. The book drops the ring's (N - 1) / N in these
    numbers (its summary formula keeps it): 3/4 over 4 chips, 15/16 over 16, so the model says 44 us for the
    second; one axis's V / W_ici (the old one-axis form) said 93 us, twice the book's."""
    v4, mesh = Cluster.tpu("v4:4x4x4"), {"X": 4, "Y": 4, "Z": 4}
    b, d = 1024, 4096
    assert collective_time("all-gather", 2 * b * d // 4, ("X",), mesh, v4) == pytest.approx(
        2 * b * d / (9e10 * 4) * 3 / 4)
    both = transfer("all-gather", 2 * b * d, ("X", "Y"), mesh, v4)
    assert both.seconds == pytest.approx(2 * b * d / (2 * 9e10) * 15 / 16)
    assert (both.bound, both.latency_s) == ("bandwidth", pytest.approx(4e-6))  # 2 + 2 hops of ~1 us
    assert int(both.seconds * 16 / 15 * 1e6) == 46 and round(both.seconds * 1e6) == 44


def test_a_tiny_all_gather_is_latency_bound():
    """SHARDING, Question 3: AllGather_X([B_X]) with B=128 bf16 on a v4p 4x4x4 slice: 256 bytes, latency-bound;
    a wraparound axis of 4 reaches every chip in 2 hops of ~1 us: about 2 us."""
    t = transfer("all-gather", 128 * BF16, ("X",), {"X": 4, "Y": 4, "Z": 4}, Cluster.tpu("v4:4x4x4"))
    assert t.seconds == pytest.approx(2e-6) and t.bound == "latency"


def test_all_reduce_reduce_scatter_and_all_to_all_against_all_gather():
    """SHARDING, "What Have We Learned?": on a bidirectional ring a ReduceScatter costs the same as an
    AllGather of the same array, an AllReduce (a ReduceScatter + an AllGather) twice that, an AllToAll a quarter
    (its footnote: N^2 / 4 shards of bytes / N^2 per link, exact for even N; the AllGather's (N - 1) / N kept).
    Checked on the 16-chip wraparound axis of a v5e 16x16 pod."""
    v5e, mesh, v = Cluster.tpu("v5e:16x16"), {"x": 16, "y": 16}, 64 * 2**20
    gather = collective_time("all-gather", v, ("x",), mesh, v5e)
    assert gather == pytest.approx(15 / 16 * v / 9e10)
    assert collective_time("reduce-scatter", v / 16, ("x",), mesh, v5e) == pytest.approx(gather)  # result: V / N
    assert collective_time("all-reduce", v, ("x",), mesh, v5e) == pytest.approx(2 * gather)
    assert collective_time("all-to-all", v / 16, ("x",), mesh, v5e) == pytest.approx(v / (4 * 9e10))
    # the 8-chip axis of v5e:8x16 is a line: half the ring's bandwidth (the book's "(N - 1) hops one way")
    line = collective_time("all-gather", v, ("x",), {"x": 8, "y": 16}, Cluster.tpu("v5e:8x16"))
    assert line == pytest.approx(7 / 8 * v / 4.5e10)


def test_the_books_one_axis_forms_are_the_models_limit():
    """SHARDING, "What Have We Learned?": T = V / W * (N - 1) / N -> V / W_ici (bidirectional) for an AllGather or
    ReduceScatter, twice that for an AllReduce, a quarter for an AllToAll: the model's bandwidth term on one
    wraparound axis of N chips (TPU v4 rings of 4, 8, 16; W_ici = 2 x 4.5e10) and through one node's NVSwitch
    (the GPU chapter: W = 450 GB/s egress), approaching the book's forms as N grows."""
    v = 64 * 2**20
    for n in (4, 8, 16):
        ring, mesh = Cluster.tpu(f"v4:4x4x{n}"), {"x": n, "rest": 16}  # x: the torus axis of n
        gather = transfer("all-gather", v, ("x",), mesh, ring)
        assert gather.bandwidth_s == pytest.approx((n - 1) / n * v / 9e10)
        assert transfer("reduce-scatter", v / n, ("x",), mesh, ring).bandwidth_s == pytest.approx(gather.bandwidth_s)
        assert transfer("all-reduce", v, ("x",), mesh, ring).bandwidth_s == pytest.approx(2 * gather.bandwidth_s)
        assert transfer("all-to-all", v / n, ("x",), mesh, ring).bandwidth_s == pytest.approx(v / (4 * 9e10))
        node = Cluster.h100(gpus_per_node=n)
        assert transfer("all-gather", v, ("x",), {"x": n}, node).bandwidth_s == pytest.approx((n - 1) / n * v / 450e9)


def test_mesh_axes_land_on_torus_axes_as_jax_lays_them():
    """The reference: jax's own assignment of mesh axes to a torus (mesh_utils._create_device_mesh_for_nd_torus,
    what create_device_mesh runs for these slices)."""
    from jax._src.mesh_utils import _create_device_mesh_for_nd_torus

    for torus, shape in [((4, 4, 4), (1, 16, 1, 4, 1)), ((4, 4, 4), (16, 4)), ((4, 4, 4), (4, 16)),
                         ((4, 4, 8), (1, 8, 1, 16, 1)), ((16, 16, 16), (256, 16)), ((16, 16), (16, 16)),
                         ((4, 8), (8, 4)), ((2, 2, 1), (2, 2)), ((4, 4, 4), (64,))]:
        _, reference = _create_device_mesh_for_nd_torus(np.zeros(torus), shape)
        ours = torus_assignment(shape, torus)
        for i in range(len(shape)):
            used = {j for j in range(len(torus)) if reference[j, i] > 1}
            assert {j for j in ours[i] if torus[j] > 1} == used, (torus, shape, i)


def test_split_physical_axes_land_as_jax_lays_them():
    """The reference: jax's own assignment matrix with splitting allowed (mesh_utils._create_device_mesh_for_nd_torus
    with allow_split_physical_axes=True, what create_device_mesh(..., allow_split_physical_axes=True) runs): the
    part of each physical axis each mesh axis owns. Whole-axis shapes give whole axes, as without splitting."""
    from jax._src.mesh_utils import _create_device_mesh_for_nd_torus

    from workbench.core.hardware.cluster import needs_split, torus_layout

    for torus, shape, split in [((16, 16), (1, 1, 64, 4, 1, 1), True), ((16, 16), (1, 4, 64, 1, 1, 1), True),
                                ((4, 4, 8), (1, 2, 8, 1, 8, 1), True), ((4, 4, 8), (1, 1, 64, 1, 2, 1), True),
                                ((4, 4, 4), (8, 8), True), ((4, 4, 4), (2, 2, 2, 8), True), ((8, 16), (2, 8, 8), True),
                                ((4, 4, 4), (1, 16, 1, 4, 1), False), ((16, 16), (16, 16), False)]:
        _, reference = _create_device_mesh_for_nd_torus(np.zeros(torus), shape, allow_split_physical_axes=True)
        assert np.array_equal(np.array(torus_layout(shape, torus)), reference), (torus, shape)
        assert needs_split(shape, torus) == split, (torus, shape)


MESH6 = ("pp", "dp", "fsdp", "ep", "tp", "sp")


def _coordinate_parts(group, cluster):
    """The reference description of one group, from libtpu's device coordinates alone: per physical axis d
    with more than one coordinate among the group's devices of one slice, their number k, their spacing s
    (which must be even), and whether they close a ring (k s = the axis's size and the axis wraps)."""
    one_slice = [d for d in group if d.slice_index == group[0].slice_index] if hasattr(group[0], "slice_index") \
        else list(group)
    parts = []
    for d, axis in enumerate(cluster.torus):
        values = sorted({dev.coords[d] for dev in one_slice})
        if len(values) > 1:
            steps = {b - a for a, b in itertools.pairwise(values)}
            assert len(steps) == 1, (d, values)
            (stride,) = steps
            parts.append((len(values), stride, axis.wraparound and len(values) * stride == axis.size))
    cores = {dev.core_on_chip for dev in one_slice if tuple(dev.coords) == tuple(one_slice[0].coords)}
    if len(cores) > 1:  # a TPU7x chip's two TensorCores, joined by its die-to-die link: a line of them
        parts.append((len(cores), 1, False))
    return parts


@needs_libtpu
@pytest.mark.parametrize("topology, slices, sizes, dcn, ici", [
    ("v6e:16x16", 2, {"fsdp": 512}, (1, 1, 2, 1, 1, 1), (1, 1, 256, 1, 1, 1)),
    ("v6e:16x16", 2, {"dp": 2, "fsdp": 256}, (1, 2, 1, 1, 1, 1), (1, 1, 256, 1, 1, 1)),
    ("v6e:16x16", 2, {"fsdp": 128, "ep": 4}, (1, 1, 2, 1, 1, 1), (1, 1, 64, 4, 1, 1)),
    ("v5p:4x4x4", 2, {"fsdp": 32, "tp": 4}, (1, 1, 2, 1, 1, 1), (1, 1, 16, 1, 4, 1)),
    ("v5p:4x4x4", 2, {"fsdp": 16, "tp": 8}, (1, 1, 2, 1, 1, 1), (1, 1, 8, 1, 8, 1)),
    ("v6e:16x16", 1, {"fsdp": 64, "ep": 4}, None, None),
    ("v6e:16x16", 1, {"dp": 4, "fsdp": 64}, None, None),
    ("v5p:4x4x8", 1, {"dp": 2, "fsdp": 8, "tp": 8}, None, None),
    ("v5p:4x4x8", 1, {"fsdp": 64, "tp": 2}, None, None),
    ("tpu7x:4x4x4", 1, {"fsdp": 64, "tp": 2}, None, None),
    ("tpu7x:4x4x4", 1, {"fsdp": 32, "tp": 4}, None, None),
    ("tpu7x:4x4x4", 2, {"fsdp": 128, "tp": 2}, (1, 1, 2, 1, 1, 1), (1, 1, 64, 1, 2, 1)),
])
def test_span_agrees_with_the_coordinates_of_every_group(topology, slices, sizes, dcn, ici):
    """The reference: the device grid jax's mesh_utils builds on libtpu's devices (create_hybrid_device_mesh with
    the dcn / ici shapes written by hand, or create_device_mesh(..., allow_split_physical_axes=True)), and the
    coordinates and slice_index of the devices of each group: its size, its slices (units), its devices per
    slice, and per physical axis its part (chips, spacing, ring or not), for every group over each single mesh
    axis and over every pair."""
    from jax.experimental import mesh_utils

    from workbench.core.hardware.cluster import tpu_devices

    cluster = Cluster.tpu(topology, slices=slices)
    devices = tpu_devices(cluster.topology, slices)
    mesh = {a: sizes.get(a, 1) for a in MESH6}
    shape = tuple(mesh.values())
    if slices > 1:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    assert grid.shape == shape
    used = [a for a in MESH6 if mesh[a] > 1]
    for axes in [(a,) for a in used] + [pair for pair in itertools.combinations(used, 2)]:
        s = span(axes, mesh, cluster)
        idx = [MESH6.index(a) for a in axes]
        groups = np.moveaxis(grid, idx, list(range(-len(idx), 0))).reshape(-1, math.prod(mesh[a] for a in axes))
        for group in groups:
            units = len({d.slice_index for d in group}) if slices > 1 else 1
            assert (s.size, s.units, s.per_unit) == (len(group), units, len(group) // units), axes
            assert [(p.size, p.stride, p.wraparound) for p in s.torus] == _coordinate_parts(group, cluster), axes


def test_a_collective_over_part_of_a_physical_axis():
    """{"fsdp": 64, "ep": 4} on a v6e 16x16 (both axes rings of 16, 9e10 B/s per link one way): JAX gives ep the
    first factor of 4 it finds, the inner 4 chips of the x axis, and fsdp the outer 4 of x (neighbours 4 links
    apart) and all of y. An all-gather of V bytes over ep runs on a line of 4: one link, (4 - 1) / 4 V / 9e10,
    3 hops. Over fsdp: x's strided ring of 4 gives 2 x 9e10 / 4 = 4.5e10 (its four interleaved groups share
    each link), y's ring 1.8e11: (64 - 1) / 64 V / 2.25e11; latency (4 // 2) x 4 + 16 // 2 = 16 hops. With
    {"dp": 4, "fsdp": 64}, dp owns only the outer 4 of y: a ring of 4 with hops of 4 links, 3/4 V / 4.5e10, 8
    hops."""
    v6e, v = Cluster.tpu("v6e:16x16"), 64 * 2**20
    mesh = {"pp": 1, "dp": 1, "fsdp": 64, "ep": 4, "tp": 1, "sp": 1}
    ep = transfer("all-gather", v, ("ep",), mesh, v6e)
    assert ep.bandwidth_s == pytest.approx(3 / 4 * v / 9e10) and ep.latency_s == pytest.approx(3e-6)
    fsdp = transfer("all-gather", v, ("fsdp",), mesh, v6e)
    assert fsdp.bandwidth_s == pytest.approx(63 / 64 * v / 2.25e11) and fsdp.latency_s == pytest.approx(16e-6)
    # over both, fsdp's and ep's parts of x are all of x again: the whole 16 x 16 torus, two rings of 16
    both = transfer("all-gather", v, ("fsdp", "ep"), mesh, v6e)
    assert both.bandwidth_s == pytest.approx(255 / 256 * v / (2 * 1.8e11))
    dp = transfer("all-gather", v, ("dp",), {**mesh, "dp": 4, "fsdp": 64, "ep": 1}, v6e)
    assert dp.bandwidth_s == pytest.approx(3 / 4 * v / 4.5e10) and dp.latency_s == pytest.approx(8e-6)
    # all-to-all of S = V / 4 bytes per device over ep: across the line's middle link 2 x 2 shards of S / 4
    # one way, S: S / 9e10 (the ring form k S / (4 W) with W one link)
    assert transfer("all-to-all", v / 4, ("ep",), mesh, v6e).bandwidth_s == pytest.approx((v / 4) / 9e10)


def test_an_axis_across_slices_and_ici_prices_both_networks():
    """MaxText's dcn_fsdp = 2 x ici_fsdp = 256: {"fsdp": 512} on two v6e 16x16 slices (DCN 4 x 200 Gbps per host
    of 8 chips: 1.25e10 B/s per chip one way). An all-gather of V over fsdp: inside a slice the 256 chips of
    the whole torus, (255 / 256) V / (2 x 1.8e11); across the 2 slices, each chip's share of its host's NICs
    carries its 256 devices' half: (1 / 2) V / (1.25e10 x 256). The ICI ring bounds it."""
    two, v = Cluster.tpu("v6e:16x16", slices=2), 1e9
    mesh = {"pp": 1, "dp": 1, "fsdp": 512, "ep": 1, "tp": 1, "sp": 1}
    s = span(("fsdp",), mesh, two)
    assert (s.size, s.units, s.per_unit) == (512, 2, 256) and [p.size for p in s.torus] == [16, 16]
    t = transfer("all-gather", v, ("fsdp",), mesh, two)
    assert t.level == "ici" and t.seconds == pytest.approx(255 / 256 * v / 3.6e11)
    assert (1 / 2) * v / (1.25e10 * 256) < t.seconds


# -- the training chapter's conditions ----------------------------------------------------------------------
@pytest.mark.parametrize("mesh, axes, book", [({"dp": 256, "fsdp": 16}, ("fsdp",), 2550),
                                              ({"fsdp": 4096}, ("fsdp",), 850)])
def test_fsdp_is_compute_bound_above_c_over_w_ici_per_chip(mesh, axes, book):
    """TRAINING, "Fully-Sharded Data Parallelism": per layer the forward gathers W_in and W_out (2DF bytes each,
    bf16) while doing 4 (B/X) D F FLOPs; compute-bound when the per-chip batch B/X > C / W_ici = 4.59e14 /
    1.8e11 = 2550 on TPU v5p, or 2550 / 3 = 850 with all three axes of the torus. The crossing here also carries
    the ring's (N - 1) / N."""
    v5p = Cluster.tpu("v5p:16x16x16")
    d, f = 8192, 32768
    n = math.prod(mesh[a] for a in axes)
    comms = 2 * collective_time("all-gather", 2 * d * f, axes, mesh, v5p)
    per_token = roofline(4 * d * f, 0.0, v5p).compute_s  # one token of per-chip batch
    assert comms / per_token == pytest.approx(book * (n - 1) / n, rel=2e-3)
    for scale, bound in ((1.05, "compute"), (0.9, "communication")):  # per-chip batch around the threshold
        step = step_time(efficiency=1.0, cluster=v5p, mesh_shape=mesh, flops=4 * scale * book * d * f,
                         hbm_bytes=0.0,
                         collectives=[("all-gather", 2 * d * f, axes, 2)])
        assert step.bound == bound, (scale, step)


def test_efficiency_scales_compute_time():
    """TRAINING, "Real-world example": LLaMA-3 70B's ~6.3e24 training FLOPs over 18,823 TPU v5p chips at 50 %
    of peak (the book's MFU: its FLOPs are 6 x params x tokens, model FLOPs) takes approximately 17 days."""
    days = roofline(6.3e24 / 18823, 0.0, Cluster.tpu("v5p:4x4x4"), efficiency=0.5).time_s / 86400
    assert round(days) == 17


# -- the inference chapter: decoding is memory-bound ---------------------------------------------------------
def test_decode_step_time_is_parameter_and_kv_bytes_over_hbm_bandwidth():
    """INFERENCE, "Theoretical estimates for LLM latency and throughput", Pop Quiz: a 30B dense model in int8
    with bf16 FLOPs on a TPU v5e 4x4 (16 chips, 8.1e11 B/s and 1.97e14 bf16 FLOP/s each), 8192 tokens of context
    at 100 kB per token of KV cache (819 MB per sequence). Batch 4: memory-bound,
    (4 * 819e6 + 30e9) / (16 * 8.1e11) = 2.5 ms. Batch 256: the MLPs become compute-bound at the bf16 rate,
    256 * 819e6 / (16 * 8.1e11) + 2 * 256 * 30e9 / (16 * 1.97e14) = 21 ms."""
    v5e, params, kv = Cluster.tpu("v5e:4x4"), 30e9, 819e6

    def step(batch):
        mlp = roofline(2 * batch * params / 16, params / 16, v5e, dtype=("int8", "bfloat16"))
        attention = roofline(0.0, batch * kv / 16, v5e)  # attention reads each sequence's cache: never compute-bound
        return mlp, mlp.time_s + attention.time_s

    mlp, seconds = step(4)
    assert mlp.bound == "memory" and seconds == pytest.approx((4 * kv + params) / (16 * 8.1e11))
    mlp, seconds = step(256)
    assert mlp.bound == "compute"
    assert seconds == pytest.approx(256 * kv / (16 * 8.1e11) + 2 * 256 * params / (16 * 1.97e14))
    assert round(seconds * 1e3) == 21
    # int8 weights and int8 activations run at the int8 rate (3.94e14)
    assert roofline(1e12, 0.0, v5e, dtype=("int8", "int8")).compute_s == pytest.approx(1e12 / 3.94e14)


def test_sampling_a_200b_model_cannot_beat_reading_its_weights():
    """TPUS, Question 1: sampling from a 200B bf16 model split across 32 TPU v4p (1.2e12 B/s each) must read
    every parameter from HBM each step: 400e9 / (32 * 1.2e12) = 10 ms, a lower bound on the step."""
    step = step_time(efficiency=1.0, cluster=Cluster.tpu("v4:4x4x2"), mesh_shape={"tp": 32},
                     flops=2 * 200e9 / 32,
                     hbm_bytes=2 * 200e9 / 32, collectives=[])
    assert step.bound == "memory" and step.time_s == pytest.approx(400e9 / (32 * 1.2e12))
    assert round(step.time_s * 1e3) == 10


def test_matmul_rates_follow_the_operand_dtypes():
    assert rate_dtype(jnp.bfloat16) == "bf16" and rate_dtype(("int8", "int8")) == "int8"
    assert rate_dtype(("float8_e4m3fn", "float8_e4m3fn")) == "fp8" and rate_dtype(("int8", "bf16")) == "bf16"
    h100 = Cluster.h100()
    assert roofline(1979e12, 0.0, h100, dtype=("fp8", "fp8")).compute_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no peak FLOP/s for 'float32'"):
        roofline(1.0, 1.0, h100, dtype="float32")
    with pytest.raises(ValueError, match="no published peak for 'fp8'"):
        roofline(1.0, 1.0, Cluster.tpu("v5p:4x4x4"), dtype="fp8")
    with pytest.raises(ValueError, match="no peak numbers"):
        roofline(1.0, 1.0, Cluster.cpu(8))


# -- GPU collectives (chapter "How to Think About GPUs") -----------------------------------------------------
def test_all_gather_inside_an_h100_node():
    """GPUS, Pop Quiz 1: AllGather(bf16[B_X, F]) on an 8xH100 node, B=1024, F=16,384, 450 GB/s one way per GPU:
    2BF * 7 / (8 * 450e9) = 65 us. Quiz 2, Question 3: bf16[D_X, F] with D=4096, F=65,536: 536e6 * 7 / 3.6e12
    = 1.04 ms."""
    node = Cluster.h100()
    assert collective_time("all-gather", 2 * 1024 * 16384, ("x",), {"x": 8}, node) == pytest.approx(
        2 * 1024 * 16384 * 7 / (8 * 450e9))
    assert collective_time("all-gather", 2 * 4096 * 65536, ("x",), {"x": 8}, node) == pytest.approx(
        2 * 4096 * 65536 * 7 / 3.6e12)
    assert round(collective_time("all-gather", 2 * 4096 * 65536, ("x",), {"x": 8}, node) * 1e3, 2) == 1.04


def test_all_gather_across_nodes_is_bound_by_the_slower_level():
    """GPUS, "Cross-node collectives": each level a ring, overlapped: bytes * max_i (D_i - 1) / (D_i W_i) with
    450e9 per GPU in a node and 400e9 per node across. Quiz 4, Question 5: over exactly 2 nodes the node level
    bounds it (B * 7 / (8 * 450e9) = B / 514e9 against B / 800e9 across)."""
    b = 1e9
    across = transfer("all-gather", b, ("x",), {"x": 64}, Cluster.h100(nodes=8))
    assert across.seconds == pytest.approx(b * 7 / (8 * 400e9)) and across.level == "inter-node"
    two = transfer("all-gather", b, ("x",), {"x": 16}, Cluster.h100(nodes=2))
    assert two.seconds == pytest.approx(b / 514.28e9, rel=1e-4) and two.level == "nvlink"


def test_a_gather_over_nodes_shares_each_nodes_network_with_the_axis_inside():
    """GPUS, "Reductions when array is sharded over a separate axis": with Y = 8 (a node) as the inner axis, an
    X gather across nodes costs bytes / W_node * D_node / max(D_node, Y): each of a node's 8 groups gets one
    GPU's 50 GB/s; bytes is the whole array, 8 x what one group gathers."""
    group_bytes = 1e9
    t = transfer("all-gather", group_bytes, ("fsdp",), {"fsdp": 8, "tp": 8}, Cluster.h100(nodes=8))
    assert t.seconds == pytest.approx(8 * group_bytes / 400e9 * 7 / 8) and t.level == "inter-node"


def test_all_to_all_inside_and_across_h100_nodes():
    """GPUS, "AllToAlls": inside a node each GPU sends B / N^2 to N - 1 others, B (N - 1) / (W N^2); across M
    nodes the node's network carries it, B (M - 1) / (M^2 W_node) ("effectively 50GB/s rather than 400GB/s").
    ``B`` is the whole array: each of the N devices holds B / N."""
    b = 8e9
    assert collective_time("all-to-all", b / 8, ("x",), {"x": 8}, Cluster.h100()) == pytest.approx(
        b * 7 / (450e9 * 64))
    assert collective_time("all-to-all", b / 64, ("x",), {"x": 64}, Cluster.h100(nodes=8)) == pytest.approx(
        b * 7 / (64 * 400e9))


@pytest.mark.parametrize("nodes, book", [(1, 990e12 / 450e9), (8, 990e12 / 400e9)])
def test_gpu_data_parallelism_needs_c_over_w_tokens_per_gpu(nodes, book):
    """GPUS, "Rooflines for LLM Scaling on GPUs", Data Parallelism: per layer the backward does 8 (B/X) D F
    FLOPs against an AllReduce of each of W_in, W_out (2DF bytes each); compute-bound when the per-GPU token
    batch B/X > C / W_collective: 990e12 / 450e9 = 2200 inside a node, 990e12 / 400e9 = 2475 across nodes
    ((X - 1) / X kept: 7/8 on one node of 8 GPUs and over 8 nodes). The datasheet's 989 TFLOP/s is here."""
    cluster = Cluster.h100(nodes=nodes)
    d, f, n = 8192, 28672, 8
    comms = 2 * collective_time("all-reduce", 2 * d * f, ("dp",), {"dp": cluster.num_devices}, cluster)
    per_token = roofline(8 * d * f, 0.0, cluster).compute_s
    assert comms / per_token == pytest.approx(book * (n - 1) / n, rel=2e-3)


# -- a compiled step ------------------------------------------------------------------------------------------
def _matmul_args(mesh):
    w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "tp")))
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    return w, x


def _loss(w, x):
    return jnp.sum((x @ w).astype(jnp.float32) ** 2)


def test_step_time_of_a_program_compiled_for_an_h100_node():
    from workbench.core.compile.virtual import compile_on

    cluster = Cluster.h100()
    mesh = cluster.mesh((4, 2), ("fsdp", "tp"))
    analysis = compile_on(cluster, _loss, *_matmul_args(mesh))
    step = step_time(analysis, efficiency=0.5)
    assert step.mesh == {"fsdp": 4, "tp": 2}
    # hand count: this device's x rows (64/4) times w's columns (4096/2) over 1024
    assert step.roofline.flops == 2 * 16 * 1024 * 2048
    assert step.compute_s == pytest.approx(2 * 16 * 1024 * 2048 / (0.5 * 989e12))
    assert step.memory_s == pytest.approx(analysis.hbm_bytes / 3.35e12)
    gathers = [c for c in step.collectives if c.kind == "all-gather"]
    assert gathers and all(c.level == "nvlink" for c in gathers)
    gather = gathers[0]
    assert gather.seconds == pytest.approx(max(3 / 4 * gather.nbytes / 450e9, 3e-6))
    assert step.time_s == max(step.compute_s, step.memory_s, step.comm_s)
    assert step.xla_seconds is None  # XLA:CPU gives no time estimate
    text = step.summary()
    assert "all-gather" in text and "nvlink" in text and "HFU" in text and "at 50% of peak" in text
    # HFU: the program's dots over the H100's bf16 peak and the step; no MFU without the model's FLOPs
    assert step.hfu == pytest.approx(2 * 16 * 1024 * 2048 / (989e12 * step.time_s)) and step.mfu is None
    collectives = lambda html: html.split("<thead>")[1].count("<tr>") - 1  # the second table's rows, header off
    assert collectives(step.html()) == len(step.rows()) and collectives(step.html(top=1)) == 1
    serial = step_time(analysis, efficiency=0.5, overlap=False)
    assert serial.time_s == pytest.approx(max(step.compute_s, step.memory_s) + step.comm_s)


def _two_way_ring(mesh):
    """Two permutes per loop trip over sp, one each way round the ring (a bidirectional collective matmul)."""
    n = mesh.shape["sp"]

    def trips(x):
        def body(i, carry):
            a, b = carry
            a = jax.lax.ppermute(a, "sp", [(j, (j + 1) % n) for j in range(n)])
            b = jax.lax.ppermute(b, "sp", [(j, (j - 1) % n) for j in range(n)])
            return a * 2, b * 3

        a, b = jax.lax.fori_loop(0, 5, body, (x, x[:, :512]))
        return jax.lax.psum(a.sum() + b.sum(), "sp")

    x = jax.ShapeDtypeStruct((n * 256, 1024), jnp.float32, sharding=NamedSharding(mesh, P("sp")))
    return jax.shard_map(trips, mesh=mesh, in_specs=P("sp"), out_specs=P()), x


@pytest.mark.parametrize("cluster", [pytest.param(Cluster.tpu("v5e:2x4"), marks=needs_libtpu), Cluster.h100()],
                         ids=["tpu", "gpu"])
def test_permutes_the_two_ways_round_a_torus_ring_run_at_once(cluster):
    """A ring's links carry both directions at once on a TPU torus (the scaling book's bidirectional ICI,
    TPUS chapter); a GPU's two permutes leave by the same NVLink egress and add up."""
    from workbench.core.compile.virtual import compile_on

    analysis = compile_on(cluster, *_two_way_ring(cluster.mesh((8,), ("sp",))))
    step = step_time(analysis)
    permutes = [c for c in step.collectives if c.kind == "collective-permute"]
    assert len(permutes) == 2 and {c.runs for c in permutes} == {5}
    big = max(permutes, key=lambda c: c.nbytes)
    busy = sum(c.total_s for c in permutes)
    if cluster.platform == "tpu":
        assert [c.overlapped for c in permutes] == [c is not big for c in permutes]
        assert busy == big.total_s and "overlapped" in step.summary()
    else:
        assert not any(c.overlapped for c in permutes) and busy == sum(c.seconds * 5 for c in permutes)


def test_a_cpu_cluster_has_no_network_to_cost():
    with pytest.raises(ValueError, match="no network numbers"):
        collective_time("all-gather", 1e6, ("x",), {"x": 8}, Cluster.cpu(8))
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_time("broadcast", 1e6, ("x",), {"x": 8}, Cluster.h100())
    with pytest.raises(ValueError, match=r"axes \['y'\] are not in the mesh"):
        collective_time("all-gather", 1e6, ("y",), {"x": 8}, Cluster.h100())


def test_a_multislice_gather_crosses_the_data_center_network():
    """TPUS: DCN is ~2.5e10 B/s per host (4 v5p chips a host): a gather over the slice axis is bounded by each
    chip's share of its host's NICs, the ICI part by the torus."""
    two = Cluster.tpu("v5p:4x4x4", slices=2)
    s = span(("dp",), {"dp": 2, "fsdp": 64}, two)
    assert (s.size, s.units, s.per_unit, s.torus) == (2, 2, 1, ())
    t = transfer("all-gather", 1e9, ("dp",), {"dp": 2, "fsdp": 64}, two)
    assert t.level == "dcn" and t.seconds == pytest.approx(1 / 2 * 1e9 / (2.5e10 / 4))


@needs_libtpu
def test_a_scanned_program_on_tpu_counts_each_loop_trip():
    """XLA:TPU records no known_trip_count on a scan's while loop: the trips come from its condition (i < 6)
    and the dots are written as convolutions. The reference: a hand count of the scan's matmuls; XLA's own
    time estimate (cost_analysis's optimal_seconds) is shown beside ours."""
    from workbench.core.compile.virtual import compile_on

    cluster = Cluster.tpu("v5e:2x2")
    mesh = cluster.mesh((4,), ("fsdp",))
    rows, width = 4096, 2048

    def stack(w, x):
        def layer(x, w):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(layer, x, w)[0]

    def compiled(layers):
        w = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
        x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
        return compile_on(cluster, stack, w, x)

    layers = 6
    analysis, half, double = compiled(layers), compiled(layers // 2), compiled(2 * layers)
    assert analysis.matmul_flops == layers * 2 * (rows // 4) * width * width
    assert {c.trips for c in analysis.collectives} == {layers}
    # a trip reads one layer's weights (its slice of the stack), not the whole stack: each costs the same
    per_trip = (analysis.hbm_bytes - half.hbm_bytes) / (layers // 2)
    assert (double.hbm_bytes - analysis.hbm_bytes) / layers == pytest.approx(per_trip, rel=0.02)
    step = step_time(analysis)
    assert step.xla_seconds is not None and "XLA's estimate" in step.summary()
    assert all(c.level == "ici" and c.runs == layers for c in step.collectives)


@needs_libtpu
def test_batched_matmuls_written_as_tpu_convolutions_count_once_per_batch_element():
    """XLA:TPU writes a batched dot as a convolution whose batch dim is a spatial dim (window 8, stride 7,
    lhs_dilate 8): one tap of the window lands per output. The references: a hand count (forward, and its
    gradient's two more matmuls) and XLA's own cost_analysis() FLOPs (no loop here)."""
    from workbench.core.compile.virtual import compile_on

    cluster = Cluster.tpu("v5p:2x2x1")
    mesh = cluster.mesh((4,), ("fsdp",))
    a = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    b = jax.ShapeDtypeStruct((8, 512, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    bmm = lambda a, b: jnp.einsum("bij,bjk->bik", a, b)
    forward = compile_on(cluster, bmm, a, b)
    assert forward.matmul_flops == 2 * 8 * 256 * 512 * 128 == forward.flops
    loss = lambda a, b: jnp.sum(bmm(a, b).astype(jnp.float32) ** 2)
    backward = compile_on(cluster, jax.grad(loss, (0, 1)), a, b)
    assert backward.matmul_flops == 3 * 2 * 8 * 256 * 512 * 128
    assert backward.matmul_flops == pytest.approx(backward.flops, rel=1e-3)  # XLA adds the elementwise FLOPs


def test_hbm_bytes_equal_xla_bytes_accessed_without_loops():
    """The reference: XLA's cost_analysis()['bytes accessed'] of the same program, which has no loop."""
    from workbench.core.hlo.graph import hbm_bytes

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) * 2, axis=0)

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((256, 512), jnp.float32),
                                jax.ShapeDtypeStruct((64, 256), jnp.float32)).compile()
    assert hbm_bytes(compiled.as_text()) == compiled.cost_analysis()["bytes accessed"]


def test_a_collective_at_the_attained_bandwidth():
    """Real collectives reach a fraction of the links' bandwidth: that fraction divides the bandwidth time; a
    latency-bound collective keeps its latency."""
    v5p = Cluster.tpu("v5p:4x4x4")
    big = transfer("all-gather", 2**30, ("fsdp",), {"fsdp": 64}, v5p)
    assert big.bound == "bandwidth" and big.attained(0.8) == pytest.approx(big.bandwidth_s / 0.8)
    tiny = transfer("all-gather", 64, ("fsdp",), {"fsdp": 64}, v5p)
    assert tiny.bound == "latency" and tiny.attained(0.8) == tiny.latency_s


def test_a_compiled_and_a_predicted_step_price_a_collective_the_same_way():
    """The collectives of a predicted step, given to the compiled step's pricer: each costs what the prediction
    said (both at the chip's attained fraction of link bandwidth); with efficiency=1 the compiled one is the ideal."""
    from workbench.core.cost.predicted import predict_step
    from workbench.core.hardware.calibration import calibration
    from workbench.core.models.presets import full_config

    cluster, mesh = Cluster.h100(nodes=8), {"fsdp": 16, "tp": 4}
    predicted = predict_step(full_config("llama-3-8b"), cluster, mesh, batch=(64, 4096))
    records = [(c.kind, c.nbytes, c.axes, c.runs) for c in predicted.collectives]
    compiled = step_time(cluster=cluster, mesh_shape=mesh, flops=1.0, hbm_bytes=1.0, collectives=records)
    assert [c.seconds for c in compiled.collectives] == [c.seconds for c in predicted.collectives]
    ideal = step_time(cluster=cluster, mesh_shape=mesh, flops=1.0, hbm_bytes=1.0, collectives=records,
                      efficiency=1.0)
    network = calibration(cluster.chip).network.value
    for at, c in zip(ideal.collectives, compiled.collectives, strict=True):
        t = transfer(c.kind, c.nbytes, c.axes, {"pp": 1, "dp": 1, "ep": 1, "sp": 1, **mesh}, cluster)
        assert at.seconds == t.seconds and c.seconds == max(t.bandwidth_s / network, t.latency_s)
