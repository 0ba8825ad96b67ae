"""ShardingView: which block of an array each device holds, for any rank, with a spec editor.

The layout comes from :func:`workbench.core.sharding.blocks.sharding_layout` (no allocation); beside the scaling
book's notation ``A[I_fsdp, J_tp]`` stands the type JAX gives the array on Explicit axes,
``float32[8@fsdp,16@tp]``. The last two dimensions are drawn as a grid of blocks, one panel per block
of the leading dimensions (``jax.debug.visualize_sharding`` stops at 2-D). Blocks take their device's
colour (the same as in :class:`~workbench.widgets.mesh_view.MeshView`); a block held by several devices
is striped with their colours and carries a ``×n`` badge.
"""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from workbench.core.sharding.blocks import ShardingLayout, format_spec, sharding_layout
from workbench.core.units import format_bytes
from workbench.widgets._errors import InlineError
from workbench.widgets._html import (
    TEXT_COLOR,
    device_background,
    escape,
    ids_text,
    typed_html,
)

__all__ = ["ShardingView", "notation_html", "sharding_html"]


def notation_html(layout: ShardingLayout, name: str = "A") -> str:
    """The scaling-book notation with real subscripts; ``data-notation`` holds the plain text."""
    parts = [f"{letter}<sub>{escape(sub)}</sub>" if sub else letter for letter, sub in layout.notation_parts()]
    return (f'<span class="wb-notation" data-notation="{escape(layout.notation(name))}" '
            f'style="font-family:serif;font-size:17px;font-weight:600">{escape(name)}[{", ".join(parts)}]</span>')


def _summary(layout: ShardingLayout) -> str:
    shape = "×".join(map(str, layout.shape)) or "scalar"
    shard = "×".join(map(str, layout.shard_shape)) or "scalar"
    copies = ""
    if layout.replication > 1:
        copies = f" · each block on {layout.replication} devices (copied over {', '.join(layout.replicated_axes)})"
    return (f"{shape} {layout.dtype.name} · {layout.spec} · shard {shard} · "
            f"{format_bytes(layout.bytes_per_device)} per device of {format_bytes(layout.logical_bytes)}{copies}")


def _block_html(layout: ShardingLayout, cell: tp.Any) -> str:
    index = ", ".join(f"{s.start}:{s.stop}" for s in cell.index)
    drawn = ", ".join(f"{s.start}:{s.stop}" for s in cell.index[-2:])  # leading dims: in the panel title
    tip = f"block {cell.block}: [{index}] on device(s) {', '.join(map(str, cell.device_ids))}"
    badge = ""
    if cell.replicas > 1:
        badge = (f'<span class="wb-replicas" style="position:absolute;top:1px;right:3px;font-size:10px;'
                 f'font-weight:700;background:#fffc;border-radius:3px;padding:0 3px">×{cell.replicas}</span>')
    return (f'<div class="wb-block" data-devices="{escape(",".join(map(str, cell.device_ids)))}" '
            f'title="{escape(tip)}" style="position:relative;background:{device_background(cell.device_ids)};'
            f'color:{TEXT_COLOR};border:1px solid #fff;padding:14px 6px 4px;text-align:center;min-width:84px;'
            f'line-height:1.25">{badge}'
            f'<div style="font-weight:700;font-size:13px;background:#fff9;border-radius:3px;display:inline-block;'
            f'padding:0 3px">{escape(ids_text(cell.device_ids))}</div>'
            f'<div style="font-size:10px;white-space:nowrap">[{escape(drawn)}]</div></div>')


def _axis_caption(layout: ShardingLayout, dim: int) -> str:
    letter = layout.notation_parts()[dim][0]
    n = layout.blocks_per_dim[dim]
    split = f"{n} blocks of {layout.shard_shape[dim]} over {'×'.join(layout.dim_axes(dim))}" if n > 1 else "whole"
    return f"{letter} ({layout.shape[dim]}): {split}"


