"""Smoke test: the tour notebook runs top to bottom in a real JupyterLab, in Chromium."""

from __future__ import annotations

import time

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

def test_tour_runs_in_jupyterlab(lab_page, lab_server):
    relative_path, screenshot = TOUR.relative_to(REPO_ROOT).as_posix(), SCREENSHOT
    start = time.monotonic()
    cells = run_notebook_in_lab(lab_page, lab_server, relative_path)
    ran_s = time.monotonic() - start

    assert notebook_errors(lab_page) == []
    assert model_errors(cells) == []
    text = notebook_output_text(lab_page)
    assert "Mesh(" in text, f"describe_mesh output missing from {relative_path}; outputs:\n{text[:3000]}"

    lab_screenshot(lab_page, screenshot)
    print(f"\n{relative_path}: {len(cells)} code cells ran in {ran_s:.1f} s; screenshot {screenshot}")
