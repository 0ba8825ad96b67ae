"""MeshView and ShardingView in a real JupyterLab: notebook 01 runs, the widgets render, edits made
in the browser reach the kernel and come back re-rendered."""

from __future__ import annotations

import re
import time
import typing as tp

from .conftest import (
    lab_screenshot,
    model_errors,
    notebook_errors,
    run_notebook_in_lab,
    screenshot_path,
)

NOTEBOOK = "notebooks/01_meshes_and_partition_specs.ipynb"
SCREENSHOT = screenshot_path("mesh_and_sharding_views.png")
TIMEOUT_MS = 30_000

# What the views show, read from the DOM of the current notebook (widget views only: the static
# fallback HTML has other class names).
_VIEWS_JS = """() => {
  const root = window.jupyterapp.shell.currentWidget.node;
  const all = (el, s) => [...el.querySelectorAll(s)];
  const text = (el, s) => { const e = el.querySelector(s); return e ? e.textContent : ''; };
  return {
    mesh: all(root, '.wb-mesh-view').map((v) => ({
      cells: all(v, '.wb-mesh-cell').map((c) => Number(c.dataset.device)),
      facets: all(v, '.wb-mesh-facet').length,
      header: text(v, '.wb-mesh-header'),
      error: text(v, '.wb-error'),
    })),
    sharding: all(root, '.wb-sharding-view').map((v) => {
      const n = v.querySelector('.wb-notation');
      return {
        notation: n ? n.dataset.notation : null,
        blocks: all(v, '.wb-block').length,
        panels: all(v, '.wb-sharding-panel').length,
        replicas: all(v, '.wb-replicas').map((b) => b.textContent),
        summary: text(v, '.wb-summary'),
        error: text(v, '.wb-error'),
      };
    }),
  };
}"""


def views(page: tp.Any) -> dict:
    return page.evaluate(_VIEWS_JS)


def wait_views(page: tp.Any, predicate_js: str, what: str) -> dict:
    """Wait until ``predicate_js`` (a JS expression over ``s``, the views' state) holds; fail with the state."""
    try:
        page.wait_for_function(f"() => {{ const s = ({_VIEWS_JS})(); return {predicate_js}; }}",
                               timeout=TIMEOUT_MS, polling=100)
    except Exception as e:
        raise AssertionError(f"{what}: not seen within {TIMEOUT_MS / 1000:.0f} s ({type(e).__name__}); "
                             f"views now: {views(page)}") from None
    return views(page)


def test_mesh_and_sharding_views_in_jupyterlab(lab_page, lab_server):
    page = lab_page
    cells = run_notebook_in_lab(page, lab_server, NOTEBOOK)
    assert notebook_errors(page) == []
    assert model_errors(cells) == []

    # Every view rendered as a live widget: 2 MeshViews, 6 ShardingViews.
    state = wait_views(page, "s.mesh.length === 2 && s.sharding.length === 6 "
                             "&& s.sharding.every((v) => v.blocks > 0)", "the widgets of notebook 01")
    first_mesh = state["mesh"][0]
    assert sorted(first_mesh["cells"]) == list(range(8)) and first_mesh["facets"] == 2
    assert "Mesh(pp=1, dp=2, fsdp=2, ep=1, tp=2, sp=1)" in first_mesh["header"]
    view3 = state["sharding"][0]
    assert view3["notation"] == "A[I_dp, J, K_tp]"
    assert (view3["panels"], view3["blocks"], view3["replicas"]) == (2, 4, ["×2"] * 4)
    assert state["sharding"][1]["notation"] == "Q[I_dp, J_fsdp, K_tp, L]" and state["sharding"][1]["panels"] == 4
    assert "did you mean 'tp'" in state["sharding"][2]["error"]  # the notebook's bad-edit demo, shown inline

    # Type a new spec into the first ShardingView and press enter: a kernel round trip re-renders it.
    spec_input = page.locator(".wb-sharding-view").first.locator(".wb-spec-input input")
    start = time.monotonic()
    spec_input.fill("(dp, fsdp), None, tp")
    spec_input.press("Enter")
    state = wait_views(page, "s.sharding[0].notation === 'A[I_{dp,fsdp}, J, K_tp]'", "the edited spec")
    edit_ms = 1e3 * (time.monotonic() - start)
    edited = state["sharding"][0]
    assert (edited["panels"], edited["blocks"], edited["replicas"]) == (4, 8, [])  # no copies left
    assert "shard 1×8×8" in edited["summary"] and edited["error"] == ""

    # A bad spec from the browser: an inline error, the last valid picture stays.
    spec_input.fill("(dp, fsdp), None, tpp")
    spec_input.press("Enter")
    state = wait_views(page, "s.sharding[0].error.includes('unknown mesh axis')", "the inline error")
    assert state["sharding"][0]["notation"] == "A[I_{dp,fsdp}, J, K_tp]" and state["sharding"][0]["blocks"] == 8

    # Reshape the linked mesh from its dropdown + apply: the weight's view follows the new mesh.
    linked = page.locator(".wb-mesh-view").nth(1)
    tp_select = linked.locator(".widget-dropdown", has=page.locator("label", has_text=re.compile(r"^tp$")))
    tp_select.locator("select").select_option(label="2")
    # the pending line comes back from the kernel: the dropdown change arrived before "apply"
    page.wait_for_function("() => [...document.querySelectorAll('.wb-mesh-view')][1]"
                           "?.querySelector('.wb-pending')?.textContent.includes('tp=2')", timeout=TIMEOUT_MS)
    linked.locator("button", has_text="apply").click()
    state = wait_views(page, "s.mesh[1].header.includes('fsdp=2, ep=1, tp=2') "
                             "&& s.sharding[4].summary.includes('shard 512×2048')",
                       "the reshaped mesh and the weight that follows it")
    assert sorted(state["mesh"][1]["cells"]) == list(range(8)) and state["mesh"][1]["error"] == ""
    assert state["sharding"][4]["notation"] == "W[I_fsdp, J_tp]"

    page.set_viewport_size({"width": 1440, "height": 1150})
    linked_cell = next(c["index"] for c in cells if "display(linked_mesh, weight)" in c["source"])
    lab_screenshot(page, SCREENSHOT, scroll_to=linked_cell)
    print(f"\nspec edit round trip: {edit_ms:.0f} ms; screenshot {SCREENSHOT}")
