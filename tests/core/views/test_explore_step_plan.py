"""The plan an explorer's step runs (``step_plan``), each field against what the core takes when called by hand: the
ledger of one microbatch, ``predict_step`` with the accumulation, a pipeline padded to equal stages built by hand,
the batch axes and expert placement the layout's partition axis and rules say."""

import pytest

from workbench.core.advisor.constraints import batch_partition_axis
from workbench.core.axes import EMPTY, EP, LAYERS, TP
from workbench.core.cost.ledger import ledger
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.pipeline import PipelineConfig, pipeline_partition_axis
from workbench.core.plan import Plan
from workbench.core.views import explore_step as steps
from workbench.core.views.explore import Layout


def _model(family="llama", **overrides):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family, **overrides)))


@pytest.fixture(scope="module")
def model():
    return _model(num_hidden_layers=4)


@pytest.fixture(scope="module")
def cluster():
    return Cluster.h100(nodes=1)  # 8 devices


def test_an_accumulated_step_holds_one_microbatch_and_runs_them_one_after_another(model, cluster):
    mesh = steps.explorer_mesh({"fsdp": 4, "tp": 2}, cluster)
    layout = Layout.of(model, mesh, remat="full", grad_accumulation=2)
    plan = steps.step_plan(layout, task="train", batch=(8, 64))
    assert plan == Plan({"fsdp": 4, "tp": 2}, remat="full", grad_accumulation=2)
    one = ledger(model, Layout.of(model, mesh), batch=(4, 64), remat="full", cluster=cluster)  # 8 rows / 2
    got = steps.step_ledger(model, layout, cluster, task="train", batch=(8, 64), optimizer="adamw")
    assert got.activations == one.activations and got.temporaries == one.temporaries + one.grads
    assert got.total == one.total + one.grads
    want = predict_step(model.config, cluster, dict(mesh.shape), batch=(8, 64), remat="full", grad_accumulation=2)
    assert steps.predicted_step(layout, cluster, task="train", batch=(8, 64)).time_s == want.time_s
    assert "in 2 microbatches of 4 run one after another: rows" in steps.batch_split(layout, "train", (8, 64))
    with pytest.raises(ValueError, match="8 sequences do not split into 3 microbatches; use a count that divides 8: "
                                         "1, 2, 4, 8"):
        steps.step_ledger(model, layout.replace(model, grad_accumulation=3), cluster, task="train", batch=(8, 64),
                          optimizer="adamw")


def test_a_prefill_or_decode_step_has_no_backward_to_plan(model, cluster):
    layout = Layout.of(model, steps.explorer_mesh({"dp": 2, "fsdp": 4}, cluster), remat="full", zero_stage=1,
                       grad_accumulation=2)
    assert steps.step_plan(layout, task="train", batch=(8, 64)) == Plan({"dp": 2, "fsdp": 4}, remat="full",
                                                                         zero_stage=1, grad_accumulation=2)
    for task in ("prefill", "decode"):
        assert steps.step_plan(layout, task=task, batch=(8, 64)) == Plan({"dp": 2, "fsdp": 4}, remat="none")
        assert steps.step_ledger(model, layout, cluster, task=task, batch=(8, 64), optimizer="adamw").kind == task


def test_the_batch_axes_and_the_experts_placement_are_the_layouts():
    """Mixtral's experts over ep=2 x fsdp=4: the batch over ep too where the partition axis says so (the advisor's
    expert-parallel layouts), the experts split over fsdp unless rules keep them whole (no fsdp in their specs)."""
    model = _model("mixtral", num_hidden_layers=2)
    cluster = Cluster.h100(nodes=1)
    mesh = steps.explorer_mesh({"ep": 2, "fsdp": 4}, cluster)
    split = Layout.of(model, mesh)
    assert steps.step_plan(split, task="train", batch=(8, 64)).batch_axes == ("fsdp", "dp")
    assert steps.experts_over_fsdp(split)
    over_ep = Layout.of(model, mesh, batch_partition_axis(split.partition_axis, dict(mesh.shape)))
    assert steps.step_plan(over_ep, task="train", batch=(8, 64)).batch_axes == ("fsdp", "dp", "ep")
    whole = Layout.of(model, mesh, rules=[("mlp/down_proj", (LAYERS, EP, TP, EMPTY)),
                                          ("mlp/(gate|up)_proj", (LAYERS, EP, EMPTY, TP))])
    assert not any("fsdp" in str(p.spec) for p in whole.params if "'ep'" in str(p.spec))
    assert not steps.experts_over_fsdp(whole)
    plan = steps.step_plan(whole, task="train", batch=(8, 64))
    assert not plan.experts_fsdp
    want = predict_step(model.config, cluster, dict(mesh.shape), batch=(8, 64), remat="none", experts_fsdp=False)
    assert steps.predicted_step(whole, cluster, task="train", batch=(8, 64)).time_s == want.time_s
    assert steps.experts_over_fsdp(Layout.of(model, steps.explorer_mesh({"ep": 2, "tp": 4}, cluster), rules=[
        ("mlp/down_proj", (LAYERS, EP, TP, EMPTY))]))  # no fsdp or sp to gather over


def test_a_chosen_pipeline_is_uneven_where_its_stages_do_not_divide_the_layers(model, cluster):
    flat = Layout.of(model, steps.explorer_mesh({"fsdp": 8}, cluster))
    assert steps.chosen_pipeline(flat, "1f1b", 4) is None
    mesh = steps.explorer_mesh({"pp": 2, "fsdp": 4}, cluster)
    piped = Layout.of(model, mesh, pipeline_partition_axis())
    assert steps.chosen_pipeline(piped, "1f1b", 4, 2) == PipelineConfig(2, 4, "1f1b")  # v only for interleaved
    assert steps.chosen_pipeline(piped, "interleaved", 4, 2) == PipelineConfig(2, 4, "interleaved", 2)
    assert steps.chosen_pipeline(piped, "interleaved", 4, 4).uneven  # 4 layers over 8 stages
    with pytest.raises(ValueError, match="the interleaved schedule runs microbatches in groups of num_stages"):
        steps.chosen_pipeline(piped, "interleaved", 3, 2)


def test_uneven_stages_are_held_as_equal_stages_as_deep_as_the_deepest(cluster):
    """6 layers on 4 stages: the deepest holds 2, so every device holds what an 8-layer model's stage does."""
    model = _model(num_hidden_layers=6)
    mesh = steps.explorer_mesh({"pp": 4, "fsdp": 2}, cluster)
    pipeline = PipelineConfig(4, 4, "1f1b", uneven=True)
    layout = Layout.of(model, mesh, pipeline_partition_axis(), remat="full", pipeline=pipeline)
    deeper = _model(num_hidden_layers=8)  # built by hand, not by stage_padded
    want = ledger(deeper, Layout.of(deeper, mesh, pipeline_partition_axis()), batch=(8, 64), remat="full",
                  cluster=cluster, pipeline=pipeline)
    got = steps.step_ledger(model, layout, cluster, task="train", batch=(8, 64), optimizer="adamw")
    assert got == want
    assert got.params < layout.param_bytes  # unpadded, 6 layers do not split over pp=4: each device held all 6
    assert steps.step_plan(layout, task="train", batch=(8, 64)).pipeline == pipeline
