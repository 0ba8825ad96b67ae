"""A pipeline schedule drawn as a timeline: devices down, ticks across, forward / backward / idle coloured,
each busy cell labelled with its microbatch (and stage when a device holds several)."""

from __future__ import annotations

import typing as tp

from workbench.widgets._html import escape, format_bytes

FORWARD_COLOR, BACKWARD_COLOR, IDLE_COLOR = "#9ecae1", "#a1d99b", "#f0f0f0"


def schedule_html(schedule: tp.Any, *, microbatch_bytes: int | None = None, cell: int = 22) -> str:
    """The timeline of ``schedule`` (a ``PipelineSchedule``) with its bubble (table vs closed form) and the
    stage inputs each device keeps alive (times ``microbatch_bytes`` when given)."""
    from workbench.core.pipeline_schedule import BACKWARD, FORWARD

    c = schedule.config
    ticks, p = schedule.grid.shape
    cell = max(10, min(cell, 900 // max(ticks, 1)))
    label_w = 70
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + ticks * cell + 2}" '
           f'height="{p * cell + 18}" style="font-family:monospace;font-size:{max(7, cell // 2 - 1)}px">']
    for d in range(p):
        y = d * cell
        svg.append(f'<text x="0" y="{y + cell * 0.7:.1f}">device {d}</text>')
        for t in range(ticks):
            kind = int(schedule.grid[t, d])
            color = {FORWARD: FORWARD_COLOR, BACKWARD: BACKWARD_COLOR}.get(kind, IDLE_COLOR)
            x = label_w + t * cell
            svg.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{color}">'
                       f'<title>tick {t}, device {d}: ' + (
                           "idle" if kind not in (FORWARD, BACKWARD) else
                           f'{"forward" if kind == FORWARD else "backward"} of microbatch '
                           f'{schedule.microbatch[t, d]} through stage {schedule.stage[t, d]}') + "</title></rect>")
            if kind in (FORWARD, BACKWARD):
                text = str(schedule.microbatch[t, d])
                if c.virtual_stages > 1:
                    text += "abcdefgh"[int(schedule.stage[t, d]) // p] if schedule.stage[t, d] // p < 8 else ""
                svg.append(f'<text x="{x + cell / 2 - 0.5:.1f}" y="{y + cell * 0.68:.1f}" '
                           f'text-anchor="middle">{escape(text)}</text>')
    svg.append(f'<text x="{label_w}" y="{p * cell + 13}">time (ticks) →</text></svg>')
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
            f'<div style="overflow-x:auto">{"".join(svg)}</div></div>')
