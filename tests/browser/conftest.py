"""Browser tests: a JupyterLab server and headless Debian Chromium driven by Playwright.

The recipe (flags, loopback-only routing, ``expose_app_in_browser``) is the one in
``/work/shared/TESTING.md``. Where Chromium or Playwright is missing the tests skip with a
reason, except under ``CI=true``, where they fail: CI must never pass by skipping them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import typing as tp
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.xla_flags import child_xla_flags

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_MISSING = "Debian chromium not installed: run `make test` as root, or apt-get install chromium"
PLAYWRIGHT_MISSING = "Python playwright not installed: pip install -e '.[test]' (never `playwright install`)"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LOOPBACK_PREFIXES = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")
SERVER_START_TIMEOUT_S = 90
KERNEL_START_TIMEOUT_S = 120
_LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
    # Every cell attached and rendered, so DOM queries see all outputs, not just those in view.
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _unavailable(reason: str) -> tp.NoReturn:
    """Skip with ``reason``, or fail with it under ``CI=true``."""
    if _in_ci():
        pytest.fail(f"{reason} (CI=true: browser tests may not be skipped)", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.browser)


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK):
        return str(CHROMIUM)
    _unavailable(CHROMIUM_MISSING)


@dataclasses.dataclass(frozen=True)
class LabServer:
    url: str  # http://127.0.0.1:PORT, no trailing slash
    token: str
    root_dir: Path
    log_path: Path

    def lab_url(self, relative_path: str) -> str:
        path = urllib.parse.quote(relative_path.replace(os.sep, "/"))
        return f"{self.url}/lab/tree/{path}?token={self.token}&reset"

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError as e:
            return f"<no server log: {e}>"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> tp.Iterator[LabServer]:
    """JupyterLab on 127.0.0.1 (free port, random token), rooted at the repository."""
    base = tmp_path_factory.mktemp("jupyterlab")
    dirs = {name: base / name.lower() for name in
            ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "JUPYTERLAB_WORKSPACES_DIR")}
    for d in dirs.values():
        d.mkdir()
    # User settings: never autosave (run-all must not write outputs into the repository's
    # notebooks), never ask about or fetch Jupyter news, no notebook windowing.
    settings = base / "lab-user-settings"
    for plugin, values in _LAB_SETTINGS.items():
        package, name = plugin.split(":")
        target = settings / package / f"{name}.jupyterlab-settings"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))
    dirs["JUPYTERLAB_SETTINGS_DIR"] = settings
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()},
           "XLA_FLAGS": child_xla_flags(8), "JAX_PLATFORMS": "cpu",
           "PYTHONUNBUFFERED": "1"}
    port, token = _free_port(), secrets.token_hex(24)
    server = LabServer(url=f"http://127.0.0.1:{port}", token=token, root_dir=REPO_ROOT,
                       log_path=base / "server.log")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={REPO_ROOT}",
           "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           "--LabApp.expose_app_in_browser=True",
           f"--LabApp.workspaces_dir={dirs['JUPYTERLAB_WORKSPACES_DIR']}",
           f"--LabApp.user_settings_dir={settings}",
           # Checkpoints (made when a notebook opens) go to the temp folder, not notebooks/.
           f"--FileCheckpoints.checkpoint_dir={base / 'checkpoints'}"]
    with open(server.log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        _wait_for_server(proc, server)
        yield server
    finally:
        proc.terminate()  # SIGTERM: the server shuts its kernels down
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for_server(proc: subprocess.Popen, server: LabServer) -> None:
    status_url = f"{server.url}/api/status?token={server.token}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    last_error = "no attempt"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {proc.returncode} before answering {status_url}.\n"
                        f"--- server log tail ---\n{server.log_tail()}", pytrace=False)
        try:
            with urllib.request.urlopen(status_url, timeout=5) as response:
                if response.status == 200:
                    return
                last_error = f"HTTP {response.status}"
        except (urllib.error.URLError, OSError) as e:
            last_error = repr(e)
        time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer {status_url} within {SERVER_START_TIMEOUT_S} s "
                f"(last error: {last_error}).\n--- server log tail ---\n{server.log_tail()}", pytrace=False)


@pytest.fixture(scope="session")
def sync_playwright() -> tp.Callable[[], tp.Any]:
    """``playwright.sync_api.sync_playwright``; session-scoped so that a missing playwright is
    reported (skip, or fail under CI=true) before the JupyterLab server is started."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable(PLAYWRIGHT_MISSING)
    return sync_playwright


