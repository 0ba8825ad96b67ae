"""The ShardingExplorer read in JupyterLab windows 1,400 and 1,920 px wide, with the file browser open (as the lab
opens) and collapsed, in the two configurations the notebooks show: the tour's (tiny Llama on dp=2 x fsdp=2 x tp=2)
and notebook 10's (Llama-3-70B on a v5p 4x4x4 cluster, fsdp=16 x tp=4).

What these tests guard, in both columns and below them:
(a) no text is clipped: none reaches past the explorer's edge, the window or a box that hides or scrolls its overflow;
(b) no table column is narrower than its longest word (a run of text between spaces or ``<wbr>`` break points,
    measured with a Range), or than its whole text where it may not wrap;
(c) the parameter table's scroll box shows at least 8 of the 12 parameters, each with its "why" line.
A first test checks that the measurements catch a clipped text, a squeezed column and a short scroll box.
"""

from __future__ import annotations

import typing as tp

import pytest

from ._measure import MEASURE_JS, SETTLE_JS
from .conftest import chromium_page, model_errors, notebook_errors, run_notebook_in_lab, temp_notebook

WIDTHS = (1400, 1920)
HEIGHT = 1000
MIN_ROWS = 8  # parameters the table's scroll box shows at once (the tour's tiny Llama has 12)
EXPLORERS = ("the tour's explorer", "notebook 10's explorer")

_CELLS = [
    "import jax.numpy as jnp\n"
    "import workbench as wb\n\nwb.simulate_devices(8)\n"
    "from workbench.core.hardware.cluster import Cluster\n"
    "from workbench.core.models import CausalLM\n"
    "from workbench.core.models.presets import full_config\n"
    "from workbench.widgets import ShardingExplorer",
    # the tour, section 3
    "mesh = wb.make_mesh(dp=2, fsdp=-1, tp=2)\n"
    "tiny = wb.models.tiny('llama')\n"
    "explorer = ShardingExplorer(tiny, mesh)\n"
    "explorer",
    # notebook 10 (its model: abstract, shapes only)
    "v5p = Cluster.tpu('v5p:4x4x4')\n"
    "model = CausalLM.lazy_init(full_config('llama-3-70b'), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)\n"
    "model = model.with_options(remat='full')\n"
    "cluster_explorer = ShardingExplorer(model, {'fsdp': 16, 'tp': 4}, cluster=v5p, batch=(16, 2048))\n"
    "cluster_explorer",
]

_EXPLORER = {"root": ".wb-sharding-explorer", "wrap": ".wb-explorer-table-wrap", "row": "wb-param-row"}
_SETTLED = ".wb-sharding-explorer, .wb-explorer-table-wrap"


Measurements = dict[tuple[str, str], dict]  # (file browser state, explorer) -> what MEASURE_JS returns


@pytest.fixture(scope="module")
def measure(chromium_path: str, sync_playwright: tp.Callable[[], tp.Any], lab_server: tp.Any,
            tmp_path_factory: pytest.TempPathFactory) -> tp.Iterator[tp.Callable[[int], Measurements]]:
    """``measure(width)``: both explorers measured in a window ``width`` px wide, with the file browser open and
    collapsed. The notebook runs once for the module; each width is measured once."""
    profile = tmp_path_factory.mktemp("chromium-widths")
    with temp_notebook("explorer_widths.ipynb", _CELLS) as path, \
            chromium_page(sync_playwright, chromium_path, profile, {"width": WIDTHS[0], "height": HEIGHT}) as page:
        cells = run_notebook_in_lab(page, lab_server, path, timeout_s=240)
        assert notebook_errors(page) == [] and model_errors(cells) == []
        page.wait_for_selector(".wb-memory-chart .js-plotly-plot", timeout=60_000)
        page.wait_for_selector(".wb-ledger .wb-hbm-line", timeout=60_000)
        done: dict[int, Measurements] = {}

        def at(width: int) -> Measurements:
            if width not in done:
                page.set_viewport_size({"width": width, "height": HEIGHT})
                found = {}
                for sidebar, command in (("file browser open", "expandLeft"),
                                         ("file browser collapsed", "collapseLeft")):
                    page.evaluate(f"() => window.jupyterapp.shell.{command}()")
                    assert page.evaluate(SETTLE_JS, _SETTLED), f"the lab's layout did not settle at {width} px"
                    for index, name in enumerate(EXPLORERS):
                        found[sidebar, name] = page.evaluate(MEASURE_JS, {**_EXPLORER, "index": index})
                page.evaluate("() => window.jupyterapp.shell.expandLeft()")
                done[width] = found
            return done[width]

        yield at


def _report(found: Measurements, key: str) -> str:
    return "\n".join(f"{name} ({m['width']} px wide, {sidebar}): {line}"
                     for (sidebar, name), m in found.items() for line in m[key])


# ------------------------------------------------------------------------------------------- the measurements

_BAD_PAGE = f"""<div class="wb-sharding-explorer" style="width:200px;overflow:auto">
  <div class="wb-cut" style="width:120px;overflow:hidden;white-space:nowrap;text-overflow:ellipsis">
    positions mapped to sp, and more words than fit</div>
  <div class="wb-past" style="width:100px;white-space:nowrap">this line runs past the explorer's right edge</div>
  <div class="wb-explorer-table-wrap" style="max-height:60px;overflow:auto"><table style="font-size:12px">
    <tr><th>path</th><th>why</th></tr>
    {"".join('<tr class="wb-param-row"><td>a/b</td><td style="word-break:break-all;width:20px">replicated</td></tr>'
             for _ in range(12))}
  </table></div></div>"""


def test_the_measurements_catch_clipped_text_a_squeezed_column_and_a_short_scroll_box(lab_page):
    lab_page.set_content(_BAD_PAGE)
    m = lab_page.evaluate(MEASURE_JS, _EXPLORER)
    assert any("wb-cut" in c and "positions mapped to sp" in c for c in m["clipped"]), m["clipped"]
    assert any("wb-past" in c for c in m["clipped"]), m["clipped"]
    assert any('column "why": "replicated"' in n for n in m["narrow"]), m["narrow"]
    assert m["rows"] == 12 and m["visible"] < MIN_ROWS


# --------------------------------------------------------------------------------------------------- the widths

@pytest.mark.parametrize("width", WIDTHS)
def test_no_text_in_the_explorers_is_clipped(measure, width):
    found = measure(width)
    assert not any(m["clipped"] for m in found.values()), f"clipped text at {width} px:\n{_report(found, 'clipped')}"


@pytest.mark.parametrize("width", WIDTHS)
def test_no_table_column_is_narrower_than_its_words(measure, width):
    found = measure(width)
    assert not any(m["narrow"] for m in found.values()), \
        f"columns narrower than their words at {width} px:\n{_report(found, 'narrow')}"


@pytest.mark.parametrize("width", WIDTHS)
def test_the_parameter_table_shows_at_least_eight_rows(measure, width):
    found = measure(width)
    short = {k: (m["visible"], m["rows"], m["box_height"]) for k, m in found.items()
             if m["visible"] < min(MIN_ROWS, m["rows"]) or m["rows"] == 0}
    assert not short, "the parameter table's scroll box shows (rows, of, box height px): " + "; ".join(
        f"{name} ({sidebar}): {v}" for (sidebar, name), v in short.items())
