"""The ShardingExplorer's static panels: the parameter table, memory per device (HTML bars and a plotly figure),
the change from the previous layout, one step's collectives and the exported layout.

Plain HTML with inline styles (tables through :func:`workbench.core.tables.html_table`), so a saved notebook
shows the same picture without a kernel, and the browser tests can find every row by its class and data.
"""

from __future__ import annotations

import re
import typing as tp

import numpy as np
from jax.sharding import Mesh

from workbench.core.axes import label
from workbench.core.cost import ledger as ledgers
from workbench.core.tables import Cell, Html, Row, html_table
from workbench.core.units import format_bytes, format_seconds
from workbench.core.views import explore
from workbench.core.views.explore_step import chart_bytes, names_auto_axes
from workbench.widgets._html import CELL, escape

__all__ = ["CHART_PX", "collectives_html", "diff_html", "export_html", "layout_html", "memory_figure", "memory_html"]

# the widget's parameter table: a row, then its reason on a line of its own (the rule under both)
_ROW_CELL = "padding:2px 4px 0;text-align:left;vertical-align:top"
_WHY_CELL = "padding:0 4px 3px 16px;border-bottom:1px solid #ddd;text-align:left;color:#555;font-size:11px"
_HEAD_CELL = "padding:2px 4px;border-bottom:1px solid #ddd;text-align:left;vertical-align:bottom;font-weight:600"
_WRAPS = (0, 3, 4)  # path (after a /), semantic axes, PartitionSpec: the columns that may wrap
_NOWRAP = "white-space:nowrap"
_HEAD = ("path", "shape", "dtype", "semantic axes", "PartitionSpec", "type", "shard", "bytes/device")
_CLASSES = ("wb-path", "", "", "", "wb-spec", "wb-type", "wb-shard", "wb-bytes", "wb-reason")
CHART_PX = 560  # the memory chart's width (memory_figure)
_PARTS = (("params", "parameters", "#4c78a8"), ("optimizer", "optimizer state (AdamW)", "#f58518"),
          ("kv_cache", "KV cache", "#54a24b"))


def _spec_text(spec: tp.Any) -> str:
    return str(spec).replace("PartitionSpec", "P")


def _param_rows(p: tp.Any, mark: str, why_below: bool, columns: int) -> list[Row]:
    """One parameter's row; with ``why_below`` its reason on a second row, the path breakable after each ``/``."""
    cells = (p.path, "×".join(map(str, p.shape)), p.dtype.name, ", ".join(p.axes), _spec_text(p.spec), p.typed,
             "×".join(map(str, p.shard_shape)), f"{p.bytes_per_device:,}", p.reason)
    attrs = {"class": "wb-param-row", "data-path": p.path, "style": mark}
    if not why_below:
        return [Row([Cell(v, "" if c == "wb-reason" else _NOWRAP, {"class": c})
                     for c, v in zip(_CLASSES, cells, strict=True)], attrs)]
    texts = [Html("/<wbr>".join(map(escape, p.path.split("/")))), *cells[1:-1]]
    row = Row([Cell(v, _ROW_CELL if i in _WRAPS else f"{_ROW_CELL};{_NOWRAP}", {"class": c})
               for i, (c, v) in enumerate(zip(_CLASSES[:-1], texts, strict=True))], attrs)
    why = Row([Cell(p.reason, _WHY_CELL, {"class": "wb-reason", "colspan": columns})],
              {"class": "wb-param-why", "style": mark})
    return [row, why]


