"""ModuleTree: treescope in an Output, counts per subtree from tree_view, a parameter's ShardingView when
chosen (driven through the dropdown's callback), inline errors and the static HTML."""

import re

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import make_mesh
from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import lazy_init, param_specs, shard_model
from workbench.core.views.param_tree import param_rows, subtree_totals
from workbench.widgets import module_tree
from workbench.widgets.module_tree import ModuleTree

MESH = make_mesh(fsdp=2, tp=4)
Q = "layers/self_attn/q_proj/kernel"


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def test_tree_counts_and_header(model):
    tree = ModuleTree(model, mesh=MESH)
    (shown,) = tree._tree.outputs  # treescope as display data in an Output, so its scripts run
    assert "<treescope-container" in shown["data"]["text/html"] and "<script" in shown["data"]["text/html"]
    assert f"({model.num_params():,})" in tree._header.value
    assert "specs resolved on mesh fsdp 2 × tp 4" in tree._header.value
    totals = subtree_totals(param_rows(model, MESH))
    html = tree._counts.value
    assert re.findall(r'class="wb-subtree" data-path="([^"]*)"', html) == list(totals)  # every subtree, in order
    assert f"({totals['layers/self_attn'].count:,})" in html
    assert len(re.findall(r'class="wb-param" data-path=', html)) == len(tree.rows)
    assert [v for _, v in tree._choose.options][1:] == [r.path for r in tree.rows]
    assert repr(tree) == f"ModuleTree(CausalLM, {model.num_params():,} parameters)"


def test_the_explorer_and_the_tree_show_one_reason_per_parameter(model):
    from workbench.core.views.explore import Layout
    from workbench.widgets._html import escape
    from workbench.widgets.module_tree import param_summary_html
    from workbench.widgets.sharding_explorer import layout_html

    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    table = dict(re.findall(r'<tr class="wb-param-row" data-path="([^"]*)".*?class="wb-reason"[^>]*>([^<]*)</td>',
                            layout_html(Layout.of(model, mesh))))  # the explorer's "why" column
    rows = param_rows(model, mesh)
    assert list(table) == [escape(r.path) for r in rows]
    for row in rows:
        assert row.reason and table[escape(row.path)] == escape(row.reason), row.path
        assert f"why: {escape(row.reason)}<" in param_summary_html(row), row.path


def test_choosing_a_parameter_shows_its_sharding_view(model):
    from workbench.widgets.sharding_view import ShardingView

    tree = ModuleTree(model, mesh=MESH)
    tree._choose.value = Q  # what the browser's dropdown does
    view = tree.sharding_view
    assert isinstance(view, ShardingView) and tree._detail.children == (view,)
    assert view.spec == param_specs(model, MESH)[Q] and view.mesh == MESH
    # the stacked (layers, in, out) kernel: every layer's slice split the same way, layers replicated
    assert view.sharding_layout.shape == (2, 64, 64) and view.sharding_layout.shard_shape == (2, 32, 16)
    assert "dim2 TP: sharded 4 ways over tp" in tree._summary.value
    # the view's spec editor is a what-if: the model and the tree's rows do not change
    assert view.set_spec("None, tp, None") and view.spec == P(None, "tp", None)
    assert {r.path: r.spec for r in tree.rows} == param_specs(model, MESH)
    assert param_specs(model, MESH)[Q] == P(None, ("fsdp", "sp"), "tp")
    tree._choose.value = ""
    assert tree.sharding_view is None and tree._detail.children == ()


def test_placed_unplaced_and_abstract_models(model):
    placed = ModuleTree(shard_model(model, MESH))
    assert placed.select(Q) and placed.sharding_view.spec == param_specs(model, MESH)[Q]
    assert "specs as placed on mesh fsdp 2 × tp 4" in placed._header.value

    unplaced = ModuleTree(model)
    assert unplaced.select("norm/weight") and unplaced.sharding_view is None
    assert "not placed on a mesh" in unplaced._detail.children[0].value and unplaced.error == ""

    config = ModelConfig.from_hf(tiny_config("llama"))
    abstract = ModuleTree(lazy_init(lambda: CausalLM(config, rngs=nnx.Rngs(0)), MESH))  # nothing allocated
    assert abstract.select(Q) and abstract.sharding_view.sharding_layout.shard_shape == (2, 32, 16)
    assert "<treescope-container" in abstract._tree.outputs[0]["data"]["text/html"]


def test_errors_are_inline_and_the_last_choice_stays(model, monkeypatch):
    tree = ModuleTree(model, mesh=MESH)
    assert tree.select(Q)
    view = tree.sharding_view
    assert not tree.select("q_proj")
    assert "no parameter 'q_proj'; did you mean layers/self_attn/q_proj/kernel" in tree.error
    assert 'class="wb-error"' in tree._error.value
    assert tree.selected == Q and tree.sharding_view is view  # the last valid state stays

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(module_tree, "ShardingView", broken)  # the name the tree calls
    tree._choose.value = "lm_head/kernel"  # the callback must not raise
    assert "cannot show the sharding of lm_head/kernel: ValueError: boom" in tree.error
    tree._choose.value = ""
    assert tree.error == ""


def test_treescope_failure_keeps_the_counts(model, monkeypatch):
    import treescope

    monkeypatch.setattr(treescope, "render_to_html", lambda *a, **k: 1 / 0)
    tree = ModuleTree(model)
    assert tree.error.startswith("treescope could not render this model: ZeroDivisionError") and not tree._tree.outputs
    assert tree.rows and "wb-subtree" in tree._counts.value


def test_static_html(model):
    tree = ModuleTree(model, mesh=MESH)
    html = tree._repr_html_()
    assert html == ModuleTree(model, mesh=MESH)._repr_html_()  # deterministic: no treescope ids
    assert "<script" not in html and "wb-module-header" in html and 'data-path="layers/self_attn"' in html
    assert "P((fsdp, sp), tp)" in html


def test_one_layer_of_the_stack_opens_as_its_own_block():
    from workbench.core.models.presets import tiny

    model = tiny("llama", num_hidden_layers=3)
    tree = ModuleTree(model)
    assert [v for _, v in tree._layer.options] == [-1, 0, 1, 2]
    assert tree.open_layer(2) and tree._layer.value == 2
    html = "".join(o["data"]["text/html"] for o in tree._layer_tree.outputs)
    assert "treescope-container" in html and "num_layers" not in tree.error
    assert not tree.open_layer(3) and "no layer 3; the model has 3 layers" in tree.error


def test_a_moe_model_has_an_experts_tab_that_compiles_the_all_to_alls():
    from workbench.core.mesh import make_mesh
    from workbench.models import tiny

    moe_tree = ModuleTree(tiny("mixtral"), mesh=make_mesh(dp=2, fsdp=1, ep=4))
    assert moe_tree.experts is not None
    moe_tree.experts.capacity.value = 1.0
    moe_tree.experts.button.click()
    summary = moe_tree.experts.summary
    assert summary is not None and len(summary.all_to_alls) == 2 and summary.dispatch is not None
    assert "all-to-alls" in moe_tree.experts.out.value and "dense" in moe_tree.experts.out.value
    unplaced = ModuleTree(tiny("mixtral"))
    unplaced.experts.button.click()  # no mesh: an inline error, the widget keeps working
    assert unplaced.error.startswith("experts: the model is not on a mesh: pass mesh=")
    assert "pass mesh=" in unplaced._error.value and unplaced.experts.summary is None
    assert ModuleTree(tiny("llama")).experts is None
