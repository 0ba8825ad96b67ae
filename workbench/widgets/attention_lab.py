"""AttentionLab: pick an attention implementation and a reference, see how they differ and what they cost.

A view over :mod:`workbench.core.views.attention_lab`: :func:`~workbench.core.views.attention_lab.compare` fills
the results table, :func:`~workbench.core.views.attention_lab.attention_weights` and
``Comparison.output_difference`` the two heatmaps, and
:func:`~workbench.core.views.attention_lab.model_comparison` the "use in model" panel.

The implementation menus are read from ``OperationRegistry`` again after every notebook cell
(an IPython ``post_run_cell`` hook), on every interaction and on :meth:`AttentionLab.refresh`, so an
implementation registered in a later cell appears without rebuilding the widget.
"""

from __future__ import annotations

import json
import typing as tp
import weakref

import IPython  # ipywidgets requires it
import ipywidgets as widgets
import jax
import jax.numpy as jnp
import numpy as np
import plotly.graph_objects as go

from workbench.core.models.tokenizer import as_tokenizer
from workbench.core.operations import OperationRegistry
from workbench.core.operations.attention.common import RETURN_WEIGHTS
from workbench.core.operations.attention.flex import FlexAttention
from workbench.core.tables import html_table
from workbench.core.units import format_bytes
from workbench.core.views.attention_lab import (
    DTYPES,
    Comparison,
    LabOptions,
    ModelComparison,
    attention_weights,
    capability_summary,
    compare,
    make_inputs,
    model_comparison,
)
from workbench.widgets._errors import InlineError
from workbench.widgets._html import escape
from workbench.widgets.generation_view import default_tokenizer

__all__ = ["AttentionLab", "comparison_html", "model_comparison_html"]

HEADS, HEAD_DIM = 8, 64
SEQ_LENS = (64, 128, 256, 512, 1024)
GQA_RATIOS = (1, 2, 4, 8)
DEFAULT_PROMPT = "In the beginning God created the heaven and the earth."
_NOTE = "font-size:12px;color:#555;margin:2px 0"


def _fmt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def comparison_html(c: Comparison) -> str:
    """The results table: one row per implementation (compared first, then the reference)."""
    rows = []
    for r in c.rows():
        compile_ms = _fmt(r["compile_ms"], "{:.0f}") + (" (cached)" if r["cached"] and r["compile_ms"] else "")
        rows.append([r["implementation"], r["role"], r["kernel_path"] or "–", _fmt(r["max_abs_diff"], "{:.2e}"),
                     _fmt(r["median_ms"], "{:.2f}"), compile_ms,
                     "–" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"]),
                     "; ".join(r["collectives"]) or "none", r["note"] or ""])
    return html_table(rows, ["implementation", "role", "kernel path", "max |Δ| vs reference", "median ms",
                             "compile ms", "temp memory", "collectives (runs)", "note"],
                      css_class="wb-attention-results")


def model_comparison_html(m: ModelComparison) -> str:
    """Logits difference and the two greedy continuations side by side."""
    runs = (m.reference, m.impl)
    rows = [["new tokens (row 0)", *(" ".join(map(str, r.new_tokens[0])) for r in runs)]]
    if m.impl.text is not None:
        rows.append(["text (row 0)", *(repr(r.text[0]) for r in runs)])
    rows.append(["same tokens", *(["yes" if m.same_tokens else "no"] * 2)])
    head = (f'<div style="{_NOTE}">logits max |Δ| {m.logits_max_abs_diff:.2e} over the prompt '
            f"({len(m.position_max_abs_diff)} positions)</div>")
    return head + html_table(rows, ["", f"{m.reference.name} (reference)", m.impl.name],
                             css_class="wb-attention-model")


MODEBAR_REMOVED = ["pan2d", "select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d"]
STALE = ('<div class="wb-attention-stale" style="color:#b00020;font-size:12px">stale: computed for the previous '
         'controls ({why})</div><div style="opacity:0.45">{html}</div>')


