"""ShardingView: pictures of any rank, the spec editor driven through its callbacks, and _html helpers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import make_mesh
from workbench.core.sharding.blocks import sharding_layout
from workbench.widgets import _html
from workbench.widgets.mesh_view import MeshView
from workbench.widgets.sharding_view import ShardingView, sharding_html

MESH = make_mesh(dp=2, fsdp=2, tp=2)


def notation_in(html):
    return re.findall(r'data-notation="([^"]*)"', html)


def blocks(html):
    return re.findall(r'class="wb-block" data-devices="([\d,]*)"', html)


def test_live_array_2d():
    x = jax.device_put(jnp.zeros((8, 16), jnp.bfloat16), NamedSharding(MESH, P("fsdp", "tp")))
    view = ShardingView(x)
    html = view._picture.value
    assert notation_in(html) == ["A[I_fsdp, J_tp]"]
    assert "shard 4×8" in html and "64 B per device of 256 B" in html and "copied over dp" in html
    assert len(blocks(html)) == 4 and html.count(">×2</span>") == 4  # each block on 2 devices
    assert sorted(blocks(html)) == sorted(",".join(map(str, g)) for g in sharding_layout(x).replica_groups)
    assert "repeating-linear-gradient" in html  # replicated blocks are striped
    assert view.spec == P("fsdp", "tp") and view.mesh == MESH and view.sharding == x.sharding
    assert view._text.value == "fsdp, tp"
    assert repr(view) == "ShardingView(A[I_fsdp, J_tp], shape=(8, 16), bfloat16)"


@pytest.mark.parametrize("x, mesh", [
    (((4, 8, 16), "float32", P("dp", None, "tp")), MESH),
    (((4, 8, 16), "float32", NamedSharding(MESH, P("dp", None, "tp"))), None),
    (jax.ShapeDtypeStruct((4, 8, 16), jnp.float32, sharding=NamedSharding(MESH, P("dp", None, "tp"))), None),
])
def test_3d_without_allocation(x, mesh):
    view = ShardingView(x, mesh, name="W")
    html = view._repr_html_()
    assert notation_in(html) == ["W[I_dp, J, K_tp]"]
    assert html.count('class="wb-sharding-panel"') == 2  # one panel per block of dim 0
    assert "I = 0:2" in html and "I = 2:4" in html
    assert len(blocks(html)) == 4 and "×2" in html  # each (dp, tp) block copied over fsdp
    assert html == sharding_html(view.sharding_layout, "W") and html == view._repr_html_()
    assert "<input" not in html  # the static picture has no controls


def test_4d_panels_and_fully_replicated():
    view = ShardingView(((2, 4, 6, 8), "int8", P("dp", "fsdp", None, "tp")), MESH)
    html = view._picture.value
    assert html.count('class="wb-sharding-panel"') == 4 and "I = 1:2, J = 2:4" in html
    assert len(blocks(html)) == 8 and "wb-replicas" not in html  # every mesh axis used: no copies
    full = ShardingView(((3, 5), "float32", P()), MESH)._picture.value
    assert blocks(full) == ["0,1,2,3,4,5,6,7"] and ">×8</span>" in full and "0–7" in full


def test_edit_rerenders_with_the_new_spec():
    view = ShardingView(((8, 16), "float32", P("fsdp", "tp")), MESH)
    seen = []
    view.on_change(seen.append)
    view._text.value = "(fsdp, dp), tp"  # what pressing enter in the browser does
    assert notation_in(view._picture.value) == ["A[I_{fsdp,dp}, J_tp]"]
    assert view.spec == P(("fsdp", "dp"), "tp") and view.error == "" and len(seen) == 1
    assert "2×8" in view._picture.value and len(blocks(view._picture.value)) == 8
    view._text.value = "None, (dp, tp)"
    view._show.click()  # "show" re-renders the same spec: harmless
    assert view.notation() == "A[I, J_{dp,tp}]"
    assert view.set_spec(P("tp")) and view._text.value == "tp" and view.notation() == "A[I_tp, J]"
    assert view.set_spec("dp, tp") and view._text.value == "dp, tp"  # code edits show in the text field


@pytest.mark.parametrize("text, message", [
    ("fsdp, tpp", r"unknown mesh axis 'tpp' \(did you mean 'tp'\?\)"),
    ("(fsdp, dp), tp", r"dim 0 has size 6, not divisible by fsdp×dp = 4 \(strict check, as NamedSharding\).*"
                       r"fit_spec \(what PartitionAxis.resolve does\) gives P\('fsdp', 'tp'\)"),
    ("None, (dp, tp, fsdp)", "dim 1 has size 12, not divisible by dp×tp×fsdp = 8"),
    ("tp, tp", "'tp' shards both dim 0 and dim 1"),
    ("fsdp tp", "cannot read 'fsdp tp' as a PartitionSpec"),
    ("dp, tp, fsdp", "3 entries but the array has 2"),
])
def test_bad_edit_keeps_the_last_layout(text, message):
    view = ShardingView(((6, 12), "float32", P("fsdp", "tp")), MESH)
    picture, layout = view._picture.value, view.sharding_layout
    view._text.value = text
    assert re.search(message, view.error), view.error
    assert view.error.startswith("spec not applied: ") and "still showing A[I_fsdp, J_tp]" in view.error
    assert 'class="wb-error"' in view._error.value
    assert view._picture.value == picture and view.sharding_layout is layout and view.spec == P("fsdp", "tp")
    view._text.value = "None, tp"  # a good edit clears the error
    assert view.error == "" and view._error.value == "" and view.notation() == "A[I, J_tp]"


def test_fit_drops_axes_that_do_not_divide():
    view = ShardingView(((6, 8), "float32", P("fsdp", "tp")), MESH)
    assert not view.set_spec("(fsdp, dp), tp") and view.spec == P("fsdp", "tp")
    view._fit.value = True  # re-applies the text with fitting
    assert view.error == "" and view.spec == P("fsdp", "tp")
    view._text.value = "(tp, dp), (fsdp, tp)"  # tp reused: fitting drops it, as resolve does
    assert view.spec == P("tp", "fsdp") and view.error == ""


def test_follows_a_mesh_view_and_refuses_an_incompatible_mesh():
    mesh_view = MeshView(make_mesh(dp=2, tp=4))
    view = ShardingView(((8, 4), "float32", P("dp", "tp")), mesh_view.mesh)
    mesh_view.on_change(view.set_mesh)
    mesh_view.set_sizes(dp=4, tp=2)
    mesh_view.apply()
    assert view.mesh == mesh_view.mesh and view.sharding_layout.shard_shape == (2, 2)
    mesh_view.set_sizes(dp=1, tp=8)
    mesh_view.apply()  # tp=8 does not divide 4: the view keeps its last layout and says why
    assert view.mesh == make_mesh(dp=4, fsdp=1, tp=2)
    assert view.error.startswith("new mesh not applied: dim 1 has size 4, not divisible by tp = 8")
    assert mesh_view.error == ""  # the follower reported inline itself, it did not raise


def test_input_errors():
    with pytest.raises(TypeError, match="not a NamedSharding"):
        ShardingView(jnp.ones(4))
    with pytest.raises(TypeError, match="needs a mesh"):
        ShardingView(((4,), "float32", P("dp")))
    with pytest.raises(TypeError, match="needs an array or"):
        ShardingView([4, 4])
    with pytest.raises(ValueError, match="unknown mesh axis"):
        ShardingView(((4,), "float32", P("model")), MESH)


# ------------------------------------------------------------------------------------------ _html
def test_html_helpers_escape_and_format():
    assert _html.error_html("") == "" and "&lt;x&gt;" in _html.error_html("<x>")
    colors = _html.device_colors(64)
    assert len(set(colors)) == 64 and all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colors)
    assert _html.device_color(3) == colors[3]  # a device's colour does not depend on the count
    assert _html.ids_text([0, 1, 2, 3, 6, 8, 9]) == "0–3,6,8,9" and _html.ids_text([4]) == "4"
    assert _html.device_background([5]) == _html.device_color(5)
    mesh = jax.make_mesh((2, 4), ("<x>", "y"))
    html = ShardingView(((4, 8), np.float32, P("<x>", "y")), mesh)._picture.value
    assert "<x>" not in html and "&lt;x&gt;" in html
