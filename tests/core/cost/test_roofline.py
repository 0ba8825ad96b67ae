"""The chip table, a device's roofline and one sharded matmul as a step, against the worked examples of "How to
Scale Your Model" (the scaling book, https://jax-ml.github.io/scaling-book/), each test citing its chapter, and
against the collectives XLA inserts."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.cost.roofline import roofline
from workbench.core.cost.sharded_matmul import sharded_matmul
from workbench.core.hardware.chips import H100, TPU_V5E, cpu_measured
from workbench.core.hardware.cluster import Cluster
from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh

ROOFLINE = "https://jax-ml.github.io/scaling-book/roofline/"
SHARDING = "https://jax-ml.github.io/scaling-book/sharding/"
BF16 = 2


def test_critical_intensities():
    """ROOFLINE: a TPU v5e needs ~240 FLOPs/byte (1.97e14 / 8.2e11; its TPU table says 8.1e11 B/s, giving 243);
    an H100 989e12 / 3.35e12 ~ 295."""
    assert TPU_V5E.critical_intensity == pytest.approx(240, rel=0.02)
    assert H100.critical_intensity == pytest.approx(295, rel=0.01)


def test_critical_intensity_is_where_the_priced_rates_meet():
    """At efficiencies below peak the critical intensity is the one those rates give (here 0.8 x 1.97e14 FLOP/s over
    0.5 x 8.1e11 B/s, 389 FLOP/B): a program of that intensity takes as long to compute as to move, so the
    printed threshold and the printed bound never disagree."""
    v5e = Cluster.tpu("v5e:1x1")
    line = roofline(389.1e12, 1e12, v5e, efficiency=0.8, hbm_efficiency=0.5)
    assert line.critical_intensity == pytest.approx(0.8 * 1.97e14 / (0.5 * 8.1e11))
    assert line.compute_s == pytest.approx(line.memory_s, rel=1e-3)
    assert roofline(1e12, 1e12, v5e).critical_intensity == TPU_V5E.critical_intensity


def test_matmul_intensity_is_batch_when_batch_is_small():
    """ROOFLINE: a bf16 matmul [B, D] x [D, F] does 2BDF FLOPs over 2(BD + DF + BF) bytes, ~B when B << D, F; so
    on a TPU v5e it is compute-bound only for B above ~240."""
    v5e = Cluster.tpu("v5e:1x1")
    step = sharded_matmul(64, 8192, 8192, v5e)
    line = step.roofline
    assert line.flops == 2 * 64 * 8192**2 and line.hbm_bytes == BF16 * (2 * 64 * 8192 + 8192**2)
    assert line.intensity == pytest.approx(64, rel=0.02)
    assert step.bound == "memory" and step.time_s == step.memory_s == line.hbm_bytes / 8.1e11
    assert sharded_matmul(512, 8192, 8192, v5e).bound == "compute"


def test_gathering_the_weights_first():
    """SHARDING, Question 4, the baseline strategy: A[B, D] . W[D_X, F] all-gathers W (2DF bytes in bf16) and
    multiplies the whole: max(2BDF / C, 2DF / W_ici), here on the 16-chip ring X of a TPU v5e 16x16 (the ring's
    (N - 1) / N = 15/16 kept) with B = 256 tokens a device, D = 8192, F = 32768: communication-bound."""
    v5e, mesh = Cluster.tpu("v5e:16x16"), {"Y": 16, "X": 16}
    b, d, f = 256, 8192, 32768
    step = sharded_matmul(b, d, f, v5e, mesh, rhs=P("X", None))
    assert [(c.kind, c.axes, c.nbytes) for c in step.collectives] == [("all-gather", ("X",), BF16 * d * f)]
    assert step.compute_s == pytest.approx(2 * b * d * f / 1.97e14)
    assert step.comm_s == pytest.approx(15 / 16 * BF16 * d * f / 9e10)
    assert step.bound == "communication"


def test_sharded_matmul_cases_and_the_compiled_program_agree():
    """SHARDING, the three cases: the contracting dimension split alike on both -> local matmul, then AllReduce
    the output; split on one side only -> AllGather it; B and F over one axis -> AllGather w. The first as XLA
    compiles it (float32 on CPU: twice the bf16 bytes)."""
    mesh = make_mesh(dp=2, tp=4)
    h100, shape = Cluster.h100(), {"dp": 2, "tp": 4}
    B, D, F = 8, 64, 32
    alike = sharded_matmul(B, D, F, h100, shape, lhs=P(None, "tp"), rhs=P("tp", None))
    assert alike.roofline.flops == 2 * B * D * F / 4
    x = jax.device_put(jnp.ones((B, D)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(jnp.ones((D, F)), NamedSharding(mesh, P("tp", None)))
    compiled = [(r.kind, r.mesh_axes, r.bytes) for r in collectives(jnp.dot, x, w)]
    assert [(c.kind, c.axes, 2 * c.nbytes) for c in alike.collectives] == compiled == [
        ("all-reduce", ("tp",), B * F * 4)]
    one = sharded_matmul(B, D, F, h100, shape, lhs=P(None, "tp"))
    assert [(c.kind, c.axes, c.nbytes) for c in one.collectives] == [("all-gather", ("tp",), B * D * BF16)]
    four = sharded_matmul(B, D, F, h100, shape, lhs=P("tp"), rhs=P(None, "tp"))
    assert [(c.kind, c.axes, c.nbytes) for c in four.collectives] == [("all-gather", ("tp",), D * F * BF16)]
    assert four.roofline.flops == 2 * (B // 4) * D * F
    assert sharded_matmul(B, D, F, h100).collectives == ()
    with pytest.raises(ValueError, match=r"axes \['tp'\] are not in mesh_shape"):
        sharded_matmul(B, D, F, h100, lhs=P("tp"))


def test_cpu_measured_is_cached_and_plausible():
    hw = cpu_measured()
    assert hw is cpu_measured()
    assert 1e8 < hw.flops < 1e14 and 1e8 < hw.hbm_bandwidth < 1e12
