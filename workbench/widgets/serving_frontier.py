"""The latency-throughput frontier as a plotly figure: each serving layout's points (ms a token against output
tokens a second a chip, one point a concurrency), the Pareto front as a line, and measured points beside them.

The data is :func:`workbench.core.cost.serving.serving_frontier`'s; this draws it.
"""

from __future__ import annotations

import typing as tp

import plotly.graph_objects as go

from workbench.core.cost.serving import FrontierPoint


class MeasuredPoint(tp.NamedTuple):
    """A measured serving point to draw beside the predictions: its name, ms a token, tokens a second a chip."""

    name: str
    ms_per_token: float
    tokens_per_s_per_chip: float


def frontier_figure(points: tp.Sequence[FrontierPoint], measured: tp.Sequence[MeasuredPoint] = (),
                    title: str = "") -> go.Figure:
    """One marker trace per layout (hover: its concurrency and step's parts), the front as a line through its
    points, and ``measured`` as crosses; ms a token on a log x axis (lower is faster), tokens a second a chip on y."""
    if not points:
        raise ValueError("no frontier points to draw: every layout's weights overflow the chips' HBM (see "
                         "workbench.core.cost.serving.kv_capacity)")
    fig = go.Figure()
    for layout in dict.fromkeys(p.layout for p in points):
        mine = [p for p in points if p.layout == layout]
        fig.add_trace(go.Scatter(
            x=[p.ms_per_token for p in mine], y=[p.tokens_per_s_per_chip for p in mine], mode="markers", name=layout,
            text=[f"{p.step.concurrency} in flight: decode {p.step.decode.time_s * 1e3:.1f} ms, admitted prefills "
                  f"{p.step.prefill_s * 1e3:.1f} ms, engine {p.step.engine.seconds * 1e3:.1f} ms" for p in mine],
            hovertemplate="%{text}<br>%{x:.1f} ms a token, %{y:.0f} tokens/s a chip<extra>" + layout + "</extra>"))
    front = sorted((p for p in points if p.on_front), key=lambda p: p.ms_per_token)
    fig.add_trace(go.Scatter(x=[p.ms_per_token for p in front], y=[p.tokens_per_s_per_chip for p in front],
                             mode="lines", name="Pareto front", line={"color": "black", "width": 1}, hoverinfo="skip"))
    if measured:
        fig.add_trace(go.Scatter(x=[m.ms_per_token for m in measured], y=[m.tokens_per_s_per_chip for m in measured],
                                 mode="markers", name="measured (published)", text=[m.name for m in measured],
                                 marker={"symbol": "x", "size": 10, "color": "crimson"},
                                 hovertemplate="%{text}<br>%{x:.1f} ms a token, %{y:.0f} tokens/s a chip"
                                               "<extra></extra>"))
    fig.update_layout(title={"text": title, "x": 0, "xanchor": "left"}, template="plotly_white", width=720, height=420,
                      xaxis={"title": "ms a token (TPOT)", "type": "log"},
                      yaxis={"title": "output tokens/s a chip"}, margin={"t": 48, "b": 40, "l": 60, "r": 10})
    return fig


__all__ = ["MeasuredPoint", "frontier_figure"]
