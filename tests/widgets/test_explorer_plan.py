"""The ShardingExplorer's plan controls on a cluster (gradient accumulation, ZeRO-1, a pp mesh's pipeline): they start
as the layout's, show where the step uses them, change the ledger and the predicted step as the core counts them when
called by hand, travel in the export, follow a load, and a value that makes no step says what to change inline."""

import json

import pytest

from workbench.core.cost.ledger import ledger
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.pipeline import pipeline_partition_axis
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import Plan
from workbench.core.views.explore import Layout
from workbench.core.views.explore_step import explorer_mesh
from workbench.widgets.sharding_explorer import ShardingExplorer


@pytest.fixture(scope="module")
def model():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))


@pytest.fixture(scope="module")
def cluster():
    return Cluster.h100(nodes=1)  # 8 devices


def _shown(row):
    return row.layout.display != "none"


def test_the_controls_start_as_the_layout_s_and_show_where_the_step_uses_them(model, cluster):
    mesh = explorer_mesh({"dp": 2, "fsdp": 4}, cluster)
    ex = ShardingExplorer(model, Layout.of(model, mesh, remat="full", zero_stage=1, grad_accumulation=2),
                          cluster=cluster, batch=(8, 64))
    assert (ex._remat.value, ex._accumulation.value, ex._zero.value) == ("full", 2, True)
    assert ex.plan() == Plan({"dp": 2, "fsdp": 4}, remat="full", zero_stage=1, grad_accumulation=2)
    assert _shown(ex._train_row) and not _shown(ex._pipeline_row)  # no pp axis: no pipeline to choose
    ex._task.value = "decode"  # no backward: nothing to accumulate, no optimizer state to split
    assert not _shown(ex._train_row) and ex.plan() == Plan({"dp": 2, "fsdp": 4}, remat="none")
    assert not ex.error


def test_microbatches_hold_one_microbatch_and_the_gradients_sum(model, cluster):
    mesh = explorer_mesh({"fsdp": 4, "tp": 2}, cluster)
    ex = ShardingExplorer(model, mesh=dict(mesh.shape), cluster=cluster, batch=(16, 64))
    ex._remat.value = "full"
    ex._accumulation.value = 4
    assert not ex.error, ex.error
    plain = Layout.of(model, mesh)
    one = ledger(model, plain, batch=(4, 64), remat="full", cluster=cluster)  # 16 sequences / 4
    assert ex.ledger().total == one.total + one.grads and ex.ledger().activations == one.activations
    want = predict_step(model.config, cluster, dict(mesh.shape), batch=(16, 64), remat="full", grad_accumulation=4)
    assert ex.predicted_step().time_s == want.time_s
    assert "in 4 microbatches of 4 run one after another" in ex._ledger_out.value
    assert json.loads(ex.export()[1])["grad_accumulation"] == 4 and "grad_accumulation=4" in ex.export()[0]

    ex._accumulation.value = 3  # does not divide the 16 sequences: said inline, nothing escapes
    assert ex.error == ("ledger: 16 sequences do not split into 3 microbatches; use a count that divides 16: "
                        "1, 2, 4, 8, 16")
    assert ex._ledger_out.value == ""
    ex._accumulation.value = 8  # divides them, but leaves 2 sequences for 4 data-parallel ways: the step model says
    assert ex.error.startswith("predicted step: 16 sequences do not split into 8 microbatches over 4 data-parallel")
    ex._accumulation.value = 2
    assert not ex.error and ex.ledger().total < ledger(model, plain, batch=(16, 64), remat="full",
                                                       cluster=cluster).total


def test_zero_1_splits_the_optimizer_state_over_dp(model, cluster):
    mesh = explorer_mesh({"dp": 4, "fsdp": 2}, cluster)
    ex = ShardingExplorer(model, dict(mesh.shape), cluster=cluster, batch=(8, 64))
    ex._zero.value = True
    zero = ledger(model, Layout.of(model, mesh, zero_stage=1), batch=(8, 64), remat="none", cluster=cluster)
    assert ex.ledger() == zero and zero.optimizer < ledger(model, Layout.of(model, mesh), batch=(8, 64),
                                                           remat="none", cluster=cluster).optimizer
    assert ex.plan().zero_stage == 1 and json.loads(ex.export()[1])["zero_stage"] == 1


def test_a_pp_mesh_s_pipeline_is_chosen_counted_exported_and_loaded(model, cluster):
    ex = ShardingExplorer(model, {"pp": 2, "fsdp": 4}, cluster=cluster, batch=(16, 64))
    assert _shown(ex._pipeline_row) and not _shown(ex._virtual) and ex._schedule.value == "1f1b"
    assert ex._pipe_m.value == 4  # 1F1B's default: as many microbatches as divide a data shard's rows, up to 2 p
    ex._schedule.value = "interleaved"
    assert _shown(ex._virtual) and not ex.error, ex.error
    interleaved = PipelineConfig(2, 4, "interleaved", 2)
    assert ex.plan().pipeline == interleaved
    mesh = explorer_mesh({"pp": 2, "fsdp": 4}, cluster)
    assert ex.ledger() == ledger(model, Layout.of(model, mesh, pipeline_partition_axis()), batch=(16, 64),
                                 remat="none", cluster=cluster, pipeline=interleaved)
    ex._pipe_m.value = 3  # the interleaved schedule runs microbatches in groups of the stages
    assert "in groups of num_stages: num_microbatches=3 must be a multiple of num_stages=2" in ex.error
    ex._pipe_m.value = 2
    assert not ex.error
    text = ex.export()[1]
    assert json.loads(text)["pipeline"] == {"num_stages": 2, "num_microbatches": 2, "schedule": "interleaved",
                                            "virtual_stages": 2}
    other = ShardingExplorer(model, cluster=cluster, batch=(16, 64))
    assert not _shown(other._pipeline_row)
    assert other.load(text) and _shown(other._pipeline_row)
    assert (other._schedule.value, other._pipe_m.value, other._virtual.value) == ("interleaved", 2, 2)
    assert other.plan() == ex.plan()