@pytest.fixture
def lab_page(chromium_path: str, sync_playwright: tp.Callable[[], tp.Any],
             tmp_path: Path) -> tp.Iterator[tp.Any]:
    """A Playwright page in headless Debian Chromium that can only reach loopback."""
    user_data_dir = tmp_path / "chromium-profile"
    user_data_dir.mkdir()
    with chromium_page(sync_playwright, chromium_path, user_data_dir) as page:
        yield page


@contextlib.contextmanager
def chromium_page(sync_playwright: tp.Callable[[], tp.Any], chromium_path: str, user_data_dir: Path,
                  viewport: tp.Mapping[str, int] | None = None) -> tp.Iterator[tp.Any]:
    """A page in headless Chromium with a fresh profile in ``user_data_dir``, able to reach loopback only (what
    ``lab_page`` yields; a module-scoped fixture opens one with this to share it between tests)."""
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=chromium_path, headless=True, args=CHROMIUM_ARGS,
            viewport=dict(viewport or {"width": 1440, "height": 900}))
        try:
            context.route("**/*", _loopback_only)
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def _loopback_only(route: tp.Any) -> None:
    if route.request.url.startswith(LOOPBACK_PREFIXES):
        route.continue_()
    else:
        route.abort()


# ---------------------------------------------------------------------------------------------- helpers

_WAIT_NOTEBOOK_JS = """(path) => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  return !!(w && w.sessionContext && w.context && w.context.path === path && w.content);
}"""

# Polled (never awaited: a promise that never settles would hang the test without a timeout).
_KERNEL_STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const dialog = document.querySelector('.jp-Dialog');
  return {
    ready: !!(w.context.isReady && kernel && kernel.connectionStatus === 'connected'
              && kernel.status === 'idle'),
    kernel: kernel ? `${kernel.name}: ${kernel.connectionStatus}/${kernel.status}` : null,
    dialog: dialog ? dialog.innerText : null,
  };
}"""

_START_RUN_ALL_JS = """() => {
  const state = window.__wbRunAll = {done: false, error: null};
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    () => { state.done = true; },
    (e) => { state.done = true; state.error = String(e); });
}"""

# Done when run-all settled, the kernel is idle and no prompt shows [*]; the caller then checks
# that every code cell got an execution count (run-all stops at the first cell that raised).
_RUN_FINISHED_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  if (!window.__wbRunAll.done || !kernel || kernel.status !== 'idle') return false;
  const prompts = [...w.node.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
  return !prompts.some((p) => p.textContent.includes('*'));
}"""

_CELL_STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const cells = [];
  const model = w.content.model;
  for (let i = 0; i < model.cells.length; i++) {
    const cell = model.cells.get(i);
    if (cell.type !== 'code') continue;
    const outputs = [];
    for (let j = 0; j < cell.outputs.length; j++) outputs.push(cell.outputs.get(j).toJSON());
    cells.push({index: i, execution_count: cell.executionCount, source: cell.sharedModel.getSource(),
                outputs});
  }
  return {run_all_error: window.__wbRunAll ? window.__wbRunAll.error : null, cells};
}"""

# Errors as JupyterLab 4 renders them: a raised exception is an output of data-mime-type
# application/vnd.jupyter.error (class jp-RenderedText); stderr text with a traceback counts too.
_DOM_ERRORS_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const selector = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"], '
                 + '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]';
  return [...w.node.querySelectorAll(selector)]
    .filter((el) => el.dataset.mimeType === 'application/vnd.jupyter.error'
                    || el.textContent.includes('Traceback'))
    .map((el) => el.textContent);
}"""


