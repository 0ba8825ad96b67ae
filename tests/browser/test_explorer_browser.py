"""ShardingExplorer in a real JupyterLab: the table and the plotly chart render, and a rule changed in the
browser (the tensor-parallel axis) reaches the kernel and re-renders the table with the new spec."""

from __future__ import annotations

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

SCREENSHOT = screenshot_path("sharding_explorer.png")
Q_PROJ = "layers/self_attn/q_proj/kernel"
N_PARAMS = 12  # tiny Llama: embeddings, 7 stacked kernels + 2 stacked norms (2 layers each), final norm, head

# An abstract model (no weights): the notebook runs in a few seconds, and notebook 05 (the same widget on
# live models) is not executed twice in one test run (nbval already runs it).
_CELLS = [
    "import workbench as wb\n\nwb.simulate_devices(8)\n"
    "from workbench.core.models import CausalLM, ModelConfig\n"
    "from workbench.core.models.presets import tiny_config\n"
    "from workbench.widgets.sharding_explorer import ShardingExplorer",
    "model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config('llama')))\n"
    "explorer = ShardingExplorer(model, wb.make_mesh(dp=2, fsdp=2, tp=2), batch=(8, 16))\n"
    "explorer",
]


@pytest.fixture
def explorer_notebook() -> tp.Iterator[str]:
    with temp_notebook("sharding_explorer.ipynb", _CELLS) as path:
        yield path


_SPEC_JS = """(path) => {
  const row = document.querySelector(`.wb-explorer-table tr[data-path="${path}"] td.wb-spec`);
  return row ? row.textContent : null;
}"""


# What a newcomer sees at 1440 px: the rules column (the left one) has no horizontal scrollbar, cuts no control
# off, draws no control over another; the parameter table scrolls in one box, not a box inside a box.
_LAYOUT_JS = """() => {
  const editor = document.querySelector('.wb-sharding-explorer .wb-rules-editor');
  const name = (el) => (el.className && el.className.baseVal === undefined ? el.className : el.tagName)
    .toString().split(' ').filter((c) => c.startsWith('wb-') || c.startsWith('widget-')).join('.') || el.tagName;
  const scrolling = [editor, ...editor.querySelectorAll('*')].filter((el) => {
    const style = getComputedStyle(el);
    return ['auto', 'scroll'].includes(style.overflowX) && el.scrollWidth > el.clientWidth + 1;
  }).map(name);
  const box = editor.getBoundingClientRect();
  const controls = [...editor.querySelectorAll('input, select, button, textarea')]
    .filter((el) => el.getClientRects().length > 0);
  const clipped = controls.filter((el) => {
    const r = el.getBoundingClientRect();
    return r.left < box.left - 1 || r.right > box.right + 1;
  }).map(name);
  const overlapping = [];
  for (let i = 0; i < controls.length; i++) {
    for (let j = i + 1; j < controls.length; j++) {
      const a = controls[i].getBoundingClientRect(), b = controls[j].getBoundingClientRect();
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1) {
        overlapping.push(name(controls[i]) + ' / ' + name(controls[j]));
      }
    }
  }
  const wrap = document.querySelector('.wb-explorer-table-wrap');
  const nested_scroll = [...wrap.querySelectorAll('*')].filter((el) => {
    const style = getComputedStyle(el);
    return ['auto', 'scroll'].includes(style.overflowY) && el.scrollHeight > el.clientHeight + 1;
  }).map(name);
  let outer = wrap.parentElement, outer_scroll = [];
  while (outer && !outer.classList.contains('wb-sharding-explorer')) {
    const style = getComputedStyle(outer);
    if (['auto', 'scroll'].includes(style.overflowY) && outer.scrollHeight > outer.clientHeight + 1) {
      outer_scroll.push(name(outer));
    }
    outer = outer.parentElement;
  }
  return {scrolling, clipped, overlapping, nested_scroll: [...nested_scroll, ...outer_scroll]};
}"""


