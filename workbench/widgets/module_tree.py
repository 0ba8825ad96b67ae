"""ModuleTree: an NNX model rendered with treescope, its parameter counts per subtree, and each parameter's
sharding; choosing a parameter shows its :class:`~workbench.widgets.sharding_view.ShardingView`.

The rows and totals come from :mod:`workbench.core.views.param_tree` (tested without a widget). treescope's
HTML needs its scripts to run, so it goes into an ``ipywidgets.Output`` as display data (an
``ipywidgets.HTML`` value would not run them).
"""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets

from workbench.core.axes import MODE_TRAIN, PartitionAxis
from workbench.core.sharding.blocks import format_spec
from workbench.core.sharding.placement import ParamPlacement
from workbench.core.units import format_bytes, format_count
from workbench.core.views import explore
from workbench.core.views.expert_dispatch import expert_parallel_summary
from workbench.core.views.param_tree import SubtreeTotal, param_rows, subtree_totals
from workbench.widgets._errors import InlineError
from workbench.widgets._experts import ExpertsPanel
from workbench.widgets._html import escape, typed_html
from workbench.widgets.sharding_view import ShardingView

__all__ = ["ModuleTree", "param_summary_html", "tree_totals_html"]

_TREE_FAILED = "treescope could not render this model"
_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:12px"


def _spec_text(row: ParamPlacement) -> str:
    return "not placed" if row.spec is None else f"P({format_spec(row.spec)})"


def _row_label(row: ParamPlacement) -> str:
    """The dropdown label of a parameter: path, shape, dtype, spec."""
    return f"{row.path}  {tuple(row.shape)} {row.dtype.name}  {_spec_text(row)}"


def _leaf_html(row: ParamPlacement) -> str:
    axes = "" if row.axes is None else f" · axes ({', '.join(row.axes)})"
    shard = ""
    if row.shard_shape is not None:
        shard = f" · shard {tuple(row.shard_shape)} = {format_bytes(row.bytes_per_device)}/device"
    return (f'<div class="wb-param" data-path="{escape(row.path)}" style="margin-left:14px">'
            f"<b>{escape(row.name)}</b> {escape(tuple(row.shape))} {escape(row.dtype.name)} · "
            f"{escape(format_count(row.count))} · {escape(format_bytes(row.nbytes))}{escape(axes)} · "
            f"{escape(_spec_text(row))}{escape(shard)}</div>")


def _total_text(total: SubtreeTotal) -> str:
    per = "" if total.bytes_per_device is None else f", {format_bytes(total.bytes_per_device)}/device"
    arrays = f"{total.num_arrays} array{'s' * (total.num_arrays != 1)}"
    return f"{format_count(total.count)} params ({total.count:,}) · {format_bytes(total.nbytes)}{per} · {arrays}"


def tree_totals_html(rows: tp.Sequence[ParamPlacement], open_depth: int = 1) -> str:
    """Foldable parameter counts per subtree (``<details>``, no script needed), leaves with their spec."""
    totals = subtree_totals(rows)
    by_parent: dict[str, list[tuple[str, str | ParamPlacement]]] = {}
    for prefix in totals:
        if prefix:
            parent = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            by_parent.setdefault(parent, []).append((prefix, prefix))
    for row in rows:
        parent = row.path.rsplit("/", 1)[0] if "/" in row.path else ""
        by_parent.setdefault(parent, []).append((row.path, row))
    order: dict[str, int] = {}  # a subtree sits where its first parameter does
    for i, row in enumerate(rows):
        parts = row.path.split("/")
        for depth in range(1, len(parts) + 1):
            order.setdefault("/".join(parts[:depth]), i)

    def node(prefix: str) -> str:
        total = totals[prefix]
        name = prefix.rsplit("/", 1)[-1] if prefix else "model"
        children = sorted(by_parent.get(prefix, []), key=lambda kv: order[kv[0]])
        inner = "".join(_leaf_html(c) if isinstance(c, ParamPlacement) else node(c) for _, c in children)
        is_open = " open" if total.depth < open_depth else ""
        return (f'<details class="wb-subtree" data-path="{escape(prefix)}"{is_open} style="margin-left:14px">'
                f"<summary><b>{escape(name)}</b> · {escape(_total_text(total))}</summary>{inner}</details>")

    if not rows:
        return '<div class="wb-module-totals">no nnx.Param in this module</div>'
    return f'<div class="wb-module-totals" style="{_MONO};margin-left:-14px">{node("")}</div>'


def param_summary_html(row: ParamPlacement) -> str:
    """One parameter in words: shape, semantic axes, spec and where it came from, its type on Explicit axes,
    and why per dimension."""
    where = {"placed": "as placed (the array's NamedSharding)",
             "resolved": "resolved from its semantic axes on the mesh given"}.get(row.source or "", "")
    lines = [f"<b>{escape(row.path)}</b> {escape(tuple(row.shape))} {escape(row.dtype.name)} · "
             f"{escape(f'{row.count:,}')} params · {escape(format_bytes(row.nbytes))}"]
    if row.axes is not None:
        lines.append(f"semantic axes: ({escape(', '.join(row.axes))})")
    lines.append(f"spec: {escape(_spec_text(row))} {escape(where)}")
    if row.spec is not None:
        lines.append(f"type: {typed_html(row.typed, row.typed_on_mesh)}")
    if row.reason:
        lines.append(f"why: {escape(row.reason)}")
    return f'<div class="wb-param-summary" style="{_MONO}">' + "<br>".join(lines) + "</div>"


