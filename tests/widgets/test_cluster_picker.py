"""The cluster picker of the LayoutAdvisor and the ShardingExplorer (issue 50: "The new presets are in the cluster
picker of the explorer and the advisor"): the presets offered, a switch re-ranks (advisor) or lays the rules out on
the new cluster (explorer), and a failure shows inline and leaves the widget usable. Nothing compiles for a TPU: the
TPU test only asks libtpu for a slice's devices (the quick tier skips it)."""

import html
import importlib.util
import re

import ipywidgets as w
import pytest

from workbench.core.advisor import advise
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.presets import CLUSTER_PRESETS, cluster_preset
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.units import format_bytes
from workbench.widgets import _explorer_cluster
from workbench.widgets import layout_advisor as layout_advisor_module
from workbench.widgets._cluster_html import mesh_options
from workbench.widgets.layout_advisor import LayoutAdvisor
from workbench.widgets.sharding_explorer import ShardingExplorer

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
H100, GB200 = "H100 1 node (8 GPUs)", "GB200 NVL72 1 rack (72 GPUs)"
# 72 sequences of 256 tokens: whole sequences over 8 H100s and over the 72 GPUs of a rack
TOKENS, SEQ = 72 * 256, 256


@pytest.fixture(scope="module")
def model():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))


def _first_row(advisor):
    return html.unescape(re.search(r'data-rank="1"[^>]*><td[^>]*>1</td><td[^>]*>([^<]*)<',
                                   advisor._table.value).group(1))


def _hbm(explorer):
    return re.search(r'wb-hbm-line" title="HBM per device ([^"]+)"', explorer._ledger_out.value).group(1)


def _classes(root):
    stack, found = [root], set()
    while stack:
        node = stack.pop()
        found |= set(node._dom_classes)
        if isinstance(node, w.Box):
            stack.extend(node.children)
    return found


def _usable(widget):
    assert isinstance(widget._repr_html_(), str) and widget.widget._repr_mimebundle_()


# -- the advisor ------------------------------------------------------------------------------------------------
def test_the_advisor_offers_the_presets_and_a_switch_re_ranks_on_the_new_cluster(model):
    advisor = LayoutAdvisor(model, Cluster.h100(nodes=1), batch_tokens=TOKENS, seq_len=SEQ)
    picker = advisor._cluster
    assert "wb-advisor-cluster" in picker._dom_classes and "wb-advisor-cluster" in _classes(advisor.widget)
    assert list(picker.options) == list(CLUSTER_PRESETS) and picker.value == H100
    before, h100_first = advisor._table.value, _first_row(advisor)
    advisor.open_in_explorer()
    assert advisor.explorer is not None

    picker.value = GB200
    gb200 = Cluster.gb200_nvl72(racks=1)
    assert not advisor.error
    assert advisor.cluster == gb200 and advisor.advice.cluster == gb200
    expected = advise(model, gb200, batch_tokens=TOKENS, seq_len=SEQ, constraints=advisor.constraints)
    assert _first_row(advisor) == expected.ranked[0].label != h100_first
    assert advisor._table.value != before
    assert "GB200 NVL72" in advisor._title.value and "GB200 NVL72" in repr(advisor)
    # the explorer opened from an H100 row is gone; a row opens on the rack now
    assert advisor.explorer is None and advisor._explorer_box.children == ()
    assert advisor.open_in_explorer() and advisor.explorer.cluster.chip == gb200.chip

    assert advisor.set_cluster(Cluster.h100(nodes=1)) and picker.value == H100  # from code: the picker follows
    assert _first_row(advisor) == h100_first and advisor.advice.cluster == Cluster.h100(nodes=1)


