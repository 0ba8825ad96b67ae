"""AttentionLab in a real JupyterLab: an implementation registered in a later cell reaches the menu,
and choosing another one in the browser re-renders the results (a kernel round trip).

The notebook is small and written here (into a throwaway folder of the repository, which the lab
serves): notebooks/07 runs the same steps with a model and is executed by nbval already.
"""

from __future__ import annotations

import time

import pytest

from .conftest import (
    lab_screenshot,
    model_errors,
    notebook_errors,
    run_notebook_in_lab,
    screenshot_path,
    temp_notebook,
)

SCREENSHOT = screenshot_path("attention_lab.png")

CELLS = [
    """import workbench as wb

wb.simulate_devices(8)
from workbench.widgets.attention_lab import AttentionLab

lab = AttentionLab(seq_len=128)
lab""",
    """import dataclasses

import jax.numpy as jnp

from workbench.core.operations import AttentionOutput, Capabilities, OperationImpl, OperationRegistry
from workbench.core.operations.attention.common import (
    CAUSAL, GQA, MASK, RETURN_WEIGHTS, SLIDING_WINDOW, AttentionImplMixin, Visibility, dense_attention)


@OperationRegistry.register(override=True)
class SinkWindowAttention(AttentionImplMixin, OperationImpl):
    capabilities = Capabilities(features={CAUSAL, SLIDING_WINDOW, MASK, GQA, RETURN_WEIGHTS},
                                description="StreamingLLM: the first 4 keys plus a window of 32")

    @classmethod
    def get_impl_name(cls):
        return "sinks"

    def forward_native(self, query, key, value, *, sliding_window=None, **kwargs):
        window, num_sinks = sliding_window or 32, 4
        call = self.prepare(query, key, value, **kwargs)
        t, s = call.visibility.q_len, call.visibility.kv_len
        may_see = call.visibility.block(jnp.arange(t), jnp.arange(s))
        may_see = jnp.ones((1, 1, t, s), bool) if may_see is None else may_see
        rank, from_end = jnp.cumsum(may_see, -1), jnp.cumsum(may_see[..., ::-1], -1)[..., ::-1]
        sees = may_see & ((rank <= num_sinks) | (from_end <= window))
        out, weights = dense_attention(dataclasses.replace(call, visibility=Visibility(t, s, mask=sees)))
        return AttentionOutput(out, weights, kernel_path="sinks/native")""",
    """assert "sinks" in lab.implementations  # registered after the lab was built
lab.select("sinks")""",
]

_IMPL_LABELS_JS = """() => [...document.querySelectorAll('.wb-attention-impl select option')]
  .map((o) => o.textContent)"""
# rows of the results table: [implementation, role, kernel path, ...] per row
_RESULT_ROWS_JS = """() => [...document.querySelectorAll('.wb-attention-results tbody tr')]
  .map((tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent))"""


@pytest.fixture
def lab_notebook():
    with temp_notebook("attention_lab.ipynb", CELLS) as path:
        yield path


def _wait_for_row(page, implementation: str, kernel_path: str, timeout_ms: int = 60_000) -> list[list[str]]:
    page.wait_for_function(
        """([impl, path]) => {
          const row = document.querySelector('.wb-attention-results tbody tr');
          if (!row) return false;
          const cells = [...row.querySelectorAll('td')].map((td) => td.textContent);
          return cells[0] === impl && cells[2] === path;
        }""", arg=[implementation, kernel_path], timeout=timeout_ms, polling=200)
    return page.evaluate(_RESULT_ROWS_JS)


def test_attention_lab_in_jupyterlab(lab_page, lab_server, lab_notebook):
    start = time.monotonic()
    cells = run_notebook_in_lab(lab_page, lab_server, lab_notebook, timeout_s=180)
    assert notebook_errors(lab_page) == [] and model_errors(cells) == []

    # the menu has the implementation registered after the lab was built, and the lab shows it
    rows = _wait_for_row(lab_page, "sinks", "sinks/native")
    raw_labels = lab_page.evaluate(_IMPL_LABELS_JS)
    labels = [label.replace("\xa0", " ") for label in raw_labels]  # ipywidgets shows spaces as &nbsp;
    assert any(label.startswith("sinks ·") for label in labels), labels
    assert {"flash", "vanilla", "sdpa"} <= {label.split(" ·")[0] for label in labels}
    assert rows[1][:3] == ["vanilla", "reference", "vanilla/native"]
    lab_page.wait_for_selector(".wb-attention-weights .js-plotly-plot", timeout=30_000)
    lab_page.wait_for_selector(".wb-attention-difference .js-plotly-plot", timeout=30_000)
    assert "(sinks)" in lab_page.text_content(".wb-attention-weights")  # its own weights: it returns them

    # choose flash in the browser: the kernel compares again and the table re-renders
    flash = next(raw for raw, label in zip(raw_labels, labels, strict=True) if label.startswith("flash ·"))
    lab_page.select_option(".wb-attention-impl select", label=flash)
    rows = _wait_for_row(lab_page, "flash", "flash/native")
    assert rows[0][1] == "compared" and float(rows[0][3]) < 1e-5  # max |Δ| vs vanilla
    lab_page.wait_for_function(
        """() => document.querySelector('.wb-attention-weights').textContent.includes('(vanilla)')""", timeout=30_000)

    # and a head from the head menu
    lab_page.select_option(".wb-attention-head select", label="3")
    lab_page.wait_for_function(
        """() => document.querySelector('.wb-attention-difference').textContent.includes('head 3')""",
        timeout=30_000)
    assert notebook_errors(lab_page) == []
    assert not lab_page.query_selector(".wb-attention-lab .wb-error")

    # a refused edit: the reason inline, and the results on show marked as the previous controls' (stale)
    lab_page.fill(".wb-attention-window input", "-2")
    lab_page.press(".wb-attention-window input", "Enter")
    lab_page.wait_for_function(
        """() => (document.querySelector('.wb-attention-lab .wb-attention-stale') || {}).textContent
                 ?.includes('these controls failed')""", timeout=30_000)
    assert "sliding_window must be a positive int" in lab_page.text_content(".wb-attention-lab .wb-error")
    lab_page.fill(".wb-attention-window input", "0")
    lab_page.press(".wb-attention-window input", "Enter")
    lab_page.wait_for_function(
        """() => !document.querySelector('.wb-attention-lab .wb-attention-stale')
                 && !document.querySelector('.wb-attention-lab .wb-error')""", timeout=30_000)

    # back to sinks (compiled already) for the picture: its weights show the sink columns and the window
    lab_page.select_option(".wb-attention-impl select", label=raw_labels[labels.index(next(
        label for label in labels if label.startswith("sinks ·")))])
    _wait_for_row(lab_page, "sinks", "sinks/native")
    lab_page.wait_for_function(
        """() => document.querySelector('.wb-attention-weights').textContent.includes('head 3 (sinks)')""",
        timeout=30_000)
    lab_screenshot(lab_page, SCREENSHOT)
    print(f"\n{lab_notebook}: ran and interacted in {time.monotonic() - start:.1f} s; screenshot {SCREENSHOT}")
