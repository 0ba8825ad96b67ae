"""The explorer's step rules, each against the core function it must agree with: predict_step and the ledger
called by hand, pipeline_partition_axis, default_config, format_bytes, Layout's JSON."""

import types

import pytest

from workbench.core.axes import EMPTY, MODE_DECODE, TP, PartitionAxis
from workbench.core.cost.ledger import ledger
from workbench.core.cost.predicted import predict_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.pipeline import default_config, pipeline_partition_axis
from workbench.core.units import format_bytes
from workbench.core.views import explore_step as steps
from workbench.core.views.explore import Layout


@pytest.fixture(scope="module")
def model():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))


@pytest.fixture(scope="module")
def cluster():
    return Cluster.h100(nodes=1)  # 8 devices


def test_a_decode_step_is_one_token_per_sequence_against_a_cache_of_t():
    assert steps.step_batch("decode", (4, 256)) == ((4, 1), 256)
    assert steps.step_batch("train", (4, 256)) == steps.step_batch("prefill", (4, 256)) == ((4, 256), None)


def test_pipelined_is_pipeline_partition_axis_on_a_pp_mesh_only():
    pp, flat = make_mesh(pp=2, fsdp=4), make_mesh(fsdp=8)
    assert steps.pipelined(None, pp) == pipeline_partition_axis() and steps.pipelined(None, pp).layer_axis == "pp"
    given = PartitionAxis().replace(head_axis="tp")
    assert steps.pipelined(given, pp) == pipeline_partition_axis(given)
    assert steps.pipelined(None, flat) is None and steps.pipelined(given, flat) is given
    placed = PartitionAxis().replace(layer_axis="fsdp")  # a rule already places the layers: kept
    assert steps.pipelined(placed, pp) is placed


def test_the_explorer_mesh(cluster):
    mesh = make_mesh(fsdp=8)
    assert steps.explorer_mesh(mesh, None) is mesh
    with pytest.raises(ValueError, match="give a mesh"):
        steps.explorer_mesh({"fsdp": 8}, None)
    assert dict(steps.explorer_mesh(None, cluster).shape) == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
    assert dict(steps.explorer_mesh({"fsdp": 4, "tp": 2}, cluster).shape)["tp"] == 2
    with pytest.raises(ValueError, match="the mesh has 4 devices"):
        steps.explorer_mesh(make_mesh(fsdp=4, devices=mesh.devices.flat[:4]), cluster)


def test_the_step_pipeline_is_the_layouts_or_1f1b_on_a_pp_mesh(model):
    flat = Layout.of(model, make_mesh(fsdp=8))
    assert steps.step_pipeline(flat, 8) is None
    pp_mesh = make_mesh(pp=2, fsdp=4)
    piped = Layout.of(model, pp_mesh, steps.pipelined(None, pp_mesh))
    assert steps.step_pipeline(piped, 16) == default_config(pp_mesh, 16)


@pytest.mark.parametrize("task", ["train", "decode"])
def test_the_ledger_and_the_predicted_step_are_the_cores_called_as_the_advisor_does(model, cluster, task):
    layout = Layout.of(model, steps.explorer_mesh({"fsdp": 4, "tp": 2}, cluster), remat="full")
    batch, kv_length = ((8, 1), 64) if task == "decode" else ((8, 64), None)
    got = steps.predicted_step(layout, cluster, task=task, batch=(8, 64))
    want = predict_step(layout.config, cluster, dict(layout.mesh.shape), batch=batch, task=task, remat="full",
                        kv_length=kv_length)
    assert got.time_s == want.time_s > 0
    assert steps.step_ledger(model, layout, cluster, task=task, batch=(8, 64), optimizer="adamw") == \
        ledger(model, layout, kind=task, batch=batch, kv_length=kv_length, remat="full", cluster=cluster)
    assert steps.batch_split(layout, task, (8, 64)).startswith(f"batch 8 × {batch[1]} tokens: rows ")


def test_chart_bytes_are_in_the_unit_format_bytes_writes():
    for total in (512, 3 * 2**20 + 5, 37.4e9):
        unit, values = steps.chart_bytes(total, [total, total / 2])
        assert format_bytes(total).endswith(f" {unit}") and values[0] == pytest.approx(values[1] * 2, abs=1e-3)
    assert steps.chart_bytes(3 * 2**30, [2**29]) == ("GiB", [0.5])


def test_resolve_on_reads_a_layout_or_its_json_and_refuses_another_model(model):
    mesh = make_mesh(fsdp=4, tp=2)
    current = Layout.of(model, mesh)
    other = Layout.of(model, mesh, rules=[("embed_tokens", (TP, EMPTY))], mode=MODE_DECODE)
    assert steps.resolve_on(other.to_json(), model, current).params == other.params
    assert steps.resolve_on(other, model, current).mode == MODE_DECODE
    small = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=2)))
    with pytest.raises(ValueError, match="another model"):
        steps.resolve_on(Layout.of(small, mesh), model, current)
    with pytest.raises(TypeError, match="load takes a Layout"):
        steps.resolve_on(3, model, current)


def test_names_auto_axes(model):
    assert steps.names_auto_axes(Layout.of(model, make_mesh(fsdp=8)))
    explicit = types.SimpleNamespace(mesh=types.SimpleNamespace(explicit_axes=("fsdp", "tp")),
                                     params=[types.SimpleNamespace(spec=(("fsdp", "tp"), None, "tp"))])
    assert not steps.names_auto_axes(explicit)


def test_step_model_changes_only_what_differs(model):
    assert steps.step_model(model) is model and steps.step_model(model, "", getattr(model, "remat", "none")) is model