def heatmap(z: tp.Any, title: str, colorscale: str, x_title: str, zmax: float | None = None) -> go.Figure:
    """A query-by-``x_title`` heatmap of ``z`` (float32, sent to the browser as a typed array)."""
    fig = go.Figure(go.Heatmap(z=np.asarray(z, np.float32), colorscale=colorscale, zmin=0, zmax=zmax,
                               hovertemplate="query %{y}, " + x_title + " %{x}: %{z:.3g}<extra></extra>"))
    # the title starts at the left edge: plotly's toolbar (three buttons, see _show) sits at the right
    fig.update_layout(title={"text": title, "font": {"size": 13}, "x": 0.0, "xanchor": "left"}, width=430, height=380,
                      template="plotly_white", margin={"t": 48, "b": 40, "l": 50, "r": 10})
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text="query", autorange="reversed")
    return fig


def _show(out: widgets.Output, fig: go.Figure) -> None:
    """Replace ``out``'s content with ``fig`` as plotly's MIME bundle (what the "plotly_mimetype" renderer
    sends): JupyterLab draws it with its bundled plotly.js, whatever ``plotly.io.renderers.default`` is."""
    config = {"displaylogo": False, "modeBarButtonsToRemove": MODEBAR_REMOVED}  # zoom, reset, save image stay
    bundle = {"application/vnd.plotly.v1+json": {**json.loads(fig.to_json()), "config": config},
              "text/plain": f"<heatmap: {fig.layout.title.text}>"}
    out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


