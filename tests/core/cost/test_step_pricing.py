"""The two pricers of a predicted step's counts (``cost/step_pricing.py``) on counts written by hand: the roofline
is the longer of FLOPs at peak and bytes at the HBM bandwidth (the book's roofline chapter,
https://jax-ml.github.io/scaling-book/roofline/); the measured model's step is the sum of its terms."""

import pytest

from workbench.core.cost.step_counts import StepCounts
from workbench.core.cost.step_pricing import measured_step, roofline_step
from workbench.core.hardware.cluster import Cluster

from .step_sizes import hand_step

H100_BF16, H100_HBM = 989e12, 3.35e12  # NVIDIA H100 SXM datasheet: dense bf16 FLOP/s, HBM3 bytes/s


def _counts(step):
    counts = StepCounts(step.sizes)
    counts.flops["mlp"], counts.bytes["mlp"] = 989e12, 1e12  # 1 s of compute, 0.3 s of memory at peak
    counts.gemm("mlp", 8192, 8192, 8192, 1, 0)
    return counts


def test_roofline_step_is_the_longer_of_compute_and_memory():
    step = hand_step()
    priced = roofline_step(_counts(step), step, Cluster.h100(gpus_per_node=1), efficiency=1.0, overlap=True,
                           staged={}, model_flops=989e12)
    assert priced.roofline.compute_s == pytest.approx(1.0) and priced.roofline.memory_s == pytest.approx(1 / 3.35)
    assert priced.time_s == pytest.approx(1.0) and priced.bound == "compute" and priced.mfu == pytest.approx(1.0)
    assert [(p.kind, p.flops) for p in priced.parts] == [("mlp", 989e12)]


def test_roofline_bubble_is_f_over_one_minus_f_of_the_stages():
    step = hand_step(bubble=0.25)
    priced = roofline_step(_counts(step), step, Cluster.h100(gpus_per_node=1), efficiency=1.0, overlap=True,
                           staged={"attention": 1.0, "mlp": 1.0, "experts": 1.0}, model_flops=989e12)
    assert priced.bubble_s == pytest.approx(1.0 * 0.25 / 0.75)


def test_measured_step_is_the_sum_of_its_terms_the_bubble_last():
    step = hand_step()
    priced = measured_step(_counts(step), step, Cluster.h100(gpus_per_node=1), overlap=True, tp_overlap=False,
                           staged={}, model_flops=989e12)
    assert priced.terms[-1].name == "pipeline bubble" and priced.terms[-1].seconds == 0
    assert priced.time_s == sum(t.seconds for t in priced.terms)
    one_gemm = 2 * 8192**3 / H100_BF16  # at peak; the calibrated efficiency makes it longer
    assert priced.terms[0].name == "matmuls" and priced.terms[0].seconds > one_gemm
    assert 0 < priced.efficiency < 1 and priced.efficiency == pytest.approx(one_gemm / priced.terms[0].seconds)
