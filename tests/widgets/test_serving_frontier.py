"""The frontier figure draws the frontier's data as it is: one trace a layout, the front's points in order of ms a
token, the measured points beside them; no points says what to change."""

import pytest

from workbench.core.cost.serving import serving_frontier
from workbench.core.hardware.cluster import Cluster
from workbench.core.models.presets import full_config
from workbench.widgets.serving_frontier import MeasuredPoint, frontier_figure


def test_one_trace_a_layout_the_front_and_the_measured_points():
    points = serving_frontier(full_config("llama-3-8b"), Cluster.h100(nodes=1), input_len=512, output_len=512)
    measured = [MeasuredPoint("a run", 9.0, 400.0)]
    fig = frontier_figure(points, measured, title="Llama-3-8B on 8 H100s")
    names = [t.name for t in fig.data]
    layouts = {p.layout for p in points}
    assert set(names[:-2]) == layouts and names[-2:] == ["Pareto front", "measured (published)"]
    for trace in fig.data[:-2]:
        mine = [p for p in points if p.layout == trace.name]
        assert list(trace.x) == [p.ms_per_token for p in mine] and list(trace.y) == [p.tokens_per_s_per_chip
                                                                                      for p in mine]
    front = fig.data[-2]
    assert list(front.x) == sorted(p.ms_per_token for p in points if p.on_front)
    assert list(fig.data[-1].x) == [9.0] and fig.layout.xaxis.type == "log"


def test_no_points_says_why():
    with pytest.raises(ValueError, match="HBM"):
        frontier_figure([])
