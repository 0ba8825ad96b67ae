"""Smoke test: the tour notebook runs top to bottom in a real JupyterLab, in Chromium."""

from __future__ import annotations

import time

import pytest

from .conftest import (
    REPO_ROOT,
    lab_screenshot,
    model_errors,
    notebook_errors,
    notebook_output_text,
    run_notebook_in_lab,
    screenshot_path,
)

TOUR = REPO_ROOT / "notebooks" / "00_tour.ipynb"
SCREENSHOT = screenshot_path("lab_tour.png")

# The texts of the inline widget errors (class wb-error) in the outputs of each code cell whose source contains
# `marker`, one list per such cell.
_WIDGET_ERRORS_JS = """(marker) => window.jupyterapp.shell.currentWidget.content.widgets
  .filter((cell) => cell.model.type === 'code' && cell.model.sharedModel.getSource().includes(marker))
  .map((cell) => [...cell.node.querySelectorAll('.jp-OutputArea .wb-error')].map((el) => el.textContent))"""
HEADLINE_EXPLORER = "explorer = ShardingExplorer(tiny, mesh)"
BAD_EDIT_EXPLORER = "scratch = ShardingExplorer(tiny, mesh"


@pytest.mark.reference
def test_tour_runs_in_jupyterlab(lab_page, lab_server):
    relative_path, screenshot = TOUR.relative_to(REPO_ROOT).as_posix(), SCREENSHOT
    start = time.monotonic()
    cells = run_notebook_in_lab(lab_page, lab_server, relative_path)
    ran_s = time.monotonic() - start

    assert notebook_errors(lab_page) == []
    assert model_errors(cells) == []
    text = notebook_output_text(lab_page)
    assert "Mesh(" in text, f"describe_mesh output missing from {relative_path}; outputs:\n{text[:3000]}"

    # The tour's deliberate bad edit is made on its own explorer: that one shows the error inline, and the
    # headline explorer, after Run All, shows none.
    lab_page.wait_for_function(f"(marker) => ({_WIDGET_ERRORS_JS})(marker).flat().some((t) => t.includes('tpp'))",
                               arg=BAD_EDIT_EXPLORER, timeout=30_000)
    assert lab_page.evaluate(_WIDGET_ERRORS_JS, HEADLINE_EXPLORER) == [[]]

    lab_screenshot(lab_page, screenshot)
    print(f"\n{relative_path}: {len(cells)} code cells ran in {ran_s:.1f} s; screenshot {screenshot}")
