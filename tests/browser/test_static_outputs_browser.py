"""Saved outputs read well before a notebook is trusted or run: JupyterLab sanitises the HTML of an untrusted
notebook (it strips SVG, scripts and unknown styles). The static views workbench saves (the explorer's
parameter table and memory bars, a block mask's tiles, a mesh) must come through it whole."""

from __future__ import annotations

import json
import shutil
import tempfile
import typing as tp
from pathlib import Path

import pytest

from .conftest import _WAIT_NOTEBOOK_JS, REPO_ROOT

N_PARAMS = 12  # tiny Llama


def _display(html: str) -> dict:
    return {"output_type": "display_data", "metadata": {}, "data": {"text/html": html, "text/plain": "<view>"}}


@pytest.fixture
def saved_notebook() -> tp.Iterator[str]:
    """A notebook holding only saved outputs (never run here, never signed: JupyterLab opens it untrusted)."""
    from workbench.core.mesh import make_mesh
    from workbench.core.models import CausalLM, ModelConfig
    from workbench.core.models.presets import tiny_config
    from workbench.core.operations.attention import block_mask as bm
    from workbench.widgets.mesh_view import MeshView
    from workbench.widgets.sharding_explorer import ShardingExplorer

    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    explorer = ShardingExplorer(CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama"))), mesh)
    mask = bm.create_block_mask(bm.causal, None, None, 1024, 1024, 128, 256)
    outputs = [_display(explorer._repr_html_()), _display(mask._repr_html_()), _display(MeshView(mesh)._repr_html_()),
               _display('<svg class="wb-control" width="10" height="10"><rect width="10" height="10"/></svg>')]
    cells = [{"cell_type": "code", "execution_count": i + 1, "id": f"cell-{i}", "metadata": {}, "outputs": [out],
              "source": f"view_{i}"} for i, out in enumerate(outputs)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                      "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}
    directory = Path(tempfile.mkdtemp(prefix="_browser_static_", dir=REPO_ROOT))
    path = directory / "saved_views.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    try:
        yield path.relative_to(REPO_ROOT).as_posix()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_STATIC_JS = """() => {
  const px = (el) => el.getBoundingClientRect();
  const columns = [...document.querySelectorAll('.wb-memory-bars > div')];
  const mask_rows = [...document.querySelectorAll('.wb-block-mask > div')];
  const tile = mask_rows.length ? px(mask_rows[0].children[0]) : null;
  return {
    control_svg: document.querySelectorAll('svg.wb-control').length,
    params: document.querySelectorAll('.wb-sharding-explorer-static tr.wb-param-row').length,
    devices: columns.length,
    tallest_bar: Math.max(0, ...columns.map((c) => px(c.children[0]).height)),
    parts: Math.max(0, ...columns.map((c) => c.children[0].children.length)),
    mask_rows: mask_rows.length,
    mask_cols: mask_rows.length ? mask_rows[0].children.length : 0,
    tile: tile ? [tile.width, tile.height] : null,
    mesh_header: (document.querySelector('.wb-mesh-view-static .wb-mesh-header') || {}).textContent || '',
  };
}"""


def test_an_untrusted_notebook_shows_the_static_views(lab_page, lab_server, saved_notebook):
    page = lab_page
    page.goto(lab_server.lab_url(saved_notebook), wait_until="domcontentloaded", timeout=90_000)
    page.wait_for_function(_WAIT_NOTEBOOK_JS, arg=saved_notebook, timeout=90_000)
    page.wait_for_selector(".wb-sharding-explorer-static", timeout=60_000)
    page.wait_for_selector(".wb-block-mask", timeout=60_000)
    state = page.evaluate(_STATIC_JS)
    assert state["control_svg"] == 0, "the notebook was trusted: the sanitiser did not run, nothing was tested"
    assert state["params"] == N_PARAMS
    # 8 device columns of stacked boxes (parameters, AdamW state), the tallest 90 px as drawn
    assert state["devices"] == 8 and state["parts"] == 2 and abs(state["tallest_bar"] - 90) <= 1
    # causal at T = S = 1024 in 128 x 256 tiles: 8 rows of 4, each tile twice as wide as tall
    assert (state["mask_rows"], state["mask_cols"]) == (8, 4)
    width, height = state["tile"]
    assert height > 0 and abs(width - 2 * height) <= 1
    assert "dp=2, fsdp=2" in state["mesh_header"]
