"""FSDP, data parallelism and ZeRO-1 (``cost/parallel/data.py``) against hand counts: "How to Scale Your Model",
Training (https://jax-ml.github.io/scaling-book/training/): FSDP gathers each layer's weights in the forward and
the backward and reduce-scatters its gradients; pure data parallelism all-reduces them."""

from workbench.core.cost.parallel.data import exposed_s, weight_collectives
from workbench.core.cost.step_counts import DENSE_WEIGHT_AXES, StepCounts, WeightGroup

from ..step_sizes import hand_step

GROUP = WeightGroup("mlp", 8e6, DENSE_WEIGHT_AXES, 4, "MLP")  # 4 layers of 8 MB gathered


def _comms(counts):
    return {(kind, axes, nbytes, name): runs for (_, kind, axes, nbytes, name), (runs, _, _) in counts.comms.items()}


def test_fsdp_gathers_twice_and_reduce_scatters_once_dp_all_reduces():
    step = hand_step({"fsdp": 8, "dp": 2})
    counts = StepCounts(step.sizes)
    shard = weight_collectives(counts, step, GROUP)
    assert shard == 4 * 8e6 / 8
    assert _comms(counts) == {
        ("all-gather", ("fsdp",), 8_000_000, "MLP weights (FSDP)"): 4 * 2,
        ("reduce-scatter", ("fsdp",), 1_000_000, "MLP gradients (FSDP)"): 4,
        ("all-reduce", ("dp",), 1_000_000, "MLP gradients (data parallel)"): 4,
    }


def test_zero1_replaces_the_dp_all_reduce_by_a_reduce_scatter_and_a_gather():
    step = hand_step({"fsdp": 8, "dp": 2}, zero=True)
    counts = StepCounts(step.sizes)
    weight_collectives(counts, step, GROUP)
    comms = _comms(counts)
    assert comms[("reduce-scatter", ("dp",), 500_000, "MLP gradients (ZeRO-1)")] == 4
    assert comms[("all-gather", ("dp",), 1_000_000, "MLP updated weights (ZeRO-1)")] == 4
    assert not any(kind == "all-reduce" for kind, *_ in comms)


def test_inference_only_gathers():
    step = hand_step({"fsdp": 8}, task="prefill", train=False)
    counts = StepCounts(step.sizes)
    weight_collectives(counts, step, GROUP)
    assert _comms(counts) == {("all-gather", ("fsdp",), 8_000_000, "MLP weights (FSDP)"): 4}


def test_exposed_is_the_first_gather_the_last_reduction_and_what_outlasts_the_work():
    """10 s of gathers in 10 runs (half forward), 4 s of reductions in 4: the first gather (1 s) and the last
    reduction (1 s), plus 5 - 3 forward and 5 + 4 - 2 backward; overlap=False exposes all 14 s."""
    assert exposed_s(10.0, 10, 4.0, 4, 3.0, 2.0, train=True, overlap=True) == 1 + 1 + 2 + 7
    assert exposed_s(10.0, 10, 4.0, 4, 30.0, 20.0, train=True, overlap=True) == 2
    assert exposed_s(10.0, 10, 4.0, 4, 3.0, 2.0, train=True, overlap=False) == 14
