"""The ledger of a pipelined train step: the layers' bytes divide by the stage count, and the activations follow
the schedule (GPipe minus 1F1B == the compiled steps' difference of temporary memory, XLA's memory_analysis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.cost.ledger import ledger
from workbench.core.mesh import make_mesh
from workbench.core.models.presets import tiny
from workbench.core.pipeline import PipelineConfig, pipeline_loss_and_grads, pipeline_partition_axis
from workbench.core.views.explore import Layout

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
B, T = 32, 128


def _model():
    return tiny("llama", num_hidden_layers=8, hidden_size=128, intermediate_size=256)


def test_layers_divide_by_the_stage_count():
    model = _model()
    plain = Layout.of(model, make_mesh(dp=8, fsdp=1))
    mesh = make_mesh(pp=4, dp=2, fsdp=1)
    piped = Layout.of(model, mesh, pipeline_partition_axis())
    layer_bytes = sum(p.bytes_per_device for p in plain.params if p.path.startswith("layers/"))
    rest = plain.param_bytes - layer_bytes
    assert piped.param_bytes == rest + layer_bytes // 4
    book = ledger(model, piped, batch=(B, T), pipeline=PipelineConfig(4, 8, "1f1b"))
    assert book.params == book.grads == piped.param_bytes
    assert book.optimizer == 2 * piped.param_bytes + 4  # AdamW's two moments and its count


def test_activations_follow_the_schedule_as_compiled():
    model = _model()
    mesh = make_mesh(pp=4, dp=2, fsdp=1)
    pa = pipeline_partition_axis()
    sharded = model.shard_model(mesh, pa)
    layout = Layout.of(sharded, mesh, pa)
    graphdef, params, other = nnx.split(sharded, nnx.Param, ...)
    batch = {"input_ids": jax.device_put(jnp.zeros((B, T), jnp.int32), NamedSharding(mesh, P("dp")))}
    temp, kept = {}, {}
    for schedule in ("gpipe", "1f1b"):
        config = PipelineConfig(4, 8, schedule)
        fn = jax.jit(lambda p, o, b, config=config: pipeline_loss_and_grads(graphdef, p, o, b, config, mesh))
        temp[schedule] = fn.lower(params, other, batch).compile().memory_analysis().temp_size_in_bytes
        kept[schedule] = ledger(sharded, layout, batch=(B, T), pipeline=config).activations
    assert kept["gpipe"] > kept["1f1b"]
    assert kept["gpipe"] - kept["1f1b"] == pytest.approx(temp["gpipe"] - temp["1f1b"], rel=0.05)


def test_pipeline_ledger_errors():
    model = _model()
    mesh = make_mesh(pp=4, dp=2, fsdp=1)
    with pytest.raises(ValueError, match=r"pipeline_partition_axis\(\)"):
        ledger(model, Layout.of(model, mesh), batch=(B, T), pipeline=PipelineConfig(4, 8))
    with pytest.raises(ValueError, match=r"num_stages=2.*pp=4"):
        ledger(model, Layout.of(model, mesh, pipeline_partition_axis()), batch=(B, T), pipeline=PipelineConfig(2, 8))