class AttentionLab(InlineError, widgets.VBox):
    """Compare a registered attention implementation with a reference, live.

    Without ``query``/``key``/``value`` the lab draws its own inputs (sequence length and GQA ratio
    from the controls, 8 query heads of 64 dims); with them, their shapes are fixed and only the dtype
    changes. With a ``model`` (a ``CausalLM``), "use in model" runs the prompt through
    ``model.with_attention(impl)`` and ``model.with_attention(reference)``, encoded by ``tokenizer``
    (ours, a Hugging Face one, or a local directory such as ``local_checkpoint()``; by default a
    ``ByteTokenizer`` for the tiny presets' byte vocab). The model passed in is never changed: the
    switched one is :attr:`model_with_attention`.
    """

    def __init__(self, model: tp.Any = None, query: jax.Array | None = None, key: jax.Array | None = None,
                 value: jax.Array | None = None, *, impl: str | None = None, reference: str = "vanilla",
                 seq_len: int = 256, gqa_ratio: int = 4, tokenizer: tp.Any = None, max_new_tokens: int = 8,
                 runs: int = 5, **kwargs: tp.Any):
        given = [x is not None for x in (query, key, value)]
        if any(given) and not all(given):
            raise ValueError("pass query, key and value together (BTHD arrays), or none of them")
        if all(given):
            query, key, value = (jnp.asarray(x) for x in (query, key, value))
            if query.ndim != 4 or key.shape != value.shape or key.ndim != 4:
                raise ValueError(f"query (B, T, H, D) and key/value (B, S, KV, D) must be 4-D and key and value "
                                 f"the same shape; got {query.shape}, {key.shape}, {value.shape}")
        self._user_inputs = (query, key, value) if all(given) else None
        if seq_len not in SEQ_LENS or gqa_ratio not in GQA_RATIOS:
            raise ValueError(f"seq_len must be one of {SEQ_LENS} and gqa_ratio one of {GQA_RATIOS}; got "
                             f"{seq_len}, {gqa_ratio}")
        self.model = model
        self.runs = runs
        self.max_new_tokens = max_new_tokens
        if tokenizer is not None:
            tokenizer = as_tokenizer(tokenizer)  # ours, a Hugging Face tokenizer, or a local directory
        self.tokenizer = tokenizer if tokenizer is not None or model is None else self._default_tokenizer(model)
        self.comparison: Comparison | None = None
        self.model_result: ModelComparison | None = None
        self._syncing = False
        self._inputs_cache: dict[tuple, tuple] = {}
        self._weights_key: tuple | None = None
        self._classes: tuple | None = None
        self._menu_note = ""
        self._cell_hook: tuple | None = None

        names = OperationRegistry.list_implementations()
        if reference not in names:
            raise ValueError(f"reference {reference!r} is not registered; registered: {names}")
        impl = impl or next((n for n in ("flash", "sdpa") if n in names and n != reference), reference)
        self._impl = widgets.Dropdown(description="implementation", layout=widgets.Layout(width="480px"),
                                      style={"description_width": "105px"})
        self._reference = widgets.Dropdown(description="reference", layout=widgets.Layout(width="330px"),
                                           style={"description_width": "70px"})
        self._impl.add_class("wb-attention-impl")
        self._reference.add_class("wb-attention-reference")
        self._refresh_button = widgets.Button(icon="refresh", tooltip="re-read the registered implementations",
                                              layout=widgets.Layout(width="36px"))
        self._capabilities = widgets.HTML()
        self._causal = widgets.Checkbox(value=True, description="causal", indent=False,
                                        layout=widgets.Layout(width="80px"))
        self._window = widgets.IntText(value=0, description="window", tooltip="sliding window (0 = off)",
                                       layout=widgets.Layout(width="130px"), style={"description_width": "52px"})
        self._window.add_class("wb-attention-window")
        self._soft_cap = widgets.FloatText(value=0.0, description="soft cap", tooltip="logits soft cap (0 = off)",
                                           layout=widgets.Layout(width="140px"), style={"description_width": "58px"})
        self._dtype = widgets.Dropdown(options=[(d, d) for d in DTYPES], value="float32", description="dtype",
                                       layout=widgets.Layout(width="150px"), style={"description_width": "40px"})
        self._seq_len = widgets.Dropdown(options=[(str(t), t) for t in SEQ_LENS], value=seq_len, description="T",
                                         layout=widgets.Layout(width="110px"), style={"description_width": "16px"})
        self._gqa = widgets.Dropdown(options=[(f"H/KV={r}", r) for r in GQA_RATIOS], value=gqa_ratio,
                                     description="GQA", layout=widgets.Layout(width="150px"),
                                     style={"description_width": "36px"})
        if self._user_inputs is not None:
            self._seq_len.disabled = self._gqa.disabled = True
            self._seq_len.tooltip = self._gqa.tooltip = "fixed by the query/key/value passed in"
        self._results = widgets.HTML()
        self._results.add_class("wb-attention-results-box")
        self._results_html = ""  # the results as computed, before any stale mark
        self._busy = widgets.HTML()
        self._busy.add_class("wb-attention-busy")
        self._head = widgets.Dropdown(description="head", layout=widgets.Layout(width="120px"),
                                      style={"description_width": "36px"})
        self._head.add_class("wb-attention-head")
        self.weights_figure: go.Figure | None = None  # the heatmaps on show
        self.difference_figure: go.Figure | None = None
        self._weights_out = widgets.Output(layout=widgets.Layout(width="440px", min_height="380px"))
        self._diff_out = widgets.Output(layout=widgets.Layout(width="440px", min_height="380px"))
        self._weights_out.add_class("wb-attention-weights")
        self._diff_out.add_class("wb-attention-difference")
        self._model_box = widgets.VBox()
        children = [
            widgets.HBox([self._impl, self._reference, self._refresh_button]),
            self._capabilities,
            widgets.HBox([self._causal, self._window, self._soft_cap, self._dtype, self._seq_len, self._gqa],
                         layout=widgets.Layout(flex_flow="row wrap")),
            self._error_area(), self._busy, self._results, self._head,
            widgets.HBox([self._weights_out, self._diff_out], layout=widgets.Layout(flex_flow="row wrap")),
            self._model_box,
        ]
        if model is not None:
            self._prompt = widgets.Text(value=DEFAULT_PROMPT, description="prompt",
                                        layout=widgets.Layout(width="520px"), style={"description_width": "50px"})
            self._use_button = widgets.Button(description="use in model", icon="exchange", button_style="primary")
            self._use_button.add_class("wb-attention-use")
            self._model_html = widgets.HTML()
            self._model_html.add_class("wb-attention-model-box")
            self._model_box.children = [widgets.HBox([self._prompt, self._use_button]), self._model_html]
            self._use_button.on_click(lambda _: self.use_in_model())
        super().__init__(children, **kwargs)
        self.add_class("wb-attention-lab")

        self._set_menus(impl, reference)
        self._update_head_options()
        for control in (self._impl, self._reference, self._causal, self._window, self._soft_cap, self._dtype,
                        self._seq_len, self._gqa):
            control.observe(self._on_control, names="value")
        self._head.observe(self._on_head, names="value")
        self._refresh_button.on_click(lambda _: self.refresh())
        self._install_cell_hook()
        self.update()

    # -- public ------------------------------------------------------------------------------------
    @property
    def implementations(self) -> list[str]:
        """The implementation menu's names, as last read from the registry."""
        return [name for _, name in self._impl.options]

    @property
    def impl(self) -> str:
        return self._impl.value

    @property
    def reference(self) -> str:
        return self._reference.value

    @property
    def head(self) -> int:
        return self._head.value

    @property
    def options(self) -> LabOptions:
        """The options the controls show (raises ValueError when they are invalid)."""
        window, cap = self._window.value, self._soft_cap.value
        return LabOptions(bool(self._causal.value), window if window else None, cap if cap else None)

    @property
    def model_with_attention(self) -> tp.Any:
        """The model switched to the compared implementation by the last "use in model"."""
        return None if self.model_result is None else self.model_result.impl.model

    def inputs(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The query, key and value of the current controls."""
        dtype = self._dtype.value
        key = ("given", dtype) if self._user_inputs is not None else (self._seq_len.value, self._gqa.value, dtype)
        if key not in self._inputs_cache and self._user_inputs is not None:
            self._inputs_cache[key] = tuple(x.astype(dtype) for x in self._user_inputs)
        elif key not in self._inputs_cache:
            self._inputs_cache[key] = make_inputs(self._seq_len.value, HEADS, HEADS // self._gqa.value, HEAD_DIM,
                                                  dtype=dtype)
        return self._inputs_cache[key]

    def select(self, impl: str | None = None, reference: str | None = None) -> bool:
        """Choose the compared implementation and/or the reference (as the menus do); re-renders."""
        self.refresh_implementations()
        names = self.implementations
        for name in (impl, reference):
            if name is not None and OperationRegistry.canonical_name(name) not in names:
                raise ValueError(f"{name!r} is not in the menu {names}")
        self._syncing = True
        try:
            if impl is not None:
                self._impl.value = OperationRegistry.canonical_name(impl)
            if reference is not None:
                self._reference.value = OperationRegistry.canonical_name(reference)
        finally:
            self._syncing = False
        return self.update()

    def set_options(self, *, causal: bool | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, dtype: str | None = None, seq_len: int | None = None,
                    gqa_ratio: int | None = None) -> bool:
        """Set several controls at once (0 turns the window or the cap off), then re-render once."""
        values = {self._causal: causal, self._window: sliding_window, self._soft_cap: logits_soft_cap,
                  self._dtype: dtype, self._seq_len: seq_len, self._gqa: gqa_ratio}
        values = {control: value for control, value in values.items() if value is not None}
        for control, value in values.items():  # all checked before any is set
            if isinstance(control, widgets.Dropdown) and value not in [v for _, v in control.options]:
                choices = ", ".join(str(v) for _, v in control.options)
                self._show_error(f"{control.description} must be one of {choices}; got {value!r}")
                return False
        self._syncing = True
        try:
            with self._guard() as failed:  # a value the control itself refuses (e.g. a string for the window)
                for control, value in values.items():
                    control.value = value
        finally:
            self._syncing = False
        if failed:
            return False
        return self.update()

    def refresh(self) -> bool:
        """Re-read the registry; re-render when the selected implementations changed class."""
        self.refresh_implementations()
        if self.comparison is None or self._classes != self._current_classes():
            return self.update()
        return True

    def refresh_implementations(self) -> None:
        """Re-read the implementation menus from ``OperationRegistry`` (keeps the selections)."""
        self._set_menus(self._impl.value, self._reference.value)

    def update(self) -> bool:
        """Recompute everything from the controls. False (with the reason inline) if that failed; the
        last valid results then stay on show."""
        self.refresh_implementations()
        if self._results_html:  # until the new numbers arrive, the old ones say they are the old ones
            self._results.value = STALE.format(why="computing", html=self._results_html)
        self._busy.value = ('<div style="font-size:12px;color:#555">computing: compiling and timing '
                            f'{escape(self.impl)} against {escape(self.reference)}…</div>')
        try:
            with self._guard() as failed:
                options = self.options
                q, k, v = self.inputs()
                comparison = compare(self.impl, q, k, v, reference=self.reference, runs=self.runs,
                                     **options.kwargs())
        finally:
            self._busy.value = ""
        if failed:
            if self._results_html:
                self._results.value = STALE.format(why="these controls failed, see above", html=self._results_html)
            return False
        self.comparison = comparison
        self._classes = self._current_classes()
        self._results_html = self._results.value = comparison_html(comparison)
        self._capabilities.value = self._capabilities_html()
        self._update_head_options()
        self._show_error(self._menu_note)  # a vanished implementation is said once, then forgotten
        self._menu_note = ""
        return self._draw()

    def use_in_model(self, prompt: str | None = None) -> bool:
        """What "use in model" does: the prompt (``prompt`` replaces the text box's) through
        ``model.with_attention(impl)`` and ``model.with_attention(reference)``, side by side."""
        if self.model is None:
            self._show_error("no model: build the lab with AttentionLab(model=...) to use an implementation in it")
            return False
        if prompt is not None:
            self._prompt.value = prompt
        with self._guard("use in model") as failed:
            if self.tokenizer is None:
                raise ValueError("no tokenizer: pass AttentionLab(model, tokenizer=...) to encode the prompt")
            batch = self.tokenizer([self._prompt.value])
            result = model_comparison(self.model, self.impl, batch["input_ids"], batch["attention_mask"],
                                      reference=self.reference, max_new_tokens=self.max_new_tokens,
                                      tokenizer=self.tokenizer)
        if failed:
            return False
        self.model_result = result
        self._model_html.value = model_comparison_html(result)
        self._clear_error()
        return True

    def close(self) -> None:
        """Close the widget and stop re-reading the registry after each cell."""
        if getattr(self, "_cell_hook", None) is not None:  # absent when __init__ raised early
            shell, hook = self._cell_hook
            if hook in shell.events.callbacks["post_run_cell"]:
                shell.events.unregister("post_run_cell", hook)
            self._cell_hook = None
        super().close()

    def _repr_html_(self) -> str:
        parts = [f'<div class="wb-attention-lab-static"><div style="{_NOTE}"><b>AttentionLab</b> · '
                 f"{escape(self._inputs_text())} · {escape(self._options_text())}</div>"]
        parts.append(self._error_html())
        if self.comparison is not None:
            parts.append(comparison_html(self.comparison))
        if self.model_result is not None:
            parts.append(model_comparison_html(self.model_result))
        return "".join(parts) + "</div>"

    def __repr__(self) -> str:
        return f"AttentionLab(impl={self.impl!r}, reference={self.reference!r}, {self._inputs_text()})"

    # -- internals ---------------------------------------------------------------------------------
    @staticmethod
    def _default_tokenizer(model: tp.Any) -> tp.Any:
        """A ``ByteTokenizer`` for a byte-vocab model only (as GenerationView): byte ids mean nothing to a
        real model's vocab, whose tokenizer must be passed."""
        return default_tokenizer(model)

    def _current_classes(self) -> tuple:
        return tuple(OperationRegistry.get(n) if n in self.implementations else None
                     for n in (self.impl, self.reference))

    def _inputs_text(self) -> str:
        q, k, _ = self.inputs()
        return f"T={q.shape[1]}, H={q.shape[2]}, KV={k.shape[2]}, D={q.shape[3]}, {q.dtype}"

    def _options_text(self) -> str:
        """The options of the results on show (the last valid ones)."""
        if self.comparison is None:
            return "no results yet"
        return ", ".join(f"{k}={v}" for k, v in self.comparison.options.kwargs().items())

    def _set_menus(self, impl: str | None, reference: str | None) -> None:
        names = OperationRegistry.list_implementations()
        options = [(capability_summary(n), n) for n in names]
        fallback = "vanilla" if "vanilla" in names else names[0]
        self._syncing = True
        try:
            for dropdown, wanted in ((self._impl, impl), (self._reference, reference)):
                if list(dropdown.options) != options:
                    dropdown.options = options
                dropdown.value = wanted if wanted in names else fallback
                if wanted is not None and wanted not in names:
                    self._menu_note = f"{wanted!r} is no longer registered; the menu shows {fallback!r} instead"
        finally:
            self._syncing = False

    def _capabilities_html(self) -> str:
        caps = OperationRegistry.capabilities(self.impl)
        features = ", ".join(sorted(caps.features)) or "none"
        text = (f'<div class="wb-attention-capabilities" style="{_NOTE}"><b>{escape(self.impl)}</b>: '
                f"{escape(caps.description or '(no description)')} · features: {escape(features)} · dtypes: "
                f"{escape(', '.join(caps.dtypes))}</div>")
        return text + self._block_mask_html()

    def _block_mask_html(self) -> str:
        """A flex implementation's block mask at the lab's T: its picture and sparsity."""
        impl = OperationRegistry.get(self.impl)
        if not issubclass(impl, FlexAttention):
            return ""
        t = self.inputs()[0].shape[1]
        mask = impl().block_mask_for(t, t)
        if mask is None:
            return ""
        return f'<div class="wb-attention-block-mask" style="{_NOTE}">{mask._repr_html_()}</div>'

    def _update_head_options(self) -> None:
        heads = self.inputs()[0].shape[2]
        if [v for _, v in self._head.options] != list(range(heads)):
            self._syncing = True
            try:
                current = self._head.value
                self._head.options = [(str(h), h) for h in range(heads)]
                self._head.value = current if current is not None and current < heads else 0
            finally:
                self._syncing = False

    def _draw(self) -> bool:
        """Both heatmaps for the selected head (the weights only when their inputs changed)."""
        c, head = self.comparison, self.head
        with self._guard("heatmaps") as failed:
            q, k, _ = self.inputs()
            source = (self.impl if c.impl.ok and OperationRegistry.capabilities(self.impl).supports(RETURN_WEIGHTS)
                      else "vanilla")
            key = (OperationRegistry.get(source), source, c.options, head, id(q), id(k))
            if key != self._weights_key:
                w = attention_weights(q, k, head=head, impl=source, **c.options.kwargs())
                # colours end at the 99th percentile: a few early rows (one visible key: weight 1) would
                # otherwise leave every other weight dark; hovering shows the value
                zmax = float(np.quantile(w[w > 0], 0.99)) if (w > 0).any() else None
                self.weights_figure = heatmap(w, f"attention weights, head {head} ({source})", "Viridis", "key",
                                              zmax)
                _show(self._weights_out, self.weights_figure)
                self._weights_key = key
            if c.max_abs_diff is None:  # one side did not run: say why, never a heatmap of nothing
                self.difference_figure = None
                note = f"no difference to draw: {c.impl.note or c.reference.note}"
                self._diff_out.outputs = ({"output_type": "display_data", "metadata": {}, "data": {
                    "text/html": f'<div class="wb-attention-no-difference" style="{_NOTE}">{escape(note)}</div>',
                    "text/plain": note}},)
                return not failed
            z = np.asarray(c.output_difference(head))
            most = float(z.max())
            shown = "identical" if most == 0 else f"max {most:.2e}"
            title = f"|{c.impl.name} − {c.reference.name}|, head {head}: {shown}"
            zmax = None if most > 0 else 1.0  # all zero: the scale still runs from 0, the map stays white
            self.difference_figure = heatmap(z, title, "Reds", "head_dim", zmax)
            _show(self._diff_out, self.difference_figure)
        return not failed

    def _on_control(self, change: dict) -> None:
        if not self._syncing:
            self.update()

    def _on_head(self, change: dict) -> None:
        if not self._syncing and self.comparison is not None:
            self.refresh_implementations()
            if self._draw():
                self._clear_error("heatmaps")  # only the heatmaps' own error: a bad edit elsewhere stays said

    def _install_cell_hook(self) -> None:
        """Re-read the registry after every notebook cell (so later registrations show up)."""
        shell = IPython.get_ipython()
        if shell is None:
            return
        ref = weakref.ref(self)

        def after_cell(*_: tp.Any) -> None:
            lab = ref()
            if lab is None:
                shell.events.unregister("post_run_cell", after_cell)
                return
            with lab._guard("refresh"):  # never break the user's cell
                lab.refresh()

        shell.events.register("post_run_cell", after_cell)
        self._cell_hook = (shell, after_cell)

