"""MeshView: a mesh's devices laid out by axes, with controls that reshape it.

The picture comes from :func:`workbench.core.sharding.blocks.mesh_grid`; the sizes offered come from
:func:`~workbench.core.sharding.blocks.axis_size_choices` (one axis takes the rest of the devices, as
``make_mesh``'s ``-1``), and "apply" builds the new mesh with
:func:`~workbench.core.sharding.blocks.reshape_mesh`. Other views follow with ``on_change(fn)`` or
``observe(fn, names="mesh")``.
"""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets
import traitlets
from jax.sharding import Mesh

from workbench.core.mesh import describe_mesh
from workbench.core.sharding.blocks import MeshGrid, axis_size_choices, mesh_grid, reshape_mesh, set_axis_size
from workbench.widgets._errors import Guard, InlineError
from workbench.widgets._html import TEXT_COLOR, device_color, escape

__all__ = ["MeshView", "mesh_html"]

_LABEL = "font-size:11px;color:#666;text-align:center;align-self:center"


def _cell_html(cell: tp.Any) -> str:
    coords = ", ".join(f"{a}={v}" for a, v in cell.coords)
    tip = f"device {cell.device_id} · {cell.platform} · process {cell.process_index} · {coords}"
    return (f'<div class="wb-mesh-cell" data-device="{cell.device_id}" title="{escape(tip)}" '
            f'style="background:{device_color(cell.device_id)};color:{TEXT_COLOR};border-radius:4px;'
            f'padding:4px 2px;text-align:center;min-width:52px;line-height:1.2">'
            f'<div style="font-weight:700;font-size:15px">{cell.device_id}</div>'
            f'<div style="font-size:10px">{escape(cell.platform)} · p{cell.process_index}</div></div>')


def _facet_html(grid: MeshGrid, facet: tp.Any) -> str:
    n_cols = len(facet.cells[0])
    parts = ['<div style="' + _LABEL + '"></div>']  # corner
    parts += [f'<div style="{_LABEL}">{escape(f"{grid.cols}={c}" if grid.cols else "")}</div>' for c in range(n_cols)]
    for r, row in enumerate(facet.cells):
        parts.append(f'<div style="{_LABEL};padding-right:4px">{escape(f"{grid.rows}={r}" if grid.rows else "")}</div>')
        parts += [_cell_html(c) for c in row]
    title = (f'<div class="wb-facet-title" style="font-size:12px;font-weight:600;margin-bottom:2px">'
             f"{escape(facet.title)}</div>") if facet.title else ""
    return (f'<div class="wb-mesh-facet">{title}<div style="display:grid;grid-template-columns:auto '
            f'repeat({n_cols}, minmax(52px, auto));gap:3px">{"".join(parts)}</div></div>')


def mesh_html(mesh: Mesh, rows: str | None = None, cols: str | None = None) -> str:
    """The static picture of ``mesh``: a header line and one CSS grid per facet."""
    grid = mesh_grid(mesh, rows=rows, cols=cols)
    where = [f"rows: {grid.rows}" if grid.rows else "", f"columns: {grid.cols}" if grid.cols else "",
             f"facets: {', '.join(grid.facet_axes)}" if grid.facet_axes else ""]
    collapsed = [a for a, n in grid.axis_sizes if n == 1]
    if collapsed:
        where.append(f"size 1: {', '.join(collapsed)}")
    header = (f'<div class="wb-mesh-header" style="font-size:12px;margin-bottom:4px">'
              f'<code>{escape(describe_mesh(mesh))}</code><br>'
              f'<span style="color:#666">{escape(" · ".join(w for w in where if w))}</span></div>')
    facets = "".join(_facet_html(grid, f) for f in grid.facets)
    return (f'<div class="wb-mesh-view-static">{header}<div style="display:flex;flex-wrap:wrap;gap:16px;'
            f'align-items:flex-start">{facets}</div></div>')