def test_explorer_renders_and_a_rule_changed_in_the_browser_re_renders_the_table(lab_page, lab_server,
                                                                                explorer_notebook):
    start = time.monotonic()
    cells = run_notebook_in_lab(lab_page, lab_server, explorer_notebook, timeout_s=180)
    assert notebook_errors(lab_page) == [] and model_errors(cells) == []
    page = lab_page
    page.wait_for_selector(".wb-sharding-explorer .wb-explorer-table", timeout=60_000)
    assert page.locator(".wb-explorer-table tr.wb-param-row").count() == N_PARAMS
    page.wait_for_selector(".wb-memory-chart .js-plotly-plot", timeout=60_000)  # plotly.js drew the chart
    assert page.evaluate(_SPEC_JS, Q_PROJ) == "P(None, ('fsdp', 'sp'), 'tp')"

    # the kernel round trip: a dropdown changed in the browser, the table re-rendered by the kernel
    page.select_option(".wb-field-tensor_parallel_axis select", "dp")
    page.wait_for_function(f"() => ({_SPEC_JS})('{Q_PROJ}') === \"P(None, ('fsdp', 'sp'), 'dp')\"", timeout=30_000)
    assert "changed spec" in page.locator(".wb-diff").inner_text()
    assert page.locator(".wb-explorer-table tr.wb-param-row").count() == N_PARAMS

    # a bad rule typed in the browser: an inline error, the table keeps the last valid layout
    page.click(".wb-add-rule")
    page.fill(".wb-rule-axes input", "TP, EMPTY")
    page.fill(".wb-rule-pattern input", "embed_tokens([")
    page.press(".wb-rule-pattern input", "Enter")
    page.wait_for_function("() => (document.querySelector('.wb-error') || {}).textContent?.includes('does not "
                           "compile')", timeout=30_000)
    assert page.evaluate(_SPEC_JS, Q_PROJ) == "P(None, ('fsdp', 'sp'), 'dp')"
    page.fill(".wb-rule-pattern input", "embed_tokens")
    page.press(".wb-rule-pattern input", "Enter")
    page.wait_for_function("() => !document.querySelector('.wb-error')", timeout=30_000)
    page.wait_for_function(f"() => ({_SPEC_JS})('embed_tokens') === \"P('dp', None)\"", timeout=30_000)

    # a button: the collectives panel compiles one step in the kernel
    page.click(".wb-collectives-button")
    page.wait_for_selector(".wb-collective-row", timeout=60_000)
    assert "all-reduce" in page.locator(".wb-collectives").inner_text()

    page.set_viewport_size({"width": 1440, "height": 1500})  # the whole explorer in one picture
    page.wait_for_timeout(500)  # JupyterLab lays the notebook out again
    layout = page.evaluate(_LAYOUT_JS)
    assert layout["scrolling"] == [], f"horizontal scrollbars in the rules column at 1440 px: {layout['scrolling']}"
    assert layout["clipped"] == [], f"controls cut off by the rules column at 1440 px: {layout['clipped']}"
    assert layout["overlapping"] == [], f"controls drawn over each other at 1440 px: {layout['overlapping']}"
    assert layout["nested_scroll"] == [], f"a scroll box inside the table's scroll box: {layout['nested_scroll']}"
    lab_screenshot(page, SCREENSHOT, scroll_to=1)
    print(f"\n{explorer_notebook}: ran and interacted in {time.monotonic() - start:.1f} s; screenshot {SCREENSHOT}")


EXPERTS_SCREENSHOT = screenshot_path("sharding_explorer_experts.png")
_EXPERT_CELLS = [
    _CELLS[0],
    "moe = wb.models.tiny('mixtral')\n"
    "moe_explorer = ShardingExplorer(moe, wb.make_mesh(dp=2, fsdp=1, ep=4), batch=(8, 32))\n"
    "moe_explorer",
]