def test_a_cluster_no_layout_fits_shows_the_usual_message(model):
    """Too few sequences for 256 GPUs: no row, the advice's why-none in the table, no error, the buttons off."""
    advisor = LayoutAdvisor(model, Cluster.h100(nodes=1), batch_tokens=TOKENS, seq_len=SEQ)
    advisor._cluster.value = "H100 32 nodes (256 GPUs)"
    assert not advisor.error and advisor.advice.ranked == [] and advisor.cluster.num_devices == 256
    assert "wb-error" in advisor._table.value and "pruned" in html.unescape(advisor._table.value)
    assert advisor._confirm.disabled and advisor._open.disabled and advisor._row.options == ()
    advisor._cluster.value = H100
    assert advisor.advice.ranked and not advisor._confirm.disabled


def test_a_cluster_that_is_no_preset_comes_first_under_its_name(model):
    own = Cluster.h100(nodes=2)
    advisor = LayoutAdvisor(model, own, batch_tokens=TOKENS, seq_len=SEQ)
    assert advisor._cluster.options == (own.name, *CLUSTER_PRESETS) and advisor._cluster.value == own.name
    advisor._cluster.value = "DGX B200 1 node (8 GPUs)"
    assert advisor.cluster == Cluster.b200(nodes=1)
    advisor._cluster.value = own.name
    assert advisor.cluster is own and advisor.advice.cluster is own


def test_a_failing_switch_shows_why_and_keeps_the_cluster_and_ranking(model, monkeypatch):
    advisor = LayoutAdvisor(model, Cluster.h100(nodes=1), batch_tokens=TOKENS, seq_len=SEQ)
    before, advice = advisor._table.value, advisor.advice

    def fail(model, cluster, **kwargs):
        raise ValueError(f"nothing for {cluster.name} <here>")

    monkeypatch.setattr(layout_advisor_module, "advise", fail)
    advisor._cluster.value = GB200  # no exception escapes the callback
    assert advisor.error == "nothing for 1 x GB200 NVL72 <here>" and "&lt;here&gt;" in advisor._status.value
    assert advisor._cluster.value == H100 and advisor.cluster == Cluster.h100(nodes=1)
    assert advisor.advice is advice and advisor._table.value == before
    monkeypatch.undo()
    assert not advisor.set_cluster("TPU v9 (nowhere)")
    assert advisor.error.startswith("cluster: no cluster preset 'TPU v9 (nowhere)'") and GB200 in advisor.error
    _usable(advisor)
    advisor._cluster.value = GB200  # the widget keeps working
    assert not advisor.error and advisor.advice.cluster == Cluster.gb200_nvl72(racks=1)


# -- the explorer -----------------------------------------------------------------------------------------------
def test_the_explorer_shows_no_picker_without_a_cluster(model):
    explorer = ShardingExplorer(model, make_mesh(fsdp=8))
    assert not hasattr(explorer, "_cluster_choice") and "wb-explorer-cluster" not in _classes(explorer.widget)
    assert not explorer.set_cluster(GB200) and "no cluster to change" in explorer.error
    assert explorer.cluster is None
    _usable(explorer)


def test_a_switch_offers_the_new_cluster_s_meshes_and_redraws_the_ledger_and_step(model):
    batch = (576, 16)  # whole sequences over 8, 64 and 72 devices
    explorer = ShardingExplorer(model, {"dp": 2, "fsdp": 4}, cluster=Cluster.h100(nodes=1), batch=batch)
    picker = explorer._cluster_choice
    assert "wb-explorer-cluster" in _classes(explorer.widget)
    assert list(picker.options) == list(CLUSTER_PRESETS) and picker.value == H100
    assert _hbm(explorer) == format_bytes(80e9)
    ledger_before, step_before = explorer._ledger_out.value, explorer._predicted_out.value
    explorer._kind.value = "train"
    assert explorer.compute_collectives(), explorer.error  # on the 8 simulated devices of the H100 node
    assert "stale" not in explorer._collectives_out.value

    picker.value = GB200
    gb200 = Cluster.gb200_nvl72(racks=1)
    assert not explorer.error, explorer.error
    assert explorer.cluster == gb200 and explorer.mesh.size == 72
    assert list(explorer._mesh_choice.options) == mesh_options(gb200)
    assert explorer._mesh_choice.value == "fsdp=72" and dict(explorer.mesh.shape)["fsdp"] == 72
    assert _hbm(explorer) == format_bytes(gb200.hbm_per_device)
    assert explorer._ledger_out.value != ledger_before and explorer._predicted_out.value != step_before
    assert "wb-ledger-verdict" in explorer._ledger_out.value and "1 x GB200 NVL72" in explorer._title.value
    # the step compiled on the H100 node: marked stale, as after a mesh change
    assert "stale" in explorer._collectives_out.value and "stale" in explorer._step_out.value
    code, text = explorer.export()  # the layout exports with the cluster it is now on
    assert "Cluster.gb200_nvl72(racks=1)" in code and '"cluster": {"gpu": "gb200", "racks": 1' in text

    explorer._mesh_choice.value = "fsdp=8 × tp=9"  # the new cluster's shapes are the ones offered
    assert not explorer.error and dict(explorer.mesh.shape)["tp"] == 9
    assert explorer.set_cluster("DGX B200 8 nodes (64 GPUs)") and picker.value == "DGX B200 8 nodes (64 GPUs)"
    assert explorer._mesh_choice.value == "fsdp=64" and list(explorer._mesh_choice.options) == \
        mesh_options(Cluster.b200(nodes=8))


