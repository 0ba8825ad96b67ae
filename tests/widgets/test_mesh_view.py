"""MeshView: the picture and the reshape controls, driven by calling the widget's callbacks."""

import re

import jax
import pytest
from jax.sharding import AxisType

from workbench.core.mesh import describe_mesh, make_mesh
from workbench.core.sharding.blocks import axis_size_choices
from workbench.widgets import mesh_view as mv_module
from workbench.widgets.mesh_view import MeshView, mesh_html


def cells(html):
    return re.findall(r'class="wb-mesh-cell" data-device="(\d+)"', html)


def test_picture_has_every_device_and_facets():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    view = MeshView(mesh)
    html = view._picture.value
    assert sorted(map(int, cells(html))) == list(range(8))
    assert html.count('class="wb-mesh-facet"') == 2 and "dp=0" in html and "dp=1" in html
    assert describe_mesh(mesh) in html and "rows: fsdp · columns: tp · facets: dp" in html
    assert view._repr_html_() == mesh_html(mesh) == html  # static, deterministic
    assert repr(view) == "MeshView(pp=1, dp=2, fsdp=2, ep=1, tp=2, sp=1)"
    assert "wb-mesh-view" in view._dom_classes


def test_dropdowns_offer_only_valid_sizes():
    mesh = make_mesh(dp=2, tp=4)
    view = MeshView(mesh)
    for axis, dd in view._dropdowns.items():
        assert [v for _, v in dd.options] == axis_size_choices(8, dict(mesh.shape), axis, "fsdp")
        assert dd.value == mesh.shape[axis]
        assert dd.disabled == (axis == "fsdp")
    assert [v for _, v in view._dropdowns["tp"].options] == [1, 2, 4]  # dp=2 fixed: tp*dp must divide 8


def test_edit_then_apply_notifies_followers():
    mesh = make_mesh(dp=2, tp=4)
    view = MeshView(mesh)
    seen, observed = [], []
    view.on_change(seen.append)
    view.observe(lambda change: observed.append(change["new"]), names="mesh")
    view._dropdowns["tp"].value = 2  # what a browser edit does
    assert view.pending == {"pp": 1, "dp": 2, "fsdp": 2, "ep": 1, "tp": 2, "sp": 1}
    assert view._dropdowns["fsdp"].value == 2 and "pending: pp=1, dp=2, fsdp=2" in view._status.value
    assert view.mesh == mesh and seen == []  # nothing applied yet
    view._apply_button.click()
    assert dict(view.mesh.shape) == view.pending and view.mesh == make_mesh(dp=2, fsdp=2, tp=2)
    assert seen == [view.mesh] and observed == [view.mesh]
    assert view._picture.value == mesh_html(view.mesh) and view._status.value == "" and view.error == ""
    assert [v for _, v in view._dropdowns["tp"].options] == [1, 2, 4]


def test_rest_axis_switch():
    view = MeshView(make_mesh(dp=2, tp=4))
    view._rest.value = "dp"
    assert view._dropdowns["dp"].disabled and not view._dropdowns["fsdp"].disabled
    assert [v for _, v in view._dropdowns["tp"].options] == [1, 2, 4, 8]  # fsdp=1 fixed, dp takes the rest
    view._dropdowns["tp"].value = 8
    assert view.pending == {"pp": 1, "dp": 1, "fsdp": 1, "ep": 1, "tp": 8, "sp": 1}
    assert view.apply() and view.mesh == make_mesh(fsdp=1, tp=8)


def test_invalid_shape_shows_inline_error_and_keeps_state():
    mesh = make_mesh(dp=2, tp=4)
    view = MeshView(mesh)
    picture = view._picture.value
    assert not view.set_sizes(dp=4, tp=4)
    assert "invalid mesh shape" in view.error and "tp may be 1, 2" in view.error
    assert 'class="wb-error"' in view._error.value
    assert view.pending == dict(mesh.shape) and view.mesh == mesh and view._picture.value == picture
    assert not view.set_sizes(fsdp=2) and "fsdp takes the rest" in view.error
    assert not view.set_sizes(model=2) and "unknown axes ['model']" in view.error
    assert view.set_sizes(tp=2, sp=2) and view.error == ""
    assert view.pending == {"pp": 1, "dp": 1, "fsdp": 2, "ep": 1, "tp": 2, "sp": 2}
    assert view._dropdowns["sp"].value == 2


def test_failed_build_and_failing_follower(monkeypatch):
    mesh = make_mesh(dp=2, tp=4)
    view = MeshView(mesh)

    def broken(mesh, sizes):
        raise ValueError("no such topology")

    monkeypatch.setattr(mv_module, "reshape_mesh", broken)
    view.set_sizes(tp=8)
    assert not view.apply() and "could not build the mesh: no such topology" in view.error
    assert view.mesh == mesh
    monkeypatch.undo()

    def bad_follower(new):
        raise RuntimeError("boom")

    view.on_change(bad_follower)
    assert view.apply()  # the mesh is applied; the follower's failure is reported inline
    assert view.mesh == make_mesh(fsdp=1, tp=8)
    assert "a follower failed" in view.error and "RuntimeError: boom" in view.error


def test_any_axis_names_and_types():
    mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Explicit,) * 3)
    view = MeshView(mesh, rows="x", cols="z")
    assert "rows: x · columns: z · facets: y" in view._picture.value
    assert view._rest.value == "x"
    assert view.set_sizes(y=4) and view.apply()
    assert dict(view.mesh.shape) == {"x": 2, "y": 4, "z": 1}
    assert tuple(view.mesh.axis_types) == (AxisType.Explicit,) * 3


def test_constructor_errors():
    with pytest.raises(TypeError, match=r"needs a jax\.sharding\.Mesh"):
        MeshView("dp=2")
    with pytest.raises(ValueError, match="rest_axis='model'"):
        MeshView(make_mesh(), rest_axis="model")
    with pytest.raises(ValueError, match="mesh has axes"):
        MeshView(make_mesh(), rows="model")
