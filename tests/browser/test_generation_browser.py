"""ModuleTree and GenerationView in a real JupyterLab (headless Chromium): treescope renders, a parameter's
ShardingView appears when chosen, tokens stream after "generate", "stop" ends a long run early and the
kernel still answers (another execute, a second generate that reuses the compiled program)."""

from __future__ import annotations

import re
import time

from .conftest import model_errors, notebook_errors, run_notebook_in_lab, screenshot_path

NOTEBOOK = "tests/browser/notebooks/generation_widgets.ipynb"
MAX_NEW = 4000
PROMPT_LEN = 16  # "In the beginning": 16 bytes, a multiple of the default pad_to
Q = "layers/self_attn/q_proj/kernel"

_TREESCOPE_RENDERED_JS = """() => {
  const roots = [...document.querySelectorAll('.wb-module-tree treescope-container')];
  return roots.length > 0 && roots.every((el) => el.shadowRoot && el.shadowRoot.childElementCount > 0);
}"""

# Executes code on the notebook's kernel and returns its status and output (a hung kernel times out).
_EXECUTE_JS = """async ([code, timeoutMs]) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = kernel.requestExecute({code, store_history: false});
  const out = [];
  future.onIOPub = (msg) => {
    if (msg.header.msg_type === 'stream') out.push(msg.content.text);
  };
  const timeout = new Promise((resolve) => setTimeout(() => resolve({content: {status: 'timeout'}}), timeoutMs));
  const reply = await Promise.race([future.done, timeout]);
  return {status: reply.content.status, out: out.join('')};
}"""


def _screenshot(page, selector: str, path, height: int = 900) -> None:
    """Screenshot with ``selector``'s top at the top of the notebook panel (the window ``height`` tall)."""
    page.set_viewport_size({"width": 1440, "height": height})
    page.evaluate("""async (sel) => {
      window.jupyterapp.shell.collapseLeft();
      window.jupyterapp.shell.currentWidget.content.deselectAll();
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
      document.querySelector(sel).closest('.jp-Cell').scrollIntoView({block: 'start'});
    }""", selector)
    page.wait_for_timeout(400)  # layout settles after the resize and the side panel collapses
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1440, "height": 900})


def _status(page) -> str:
    return page.inner_text(".wb-generation-view .wb-gen-status")


def _wait_status(page, css_class: str, timeout_ms: int = 60_000) -> str:
    page.wait_for_selector(f".wb-generation-view .wb-gen-state.{css_class}", timeout=timeout_ms)
    return _status(page)


def _stopped_after(text: str) -> int:
    match = re.search(r"stopped: (\d+) new tokens? per row", text)
    assert match, f"the status does not say the run stopped: {text!r}"
    return int(match.group(1))


def test_module_tree_and_generation_view(lab_page, lab_server):
    page = lab_page
    start = time.monotonic()
    cells = run_notebook_in_lab(page, lab_server, NOTEBOOK)
    assert notebook_errors(page) == [] and model_errors(cells) == []

    # ModuleTree: treescope's scripts ran (its custom element filled its shadow root), counts are shown
    page.wait_for_function(_TREESCOPE_RENDERED_JS, timeout=30_000)
    assert "CausalLM (llama)" in page.inner_text(".wb-module-tree .wb-module-header")
    # choose a parameter in the dropdown: a kernel round trip builds its ShardingView
    index = page.evaluate("""(path) => [...document.querySelectorAll('.wb-param-choose select option')]
        .findIndex((o) => o.textContent.startsWith(path))""", Q)
    assert index > 0
    page.select_option(".wb-param-choose select", index=index)
    page.wait_for_selector(".wb-param-detail .wb-sharding-view .wb-notation", timeout=30_000)
    notation = page.get_attribute(".wb-param-detail .wb-notation", "data-notation")
    assert notation == "W[I, J_{fsdp,sp}, K_tp]", notation  # the stacked (layers, in, out) kernel
    assert "sharded 4 ways over tp" in page.inner_text(".wb-module-tree .wb-param-summary")
    _screenshot(page, ".wb-module-tree", screenshot_path("module_tree.png"), height=1200)

    # GenerationView: generate, watch tokens stream in, stop the long run half-way
    page.click(".wb-generation-view .wb-gen-generate")
    page.wait_for_selector(".wb-generation-view .wb-gen-state.wb-gen-compiling", timeout=30_000)
    # tokens arrive and the cache picture fills while it decodes
    page.wait_for_function("""() => {
        const el = document.querySelector('.wb-generation-view .wb-gen-new');
        const cache = document.querySelector('.wb-generation-view .wb-cache-contiguous');
        return !!el && el.textContent.length > 0 && !!cache && cache.textContent.includes('live'); }""",
                           timeout=60_000, polling=100)
    page.click(".wb-generation-view .wb-gen-stop")
    first = _wait_status(page, "wb-gen-stopped")
    n = _stopped_after(first)
    assert 0 < n < MAX_NEW and "compiled in" in first, first
    index_attr = page.get_attribute(".wb-generation-view .wb-cache-contiguous", "data-index")
    assert int(index_attr) == PROMPT_LEN + n - 1  # read from the cache generate returned
    assert page.is_enabled(".wb-generation-view .wb-gen-generate")

    # the kernel still answers, and knows what the widget shows
    reply = page.evaluate(_EXECUTE_JS, ["print(gen.wait(30), gen.running, gen.output.num_new_tokens)", 40_000])
    assert reply == {"status": "ok", "out": f"True False {n}\n"}, reply

    # generate again: no compile this time; stop it too
    page.click(".wb-generation-view .wb-gen-generate")
    _wait_status(page, "wb-gen-running")
    page.click(".wb-generation-view .wb-gen-stop")
    second = _wait_status(page, "wb-gen-stopped")
    assert _stopped_after(second) < MAX_NEW and "no compile (program reused)" in second, second
    assert page.inner_text(".wb-generation-view .wb-gen-new")
    _screenshot(page, ".wb-generation-view", screenshot_path("generation_view.png"))
    print(f"\n{NOTEBOOK}: done in {time.monotonic() - start:.1f} s; first run stopped after {n} tokens")