def test_a_failing_switch_shows_why_and_the_explorer_keeps_working(model, monkeypatch):
    explorer = ShardingExplorer(model, {"fsdp": 8}, cluster=Cluster.h100(nodes=1), batch=(8, 16))
    layout, options = explorer.layout, explorer._mesh_choice.options

    def fail(mesh, cluster):
        raise ValueError(f"{cluster.name} cannot hold this model")

    monkeypatch.setattr(_explorer_cluster, "explorer_mesh", fail)
    explorer._cluster_choice.value = GB200  # no exception escapes the callback
    assert explorer.error == "1 x GB200 NVL72 cannot hold this model (still showing the last valid cluster)"
    assert explorer.cluster == Cluster.h100(nodes=1) and explorer.layout is layout
    assert explorer._cluster_choice.value == H100 and explorer._mesh_choice.options == options
    monkeypatch.undo()
    # a batch the rack's 72 devices cannot split: its panels say so inline, the widget stays usable
    explorer._cluster_choice.value = GB200
    assert explorer.cluster.num_devices == 72
    assert "8 sequences do not split" in explorer.error
    _usable(explorer)
    explorer._cluster_choice.value = H100
    assert not explorer.error and explorer.mesh.size == 8 and _hbm(explorer) == format_bytes(80e9)
    assert not explorer.set_cluster("nope") and explorer.error.startswith("no cluster preset 'nope'")
    assert explorer.cluster == Cluster.h100(nodes=1)


def test_an_explorer_on_a_cluster_that_is_no_preset_lists_it_first(model):
    own = Cluster.h100(nodes=2, gpus_per_node=4)
    explorer = ShardingExplorer(model, cluster=own)
    assert explorer._cluster_choice.options == (own.name, *CLUSTER_PRESETS)
    assert explorer.set_cluster(Cluster.h100(nodes=3))  # another from code joins the options
    assert explorer._cluster_choice.value == "3 x 8 H100 SXM" and explorer.mesh.size == 24
    explorer._cluster_choice.value = own.name
    assert explorer.cluster is own and explorer.mesh.size == 8


@needs_libtpu
def test_a_tpu_preset_offers_the_slice_s_shapes(model):
    """TPU7x 4x4x4: 128 devices, the two TensorCores of a chip an axis of their own (asks libtpu for the slice's
    devices; compiles nothing)."""
    explorer = ShardingExplorer(model, cluster=Cluster.h100(nodes=1), batch=(128, 16))
    label = "TPU7x Ironwood 4x4x4 (64 chips, 128 devices)"
    explorer._cluster_choice.value = label
    assert not explorer.error, explorer.error
    assert explorer.cluster == cluster_preset(label) and explorer.mesh.size == 128
    assert list(explorer._mesh_choice.options) == mesh_options(cluster_preset(label))
    assert explorer._mesh_choice.value == "fsdp=128"
