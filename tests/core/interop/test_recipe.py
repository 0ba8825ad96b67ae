"""TrainingRecipe.from_layout: the plan a Layout or an advisor's row carries (remat, pipeline, ZeRO stage, gradient
accumulation) becomes the recipe's, lays out again as the same plan, and prices as the row did."""

import pytest

from workbench.core.advisor import advise
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.recipe import TrainingRecipe
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.pipeline import pipeline_partition_axis
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import Plan
from workbench.core.views.explore import Layout


@pytest.fixture(scope="module")
def model():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))


def test_a_layout_s_plan_becomes_the_recipe_s(model):
    layout = Layout.of(model, make_mesh(dp=2, fsdp=4), remat="dots_saveable", zero_stage=1, grad_accumulation=4)
    r = TrainingRecipe.from_layout(layout, batch=(64, 1024))
    assert (r.remat, r.zero_stage, r.grad_accumulation, r.pipeline) == ("dots_saveable", 1, 4, None)
    assert r.plan == Plan({"dp": 2, "fsdp": 4}, remat="dots_saveable", zero_stage=1, grad_accumulation=4)
    back = r.layout(model, Cluster.h100(nodes=1))
    assert (back.remat, back.zero_stage, back.grad_accumulation) == ("dots_saveable", 1, 4)
    assert TrainingRecipe.from_layout(layout, batch=(64, 1024), grad_accumulation=2).grad_accumulation == 2
    assert TrainingRecipe.from_layout({"fsdp": 8}, batch=(64, 1024)).grad_accumulation == 1

    pipeline = PipelineConfig(2, 8, "interleaved", 2)
    piped = Layout.of(model, make_mesh(pp=2, fsdp=4), pipeline_partition_axis(), remat="full", pipeline=pipeline)
    r = TrainingRecipe.from_layout(piped, batch=(64, 1024))
    assert (r.pipeline, r.grad_accumulation, r.num_layers) == (pipeline, 1, 4)


def test_an_advisor_s_accumulated_row_is_the_recipe_s_plan_and_prices_the_same():
    """Llama-3-8B on v5p:2x2x4 at 8k, 1M tokens a step (the review's TPU case): its rows need accumulation."""
    config = full_config("llama-3-8b")
    cluster = Cluster.tpu("v5p:2x2x4")
    advice = advise(config, cluster, batch_tokens=2**20, seq_len=8192)
    rows = [c for c in advice.ranked[:10] if c.grad_accumulation > 1]
    assert rows
    for c in rows:
        r = TrainingRecipe.from_layout(c, batch=advice.batch)
        assert r.grad_accumulation == c.grad_accumulation and r.plan == c.plan, c.label
        assert r.price(config, cluster).time_s == c.time_s