def run_notebook_in_lab(page: tp.Any, lab_server: LabServer, relative_path: str,
                        timeout_s: float = 240) -> list[dict]:
    """Open ``relative_path`` (relative to the lab root) in JupyterLab and run all its cells.

    Returns once every code cell ran (the kernel is idle and no prompt shows ``[*]``). Fails the
    test with the error outputs if a cell raised and run-all stopped before the end. Returns the
    code cells: ``{index, execution_count, source, outputs}`` with outputs as nbformat dicts.
    """
    relative_path = relative_path.replace(os.sep, "/")
    timeout_ms = timeout_s * 1000
    page.goto(lab_server.lab_url(relative_path), wait_until="domcontentloaded", timeout=timeout_ms)
    try:
        page.wait_for_function(_WAIT_NOTEBOOK_JS, arg=relative_path, timeout=min(timeout_ms, 90_000))
    except Exception as e:
        pytest.fail(f"JupyterLab did not open {relative_path}: {e}\n--- server log tail ---\n"
                    f"{lab_server.log_tail()}", pytrace=False)
    _wait_for_kernel(page, lab_server, relative_path, timeout_s=min(timeout_s, KERNEL_START_TIMEOUT_S))
    page.evaluate(_START_RUN_ALL_JS)
    page.wait_for_function(_RUN_FINISHED_JS, timeout=timeout_ms, polling=250)
    state = page.evaluate(_CELL_STATE_JS)
    not_run = [c for c in state["cells"] if c["execution_count"] is None]
    if state["run_all_error"] or not_run:
        errors = "\n\n".join(notebook_errors(page)) or "<no error output in the DOM>"
        first = not_run[0]["index"] if not_run else "?"
        pytest.fail(f"{relative_path}: run-all did not run every code cell (first not run: cell {first}; "
                    f"command error: {state['run_all_error']}).\n--- error outputs ---\n{errors}",
                    pytrace=False)
    return state["cells"]


def _wait_for_kernel(page: tp.Any, lab_server: LabServer, relative_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    state: dict = {}
    while time.monotonic() < deadline:
        state = page.evaluate(_KERNEL_STATE_JS)
        if state["ready"]:
            return
        if state["dialog"] and "Select Kernel" in state["dialog"]:
            # A notebook without kernelspec metadata asks which kernel to start: take the default.
            page.click(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        time.sleep(0.25)
    pytest.fail(f"the kernel for {relative_path} was not idle within {timeout_s:.0f} s (kernel: "
                f"{state.get('kernel')}; dialog: {state.get('dialog')!r}).\n--- server log tail ---\n"
                f"{lab_server.log_tail()}", pytrace=False)


def notebook_errors(page: tp.Any) -> list[str]:
    """Texts of the error outputs of the current notebook (exceptions, tracebacks on stderr)."""
    return page.evaluate(_DOM_ERRORS_JS)


def notebook_output_text(page: tp.Any) -> str:
    """The visible text of every output of the current notebook, concatenated."""
    return page.evaluate("""() => [...window.jupyterapp.shell.currentWidget.node
        .querySelectorAll('.jp-OutputArea-output')].map((el) => el.textContent).join('\\n')""")


def model_errors(cells: list[dict]) -> list[str]:
    """Error outputs in the notebook model (independent of what the DOM has rendered)."""
    found = []
    for cell in cells:
        for out in cell["outputs"]:
            if out.get("output_type") == "error":
                found.append(f"cell {cell['index']}: {out.get('ename')}: {out.get('evalue')}")
            elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = out.get("text", "")
                text = "".join(text) if isinstance(text, list) else text
                if "Traceback" in text:
                    found.append(f"cell {cell['index']} (stderr): {text[-2000:]}")
    return found



@contextlib.contextmanager
def temp_notebook(name: str, sources: tp.Sequence[str]) -> tp.Iterator[str]:
    """A notebook of code cells ``sources`` in a throwaway folder inside the lab root (Jupyter refuses
    hidden paths); yields its path relative to the root and removes the folder afterwards."""
    directory = Path(tempfile.mkdtemp(prefix=f"_browser_{Path(name).stem}_", dir=REPO_ROOT))
    cells = [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {}, "outputs": [],
              "source": src} for i, src in enumerate(sources)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                      "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}
    path = directory / name
    path.write_text(json.dumps(nb, indent=1))
    try:
        yield path.relative_to(REPO_ROOT).as_posix()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def screenshot_path(name: str) -> Path:
    """Where a browser test saves screenshot ``name``: ``$WORKBENCH_SCREENSHOTS`` (``make screenshots``
    sets it to docs/screenshots, the committed pictures the README shows), else build/screenshots."""
    return Path(os.environ.get("WORKBENCH_SCREENSHOTS", REPO_ROOT / "build" / "screenshots")) / name


def lab_screenshot(page: tp.Any, path: Path, *, scroll_to: int = 0) -> None:
    """Screenshot of the current notebook: file browser collapsed, scrolled to cell ``scroll_to``."""
    page.evaluate("""async (index) => {
      const app = window.jupyterapp;
      app.shell.collapseLeft();
      const notebook = app.shell.currentWidget.content;
      notebook.deselectAll();
      notebook.activeCellIndex = index;
      await notebook.scrollToItem(index, 'start');
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
    }""", scroll_to)
    page.wait_for_timeout(300)  # the layout settles after the side panel collapses
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
