"""Every notebook in notebooks/ opens in JupyterLab unmodified: once it has rendered and its kernel has started and
answered (the moment JupyterLab writes the kernel's name and language into the metadata), the document is not dirty,
and saving it without an edit writes the same bytes. Copies are opened (never run), so notebooks/ is not touched."""

from __future__ import annotations

import difflib
import json
import platform
import shutil
import tempfile
import typing as tp
from pathlib import Path

import pytest

from .conftest import _WAIT_NOTEBOOK_JS, KERNEL_START_TIMEOUT_S, REPO_ROOT, _wait_for_kernel, chromium_page

NOTEBOOKS = sorted(p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))

# Rendered: a widget per cell and an output view per output. Then the kernel's info and spec are awaited after the
# notebook panel's own handlers (which write language_info and kernelspec into the metadata), and two frames pass.
_RENDERED_JS = """() => {
  const notebook = window.jupyterapp.shell.currentWidget.content;
  const cells = notebook.widgets;
  return cells.length === notebook.model.cells.length && cells.every((cell) => cell.model.type !== 'code'
    || cell.outputArea.widgets.length === cell.model.outputs.length);
}"""

_SETTLED_DIRTY_JS = """async () => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session.kernel;
  await kernel.info;
  await kernel.spec;
  for (let i = 0; i < 2; i++) await new Promise((r) => requestAnimationFrame(r));
  return panel.context.model.dirty;
}"""

_SAVE_AND_CLOSE_JS = """async () => {
  const panel = window.jupyterapp.shell.currentWidget;
  await panel.context.save();
  const dirty = panel.context.model.dirty;
  await panel.sessionContext.shutdown();
  panel.dispose();
  return dirty;
}"""


@pytest.fixture(scope="module")
def copies() -> tp.Iterator[Path]:
    """The notebooks, copied into a throwaway folder inside the lab's root."""
    directory = Path(tempfile.mkdtemp(prefix="_browser_open_", dir=REPO_ROOT))
    for name in NOTEBOOKS:
        shutil.copyfile(REPO_ROOT / "notebooks" / name, directory / name)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def page(chromium_path: str, sync_playwright: tp.Callable[[], tp.Any],
         tmp_path_factory: pytest.TempPathFactory) -> tp.Iterator[tp.Any]:
    with chromium_page(sync_playwright, chromium_path, tmp_path_factory.mktemp("chromium-open")) as page:
        yield page


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_notebook_opens_unmodified(page, lab_server, copies, name):
    path = copies / name
    relative = path.relative_to(REPO_ROOT).as_posix()
    before = path.read_bytes()
    page.goto(lab_server.lab_url(relative), wait_until="domcontentloaded", timeout=90_000)
    page.wait_for_function(_WAIT_NOTEBOOK_JS, arg=relative, timeout=90_000)
    _wait_for_kernel(page, lab_server, relative, timeout_s=KERNEL_START_TIMEOUT_S)
    page.wait_for_function(_RENDERED_JS, timeout=60_000, polling=250)
    dirty = page.evaluate(_SETTLED_DIRTY_JS)
    dirty_after_save = page.evaluate(_SAVE_AND_CLOSE_JS)
    after = path.read_bytes()
    diff = "".join(list(difflib.unified_diff(before.decode().splitlines(True), after.decode().splitlines(True),
                                             "on disk", "saved by JupyterLab", n=1))[:40])
    expected = _with_running_python(before)
    if expected != before:  # another Python runs the kernel (the newest leg): JupyterLab records its version, only that
        assert after in (expected, _as_javascript_saves(expected)), f"{name}: saving it rewrites more than " \
            f"language_info.version:\n{diff}"
        return
    assert not dirty, f"{name} is dirty once opened, before any edit; saving it changes:\n{diff or '(nothing)'}"
    assert after in (before, _as_javascript_saves(before)), f"{name}: saving it without an edit rewrites it:\n{diff}"
    assert not dirty_after_save


def _with_running_python(before: bytes) -> bytes:
    """``before`` with the kernel's Python version as ``language_info.version`` (the kernels run this interpreter), as
    the notebook was written (indent 1, keys sorted): ``before`` itself where the versions agree."""
    nb = json.loads(before)
    if nb["metadata"].get("language_info", {}).get("version", platform.python_version()) == platform.python_version():
        return before
    nb["metadata"]["language_info"]["version"] = platform.python_version()
    return (json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n").encode()


def _as_javascript_saves(before: bytes) -> bytes:
    """``before`` as JupyterLab would save it unchanged: its numbers pass through JavaScript, which has no float type
    and writes a whole float (plotly's ``1.0`` in a saved figure) as an integer (``1``)."""
    def number(text: str) -> float | int:
        value = float(text)
        return int(value) if value.is_integer() and abs(value) < 1e21 else value

    nb = json.loads(before, parse_float=number)
    return (json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n").encode()
