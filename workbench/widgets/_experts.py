"""The expert-parallelism panel both the explorer and the module tree show: the alltoall forward's all-to-all
pair from the compiled HLO, its matmul FLOPs against ``dense``, and the drops of a sample batch."""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets

from workbench.core.units import format_bytes
from workbench.widgets._errors import Guard
from workbench.widgets._html import escape

CAPACITY_OPTIONS = [("no drop", None), ("1.0", 1.0), ("1.25", 1.25), ("1.5", 1.5), ("2.0", 2.0)]


def experts_html(summary: tp.Any, *, stale: bool = False) -> str:
    """A MoE model's expert parallelism on the layout: the all-to-all pair, FLOPs against ``dense``, drops."""
    cf = "no drop" if summary.capacity_factor is None else f"capacity factor {summary.capacity_factor:g}"
    def shape(r: tp.Any) -> str:  # XLA may split an all-to-all into one operand per destination
        parts = r.shape if r.shape and isinstance(r.shape[0], tuple) else (r.shape,)
        return f"{len(parts)} × {tuple(parts[0])}" if len(parts) > 1 else str(tuple(parts[0]))

    pair = "; ".join(f"{escape(shape(r))}, {format_bytes(r.bytes)} per device, ×{r.trips} runs"
                     for r in summary.all_to_alls) or "none (no ep axis of size > 1 on this layout)"
    lines = [f"<div><b>alltoall</b> ({cf}): all-to-alls {pair}</div>",
             f"<div>matmul FLOPs per device: {summary.alltoall.matmul_flops / 1e6:,.1f} M vs "
             f"{summary.dense.matmul_flops / 1e6:,.1f} M with <b>dense</b> ({summary.flops_vs_dense:.2f}x)</div>"]
    d = summary.dispatch
    if d is None:
        lines.append('<div style="color:#555">an abstract model: no router to run, so no dispatch or drops</div>')
    else:
        worst = float(d.imbalance_L.max())
        lines.append(f"<div>a sample batch of random tokens: {d.groups} token shares of {d.share}, {d.slots} slots "
                     f"per expert; <b>{d.dropped_fraction:.1%}</b> of the copies dropped; busiest expert "
                     f"{worst:.2f}x the mean load</div>")
    note = '<div style="color:#b00020">stale: computed for an earlier layout; press "experts" again</div>' \
        if stale else ""
    return (f'<div class="wb-experts" style="font-size:12px;{"opacity:0.6" if stale else ""}">{note}'
            f'{"".join(lines)}</div>')


class ExpertsPanel:
    """A capacity-factor dropdown, an "experts" button and the result. A click calls ``compute(capacity_factor)``
    (the owner knows the model, layout and batch) and hands a result to ``on_result``; ``.summary`` is the last.
    ``guard`` is the owner's ``InlineError._guard``: a failure is the owner's inline error, prefixed "experts"."""

    def __init__(self, compute: tp.Callable[[float | None], tp.Any], guard: tp.Callable[..., Guard],
                 on_result: tp.Callable[[tp.Any], None] | None = None):
        self._compute, self._guard, self._on_result = compute, guard, on_result
        self.summary: tp.Any = None
        self.capacity = widgets.Dropdown(options=CAPACITY_OPTIONS, value=1.25, description="capacity",
                                         layout=widgets.Layout(width="170px"), style={"description_width": "60px"})
        self.button = widgets.Button(description="experts", icon="random", button_style="info")
        self.button.add_class("wb-experts-button")
        self.button.on_click(lambda _: self.run())
        self.out = widgets.HTML('<div style="font-size:12px;color:#666">press "experts" to compile the forward '
                                "with the alltoall and dense MoE strategies and dispatch a sample batch</div>")
        self.widget = widgets.VBox([widgets.HBox([self.capacity, self.button]), self.out])

    def run(self) -> bool:
        before = self.out.value
        self.out.value = '<div style="font-size:12px;color:#555">compiling alltoall and dense…</div>'
        with self._guard("experts", plain=(ValueError, TypeError), clear="own") as failed:
            summary = self._compute(self.capacity.value)
        if failed:  # the reason is the owner's inline error; the last result stays
            self.out.value = before
            return False
        self.summary = summary
        self.out.value = experts_html(summary)
        if self._on_result is not None:
            self._on_result(summary)
        return True
