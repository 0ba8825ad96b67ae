"""ShardingExplorer's export (issue 17): the "export" button shows the layout as Python and as JSON (the
snippet, exec'd, rebuilds the explorer's layout), and load() switches to a given layout or its JSON,
with an inline error for one that does not fit."""

import dataclasses
import html
import json
import re

import jax
import pytest

import workbench as wb
from workbench.core.axes import EMPTY, MODE_DECODE, TP, VOCAB, PartitionAxis
from workbench.core.cost import ledger as ledgers
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.pipeline import default_config
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.views.explore import Layout
from workbench.widgets.sharding_explorer import ShardingExplorer

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
Q_PROJ = "layers/self_attn/q_proj/kernel"


@pytest.fixture(scope="module")
def model():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))


def shown(explorer):
    """(code, json) as the export area shows them."""
    value = explorer._export_out.value
    assert 'class="wb-export"' in value
    code = re.search(r'<pre class="wb-export-code"[^>]*>(.*?)</pre>', value, re.S).group(1)
    text = re.search(r'<pre class="wb-export-json"[^>]*>(.*?)</pre>', value, re.S).group(1)
    return html.unescape(code), html.unescape(text)


def rebuilt(code, model):
    namespace = {"wb": wb, "model": model}
    exec(code, namespace)
    return namespace["layout"]


def table_specs(explorer):
    rows = re.findall(r'data-path="([^"]+)".*?class="wb-spec"[^>]*>([^<]*)<', explorer._table.value)
    return {path: html.unescape(spec) for path, spec in rows}


def test_the_export_button_shows_code_that_rebuilds_the_layout_and_follows_edits(model):
    ex = ShardingExplorer(model, make_mesh(dp=2, fsdp=2, tp=2))
    assert ex._export_out.value == "" and "wb-export-button" in ex._export_button._dom_classes
    ex._export_button.click()
    code, text = shown(ex)
    assert (code, text) == ex.export()
    assert "mesh = wb.make_mesh(dp=2, fsdp=2, tp=2)" in code
    assert rebuilt(code, model).specs == ex.layout.specs
    assert Layout.from_json(text, model) == ex.layout
    # an edit: the shown export follows
    assert ex.edit(rules=[("embed_tokens", (VOCAB, EMPTY))], mode=MODE_DECODE)
    code, text = shown(ex)
    assert "('embed_tokens', (VOCAB, EMPTY))," in code and "mode=MODE_DECODE" in code
    layout = rebuilt(code, model)
    assert layout.specs == ex.layout.specs and layout.rules == ex.rules and layout.mode == ex.mode
    assert json.loads(text)["rules"] == [{"pattern": "embed_tokens", "axes": [VOCAB, EMPTY]}]
    ex.editor.fields["tensor_parallel_axis"].value = "dp"
    assert json.loads(shown(ex)[1])["partition_axis"] == {"tensor_parallel_axis": "dp"}


def test_load_switches_to_a_layout_or_its_json(model):
    source = ShardingExplorer(model, make_mesh(fsdp=4, tp=2), PartitionAxis(vocab_axis=None),
                              [("embed_tokens", (TP, None))], MODE_DECODE)
    ex = ShardingExplorer(model, make_mesh(dp=8, fsdp=1))
    _, text = source.export()
    assert ex.load(text) and ex.error == ""
    assert dict(ex.mesh.shape) == dict(source.mesh.shape)
    for name in ("partition_axis", "rules", "mode"):
        assert getattr(ex, name) == getattr(source, name)
    assert table_specs(ex) == table_specs(source)
    assert ex.editor.read(ex.partition_axis) == (source.partition_axis, source.rules, MODE_DECODE)  # controls follow
    assert Q_PROJ in [c.path for c in ex.last_diff.changed]  # dp=8 -> fsdp=4 x tp=2
    assert ex.export() == source.export()  # the round trip through the explorer is exact
    # an advised layout: a Layout of the same model
    advised = Layout.of(model, make_mesh(fsdp=2, tp=4), rules=[("lm_head", (EMPTY, TP))])
    assert ex.load(advised) and ex.layout.specs == advised.specs and ex.rules == advised.rules
    # pasted into the text box
    ex._load_text.value = text
    ex._load_button.click()
    assert ex.error == "" and ex._load_text.value == "" and ex.layout.specs == source.layout.specs


