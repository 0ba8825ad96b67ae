"""The LayoutAdvisor read in JupyterLab windows 1,400 and 1,920 px wide, with the file browser open (as the lab
opens) and collapsed: issue 48's review found the table 1,153 px wide in a 968 px output area, the "why" column off
screen and ten rows making the widget 6,252 px tall (``../shared/reviews/advisor-in-the-browser-2026-11-29.md``).

Two advisors, as the review used them: Llama-3-70B trained on 32 x 8 H100 at 8k (4M tokens a step), its top row
written into the recipe box as a torchtitan TOML; and Llama-3-70B decoding 8 sequences against an 8,192-position KV
cache on a v5e 4x4, its top row confirmed with the compiler (the confirm panel below the table). In each:
(a) no text is clipped and (b) no table column is narrower than its words (``_measure.MEASURE_JS``, whose first test
in ``test_widths_browser.py`` shows it catches both);
(c) each row's reason is a line of its own under the row, as wide as the table;
(d) the ranked table scrolls in a box no taller than ``TABLE_MAX_HEIGHT_PX`` that shows at least ``MIN_ROWS`` rows
    with their reasons, so the widget stays under ``MAX_WIDGET_PX`` however many rows it lists.
"""

from __future__ import annotations

import typing as tp

import pytest

from workbench.widgets.layout_advisor import TABLE_MAX_HEIGHT_PX

from ._measure import MEASURE_JS, SETTLE_JS
from .conftest import chromium_page, model_errors, notebook_errors, run_notebook_in_lab, temp_notebook

WIDTHS = (1400, 1920)
HEIGHT = 1000
MIN_ROWS = 4  # rows, each with its reason, the table's scroll box shows at once
MAX_WIDGET_PX = 2000  # the whole train advisor: inputs, pins, recipe box, table, buttons, and what the row shows
ADVISORS = ("train on 32 x 8 H100", "decode on v5e 4x4, confirmed")
_ADVISOR = {"root": ".wb-layout-advisor", "wrap": ".wb-advice-wrap", "row": "wb-advice-row"}

_CELLS = [
    "import jax.numpy as jnp\n"
    "from workbench.core.hardware.cluster import Cluster\n"
    "from workbench.core.models.presets import full_config\n"
    "from workbench.models import CausalLM\n"
    "from workbench.widgets import LayoutAdvisor\n"
    "model = CausalLM.lazy_init(full_config('llama-3-70b'), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)",
    "train = LayoutAdvisor(model, Cluster.h100(nodes=32), batch_tokens=4 * 2**20, seq_len=8192)\n"
    "assert train.export_recipe('torchtitan TOML') and not train.error\n"
    "train",
    "decode = LayoutAdvisor(model, Cluster.tpu('v5e:4x4'), batch_tokens=8, seq_len=8192, task='decode')\n"
    "assert decode.confirm() and not decode.error, decode.error\n"
    "decode",
]

# Each ranked row and the line under it: the line is the row's reason and spans the table.
_WHY_LINES_JS = """(index) => {
  const root = document.querySelectorAll('.wb-layout-advisor')[index];
  const table = root.querySelector('.wb-advice-table');
  return [...table.querySelectorAll('tr.wb-advice-row')].map((row) => {
    const next = row.nextElementSibling;
    const why = next && next.classList.contains('wb-advice-why') ? next.querySelector('.wb-advice-reason') : null;
    return {rank: row.dataset.rank, why: why ? why.textContent.trim().length : 0,
            spans: why ? Math.abs(why.getBoundingClientRect().width - table.getBoundingClientRect().width) <= 1
                       : false,
            scrolls: root.querySelector('.wb-advice-wrap').scrollHeight
                     > root.querySelector('.wb-advice-wrap').clientHeight};
  });
}"""

Measurements = dict[tuple[str, str], dict]  # (file browser state, advisor) -> MEASURE_JS's and _WHY_LINES_JS's


@pytest.fixture(scope="module")
def measure(chromium_path: str, sync_playwright: tp.Callable[[], tp.Any], lab_server: tp.Any,
            tmp_path_factory: pytest.TempPathFactory) -> tp.Iterator[tp.Callable[[int], Measurements]]:
    """``measure(width)``: both advisors measured in a window ``width`` px wide, file browser open and collapsed.
    The notebook runs once for the module; each width is measured once."""
    profile = tmp_path_factory.mktemp("chromium-advisor-widths")
    with temp_notebook("advisor_widths.ipynb", _CELLS) as path, \
            chromium_page(sync_playwright, chromium_path, profile, {"width": WIDTHS[0], "height": HEIGHT}) as page:
        cells = run_notebook_in_lab(page, lab_server, path, timeout_s=300)
        assert notebook_errors(page) == [] and model_errors(cells) == []
        page.wait_for_selector(".wb-layout-advisor .wb-confirm-table", timeout=60_000)
        done: dict[int, Measurements] = {}

        def at(width: int) -> Measurements:
            if width not in done:
                page.set_viewport_size({"width": width, "height": HEIGHT})
                found = {}
                for sidebar, command in (("file browser open", "expandLeft"),
                                         ("file browser collapsed", "collapseLeft")):
                    page.evaluate(f"() => window.jupyterapp.shell.{command}()")
                    assert page.evaluate(SETTLE_JS, ".wb-layout-advisor, .wb-advice-wrap"), \
                        f"the lab's layout did not settle at {width} px"
                    for index, name in enumerate(ADVISORS):
                        found[sidebar, name] = {**page.evaluate(MEASURE_JS, {**_ADVISOR, "index": index}),
                                                "why": page.evaluate(_WHY_LINES_JS, index)}
                page.evaluate("() => window.jupyterapp.shell.expandLeft()")
                done[width] = found
            return done[width]

        yield at


def _report(found: Measurements, key: str) -> str:
    return "\n".join(f"{name} ({m['width']} px wide, {sidebar}): {line}"
                     for (sidebar, name), m in found.items() for line in m[key])


@pytest.mark.parametrize("width", WIDTHS)
def test_no_text_in_the_advisors_is_clipped(measure, width):
    found = measure(width)
    assert not any(m["clipped"] for m in found.values()), f"clipped text at {width} px:\n{_report(found, 'clipped')}"


@pytest.mark.parametrize("width", WIDTHS)
def test_no_advisor_column_is_narrower_than_its_words(measure, width):
    found = measure(width)
    assert not any(m["narrow"] for m in found.values()), \
        f"columns narrower than their words at {width} px:\n{_report(found, 'narrow')}"


@pytest.mark.parametrize("width", WIDTHS)
def test_each_row_has_its_reason_on_a_line_of_its_own(measure, width):
    for key, m in measure(width).items():
        assert m["why"] and all(w["why"] > 20 and w["spans"] for w in m["why"]), (key, m["why"])


@pytest.mark.parametrize("width", WIDTHS)
def test_the_table_scrolls_in_a_bounded_box_that_shows_enough_rows(measure, width):
    for (sidebar, name), m in measure(width).items():
        assert m["box_height"] <= TABLE_MAX_HEIGHT_PX + 2, (sidebar, name, m["box_height"])
        assert m["visible"] >= min(MIN_ROWS, m["rows"]), (sidebar, name, m["visible"], m["rows"], m["box_height"])
        if name.startswith("train"):
            assert m["rows"] == 10 and m["why"][0]["scrolls"], (sidebar, m["rows"])  # ten rows: the box scrolls
            assert m["height"] <= MAX_WIDGET_PX, (sidebar, m["height"])