class MeshView(InlineError, widgets.VBox):
    """The devices of ``mesh`` by axis, plus one dropdown per axis to reshape it.

    Each dropdown offers only the sizes that keep a valid factorisation of the device count,
    while the axis chosen in "rest on" takes the remaining devices. "apply" builds the new mesh
    (same devices, names and axis types); ``.mesh`` is then the new mesh and every
    ``on_change`` callback (and ``observe(fn, names="mesh")``) is called with it. An invalid shape
    (``set_sizes``) or a failing follower shows an inline error; the last valid mesh stays.
    """

    mesh = traitlets.Instance(Mesh)

    def __init__(self, mesh: Mesh, *, rows: str | None = None, cols: str | None = None,
                 rest_axis: str | None = None, **kwargs: tp.Any):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"MeshView needs a jax.sharding.Mesh (e.g. workbench.make_mesh(dp=2, tp=4)); got "
                            f"{type(mesh).__name__}")
        names = tuple(mesh.axis_names)
        if rest_axis is None:
            rest_axis = "fsdp" if "fsdp" in names else names[0]
        if rest_axis not in names:
            raise ValueError(f"MeshView(rest_axis={rest_axis!r}): the mesh has axes {', '.join(names)}")
        mesh_grid(mesh, rows=rows, cols=cols)  # checks rows / cols
        self._rows, self._cols = rows, cols
        self._callbacks: list[tp.Callable[[Mesh], tp.Any]] = []
        self._pending = dict(mesh.shape)
        self._syncing = False
        self._picture = widgets.HTML(mesh_html(mesh, rows, cols))
        self._dropdowns = {a: widgets.Dropdown(description=a, layout=widgets.Layout(width="118px"),
                                               style={"description_width": "34px"}) for a in names}
        self._rest = widgets.Dropdown(description="rest on", options=names, value=rest_axis,
                                      layout=widgets.Layout(width="150px"), style={"description_width": "52px"})
        self._apply_button = widgets.Button(description="apply", button_style="primary", icon="check",
                                            layout=widgets.Layout(width="90px"))
        self._status = widgets.HTML("")
        controls = widgets.HBox([*self._dropdowns.values(), self._rest, self._apply_button],
                                layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([self._picture, controls, self._status, self._error_area()], **kwargs)
        self.add_class("wb-mesh-view")
        self.mesh = mesh
        self._refresh_options()
        for axis, dd in self._dropdowns.items():
            dd.observe(lambda change, axis=axis: self._on_size(axis, change["new"]), names="value")
        self._rest.observe(lambda change: self._on_rest(change["new"]), names="value")
        self._apply_button.on_click(lambda _: self.apply())

    # -- public ------------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return self.mesh.size

    @property
    def pending(self) -> dict[str, int]:
        """The sizes the controls show (applied by ``apply``)."""
        return dict(self._pending)

    def on_change(self, fn: tp.Callable[[Mesh], tp.Any]) -> tp.Callable[[Mesh], tp.Any]:
        """Call ``fn(new_mesh)`` after each applied reshape; returns ``fn`` (usable as a decorator)."""
        self._callbacks.append(fn)
        return fn

    def set_sizes(self, **sizes: int) -> bool:
        """Set axis sizes in the controls, e.g. ``set_sizes(dp=2, tp=4)``; the rest axis absorbs the rest.

        Returns False and shows the reason inline when the sizes leave no valid mesh.
        """
        with self._guard("invalid mesh shape", catch=ValueError) as failed:
            new = dict(self._pending)
            unknown = sorted(set(sizes) - set(new))
            if unknown:
                raise ValueError(f"unknown axes {unknown}; the mesh has axes {', '.join(new)}")
            rest = self._rest.value
            if rest in sizes:
                raise ValueError(f"{rest} takes the rest of the devices; set the other axes, or choose another "
                                 f"'rest on' axis first")
            for axis in new:
                if axis != rest:
                    new[axis] = 1
            new[rest] = self.n_devices
            for axis, size in sizes.items():
                new = set_axis_size(self.n_devices, new, axis, size, rest)
        if failed:
            return False
        self._pending = new
        self._clear_error()
        self._refresh_options()
        return True

    def apply(self) -> bool:
        """Build the mesh the controls show; on success update the picture and notify followers."""
        if self._pending == dict(self.mesh.shape):
            self._clear_error()
            self._refresh_status()
            return True
        with self._guard("could not build the mesh", catch=(ValueError, RuntimeError),
                         suffix=f"; still showing {describe_mesh(self.mesh)}") as failed:
            new = reshape_mesh(self.mesh, self._pending)
        if failed:
            return False
        self.mesh = new
        self._picture.value = mesh_html(new, self._rows, self._cols)
        self._refresh_status()
        failures: list[str] = []  # a follower's bug must not break this view: each one's error, said together
        for fn in list(self._callbacks):
            with Guard(failures.append, f"{getattr(fn, '__qualname__', fn)}"):
                fn(new)
        self._show_error("mesh applied, but a follower failed: " + "; ".join(failures) if failures else "")
        return True

    def _repr_html_(self) -> str:
        return mesh_html(self.mesh, self._rows, self._cols)

    def __repr__(self) -> str:
        return f"MeshView({', '.join(f'{a}={n}' for a, n in self.mesh.shape.items())})"

    # -- callbacks -----------------------------------------------------------------------------------
    def _on_size(self, axis: str, size: int) -> None:
        if self._syncing or size is None or size == self._pending[axis]:
            return
        with self._guard("invalid mesh shape", catch=ValueError, clear=True):
            self._pending = set_axis_size(self.n_devices, self._pending, axis, size, self._rest.value)
        self._refresh_options()

    def _on_rest(self, rest: str) -> None:
        if not self._syncing:
            self._refresh_options()

    def _refresh_options(self) -> None:
        self._syncing = True
        try:
            rest = self._rest.value
            for axis, dd in self._dropdowns.items():
                choices = axis_size_choices(self.n_devices, self._pending, axis, rest)
                dd.options = [(str(c), c) for c in choices]
                dd.value = self._pending[axis]
                dd.disabled = axis == rest
                dd.tooltip = (f"{axis} takes the rest of the devices" if axis == rest else
                                          f"sizes of {axis} that keep {self.n_devices} devices")
        finally:
            self._syncing = False
        self._refresh_status()

    def _refresh_status(self) -> None:
        if self._pending == dict(self.mesh.shape):
            self._status.value = ""
        else:
            shape = ", ".join(f"{a}={n}" for a, n in self._pending.items())
            self._status.value = (f'<div class="wb-pending" style="font-size:12px;color:#555">pending: '
                                  f"{escape(shape)} (press apply)</div>")
