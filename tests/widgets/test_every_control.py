"""Every control of every widget driven with bad and edge values: no callback lets an exception escape (each
shows what went wrong inline), and afterwards the widget still renders and still takes a valid value."""

from __future__ import annotations

import math
import os

import ipywidgets as w
import jax
import pytest

from workbench.core.mesh import make_mesh
from workbench.core.models.presets import tiny

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
TEXTS = ["", " ", "(((", "tpp", "-1", "P('dp',", "\x00", "9" * 60, "dp, dp", "ñ→∑"]


def controls(root):
    """Every value widget and button under ``root`` (depth first)."""
    stack, found = [root], []
    while stack:
        node = stack.pop()
        if isinstance(node, w.Box):
            stack.extend(reversed(node.children))
        elif isinstance(node, (w.ValueWidget, w.Button)) and not isinstance(node, (w.HTML, w.Label, w.Output)):
            found.append(node)
    return found


def values_for(control):
    if isinstance(control, (w.Dropdown, w.ToggleButtons, w.Select, w.RadioButtons, w.SelectionSlider)):
        return [value for _, value in control._options_full] if hasattr(control, "_options_full") else \
            list(control.options)
    if isinstance(control, (w.Checkbox, w.ToggleButton)):
        return [not control.value, control.value]
    if isinstance(control, (w.BoundedIntText, w.IntSlider, w.BoundedFloatText, w.FloatSlider)):
        return [control.min, control.max, control.value]
    if isinstance(control, w.IntText):
        return [-1, 0, 10**9, control.value]
    if isinstance(control, w.FloatText):
        return [-1.0, 0.0, 1e30, math.nan, control.value]
    if isinstance(control, (w.Text, w.Textarea)):
        return [*TEXTS, control.value]
    return []


def drive(root, *, click=True, wait=lambda: None):
    original = {id(c): getattr(c, "value", None) for c in controls(root)}
    for control in controls(root):
        if control.disabled:
            continue
        if isinstance(control, w.Button):
            if click:
                control.click()
                wait()
            continue
        for value in values_for(control):
            try:
                control.value = value
            except Exception as e:
                if type(e).__name__ == "TraitError":
                    continue
                raise AssertionError(f"{type(control).__name__} {control.description!r} = {value!r} escaped: "
                                     f"{type(e).__name__}: {e}") from e
            wait()
        if original[id(control)] is not None and not isinstance(control, (w.Text, w.Textarea)):
            control.value = original[id(control)]
            wait()


def assert_usable(widget):
    html = widget._repr_html_() if hasattr(widget, "_repr_html_") else ""
    assert isinstance(html, str)
    bundle = (widget.widget if hasattr(widget, "widget") else widget)._repr_mimebundle_()
    assert bundle


def test_mesh_view():
    from workbench.widgets import MeshView

    view = MeshView(make_mesh(dp=2, tp=4))
    drive(view)
    assert_usable(view)


def test_sharding_view():
    from workbench.widgets import ShardingView

    view = ShardingView(((8, 16), "float32", "P('dp', 'tp')"), mesh=make_mesh(dp=2, tp=4))
    drive(view)
    assert_usable(view)


def test_sharding_explorer():
    from workbench.widgets import ShardingExplorer

    explorer = ShardingExplorer(tiny("llama"), make_mesh(dp=2, tp=2, sp=2, fsdp=1), batch=(4, 16))
    drive(explorer.widget, click=False)  # each text field, dropdown and number with bad values
    for button in controls(explorer.widget):  # then every button once (collectives, experts, apply, ...)
        if isinstance(button, w.Button) and not button.disabled:
            button.click()
    assert_usable(explorer)
    assert explorer.edit(partition_axis=explorer.partition_axis)  # a valid edit still resolves


def test_sharding_explorer_on_a_cluster():
    """The cluster's controls too: the cluster picker, the step, the remat policy, accumulation, ZeRO-1 and a pp
    mesh's pipeline."""
    from workbench.core.hardware.cluster import Cluster
    from workbench.core.hardware.presets import cluster_preset
    from workbench.widgets import ShardingExplorer

    explorer = ShardingExplorer(tiny("llama", num_hidden_layers=4), {"pp": 2, "dp": 2, "fsdp": 2},
                                cluster=Cluster.h100(nodes=1), batch=(8, 16))
    if os.environ.get("WORKBENCH_TEST_QUICK") == "1":  # a TPU preset's mesh asks libtpu for its topology: skipped there
        picker = explorer._cluster_choice
        picker.options = [o for o in picker.options if cluster_preset(o).platform != "tpu"]
    drive(explorer.widget, click=False)
    assert_usable(explorer)
    assert explorer.set_mesh({"pp": 2, "dp": 2, "fsdp": 2}) and explorer.plan().pipeline is not None


def test_attention_lab():
    from workbench.widgets import AttentionLab

    lab = AttentionLab()
    drive(lab, click=False)
    assert_usable(lab)


def test_module_tree():
    from workbench.widgets import ModuleTree

    tree = ModuleTree(tiny("llama"))
    drive(tree)
    assert_usable(tree)


def test_generation_view():
    from workbench.widgets import GenerationView

    view = GenerationView(tiny("llama"), prompt="Hi", cache_length=64)
    view.max_new_tokens.value = 4
    drive(view, wait=lambda: view.wait(120))
    assert view.wait(120)
    view.prompt.value, view.max_new_tokens.value = "Hello", 4
    view.generate()
    assert view.wait(120) and view.error == "" and view.output is not None
    assert_usable(view)


def test_pipeline_view():
    from workbench.widgets import PipelineView

    view = PipelineView(4, 8, "1f1b")
    drive(view.widget, click=False)
    view.schedule_control.value, view.microbatches.value = "1f1b", 8
    assert view.redraw() and view.schedule is not None
    assert_usable(view)


def test_layout_advisor():
    """The inputs, constraints, pins, recipe box and format, then the buttons that compile nothing (import and
    export a recipe, open in the explorer, export); a valid ranking, pin and recipe still work afterwards."""
    from workbench.core.hardware.cluster import Cluster
    from workbench.widgets import LayoutAdvisor

    advisor = LayoutAdvisor(tiny("llama", num_hidden_layers=4), Cluster.h100(nodes=1), batch_tokens=4096,
                            seq_len=256)
    drive(advisor.widget, click=False)
    for button in (advisor._import, advisor._export_recipe, advisor._open, advisor._export):
        if not button.disabled:
            button.click()
    assert_usable(advisor)
    advisor._task.value = "train"
    assert advisor.rank() and advisor.pin("tp=2") and all(c.mesh_shape["tp"] == 2 for c in advisor.advice.ranked)
    text = advisor.export_recipe("torchtitan TOML")
    assert text is not None and advisor.import_recipe(text, "torchtitan TOML"), advisor.error
