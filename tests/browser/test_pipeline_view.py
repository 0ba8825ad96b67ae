"""PipelineView in a real JupyterLab: the GPipe timeline renders, the schedule toggle and the microbatches
dropdown clicked in the browser reach the kernel and the timeline and bubble come back re-drawn, and a bad
combination (interleaved with microbatches not a multiple of the stages) shows an inline error while the
widget stays usable."""

from __future__ import annotations

import re
import time
import typing as tp

import pytest

from .conftest import (
    lab_screenshot,
    model_errors,
    notebook_errors,
    run_notebook_in_lab,
    screenshot_path,
    temp_notebook,
)

SCREENSHOT = screenshot_path("pipeline_view.png")
TIMEOUT_MS = 30_000
P = 4  # stages (devices) of the view under test

_CELLS = [
    "from workbench.widgets.pipeline_view import PipelineView",
    f"view = PipelineView({P}, 8, 'gpipe')\nview",
]


@pytest.fixture
def pipeline_notebook() -> tp.Iterator[str]:
    with temp_notebook("pipeline_view.ipynb", _CELLS) as path:
        yield path


# What the live widget shows. Only the widget's HTML view counts (`.widget-html`): the static text/html
# fallback of the same output has no `.widget-html` around it, and the controls exist only in the widget.
_STATE_JS = """() => {
  const root = window.jupyterapp.shell.currentWidget.node;
  const timeline = root.querySelector('.widget-html .wb-pipeline');
  const error = root.querySelector('.widget-html .wb-error');
  const summary = timeline ? timeline.textContent : '';
  const bubble = summary.match(/bubble (\\d+\\.\\d)%/);
  const closed = summary.match(/= (\\d+\\.\\d)%\\)/);
  const active = root.querySelector('.widget-toggle-buttons button.mod-active');
  const dropdowns = {};
  for (const d of root.querySelectorAll('.widget-dropdown')) {
    const label = d.querySelector('label');
    const select = d.querySelector('select');
    if (label && select) dropdowns[label.textContent.trim()] = {
      value: select.selectedOptions.length ? select.selectedOptions[0].textContent : null,
      visible: d.offsetParent !== null,
    };
  }
  return {
    bubble: bubble ? bubble[1] : null,
    closed_form: closed ? closed[1] : null,
    rects: timeline ? timeline.querySelectorAll('td.wb-pp-cell').length : 0,
    error: error ? error.textContent : '',
    schedule: active ? active.textContent.trim() : null,
    dropdowns,
  };
}"""


def state(page: tp.Any) -> dict:
    return page.evaluate(_STATE_JS)


def wait_state(page: tp.Any, predicate_js: str, what: str) -> dict:
    """Wait until ``predicate_js`` (a JS expression over ``s``, the widget's state) holds; fail with the state."""
    try:
        page.wait_for_function(f"() => {{ const s = ({_STATE_JS})(); return {predicate_js}; }}",
                               timeout=TIMEOUT_MS, polling=100)
    except Exception as e:
        raise AssertionError(f"{what}: not seen within {TIMEOUT_MS / 1000:.0f} s ({type(e).__name__}); "
                             f"widget now: {state(page)}") from None
    return state(page)


def pick_microbatches(page: tp.Any, value: int) -> None:
    dropdown = page.locator(".widget-dropdown",
                            has=page.locator("label", has_text=re.compile(r"^microbatches$")))
    dropdown.locator("select").select_option(label=str(value))


def test_pipeline_view_redraws_from_the_browser_and_shows_a_bad_combination_inline(lab_page, lab_server,
                                                                                   pipeline_notebook):
    page = lab_page
    cells = run_notebook_in_lab(page, lab_server, pipeline_notebook, timeout_s=180)
    assert notebook_errors(page) == [] and model_errors(cells) == []

    # GPipe, p=4, m=8: 2(m+p-1) = 22 ticks, bubble (p-1)/(m+p-1) = 3/11.
    s = wait_state(page, "s.bubble !== null", "the GPipe timeline")
    assert (s["bubble"], s["closed_form"], s["rects"], s["error"]) == ("27.3", "27.3", 22 * P, "")
    assert s["schedule"] == "gpipe"
    assert s["dropdowns"]["microbatches"]["value"] == "8"
    assert not s["dropdowns"]["stages/device"]["visible"]  # only the interleaved schedule shows it

    # The toggle clicked in the browser: the kernel re-draws. Interleaved, v=2: 3/(2*8+3) = 3/19,
    # 2(vm+p-1) = 38 ticks.
    start = time.monotonic()
    page.locator(".widget-toggle-buttons button", has_text=re.compile(r"^interleaved$")).click()
    s = wait_state(page, "s.bubble === '15.8'", "the interleaved timeline")
    toggle_ms = 1e3 * (time.monotonic() - start)
    assert (s["closed_form"], s["rects"], s["error"], s["schedule"]) == ("15.8", 38 * P, "", "interleaved")
    assert s["dropdowns"]["stages/device"] == {"value": "2", "visible": True}

    # microbatches=2 is not a multiple of p=4 for interleaved: an inline error in place of the timeline.
    pick_microbatches(page, 2)
    s = wait_state(page, "s.error.includes('multiple of num_stages=4')", "the inline error")
    assert "num_microbatches=2" in s["error"] and s["rects"] == 0 and s["bubble"] is None
    assert s["schedule"] == "interleaved" and s["dropdowns"]["microbatches"]["value"] == "2"

    # The widget stays usable: 16 microbatches re-draw, 3/(2*16+3) = 3/35, 2(vm+p-1) = 70 ticks.
    pick_microbatches(page, 16)
    s = wait_state(page, "s.bubble === '8.6'", "the timeline after the error")
    assert (s["closed_form"], s["rects"], s["error"]) == ("8.6", 70 * P, "")
    assert notebook_errors(page) == []

    lab_screenshot(page, SCREENSHOT, scroll_to=1)
    print(f"\ntoggle round trip: {toggle_ms:.0f} ms; screenshot {SCREENSHOT}")