def sharding_html(layout: ShardingLayout, name: str = "A") -> str:
    """The static picture: notation, a summary line, then one grid of blocks per panel."""
    rank = len(layout.shape)
    where = []
    if rank >= 2:
        where = [f"rows {_axis_caption(layout, rank - 2)}", f"columns {_axis_caption(layout, rank - 1)}"]
    elif rank == 1:
        where = [f"columns {_axis_caption(layout, 0)}"]
    if rank > 2:
        where.append("one panel per block of " + ", ".join(_axis_caption(layout, d) for d in range(rank - 2)))
    typed = typed_html(layout.typed_notation(), layout.typed_notation(on_mesh=True))
    header = (f'<div class="wb-sharding-header" style="margin-bottom:4px">{notation_html(layout, name)}'
              f'<span style="margin-left:12px">{typed}</span>'
              f'<div class="wb-summary" style="font-size:12px">{escape(_summary(layout))}</div>'
              f'<div style="font-size:11px;color:#666">{escape(" · ".join(where))}</div></div>')
    panels = []
    for panel in layout.panels():
        n_cols = len(panel.cells[0])
        title = ", ".join(f"{letter} = {rng}" for letter, rng in panel.title)
        title_html = (f'<div class="wb-panel-title" style="font-size:12px;font-weight:600;margin-bottom:2px">'
                      f"{escape(title)}</div>") if title else ""
        blocks = "".join(_block_html(layout, c) for row in panel.cells for c in row)
        panels.append(f'<div class="wb-sharding-panel">{title_html}<div class="wb-sharding-grid" '
                      f'style="display:grid;grid-template-columns:repeat({n_cols}, minmax(84px, 1fr));'
                      f'max-width:{max(140, 130 * n_cols)}px">{blocks}</div></div>')
    return (f'<div class="wb-sharding-view-static">{header}<div style="display:flex;flex-wrap:wrap;gap:14px;'
            f'align-items:flex-start">{"".join(panels)}</div></div>')


def _inputs(x: tp.Any, mesh: Mesh | AbstractMesh | None) -> tuple[tuple[int, ...], tp.Any, PartitionSpec, tp.Any]:
    """(shape, dtype, spec, mesh) from an array / ShapeDtypeStruct or a (shape, dtype, spec) tuple."""
    if isinstance(x, tuple) and len(x) == 3 and not hasattr(x, "shape"):
        shape, dtype, spec = x
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        shape, dtype, spec = x.shape, x.dtype, getattr(x, "sharding", None)
        if not isinstance(spec, NamedSharding):
            raise TypeError(f"ShardingView: this array's sharding is {type(spec).__name__}, not a NamedSharding; "
                            f"jax.device_put it with a NamedSharding, or pass (shape, dtype, PartitionSpec) and "
                            f"mesh=...")
    else:
        raise TypeError(f"ShardingView needs an array or (shape, dtype, PartitionSpec | NamedSharding); got "
                        f"{type(x).__name__}")
    if isinstance(spec, NamedSharding):
        spec, mesh = spec.spec, spec.mesh if mesh is None else mesh
    return tuple(shape), dtype, spec, mesh


