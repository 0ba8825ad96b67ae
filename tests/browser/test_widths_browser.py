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

# Measures explorer `index` (or `root` when given a selector): clipped texts, squeezed table cells, and how many
# parameter rows (each with the row under it that belongs to it, if any) its table's scroll box shows at the top.
_MEASURE_JS = """(target) => {
  const root = typeof target === 'number' ? document.querySelectorAll('.wb-sharding-explorer')[target]
                                          : document.querySelector(target);
  const viewport = document.documentElement.clientWidth;
  const range = document.createRange();
  const where = (el) => {
    const named = el.closest('[class*="wb-"]');
    return named ? [...named.classList].filter((c) => c.startsWith('wb-')).join('.') : el.tagName.toLowerCase();
  };
  const shown = (el) => getComputedStyle(el).visibility !== 'hidden' && el.getClientRects().length > 0;
  const snippet = (text) => (text.length > 70 ? text.slice(0, 35) + ' … ' + text.slice(-30) : text);
  const rootBox = root.getBoundingClientRect();
  // the horizontal extent in which el's content can be seen: the explorer, the window, every box that clips it
  const visibleSpan = (el) => {
    let left = Math.max(0, rootBox.left), right = Math.min(viewport, rootBox.right);
    for (let a = el; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX === 'visible') continue;
      const box = a.getBoundingClientRect();
      left = Math.max(left, box.left + a.clientLeft);
      right = Math.min(right, box.left + a.clientLeft + a.clientWidth);
    }
    return [left, right];
  };
  const textNodes = (el) => {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), nodes = [];
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const parent = n.parentElement;
      if (n.textContent.trim() && parent && !parent.closest('select, option, datalist, script, style')
          && shown(parent)) nodes.push(n);
    }
    return nodes;
  };

  const clipped = [];
  for (const node of textNodes(root)) {
    const [left, right] = visibleSpan(node.parentElement);
    range.selectNodeContents(node);
    const out = [...range.getClientRects()].find((r) => r.width > 0.5 && (r.right > right + 1 || r.left < left - 1));
    if (out) {
      const px = (a, b) => `${a.toFixed(0)}-${b.toFixed(0)} px`;
      clipped.push(`${where(node.parentElement)}: "${snippet(node.textContent.trim())}" spans `
                   + `${px(out.left, out.right)}, visible ${px(left, right)}`);
    }
  }
  for (const el of [root, ...root.querySelectorAll('*')]) {  // cut off inside its own box (an ellipsis, a label)
    if (!['hidden', 'clip'].includes(getComputedStyle(el).overflowX) || !shown(el)) continue;
    const own = [...el.childNodes].filter((n) => n.nodeType === Node.TEXT_NODE && n.textContent.trim());
    if (own.length && el.scrollWidth > el.clientWidth + 1) {
      clipped.push(`${where(el)}: "${snippet(el.textContent.trim())}" needs ${el.scrollWidth} px, `
                   + `has ${el.clientWidth}`);
    }
  }

  const width = (r) => [...r.getClientRects()].reduce((sum, rect) => sum + rect.width, 0);
  const nowrap = (el) => ['nowrap', 'pre'].includes(getComputedStyle(el).whiteSpace);
  const narrow = [];
  for (const cell of root.querySelectorAll('td, th')) {
    if (!shown(cell) || !cell.textContent.trim()) continue;
    const style = getComputedStyle(cell);
    const room = cell.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    let widest = 0, word = '';
    const consider = (w, text) => { if (w > widest) { widest = w; word = text; } };
    if (nowrap(cell)) {
      range.selectNodeContents(cell);
      consider(range.getBoundingClientRect().width, cell.textContent.trim());
    } else {
      for (const node of textNodes(cell)) {
        if (nowrap(node.parentElement)) {
          range.selectNodeContents(node);
          consider(width(range), node.textContent.trim());
          continue;
        }
        for (const m of node.textContent.matchAll(/\\S+/g)) {
          range.setStart(node, m.index);
          range.setEnd(node, m.index + m[0].length);
          consider(width(range), m[0]);
        }
      }
    }
    if (widest > room + 1) {
      const table = cell.closest('table');
      const head = table && table.rows[0] && table.rows[0].cells[cell.cellIndex];
      const column = head && head !== cell ? head.textContent.trim() : cell.textContent.trim();
      narrow.push(`${where(cell)}, column "${snippet(column)}": "${snippet(word)}" is ${widest.toFixed(0)} px, `
                  + `the column ${room.toFixed(0)} px`);
    }
  }

  const wrap = root.querySelector('.wb-explorer-table-wrap');
  let rows = 0, visible = 0, box_height = null;
  if (wrap) {
    wrap.scrollTop = 0;
    const bottom = wrap.getBoundingClientRect().top + wrap.clientTop + wrap.clientHeight;
    const params = [...wrap.querySelectorAll('tr.wb-param-row')];
    rows = params.length;
    visible = params.filter((row) => {
      const next = row.nextElementSibling;
      const last = next && !next.classList.contains('wb-param-row') ? next : row;
      return last.getBoundingClientRect().bottom <= bottom + 1;
    }).length;
    box_height = wrap.clientHeight;
  }
  return {clipped, narrow, rows, visible, box_height, width: Math.round(rootBox.width)};
}"""

# Resolves after three animation frames in a row left the lab's and the explorers' boxes where they were.
_SETTLE_JS = """async () => {
  const boxes = () => JSON.stringify([document.querySelector('.jp-NotebookPanel'),
    ...document.querySelectorAll('.wb-sharding-explorer, .wb-explorer-table-wrap')]
    .map((el) => el && el.getBoundingClientRect().toJSON()));
  let last = boxes(), same = 0;
  for (let frame = 0; frame < 600 && same < 3; frame++) {
    await new Promise((r) => requestAnimationFrame(r));
    const now = boxes();
    same = now === last ? same + 1 : 0;
    last = now;
  }
  return same >= 3;
}"""


Measurements = dict[tuple[str, str], dict]  # (file browser state, explorer) -> what _MEASURE_JS returns


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
                    assert page.evaluate(_SETTLE_JS), f"the lab's layout did not settle at {width} px"
                    for index, name in enumerate(EXPLORERS):
                        found[sidebar, name] = page.evaluate(_MEASURE_JS, index)
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
    m = lab_page.evaluate(_MEASURE_JS, ".wb-sharding-explorer")
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