@pytest.fixture
def experts_notebook() -> tp.Iterator[str]:
    with temp_notebook("sharding_explorer_experts.ipynb", _EXPERT_CELLS) as path:
        yield path


def test_the_experts_panel_compiles_in_the_kernel_and_shows_the_all_to_alls(lab_page, lab_server,
                                                                            experts_notebook):
    cells = run_notebook_in_lab(lab_page, lab_server, experts_notebook, timeout_s=180)
    assert notebook_errors(lab_page) == [] and model_errors(cells) == []
    page = lab_page
    page.wait_for_selector(".wb-experts-button", timeout=60_000)
    page.click(".wb-experts-button")
    page.wait_for_selector(".wb-experts", timeout=90_000)
    text = page.locator(".wb-experts").inner_text()
    assert "all-to-alls" in text and "dense" in text and "of the copies dropped" in text
    page.set_viewport_size({"width": 1440, "height": 1500})
    page.locator(".wb-experts").scroll_into_view_if_needed()
    EXPERTS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(EXPERTS_SCREENSHOT))


CLUSTER_SCREENSHOT = screenshot_path("sharding_explorer_cluster.png")
_CLUSTER_CELLS = [
    _CELLS[0],
    "import jax.numpy as jnp\n"
    "from workbench.core.hardware.cluster import Cluster\n"
    "from workbench.core.models.presets import full_config\n"
    "big = CausalLM.lazy_init(full_config('llama-3-70b'), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)\n"
    "cluster_explorer = ShardingExplorer(big.with_options(remat='none'), {'fsdp': 8, 'tp': 8},\n"
    "                                    cluster=Cluster.h100(nodes=8), batch=(16, 2048))\n"
    "cluster_explorer",
]


@pytest.fixture
def cluster_notebook() -> tp.Iterator[str]:
    with temp_notebook("sharding_explorer_cluster.ipynb", _CLUSTER_CELLS) as path:
        yield path


_VERDICT_JS = "() => (document.querySelector('.wb-ledger-verdict') || {}).textContent || ''"


def test_on_a_virtual_cluster_the_ledger_answers_the_browsers_mesh_and_remat(lab_page, lab_server, cluster_notebook):
    """Llama-3-70B on 8 x 8 H100: without remat it does not fit; remat 'full' chosen in the browser fits; a mesh
    typed into the cluster's shape box (fsdp=64) re-resolves every parameter and re-draws the ledger (a batch of
    16 rows over 64 devices: the logits are no longer split, and it does not fit)."""
    cells = run_notebook_in_lab(lab_page, lab_server, cluster_notebook, timeout_s=180)
    assert notebook_errors(lab_page) == [] and model_errors(cells) == []
    page = lab_page
    page.wait_for_selector(".wb-ledger .wb-hbm-line", timeout=60_000)
    assert page.evaluate(_VERDICT_JS).startswith("does not fit")
    remat = page.locator(".wb-sharding-explorer .widget-dropdown", has_text="remat").locator("select")
    remat.select_option("full")
    page.wait_for_function(f"() => ({_VERDICT_JS})().startsWith('fits')", timeout=30_000)
    page.set_viewport_size({"width": 1440, "height": 1200})
    lab_screenshot(page, CLUSTER_SCREENSHOT, scroll_to=1)  # the README's picture: the layout that fits
    box = page.locator(".wb-mesh-choice input")
    box.fill("fsdp=64")
    box.press("Tab")  # the box sends its value when it loses focus
    # 16 rows cannot split over 64 devices: every device computes the whole batch's logits, it no longer fits
    page.wait_for_function(f"() => ({_VERDICT_JS})().startsWith('does not fit')", timeout=30_000)
    assert "fsdp=64, ep=1, tp=1" in page.locator(".wb-sharding-explorer").inner_text()  # the title's mesh