class ShardingView(InlineError, widgets.VBox):
    """Which block of an array each device holds, drawn for any rank, with a PartitionSpec editor.

    ``x`` is an array with a NamedSharding, or ``(shape, dtype, spec)`` with a PartitionSpec (then
    pass ``mesh``) or a NamedSharding; nothing is allocated. Type a spec in the text field
    (``fsdp, tp`` or ``(fsdp, sp), None``) and press enter or "show": the picture re-renders.
    The check is strict, as ``NamedSharding``'s (unknown axis, axis used twice, not divisible);
    tick "fit" to drop the axes that do not divide instead, as ``PartitionAxis.resolve`` does. A
    bad spec shows an inline error and the last valid layout stays. The view shows layouts; it
    never moves the array (``jax.device_put(x, view.sharding)`` does).
    """

    def __init__(self, x: tp.Any, mesh: Mesh | AbstractMesh | None = None, *, name: str = "A",
                 fit: bool = False, **kwargs: tp.Any):
        shape, dtype, spec, mesh = _inputs(x, mesh)
        self._name = name
        self._layout = sharding_layout(shape, dtype, spec, mesh, fit=fit)  # a bad initial spec raises
        self._requested: str | PartitionSpec = spec  # the last accepted spec, before fitting
        self._callbacks: list[tp.Callable[[ShardingLayout], tp.Any]] = []
        self._picture = widgets.HTML(sharding_html(self._layout, name))
        self._text = widgets.Text(value=format_spec(self._layout.spec), description="spec",
                                  placeholder="e.g. fsdp, tp  or  (fsdp, sp), None", continuous_update=False,
                                  layout=widgets.Layout(width="320px"), style={"description_width": "36px"})
        self._text.add_class("wb-spec-input")
        self._fit = widgets.Checkbox(value=fit, description="fit (drop axes that do not divide)", indent=False,
                                     layout=widgets.Layout(width="250px"))
        self._show = widgets.Button(description="show", button_style="primary", layout=widgets.Layout(width="80px"))
        self._show.add_class("wb-spec-show")
        controls = widgets.HBox([self._text, self._show, self._fit], layout=widgets.Layout(flex_flow="row wrap"))
        super().__init__([self._picture, controls, self._error_area()], **kwargs)
        self.add_class("wb-sharding-view")
        self._text.observe(lambda change: self.set_spec(change["new"]), names="value")
        self._show.on_click(lambda _: self.set_spec(self._text.value))
        self._fit.observe(lambda _: self.set_spec(self._text.value), names="value")

    # -- public ------------------------------------------------------------------------------------
    @property
    def sharding_layout(self) -> ShardingLayout:
        """The layout on screen (the last valid one)."""
        return self._layout

    @property
    def spec(self) -> PartitionSpec:
        return self._layout.spec

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self._layout.mesh

    @property
    def sharding(self) -> NamedSharding:
        """The NamedSharding on screen, e.g. for ``jax.device_put(x, view.sharding)``."""
        return self._layout.named_sharding()

    def notation(self) -> str:
        return self._layout.notation(self._name)

    def typed_notation(self) -> str:
        """The type shown beside the notation: JAX's on Explicit axes, ``float32[8@fsdp,16@tp]``."""
        return self._layout.typed_notation()

    def on_change(self, fn: tp.Callable[[ShardingLayout], tp.Any]) -> tp.Callable[[ShardingLayout], tp.Any]:
        """Call ``fn(layout)`` after each accepted edit; returns ``fn``."""
        self._callbacks.append(fn)
        return fn

    def set_spec(self, spec: str | PartitionSpec) -> bool:
        """Show the layout of ``spec`` (text or PartitionSpec); False, with an inline error, if invalid."""
        return self._update(spec, self._layout.mesh, "spec not applied")

    def set_mesh(self, mesh: Mesh | AbstractMesh) -> bool:
        """Show the current spec on ``mesh`` (e.g. ``mesh_view.on_change(view.set_mesh)``)."""
        return self._update(self._requested, mesh, "new mesh not applied")

    def _repr_html_(self) -> str:
        return sharding_html(self._layout, self._name)

    def __repr__(self) -> str:
        return f"ShardingView({self.notation()}, shape={self._layout.shape}, {self._layout.dtype.name})"

    # -- internals -----------------------------------------------------------------------------------
    def _update(self, spec: str | PartitionSpec, mesh: tp.Any, what: str) -> bool:
        old = self._layout
        with self._guard(what, catch=(ValueError, TypeError),
                         suffix=f"\nstill showing {old.notation(self._name)} = {old.spec}") as failed:
            new = sharding_layout(old.shape, old.dtype, spec, mesh, fit=self._fit.value)
        if failed:
            return False
        self._layout, self._requested = new, spec
        self._picture.value = sharding_html(new, self._name)
        self._clear_error()
        typed = spec if isinstance(spec, str) else format_spec(spec)
        if self._text.value != typed:
            self._text.value = typed  # re-enters set_spec with the same spec: harmless
        for fn in list(self._callbacks):
            with self._guard("layout shown, but a follower failed"):  # a follower's bug must not break this view
                fn(new)
        return True
