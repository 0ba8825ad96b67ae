"""Every view on a model sharded over Explicit mesh axes, beside the same model on Auto axes: the types they
show equal ``str(jax.typeof(x))`` of the placed arrays, and the explorer's collectives work in both modes."""

import html
import re

import jax
import pytest
from flax import nnx
from jax.sharding import AxisType

from workbench.core.mesh import make_mesh
from workbench.core.models.presets import tiny
from workbench.core.models.sharding import path_str
from workbench.widgets.mesh_view import MeshView
from workbench.widgets.module_tree import ModuleTree
from workbench.widgets.sharding_explorer import ShardingExplorer
from workbench.widgets.sharding_view import ShardingView

MODES = (AxisType.Auto, AxisType.Explicit)
Q_PROJ = "layers/self_attn/q_proj/kernel"


@pytest.fixture(scope="module")
def placed():
    """mode -> (mesh, tiny Llama sharded on it); the same weights in both."""
    base = tiny("llama")
    out = {}
    for mode in MODES:
        mesh = make_mesh(dp=2, tp=4, axis_types=mode)
        out[mode] = mesh, base.shard_model(mesh)
    return out


@pytest.fixture(scope="module")
def jax_types(placed):
    """path -> str(jax.typeof(param)) on the Explicit mesh: JAX's own answer, the reference."""
    _, model = placed[AxisType.Explicit]
    return {path_str(p): str(jax.typeof(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def params(model):
    return {path_str(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def typed_in(text):
    """(data-typed, whether marked 'if Explicit', title) of each wb-typed element."""
    found = re.findall(r'class="wb-typed" data-typed="([^"]*)" title="([^"]*)"[^>]*>[^<]*</code>'
                       r'(<span class="wb-typed-note")?', text)
    return [(html.unescape(t), bool(note), html.unescape(title)) for t, title, note in found]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_mesh_view_draws_the_mesh(placed, mode):
    mesh, _ = placed[mode]
    view = MeshView(mesh)
    assert f"{mode.name} axes" in view._picture.value
    assert sorted(map(int, re.findall(r'data-device="(\d+)"', view._picture.value))) == list(range(8))
    assert view.set_sizes(tp=2) and view.apply()
    assert dict(view.mesh.shape)["tp"] == 2 and set(view.mesh.axis_types) == {mode}  # reshaped, types kept


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_sharding_view_of_every_parameter_shows_its_type(placed, jax_types, mode):
    _, model = placed[mode]
    for path, x in params(model).items():
        view = ShardingView(x)
        (shown,) = typed_in(view._picture.value)
        assert view.typed_notation() == shown[0] == jax_types[path]  # the type on Explicit axes, as JAX prints it
        assert re.search(r'data-notation="[^"]+"', view._picture.value)  # beside the scaling-book notation
        on_auto = mode == AxisType.Auto and "@" in jax_types[path]
        assert shown[1] == on_auto  # on Auto axes: marked "if Explicit", and the tip says what jax.typeof shows
        assert str(jax.typeof(x)) in shown[2] if on_auto else shown[0] == str(jax.typeof(x))
    # the spec editor re-renders the type
    view = ShardingView(params(model)[Q_PROJ])
    assert view.set_spec("None, tp, None") and view.typed_notation() == "float32[2,64@tp,64]"
    assert typed_in(view._picture.value)[0][0] == "float32[2,64@tp,64]"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_module_tree_rows_and_detail_line_show_the_type(placed, jax_types, mode):
    _, model = placed[mode]
    tree = ModuleTree(model)  # specs as placed
    values = params(model)
    for row in tree.rows:
        assert row.source == "placed" and row.typed == jax_types[row.path]
        assert row.typed_on_mesh == str(jax.typeof(values[row.path]))
    assert tree.select(Q_PROJ) and tree.error == ""
    (shown,) = typed_in(tree._summary.value)
    assert shown[0] == jax_types[Q_PROJ] and shown[1] == (mode == AxisType.Auto)
    assert tree.sharding_view.typed_notation() == jax_types[Q_PROJ]
    assert "wb-module-header" in tree._header.value and "wb-module-totals" in tree._repr_html_()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_explorer_table_has_a_type_column(placed, jax_types, mode):
    mesh, model = placed[mode]
    explorer = ShardingExplorer(model, mesh)
    table = explorer._table.value
    types = dict(re.findall(r'data-path="([^"]+)".*?class="wb-type"[^>]*>([^<]*)<', table))
    assert {p: html.unescape(t) for p, t in types.items()} == jax_types
    assert (">type if Explicit</th>" in table) == (mode == AxisType.Auto)
    assert explorer.layout[Q_PROJ].typed == jax_types[Q_PROJ] and jax_types[Q_PROJ] in explorer.layout.table()


def test_the_explorers_collectives_work_in_both_modes(placed):
    """A forward and a train step compiled from either mode's layout insert the same collectives."""
    found = {}
    for mode in MODES:
        mesh, model = placed[mode]
        explorer = ShardingExplorer(model, mesh)
        for kind in ("forward", "train"):
            explorer._kind.value = kind
            assert explorer.compute_collectives(), explorer._collectives_out.value
            found[mode, kind] = explorer.collectives.by_axes()
            assert "wb-error" not in explorer._collectives_out.value
    for kind in ("forward", "train"):
        assert found[AxisType.Explicit, kind] == found[AxisType.Auto, kind]
        assert any(axes == ("tp",) for _, axes, _, _ in found[AxisType.Explicit, kind])
    assert any(k == "all-reduce" and axes == ("dp",) for k, axes, _, _ in found[AxisType.Explicit, "train"])


def test_explorer_apply_keeps_explicit_types(placed, jax_types):
    mesh, model = placed[AxisType.Explicit]
    explorer = ShardingExplorer(model, mesh)
    assert explorer.apply() is not None
    assert {p: str(jax.typeof(x)) for p, x in params(explorer.model).items()} == jax_types
