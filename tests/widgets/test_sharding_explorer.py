"""ShardingExplorer, driven by calling its controls' callbacks (setting values, clicking buttons)."""

import html
import re

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import path_str
from workbench.core.views import explore
from workbench.widgets.sharding_explorer import ShardingExplorer, layout_html

Q_PROJ = "layers/self_attn/q_proj/kernel"


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


@pytest.fixture
def explorer():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    return ShardingExplorer(model, make_mesh(dp=2, fsdp=2, tp=2))


def table_specs(explorer):
    """path -> the PartitionSpec text shown in the widget's table."""
    rows = re.findall(r'data-path="([^"]+)".*?class="wb-spec"[^>]*>([^<]*)<', explorer._table.value)
    return {path: html.unescape(spec) for path, spec in rows}


def test_table_shows_every_parameter_and_the_chart_is_plotly(explorer):
    specs = table_specs(explorer)
    # tiny Llama: embeddings, 7 stacked kernels + 2 stacked norms, final norm, head
    assert list(specs) == list(explorer.layout.paths) and len(specs) == 12
    assert specs[Q_PROJ] == "P(None, ('fsdp', 'sp'), 'tp')"
    figure = explorer._chart.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert [t["name"] for t in figure["data"]] == ["parameters", "optimizer state (AdamW)", "KV cache"]
    assert figure["layout"]["barmode"] == "stack" and figure["data"][0]["x"] == [str(i) for i in range(8)]
    assert explorer.editor.fields["tensor_parallel_axis"].options == ("pp", "dp", "fsdp", "ep", "tp", "sp")
    assert "wb-sharding-explorer" in explorer.widget._dom_classes



def test_the_change_summary_counts_what_the_chart_counts(explorer):
    """Ticking the KV cache after an edit: the summary's 'after' is the chart's total, its 'before' the previous
    layout counted the same way (both with the cache), not the totals of the edit's moment."""
    from workbench.core.units import format_bytes

    old = explorer.layout
    explorer.editor.fields["tensor_parallel_axis"].value = "dp"
    explorer._kv_on.value = True
    kv = explorer._memory_options()
    assert kv["kv_cache"] is not None
    chart = explorer._chart.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert chart["layout"]["title"]["text"] == f"memory per device: {format_bytes(explorer.memory().total)}"
    assert explorer.last_diff.new_memory.total == explorer.memory().total
    assert explorer.last_diff.old_memory == explore.layout_memory(old, **kv)
    assert explorer.last_diff.new_memory.kv_cache > 0
    assert f"→ {format_bytes(explorer.memory().total)}" in html.unescape(explorer._diff.value)

def test_changing_the_tp_axis_re_renders_the_table_and_lists_the_diff(explorer):
    old = explorer.layout
    explorer.editor.fields["tensor_parallel_axis"].value = "dp"
    assert explorer.error == "" and explorer.partition_axis.tensor_parallel_axis == "dp"
    assert table_specs(explorer)[Q_PROJ] == "P(None, ('fsdp', 'sp'), 'dp')"
    changed = [c.path for c in explorer.last_diff.changed]
    assert Q_PROJ in changed and changed == [c.path for c in explore.diff(old, explorer.layout).changed]
    assert f"{Q_PROJ}</td>" in explorer._diff.value and "changed spec" in explorer._diff.value
    assert 'background:#fff3c4' in re.search(rf'<tr[^>]*data-path="{Q_PROJ}"[^>]*>', explorer._table.value).group()


@pytest.mark.parametrize("edit, message", [
    (lambda e: setattr(e.editor.fields["batch_axis"], "value", "FSDP, data"), "mesh axis 'data'"),
    (lambda e: e.editor.add_rule("([", "TP, EMPTY"), "does not compile"),
    (lambda e: e.editor.add_rule("embed_tokens", "TP"), "name 1 dimensions"),
    (lambda e: e.editor.add_rule("embed_tokens", "TP, EMBD"), "Did you mean EMBED"),
])
def test_a_bad_edit_shows_an_inline_error_and_keeps_the_last_layout(explorer, edit, message):
    layout, table = explorer.layout, explorer._table.value
    edit(explorer)  # must not raise
    assert message in explorer.error and "wb-error" in explorer._error.value
    assert explorer.layout is layout and explorer.partition_axis is layout.partition_axis
    assert explorer._table.value == table
    # fixing it clears the error
    explorer.edit(partition_axis=layout.partition_axis, rules=())
    assert explorer.error == "" and explorer._error.value == ""


def test_a_rule_with_semantic_axes_adds_their_field_to_the_editor(explorer):
    explorer.editor.add_rule("embed_tokens", "VOCAB, EMBED")
    assert explorer.error == ""
    assert explorer.rules == (("embed_tokens", ("__VOCAB__", "__EMBED__")),)
    assert {"vocab_axis", "hidden_state_axis"} <= set(explorer.editor.fields)
    explorer.editor.fields["hidden_state_axis"].value = "fsdp"
    assert explorer.layout["embed_tokens"].spec == PartitionSpec("tp", "fsdp")
    explorer.editor._rules[0].remove.click()
    assert explorer.rules == () and "hidden_state_axis" not in explorer.editor.fields


def test_memory_controls_and_mode(explorer):
    base = explorer.memory()
    explorer._kv_on.value = True
    with_kv = explorer.memory()
    assert with_kv.kv_cache > 0 and with_kv.total == base.total + with_kv.kv_cache
    explorer._optimizer.value = False
    assert explorer.memory().optimizer == 0
    figure = explorer._chart.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert figure["data"][1]["y"] == [0.0] * 8 and figure["data"][2]["y"][0] > 0
    explorer.editor.mode.value = "__autoregressive__"
    assert explorer.mode == "__autoregressive__" and explorer.error == ""