class ModuleTree(InlineError, widgets.VBox):
    """An NNX model as a treescope tree, with parameter counts per subtree and each parameter's sharding.

    ``mesh=None`` shows the specs the parameters are placed with (``shard_model`` / ``lazy_init(...,
    mesh=...)``); with ``mesh`` (a ``Mesh`` or ``AbstractMesh``) it shows what ``shard_model(model, mesh,
    partition_axis, mode, rules)`` would place, and why. Choose a parameter in the dropdown to see its
    blocks per device in a :class:`ShardingView` (its spec editor is a what-if: the model is unchanged).
    """

    def __init__(self, model: tp.Any, *, mesh: tp.Any = None, partition_axis: PartitionAxis | None = None,
                 mode: str = MODE_TRAIN, rules: tp.Any = None, open_depth: int = 1, **kwargs: tp.Any):
        self.model = model
        self._rows = param_rows(model, mesh, partition_axis, mode, rules)  # bad rules / mesh raise here
        self._by_path = {r.path: r for r in self._rows}
        self._totals = subtree_totals(self._rows)
        self._mesh = mesh
        self._sharding_view: tp.Any = None
        self._header = widgets.HTML(self._header_html())
        error_area = self._error_area()  # before the tree: its render may fail
        self._tree = widgets.Output(layout=widgets.Layout(max_height="320px", overflow="auto",
                                                          border="1px solid #ddd"))
        self._tree.add_class("wb-treescope")
        self._render_tree()
        self._counts = widgets.HTML(tree_totals_html(self._rows, open_depth))
        self._choose = widgets.Dropdown(options=[("choose a parameter…", "")] + [(_row_label(r), r.path)
                                                                             for r in self._rows],
                                        value="", description="parameter", layout=widgets.Layout(width="720px"),
                                        style={"description_width": "70px"})
        self._choose.add_class("wb-param-choose")
        self._summary = widgets.HTML("")
        self._detail = widgets.VBox([])
        self._detail.add_class("wb-param-detail")
        layers = getattr(getattr(model, "layers", None), "num_layers", None)
        self._layer = widgets.Dropdown(options=[("choose a layer…", -1)] + [(f"layer {i}", i) for i in
                                                                          range(layers or 0)],
                                       value=-1, description="open", style={"description_width": "40px"})
        self._layer.add_class("wb-layer-choose")
        self._layer_tree = widgets.Output(layout=widgets.Layout(max_height="320px", overflow="auto"))
        self._layer_tree.add_class("wb-layer-tree")
        layer_note = widgets.HTML(
            f'<div style="font-size:12px;color:#555">the {layers} decoder layers are one block whose parameters are '
            f"stacked on a leading <code>layers</code> axis (run by <code>lax.scan</code>); open one to see it as "
            f"its own block (<code>model.layers[i]</code>)</div>" if layers else
            '<div style="font-size:12px;color:#555">this model has no stacked layers</div>')
        children = [self._tree, self._counts, widgets.VBox([layer_note, self._layer, self._layer_tree])]
        self._layout_args = (mesh, partition_axis, mode, rules)
        self.experts: tp.Any = None  # an ExpertsPanel for a MoE model
        if getattr(getattr(model, "config", None), "num_local_experts", 0):
            self.experts = ExpertsPanel(self._expert_summary, self._guard)
            note = widgets.HTML('<div style="font-size:12px;color:#555">how the MoE layers run on this mesh: the '
                                "alltoall forward's all-to-all pair from the compiled HLO, its matmul FLOPs against "
                                "dense, and the copies a sample batch drops at a capacity factor</div>")
            children.append(widgets.VBox([note, self.experts.widget]))
        tabs = widgets.Tab(children=children)
        for i, title in enumerate(("tree (treescope)", "parameter counts", "one layer", "experts")[:len(children)]):
            tabs.set_title(i, title)
        super().__init__([self._header, tabs, self._choose, error_area, self._summary, self._detail],
                         **kwargs)
        self.add_class("wb-module-tree")
        self._choose.observe(self._on_choose, names="value")
        self._layer.observe(self._on_layer, names="value")

    # -- public --------------------------------------------------------------------------------------------
    @property
    def rows(self) -> list[ParamPlacement]:
        return list(self._rows)

    @property
    def totals(self) -> dict[str, SubtreeTotal]:
        return dict(self._totals)

    @property
    def selected(self) -> str:
        """The chosen parameter's path ('' when none)."""
        return self._choose.value

    @property
    def sharding_view(self) -> tp.Any:
        """The ShardingView of the chosen parameter (None when none is shown)."""
        return self._sharding_view

    def select(self, path: str) -> bool:
        """Choose parameter ``path`` (what the dropdown does); False, with an inline error, if unknown."""
        if path and path not in self._by_path:
            close = [p for p in self._by_path if path in p][:5]
            self._show_error(f"no parameter {path!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                                         f"; the paths look like {self._rows[0].path!r}"))
            return False
        self._choose.value = path
        return True

    def open_layer(self, index: int) -> bool:
        """Show layer ``index`` of the stacked layers as its own block (what the "one layer" tab does)."""
        options = [v for _, v in self._layer.options if v >= 0]
        if index not in options:
            self._show_error(f"no layer {index!r}; the model has {len(options)} layers (0 .. {len(options) - 1})"
                             if options else "this model has no stacked layers to open")
            return False
        self._layer.value = index
        return True

    def _on_layer(self, change: dict) -> None:
        from IPython.display import HTML

        self._clear_choice_error()
        self._layer_tree.clear_output()
        if change["new"] < 0:
            return
        with self._guard(f"cannot render layer {change['new']}") as failed:  # whatever treescope does
            import treescope

            html = treescope.render_to_html(self.model.layers[change["new"]], ignore_exceptions=True, compressed=True)
        if not failed:
            self._layer_tree.append_display_data(HTML(html))

    def _clear_choice_error(self) -> None:
        """A new choice clears the last choice's error; the whole tree's failed render stays said."""
        if self._error_source != _TREE_FAILED:
            self._clear_error()

    def _repr_html_(self) -> str:
        return (f'<div class="wb-module-tree-static">{self._header_html()}'
                f"{tree_totals_html(self._rows, open_depth=1)}</div>")

    def __repr__(self) -> str:
        total = self._totals.get("")
        return f"ModuleTree({type(self.model).__name__}, {0 if total is None else total.count:,} parameters)"

    # -- internals -------------------------------------------------------------------------------------------
    def _expert_summary(self, capacity_factor: float | None) -> tp.Any:
        mesh, partition_axis, mode, rules = self._layout_args
        mesh = mesh if mesh is not None else next((r.sharding.mesh for r in self._rows if r.sharding is not None),
                                                  None)
        if mesh is None:
            raise ValueError("the model is not on a mesh: pass mesh= (one with an ep axis) to see its experts' "
                             "all-to-alls")
        layout = explore.Layout.of(self.model, mesh, partition_axis, rules, mode)
        return expert_parallel_summary(self.model, layout, capacity_factor=capacity_factor, batch=(8, 32))

    def _header_html(self) -> str:
        total = self._totals.get("")
        count = 0 if total is None else total.count
        config = getattr(self.model, "config", None)
        family = f" ({config.model_type})" if hasattr(config, "model_type") else ""
        placed = {r.source for r in self._rows} - {None}
        mesh = next((r.sharding.mesh for r in self._rows if r.sharding is not None), None)
        on = ""
        if mesh is not None:
            split = [f"{n} {s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if s > 1]
            on = f" on mesh {' × '.join(split) or 'of 1 device'}"
        where = ("not placed on a mesh (pass mesh= to see how it would shard)" if not placed else
                 f"specs resolved{on}" if "resolved" in placed else f"specs as placed{on}")
        per = "" if total is None or total.bytes_per_device is None else \
            f" · {format_bytes(total.bytes_per_device)} per device"
        return (f'<div class="wb-module-header" style="font-size:13px"><b>{escape(type(self.model).__name__)}'
                f"{escape(family)}</b> · {escape(format_count(count))} parameters ({count:,}) · "
                f"{escape(format_bytes(0 if total is None else total.nbytes))}{escape(per)} · "
                f"{escape(where)}</div>")

    def _render_tree(self) -> None:
        from IPython.display import HTML

        with self._guard(_TREE_FAILED) as failed:  # the counts and specs stay usable without the picture
            import treescope

            html = treescope.render_to_html(self.model, ignore_exceptions=True, compressed=True)
        if not failed:
            self._tree.append_display_data(HTML(html))

    def _on_choose(self, change: dict) -> None:
        path = change["new"]
        self._clear_choice_error()
        self._sharding_view = None
        if not path:
            self._summary.value, self._detail.children = "", ()
            return
        row = self._by_path[path]
        self._summary.value = param_summary_html(row)
        if row.sharding is None:
            self._detail.children = (widgets.HTML(
                '<div class="wb-note" style="font-size:12px">this parameter is not placed on a mesh: build the '
                "tree with ModuleTree(model, mesh=make_mesh(...)) to see how it would shard, or pass "
                "shard_model(model, mesh)</div>"),)
            return
        with self._guard(f"cannot show the sharding of {path}") as failed:
            view = ShardingView((row.shape, row.dtype, row.sharding), mesh=row.sharding.mesh, name="W")
        if failed:  # the tree stays usable whatever the view does
            self._detail.children = ()
            return
        self._sharding_view = view
        self._detail.children = (view,)
