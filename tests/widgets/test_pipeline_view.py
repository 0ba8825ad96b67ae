"""PipelineView: controls re-draw the table at once; the bubble shown is the table's; bad combinations show
inline; "compile" lists the compiled step's ppermutes over pp."""

from __future__ import annotations

import re

import jax
import pytest

from workbench.core.pipeline_schedule import PipelineConfig, pipeline_schedule
from workbench.widgets.pipeline_view import PipelineView


def _bubble(html: str) -> float:
    return float(re.search(r"bubble ([\d.]+)%", html).group(1)) / 100


def test_controls_redraw_the_timeline_and_bubble():
    view = PipelineView(4, 8, "gpipe")
    assert _bubble(view.timeline.value) == pytest.approx(3 / 11, abs=1e-3)
    assert view.timeline.value.count("wb-pp-cell") == view.schedule.ticks * 4 and "<svg" not in view.timeline.value
    view.schedule_control.value = "interleaved"  # v = 2: (p-1)/(vm+p-1) = 3/19
    assert _bubble(view.timeline.value) == pytest.approx(3 / 19, abs=1e-3)
    assert view.schedule.config.virtual_stages == 2
    view.microbatches.value = 32
    assert _bubble(view.timeline.value) == pytest.approx(3 / 67, abs=1e-3)
    view.schedule_control.value = "1f1b"
    assert "stage inputs alive per device (peak, for the backward): 4, 3, 2, 1" in view.timeline.value


def test_a_bad_combination_shows_inline_and_the_view_keeps_working():
    view = PipelineView(4, 8, "interleaved")
    view.microbatches.value = 2  # interleaved needs m to be a multiple of p
    assert "multiple of num_stages=4" in view.error and "wb-error" in view._error.value
    assert view.schedule is None and view.timeline.value == ""
    view.microbatches.value = 8
    assert view.error == "" and "wb-pp-cell" in view.timeline.value and view.schedule is not None


def test_schedule_renders_statically():
    from workbench.widgets.pipeline_view import schedule_html

    html = schedule_html(pipeline_schedule(PipelineConfig(2, 4, "1f1b")))
    assert "bubble 20.0%" in html and html.count("wb-pp-cell") == 10 * 2


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
def test_compile_lists_the_ppermutes():
    from workbench.core.models.presets import tiny

    view = PipelineView(2, 4, "1f1b", model=tiny("llama", num_hidden_layers=2), batch_shape=(16, 16))
    assert view.compile()
    html = view.collectives.value
    assert "collective-permute" in html and ">pp<" in html