def test_a_bad_layout_shows_an_inline_error_and_keeps_the_last_valid_one(model):
    ex = ShardingExplorer(model, make_mesh(dp=2, fsdp=2, tp=2))
    before = ex.layout
    _, good = ex.export()
    other = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=3)))
    cases = [
        ("{not json", "not JSON"),
        (good.replace('"version": 1', '"version": 7'), "unknown layout format version 7"),
        (good.replace('"rules"', '"rulez"'), r"unknown field\(s\) \['rulez'\]"),
        (good.replace('"partition_axis": {}', '"partition_axis": {"tp_axis": "tp"}'), "PartitionAxis has no field"),
        (good.replace('"cluster": null', '"cluster": {"cpu": 8}'), "planned for the cluster {'cpu': 8}, not for an "
                                                                   "explorer without a cluster"),
        (Layout.of(other, make_mesh(fsdp=8)), "resolved for another model"),
        (42, "load takes a Layout or its JSON"),
    ]
    for bad, message in cases:
        assert ex.load(bad) is False
        assert re.search(message, ex.error), (message, ex.error)
        assert "still showing the last valid layout" in ex.error and ex._error.value
        assert ex.layout is before
    ex._load_text.value = "{"
    ex._load_button.click()  # a click never raises
    assert "not JSON" in ex.error and ex._load_text.value == "{"
    assert ex.load(good) and ex.error == "" and ex._error.value == error_free()


def error_free():
    from workbench.widgets._html import error_html

    return error_html("")


def test_on_a_cluster_the_remat_control_and_the_mesh_choice_follow_a_load(model):
    cluster = Cluster.h100(nodes=2, gpus_per_node=4)
    source = ShardingExplorer(model, {"fsdp": 4, "tp": 2}, cluster=cluster)
    source._remat.value = "full"
    code, text = source.export()
    assert json.loads(text)["cluster"] == {"gpu": "h100", "nodes": 2, "gpus_per_node": 4}
    assert json.loads(text)["remat"] == "full"
    assert "cluster = Cluster.h100(nodes=2, gpus_per_node=4)" in code and "with_options(remat='full')" in code
    assert rebuilt(code, model).specs == source.layout.specs

    ex = ShardingExplorer(model, cluster=cluster)
    assert ex._remat.value == "none" and ex._mesh_choice.value == "fsdp=8"
    assert ex.load(text), ex.error
    assert ex._remat.value == "full" and ex._mesh_choice.value == "fsdp=4 × tp=2"
    assert ex.ledger() == ledgers.ledger(model, ex.layout, batch=(8, 64), remat="full", cluster=cluster)
    assert ex.export() == source.export()
    # a JSON without a cluster loads on the explorer's cluster; another cluster's does not
    assert ex.load(Layout.of(model, make_mesh(fsdp=2, tp=4)).to_json()) and dict(ex.mesh.shape)["tp"] == 4
    elsewhere = Layout.of(model, make_mesh(fsdp=8)).to_json(cluster=Cluster.h200(nodes=1))
    assert not ex.load(elsewhere) and "planned for the cluster {'gpu': 'h200'" in ex.error
    bad_remat = json.dumps({**json.loads(text), "remat": "dots_with_no_batch_dims_saveable"})
    assert not ex.load(bad_remat) and "the ledger counts" in ex.error


def test_a_pp_mesh_exports_its_pipeline_and_a_loaded_pipeline_sizes_the_ledger(model):
    cluster = Cluster.h100(nodes=1)
    ex = ShardingExplorer(model, {"pp": 2, "fsdp": 4}, cluster=cluster, batch=(16, 64))
    default = default_config(ex.mesh, 16)
    assert ex.exported_layout().pipeline == default
    code, _ = ex.export()
    assert f"PipelineConfig(num_stages=2, num_microbatches={default.num_microbatches}, schedule='1f1b')" in code
    layout = rebuilt(code, model)
    assert layout.specs == ex.layout.specs and layout.pipeline == default
    assert ex.layout.partition_axis.layer_axis == "pp"

    gpipe = PipelineConfig(2, 2, "gpipe")
    assert ex.load(ex.layout.replace(model, pipeline=gpipe))
    assert ex.layout.pipeline == gpipe and json.loads(ex.export()[1])["pipeline"]["schedule"] == "gpipe"
    assert ex.ledger() == ledgers.ledger(model, ex.layout, batch=(16, 64), remat="none", cluster=cluster,
                                         pipeline=gpipe)
    assert ex.set_mesh({"pp": 4, "fsdp": 2})  # planned for pp=2: the pp=4 mesh gets its default pipeline,
    # its stages uneven as the advisor marks them where they do not divide the layers (2 cannot fill 4: it says so)
    assert ex.layout.pipeline is None
    assert ex.exported_layout().pipeline == dataclasses.replace(default_config(ex.mesh, 16), uneven=True)
    assert "2 layers cannot fill 4 stages; use fewer stages" in ex.error
