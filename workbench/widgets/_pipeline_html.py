"""A pipeline schedule drawn as a timeline: devices down, ticks across, forward / backward / idle coloured,
each busy cell labelled with its microbatch (and stage when a device holds several). Plain HTML table cells,
so a saved notebook shows it untrusted too."""

from __future__ import annotations

import typing as tp

from workbench.core.pipeline_schedule import BACKWARD, FORWARD
from workbench.core.tables import Cell, html_table
from workbench.core.units import format_bytes
from workbench.widgets._html import escape

FORWARD_COLOR, BACKWARD_COLOR, IDLE_COLOR = "#9ecae1", "#a1d99b", "#f0f0f0"


def schedule_html(schedule: tp.Any, *, microbatch_bytes: int | None = None, cell: int = 22) -> str:
    """The timeline of ``schedule`` (a ``PipelineSchedule``) with its bubble (table vs closed form) and the
    stage inputs each device keeps alive (times ``microbatch_bytes`` when given)."""
    c = schedule.config
    ticks, p = schedule.grid.shape
    cell = max(10, min(cell, 900 // max(ticks, 1)))
    # an HTML table with styled cells, not SVG: JupyterLab's sanitiser keeps it in a saved, untrusted notebook
    box = (f"width:{cell - 1}px;min-width:{cell - 1}px;height:{cell - 1}px;padding:0;border:1px solid #fff;"
           f"text-align:center;font-size:{max(7, cell // 2 - 1)}px;line-height:{cell - 1}px")
    rows = []
    for d in range(p):
        tds = [Cell(f"device {d}", "padding:0 6px 0 0;white-space:nowrap;font-size:11px")]
        for t in range(ticks):
            kind = int(schedule.grid[t, d])
            color = {FORWARD: FORWARD_COLOR, BACKWARD: BACKWARD_COLOR}.get(kind, IDLE_COLOR)
            if kind in (FORWARD, BACKWARD):
                what = "forward" if kind == FORWARD else "backward"
                title = (f"tick {t}, device {d}: {what} of microbatch {schedule.microbatch[t, d]} through stage "
                         f"{schedule.stage[t, d]}")
                text = str(schedule.microbatch[t, d])
                if c.virtual_stages > 1 and schedule.stage[t, d] // p < 8:
                    text += "abcdefgh"[int(schedule.stage[t, d]) // p]
            else:
                title, text = f"tick {t}, device {d}: idle", ""
            tds.append(Cell(text, f"{box};background:{color}", {"class": "wb-pp-cell", "title": title}))
        rows.append(tds)
    grid = (html_table(rows, css_class="wb-pp-timeline", cell="",
                       style="border-collapse:collapse;font-family:monospace")
            + '<div style="font-size:11px;color:#555">time (ticks) →</div>')
    in_flight = schedule.in_flight()
    held = ", ".join(str(int(n)) for n in in_flight)
    memory = ""
    if microbatch_bytes is not None:
        memory = f"; at most {format_bytes(int(in_flight.max()) * microbatch_bytes)} of stage inputs per device"
    stages = f", {c.virtual_stages} stages per device (letters: a = the first)" if c.virtual_stages > 1 else ""
    legend = (f'<span style="background:{FORWARD_COLOR};padding:0 6px">forward</span> '
              f'<span style="background:{BACKWARD_COLOR};padding:0 6px">backward</span> '
              f'<span style="background:{IDLE_COLOR};padding:0 6px">idle</span>')
    summary = (f"<div><b>{escape(c.schedule)}</b>: p = {c.num_stages} devices, m = {c.num_microbatches} "
               f"microbatches{stages}; {ticks} ticks; <b>bubble {schedule.bubble_fraction:.1%}</b> of the table "
               f"(closed form (p-1)/(vm+p-1) = {schedule.formula_bubble:.1%})</div>"
               f"<div>stage inputs alive per device (peak, for the backward): {held}{memory}</div>")
    return (f'<div class="wb-pipeline" style="font-size:12px">{summary}<div>{legend}</div>'
            f'<div style="overflow-x:auto">{grid}</div></div>')