def test_filter_box_filters_rows_and_a_bad_regex_is_an_inline_error(explorer):
    explorer._filter.value = r"mlp/.*kernel"
    assert len(table_specs(explorer)) == 3  # gate, up, down: each stacked over the 2 layers
    explorer._filter.value = "(("
    assert explorer.error.startswith("filter: '((' is not a regex: ") and len(table_specs(explorer)) == 3
    explorer._filter.value = ""
    assert explorer.error == ""


def test_collectives_button_fills_the_panel_and_marks_it_stale_after_an_edit(explorer):
    explorer._batch_t.value = 16
    explorer._collectives_button.click()
    panel = explorer._collectives_out.value
    assert panel.count('class="wb-collective-row"') == len(explorer.collectives.by_axes()) > 0
    assert "forward step, batch 8×16" in panel
    explorer.editor.fields["tensor_parallel_axis"].value = "dp"
    assert "stale" in explorer._collectives_out.value


def test_set_mesh_re_resolves_and_a_mesh_without_the_axes_is_refused(explorer):
    assert explorer.set_mesh(make_mesh(fsdp=1, tp=8))
    assert explorer.layout[Q_PROJ].shard_shape == (2, 64, 8) and "tp=8" in explorer._title.value
    layout = explorer.layout
    assert not explorer.set_mesh(AbstractMesh((8,), ("data",)))
    assert "mesh axis" in explorer.error and "last valid mesh" in explorer.error and explorer.layout is layout


def test_apply_reshards_the_live_model_as_the_layout_says(llama):
    explorer = ShardingExplorer(llama, make_mesh(dp=2, fsdp=2, tp=2))
    explorer.editor.fields["tensor_parallel_axis"].value = "fsdp"
    explorer.editor.fields["fully_sharded_data_parallel_axis"].value = "tp"
    explorer._apply_button.click()
    assert "re-sharded 12 parameters" in explorer._apply_status.value and explorer.model is not llama
    for path, var in nnx.to_flat_state(nnx.state(explorer.model, nnx.Param)):
        assert var.get_value().sharding == NamedSharding(explorer.mesh, explorer.layout[path_str(path)].spec)
    assert explorer.layout[Q_PROJ].spec == PartitionSpec(None, ("tp", "sp"), "fsdp")


def test_an_abstract_model_cannot_be_applied(explorer):
    assert explorer._apply_button.disabled
    assert explorer.apply() is None and explorer.error.startswith("apply: ") and "live model" in explorer.error
    assert explorer._apply_status.value == ""


def test_static_html_and_display(explorer):
    static = explorer._repr_html_()
    assert static.count('class="wb-param-row"') == 12 and "wb-memory-bars" in static
    assert layout_html(explorer.layout) in static
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == ("ShardingExplorer(llama, 12 parameters, mesh pp=1, dp=2, fsdp=2, ep=1, tp=2, sp=1, "
                                    "MODE_TRAIN)")
    assert jax.tree.leaves(nnx.state(explorer.model, nnx.Param))[0].__class__ is jax.ShapeDtypeStruct


def test_experts_panel_shows_the_all_to_all_pair_flops_and_drops():
    moe_model = tiny("mixtral")
    ex = ShardingExplorer(moe_model, make_mesh(dp=2, fsdp=1, ep=4), batch=(8, 32))
    button = next(c for c in _walk(ex.widget) if "wb-experts-button" in getattr(c, "_dom_classes", ()))
    ex._capacity.value = 1.0
    button.click()
    assert ex.experts is not None and ex.experts.capacity_factor == 1.0
    text = html.unescape(re.sub(r"<[^>]+>", "", ex._experts_out.value))
    assert "all-to-alls" in text and "vs" in text and "dense" in text
    assert f"{ex.experts.dispatch.dropped_fraction:.1%} of the copies dropped" in text
    ex.edit(partition_axis=ex.partition_axis.replace(expert_parallel_axis="dp"))
    assert "stale" in ex._experts_out.value
    llama_explorer = ShardingExplorer(tiny("llama"), make_mesh(dp=8, fsdp=1))
    assert not any("wb-experts-button" in getattr(c, "_dom_classes", ()) for c in _walk(llama_explorer.widget))


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def test_on_a_virtual_cluster_the_collectives_compile_for_its_devices():
    """A 16-device CPU cluster (more than the notebook's 8): the layout sits on an AbstractMesh and the
    "collectives" and "experts" buttons compile in the cluster's worker; the HLO's groups span 16 devices."""
    from workbench.core.compile.steps import full_mesh_shape
    from workbench.core.hardware.cluster import Cluster, cluster_mesh
    from workbench.core.mesh import MESH_AXES

    cluster = Cluster.cpu(16)
    mesh = cluster_mesh(cluster, full_mesh_shape({"dp": 4, "ep": 4}, cluster), MESH_AXES)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("mixtral")))
    ex = ShardingExplorer(model, mesh, cluster=cluster, batch=(8, 16))
    assert ex.compute_collectives(), ex._collectives_out.value
    kinds = {(r.kind, r.mesh_axes) for r in ex.collectives.records}
    assert ("all-to-all", ("ep",)) in kinds and all(len(g) == 4 for r in ex.collectives.records
                                                    for g in r.replica_groups)
    assert ex.collectives.matmul_flops > 0
    assert ex.compute_experts(), ex._experts_out.value
    assert ex.experts.dispatch is None and ex.experts.flops_vs_dense < 1  # abstract model: no router to run
