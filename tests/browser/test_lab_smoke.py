"""Smoke test: the tour notebook runs top to bottom in a real JupyterLab, in Chromium."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import typing as tp
from pathlib import Path

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

# Used only while notebooks/00_tour.ipynb does not exist yet.
_FALLBACK_CELLS = [
    "import jax\nimport workbench as wb\nprint(len(jax.devices()), 'devices')",
    "mesh = wb.make_mesh(dp=2, tp=4)\nprint(wb.describe_mesh(mesh))",
]


def _fallback_notebook(directory: Path) -> Path:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {},
              "outputs": [], "source": src} for i, src in enumerate(_FALLBACK_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                      "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = directory / "browser_smoke.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    return path


@pytest.fixture
def smoke_notebook(tmp_path: Path) -> tp.Iterator[tuple[str, Path]]:
    """(path relative to the lab root, where to save the screenshot)."""
    if TOUR.exists():
        yield TOUR.relative_to(REPO_ROOT).as_posix(), SCREENSHOT
        return
    # The lab serves the repository root, so the stand-in goes in a throwaway folder inside it
    # (not a hidden one: Jupyter refuses hidden paths), removed afterwards.
    directory = Path(tempfile.mkdtemp(prefix="_browser_smoke_", dir=REPO_ROOT))
    try:
        path = _fallback_notebook(directory)
        yield path.relative_to(REPO_ROOT).as_posix(), tmp_path / "lab_smoke.png"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_tour_runs_in_jupyterlab(lab_page, lab_server, smoke_notebook):
    relative_path, screenshot = smoke_notebook
    start = time.monotonic()
    cells = run_notebook_in_lab(lab_page, lab_server, relative_path)
    ran_s = time.monotonic() - start

    assert notebook_errors(lab_page) == []
    assert model_errors(cells) == []
    text = notebook_output_text(lab_page)
    assert "Mesh(" in text, f"describe_mesh output missing from {relative_path}; outputs:\n{text[:3000]}"

    lab_screenshot(lab_page, screenshot)
    print(f"\n{relative_path}: {len(cells)} code cells ran in {ran_s:.1f} s; screenshot {screenshot}")