def layout_html(layout: explore.Layout, *, pattern: str = "", changed: tp.Collection[str] = (),
                why_below: bool = False) -> str:
    """The parameter table; rows whose path matches ``pattern`` (regex search), ``changed`` ones marked.

    ``why_below`` (the widget's table): each parameter's reason on a line of its own under its row, paths that may
    wrap after a ``/`` and axes and specs after a space, and a taller scroll box, so that the table reads at any
    width JupyterLab gives it; else the reason is the last column (the static table saved in notebooks)."""
    regex = re.compile(pattern) if pattern else None
    head = _HEAD if why_below else (*_HEAD, "why")
    shown = [p for p in layout.params if regex is None or regex.search(p.path)]
    rows = [row for p in shown
            for row in _param_rows(p, ";background:#fff3c4" if p.path in changed else "", why_below, len(head))]
    typed = (Cell("type", attrs={"title": "str(jax.typeof(x)) on this mesh"}) if not names_auto_axes(layout) else
             Cell("type if Explicit", attrs={"title": "the type on Explicit axes; jax.typeof leaves Auto axes out "
                                                      "of types"}))
    header = [typed if h == "type" else h for h in head]
    count = f"{len(shown)} of {len(layout.params)}" if regex is not None else str(len(shown))
    total = (f"{count} parameters · {format_bytes(layout.param_bytes)} of parameters per device, "
             f"{format_bytes(sum(p.nbytes for p in layout.params))} unsharded · {label(layout.mode)}"
             + (" · under each row: why" if why_below else ""))
    table = html_table(rows, header, "wb-explorer-table", cell="" if why_below else CELL,
                       head=_HEAD_CELL if why_below else None,
                       style="border-collapse:collapse;font-size:12px" + (";line-height:1.4" if why_below else ""))
    return (f'<div class="wb-explorer-table-wrap" style="max-height:{720 if why_below else 420}px;overflow:auto">'
            f'<div style="font-size:12px;color:#555;margin:2px 0">{escape(total)}</div>{table}</div>')


def memory_html(memory: ledgers.Ledger, n_devices: int) -> str:
    """A static stacked bar per device (HTML/CSS boxes, which JupyterLab's sanitiser keeps in an untrusted
    notebook, unlike inline SVG), with the numbers beside it."""
    parts = [(name, title, color, getattr(memory, name)) for name, title, color in _PARTS]
    height, width, top = 90, 22, max(memory.total, 1)
    columns = []
    for d in range(n_devices):
        boxes = "".join(f'<div title="device {d}: {escape(title)} {value:,} B" '
                        f'style="height:{height * value / top:.1f}px;background:{color}"></div>'
                        for _, title, color, value in parts if value > 0)
        columns.append(f'<div style="display:flex;flex-direction:column;align-items:center;width:{width}px">'
                       f'<div style="display:flex;flex-direction:column-reverse;height:{height}px;width:{width}px">'
                       f'{boxes}</div><div style="font-size:10px">{d}</div></div>')
    bars = f'<div class="wb-memory-bars" style="display:flex;gap:4px;align-items:flex-end">{"".join(columns)}</div>'
    legend = "".join(f'<div><span style="display:inline-block;width:10px;height:10px;background:{color};'
                     f'margin-right:4px"></span>{escape(title)}: {escape(format_bytes(value))}</div>'
                     for _, title, color, value in parts if value)
    return (f'<div class="wb-memory-static" style="display:flex;gap:16px;align-items:flex-end;font-size:12px">'
            f'{bars}<div><div style="font-weight:600">memory per device: {escape(format_bytes(memory.total))}'
            f"</div>{legend}</div></div>")


def memory_figure(memory: ledgers.Ledger, mesh: tp.Any) -> dict[str, tp.Any]:
    """The plotly figure of ``memory`` as a dict (``plotly.graph_objects.Figure(d)`` builds it): one
    stacked bar per device. A plain dict, so an edit re-renders without building a Figure object."""
    unit, heights = chart_bytes(memory.total, [getattr(memory, name) for name, _, _ in _PARTS])
    devices = [str(d.id) for d in np.asarray(mesh.devices).flat] if isinstance(mesh, Mesh) else \
        [str(i) for i in range(mesh.size)]
    data = [{"type": "bar", "name": title, "x": devices, "y": [y] * len(devices), "marker": {"color": color},
             "hovertemplate": f"{title}: {getattr(memory, name):,} B<extra>device %{{x}}</extra>"}
            for (name, title, color), y in zip(_PARTS, heights, strict=True)]
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc"}
    layout = {"barmode": "stack", "height": 300, "width": CHART_PX, "margin": {"l": 55, "r": 10, "t": 40, "b": 40},
              "title": {"text": f"memory per device: {format_bytes(memory.total)}", "font": {"size": 13}, "x": 0.02},
              "xaxis": {"title": {"text": "device"}, "type": "category", **axis},
              "yaxis": {"title": {"text": unit}, "rangemode": "tozero", **axis},
              "legend": {"orientation": "h", "y": -0.25, "traceorder": "normal"}, "plot_bgcolor": "white",
              "paper_bgcolor": "white"}
    return {"data": data, "layout": layout, "config": {"displayModeBar": False}}


def diff_html(d: explore.LayoutDiff | None) -> str:
    """Which parameters changed spec, and the memory per device before and after."""
    if d is None:
        return '<div class="wb-diff" style="font-size:12px;color:#666">no edit yet</div>'
    sign = "+" if d.delta >= 0 else "-"
    memory = (f"memory per device {format_bytes(d.old_memory.total)} → {format_bytes(d.new_memory.total)} "
              f"({sign}{format_bytes(abs(d.delta))})")
    if not d.changed:
        return f'<div class="wb-diff" style="font-size:12px">no parameter changed spec · {escape(memory)}</div>'
    rows = [(c.path, Html(f"{escape(_spec_text(c.old_spec))} → <b>{escape(_spec_text(c.new_spec))}</b>"),
             f"{c.old_bytes:,} → {c.new_bytes:,} B") for c in d.changed]
    return (f'<div class="wb-diff" style="font-size:12px"><div>{len(d.changed)} parameter(s) changed spec · '
            f"{escape(memory)}</div>{html_table(rows, css_class=None, cell=CELL, style='border-collapse:collapse')}"
            "</div>")


def collectives_html(sc: explore.StepCollectives, *, stale: bool = False,
                     seconds: tp.Mapping[tuple[str, tuple[str, ...]], float] | None = None) -> str:
    """The collectives of one step per kind and mesh axes, with XLA's warnings condensed; with ``seconds``
    (``(kind, axes) -> predicted seconds per step`` on a cluster's network) a column of predicted time."""
    timed = seconds is not None
    rows = [Row([kind, ", ".join(axes) or "-", n, format_bytes(b)]
                + ([Cell(format_seconds(seconds.get((kind, tuple(axes)), 0.0)), attrs={"class": "wb-collective-time"})]
                   if timed else []), {"class": "wb-collective-row"}) for kind, axes, n, b in sc.by_axes()]
    header = ["kind", "mesh axes", "runs", "bytes/device"]
    header += [Cell("time", attrs={"title": "predicted on the cluster's network, all runs"})] if timed else []
    what = (f"{sc.kind} step, batch {sc.batch[0]}×{sc.batch[1]} tokens placed {_spec_text(sc.input_spec)}: "
            f"{sc.runs} collectives run ({len(sc.records)} in the program, those in the layer scan once per layer), "
            f"{format_bytes(sc.bytes_per_device)} per device"
            + f", matmuls {sc.matmul_flops / 1e9:,.3g} GFLOP per device"
            + f" (compiled in {sc.compile_seconds:.2f} s)")
    table = (html_table(rows, header, css_class=None, cell=CELL, head=CELL, style="border-collapse:collapse")
             if rows else "<div>no collective: every device computes its part alone</div>")
    warned: dict[str, int] = {}
    for w in sc.warnings:
        first = w.split(". ")[0]
        warned[first] = warned.get(first, 0) + 1
    warnings = "".join(f'<div style="color:#8a5300">XLA warned ×{n}: {escape(w)}</div>' for w, n in warned.items())
    note = '<div style="color:#b00020">stale: computed for an earlier layout; press "collectives" again</div>' \
        if stale else ""
    return (f'<div class="wb-collectives" style="font-size:12px;{"opacity:0.6" if stale else ""}">{note}'
            f"<div>{escape(what)}</div>{table}{warnings}</div>")


def export_html(code: str, json_text: str) -> str:
    """The exported layout: the Python snippet and the JSON, each in a collapsible ``<pre>``."""
    pre = "margin:2px 0;padding:6px;background:#f6f8fa;border:1px solid #ddd;font-size:12px;overflow:auto"
    return (f'<div class="wb-export" style="font-size:12px">'
            f'<details open><summary>Python: paste after <code>import workbench as wb</code>, with <code>model</code> '
            f'defined</summary><pre class="wb-export-code" style="{pre}">{escape(code)}</pre></details>'
            f"<details open><summary>JSON: <code>Layout.from_json(text, model)</code> or "
            f'<code>explorer.load(text)</code> reads it back</summary><pre class="wb-export-json" style="{pre}">'
            f"{escape(json_text)}</pre></details></div>")
