"""``LayoutAdvisor``: the ranked layouts of a model on a cluster (:func:`workbench.core.advisor.advise`), with
the inputs that re-rank them, a step-time bar per layout, and per chosen row: confirm with the compiler, open in
the explorer, export as code and JSON: the row's plan travels with it
(``tests/widgets/test_layout_advisor_hand_off.py``)."""

from __future__ import annotations

import dataclasses
import typing as tp

import ipywidgets as widgets

from workbench.core.advisor import Advice, Candidate, Constraints, advise
from workbench.core.advisor.confirm import MAIN_QUANTITIES
from workbench.core.tables import Cell, Html, Row, html_table
from workbench.core.units import format_bytes, format_seconds
from workbench.core.vocab import OPTIMIZERS, TASKS
from workbench.widgets._advisor_recipe import RecipeControls
from workbench.widgets._cluster_picker import cluster_label, cluster_picker, picked_cluster, show_cluster
from workbench.widgets._errors import InlineError
from workbench.widgets._html import CELL, error_html, escape
from workbench.widgets.sharding_explorer import ShardingExplorer

__all__ = ["LayoutAdvisor", "advice_html", "batch_label", "convert_batch", "length_label"]

_PHASES = (("compute", "#4c78a8"), ("memory", "#72b7b2"), ("communication", "#f58518"), ("bubble", "#bab0ac"))


def batch_label(task: str) -> str:
    """What the batch box counts for ``task`` (:func:`~workbench.core.advisor.advise`'s ``batch_tokens``)."""
    return "sequences (batch)" if task == "decode" else "tokens per step"


def length_label(task: str) -> str:
    """What the length box is for ``task`` (``advise``'s ``seq_len``: a decode step's KV cache)."""
    return "KV cache length" if task == "decode" else "sequence length"


def convert_batch(value: int, seq_len: int, old_task: str, new_task: str) -> int:
    """The batch box's ``value`` for ``old_task`` in ``new_task``'s meaning: tokens per step (train, prefill) become
    ``tokens // seq_len`` sequences (at least 1) for decode, and decode's sequences ``sequences x seq_len`` tokens."""
    if (old_task == "decode") == (new_task == "decode"):
        return value
    return max(1, value // seq_len) if new_task == "decode" else value * seq_len


def _phases(c: Candidate) -> list[tuple[str, str, float]]:
    st = c.step
    bubble = getattr(st, "bubble_s", 0.0) or 0.0
    values = {"compute": st.compute_s, "memory": st.memory_s, "communication": st.comm_s, "bubble": bubble}
    return [(name, color, values[name]) for name, color in _PHASES]


def _breakdown_bar(c: Candidate, scale: float, width_px: int = 180) -> str:
    """Compute, HBM traffic, communication and bubble as stacked segments on one scale (they overlap in the step,
    which takes the longest plus the bubble: the bar shows what each would take alone)."""
    segments = "".join(f'<div title="{escape(name)}: {escape(format_seconds(s))}" '
                       f'style="width:{width_px * s / scale:.1f}px;height:10px;background:{color};flex:none"></div>'
                       for name, color, s in _phases(c) if s > 0)
    return f'<div class="wb-advice-bar" style="display:flex;width:{width_px}px">{segments}</div>'


# The ranked table's scroll box: about seven rows with their reasons at once, then its own scroll (the widget stays
# this tall however many rows it lists, tests/browser/test_layout_advisor_widths_browser.py).
TABLE_MAX_HEIGHT_PX = 520


def _memory_cell(c: Candidate, hbm: float | None) -> Html:
    """The row's memory per device, and the share of HBM on its own line (each part unbroken)."""
    share = "" if hbm is None else f'<br><span style="white-space:nowrap;color:#555">{c.ledger.total / hbm:.0%} ' \
                                   f"of HBM</span>"
    return Html(f'<span style="white-space:nowrap">{escape(format_bytes(c.ledger.total))}</span>{share}')


def advice_html(advice: Advice, *, top: int = 10, rejected: int = 5, selected: int | None = None) -> str:
    """The ranked table (with a step-time breakdown bar per row, its reason on its own line under it) in a scroll
    box of bounded height, and the best few that do not fit, with why."""
    tokens = advice.batch[0] * (1 if advice.task == "decode" else advice.batch[1])
    train = advice.task == "train"
    shown = advice.ranked[:top]
    scale = max([sum(s for _, _, s in _phases(c)) for c in shown] + [1e-12])
    head = ("#", "layout", "memory/device", "step time", "tokens/s", "MFU", "bound by", "breakdown")
    rows = []
    for i, c in enumerate(shown, 1):
        mark = ";background:#eef5ff" if selected == i else ""
        cells = (str(i), c.step_text(), c.tokens_text(tokens), c.step.mfu_text(), c.step.bound)
        reason = escape(c.reason) + (f'<div class="wb-advice-confirmed" style="color:#1a7f37">'
                                     f"{escape(c.confirm_note)}</div>" if c.confirm_note else "")
        rows.append(Row([Cell(cells[0], "white-space:nowrap;border-bottom:none"),
                         Cell(c.label, "border-bottom:none;min-width:140px"),
                         Cell(_memory_cell(c, advice.cluster.hbm_per_device), "border-bottom:none"),
                         *(Cell(v, "white-space:nowrap;border-bottom:none") for v in cells[1:]),
                         Cell(Html(_breakdown_bar(c, scale)), "border-bottom:none")],
                        {"class": "wb-advice-row", "data-rank": i, "style": mark}))
        rows.append(Row([Cell(Html(reason), "color:#333;padding-left:22px",
                              {"class": "wb-advice-reason", "colspan": len(head)})],
                        {"class": "wb-advice-why", "data-rank": i, "style": mark}))
    legend = " ".join(f'<span style="white-space:nowrap"><span style="display:inline-block;width:10px;height:10px;'
                      f'background:{color}"></span> {name}</span>' for name, color in _PHASES
                      if train or name != "bubble")  # a bubble is a pipeline's: train steps only
    # the header row stays in view as the rows scroll
    sticky = f"{CELL};font-weight:600;white-space:nowrap;position:sticky;top:0;background:#fff"
    table = (f'<div class="wb-advice-wrap" style="max-height:{TABLE_MAX_HEIGHT_PX}px;overflow:auto">'
             f'{html_table(rows, head, "wb-advice-table", cell=CELL, head=sticky, style="border-collapse:collapse")}'
             f"</div>") if rows else error_html(advice.why_none())
    misses = "".join(f'<li class="wb-advice-rejected">{escape(c.label)}: {escape(c.reason)}</li>'
                     for c in advice.rejected[:rejected])
    missed = (f'<div style="margin-top:4px;font-weight:600">closest that do not fit ({len(advice.rejected)} in all)'
              f'</div><ul style="margin:2px 0">{misses}</ul>') if misses else ""
    return (f'<div class="wb-advice" style="font-size:12px;line-height:1.4"><div class="wb-advice-summary">'
            f"{escape(advice.summary())}</div><div style='color:#555'>breakdown: {legend} (each alone; with overlap "
            f"the step takes the longest{', plus the bubble' if train else ''})</div>{table}{missed}</div>")


class LayoutAdvisor(RecipeControls, InlineError):
    """Inputs (the cluster, batch, sequence length, task, optimizer, constraints) that re-rank the layouts of
    ``model`` on ``cluster`` as they change (the cluster picker offers the presets: :meth:`set_cluster`); pick a row
    to confirm it with the compiler, open it in a
    :class:`~workbench.widgets.sharding_explorer.ShardingExplorer` (which holds the row's plan, gradient accumulation
    included, and counts and prices it as the advisor did: it shows the row's memory, step time and MFU), or export
    it as code and JSON (which read back as the same plan) or as a torchtitan TOML or MaxText YAML. Axis sizes may be
    pinned (``tp=8 x pp=2``: :attr:`constraints`' ``fixed``), and a recipe file imported: its batch and mesh set the
    inputs and pins, and its own plan is chosen among the rows or said why not (:mod:`._advisor_recipe`).
    ``advisor.advice`` is the last :class:`~workbench.core.advisor.Advice`; ``advisor.error`` the inline error ('' when
    none).

    The inputs mean what :func:`~workbench.core.advisor.advise` takes for the task, and their labels say so: for
    train and prefill ``batch_tokens`` is the tokens per step and ``seq_len`` the sequence length; for decode
    ``batch_tokens`` is the sequences (each decodes one token) and ``seq_len`` their KV cache length. Switching the
    task in or out of decode converts the batch box (:func:`convert_batch`): ``tokens // seq_len`` sequences (at
    least 1), and back ``sequences x seq_len`` tokens. Only the controls that apply to the task are shown: the
    optimizer, pipelines and ZeRO-1 are a train step's (hidden for prefill and decode, their values kept for when
    train comes back; the advisor's remat policies are train-only too). An error in any callback shows on the
    status line; the last ranking stays.
    """

    def __init__(self, model: tp.Any, cluster: tp.Any, *, batch_tokens: int = 1 << 20, seq_len: int = 4096,
                 task: str = "train", optimizer: str = "adamw", constraints: Constraints | None = None,
                 top: int = 10):
        self.model, self.cluster, self.top = model, cluster, top
        self.advice: Advice | None = None
        self.explorer: tp.Any = None
        self._quiet = False  # True while one input's change sets another (a task switch): rank once, after
        c = constraints or Constraints()
        w, style = widgets, {"description_width": "initial"}
        self._tokens = w.BoundedIntText(batch_tokens, min=1, max=1 << 40, description=batch_label(task),
                                        style=style, layout=w.Layout(width="250px"))
        self._tokens.add_class("wb-advisor-tokens")
        self._seq = w.BoundedIntText(seq_len, min=1, max=1 << 24, description=length_label(task), style=style,
                                     layout=w.Layout(width="220px"))
        self._seq.add_class("wb-advisor-seq")
        self._task = w.Dropdown(options=TASKS, value=task, description="task", layout=w.Layout(width="150px"),
                                style={"description_width": "35px"})
        self._task.add_class("wb-advisor-task")
        self._clusters = {cluster_label(cluster): cluster}  # the clusters given or set, by their picker label
        self._cluster = cluster_picker(cluster, "wb-advisor-cluster")
        self._optimizer = w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer",
                                     layout=w.Layout(width="170px"), style={"description_width": "62px"})
        self._across = w.Checkbox(c.tp_across_nodes, description="tp across GPU nodes", indent=False)
        self._pipeline = w.Checkbox(c.pipeline, description="pipeline (pp)", indent=False)
        self._zero = w.Checkbox(c.zero, description="ZeRO-1 (optimizer state over dp)", indent=False)
        self._max_axes = w.BoundedIntText(c.max_split_axes, min=1, max=6, description="split axes at most",
                                          style=style, layout=w.Layout(width="180px"))
        self._headroom = w.BoundedFloatText(c.headroom, min=0.0, max=0.9, step=0.05, description="HBM headroom",
                                            style=style, layout=w.Layout(width="170px"))
        self._fixed = dict(c.fixed)
        self._given = c  # what no control shows (the accumulations to try, split physical axes) stays as given
        self._status = self._error_area()  # "ranking…", then the inline error or nothing
        self._table = w.HTML()
        self._table.add_class("wb-advisor-table")
        self._row = w.Dropdown(options=[], description="row", layout=w.Layout(width="420px"),
                               style={"description_width": "30px"})
        self._confirm = w.Button(description="confirm with the compiler", icon="cogs", button_style="info",
                                 layout=w.Layout(width="210px"))
        self._confirm.add_class("wb-advisor-confirm")
        self._open = w.Button(description="open in explorer", icon="search", layout=w.Layout(width="150px"))
        self._open.add_class("wb-advisor-open")
        self._export = w.Button(description="export", icon="download", layout=w.Layout(width="100px"))
        self._export.add_class("wb-advisor-export")
        self._out = w.HTML()
        self._out.add_class("wb-advisor-out")
        self._explorer_box = w.VBox()
        self._confirm.on_click(lambda _: self.confirm())
        self._open.on_click(lambda _: self.open_in_explorer())
        self._export.on_click(lambda _: self.export())
        self._row.observe(lambda _: self._render_table(), names="value")
        self._task.observe(self._on_task, names="value")
        self._cluster.observe(lambda change: self._quiet or self.set_cluster(change["new"]), names="value")
        for control in (self._tokens, self._seq, self._optimizer, self._across, self._pipeline, self._zero,
                        self._max_axes, self._headroom):
            control.observe(lambda _: self._quiet or self.rank(), names="value")
        self._title = w.HTML()
        self.widget = w.VBox([
            self._title, w.HBox([self._cluster]),
            w.HBox([self._tokens, self._seq, self._task, self._optimizer]),
            w.HBox([self._across, self._pipeline, self._zero, self._max_axes, self._headroom]),
            *self._build_recipe(c.fixed), self._status, self._table,
            w.HBox([self._row, self._confirm, self._open, self._export]), self._out,
            self._explorer_box])
        self.widget.add_class("wb-layout-advisor")
        self._show_task(task)
        self._show_title()
        self.rank()

    def _show_title(self) -> None:
        self._title.value = (f'<div style="font-size:13px"><b>LayoutAdvisor</b> · {escape(self._model_name())} · '
                             f"{escape(str(self.cluster))}</div>")

    def _model_name(self) -> str:
        return getattr(getattr(self.model, "config", None), "model_type", type(self.model).__name__)

    @property
    def constraints(self) -> Constraints:
        """The constraints given, as the controls now set them."""
        return dataclasses.replace(self._given, fixed=self._fixed, tp_across_nodes=self._across.value,
                                   max_split_axes=self._max_axes.value, pipeline=self._pipeline.value,
                                   zero=self._zero.value, headroom=self._headroom.value)

    @property
    def train_only(self) -> tuple[tp.Any, ...]:
        """The controls of a train step alone (hidden for prefill and decode)."""
        return self._optimizer, self._pipeline, self._zero, self._export_recipe

    def _show_task(self, task: str) -> None:
        """Labels and visible controls for ``task``."""
        self._tokens.description, self._seq.description = batch_label(task), length_label(task)
        for control in self.train_only:
            control.layout.display = None if task == "train" else "none"

    def _on_task(self, change: dict[str, tp.Any]) -> None:
        """The task changed: the batch box converts to the new meaning, the labels and controls follow, and the
        layouts re-rank once. If that fails, the error shows and the task, its batch and labels stay as they were."""
        if self._quiet:
            return
        old, new, before = change["old"], change["new"], self._tokens.value
        self._quiet = True
        try:
            with self._guard("task") as failed:
                value = convert_batch(before, self._seq.value, old, new)
                self._tokens.value = min(max(value, self._tokens.min), self._tokens.max)
                self._show_task(new)
            if failed:
                self._task.value, self._tokens.value = old, before
                self._show_task(old)
        finally:
            self._quiet = False
        if not failed:
            self.rank()

    def set_cluster(self, cluster: tp.Any) -> bool:
        """Re-rank on ``cluster`` (a Cluster, or a picker's label: a preset's); the picker follows, and the panels of
        the last cluster's rows (confirmed, exported, opened in the explorer) go. If the ranking fails, the error
        shows and the last cluster and ranking stay."""
        old = self.cluster
        with self._guard("cluster", plain=(ValueError, TypeError)) as failed:
            new = picked_cluster(cluster, self._clusters)
        if not failed and new == old:
            return True
        if not failed:
            self.cluster, before = new, self.advice
            self.rank()
            failed = self.advice is before  # advise failed on it: its error shows
        if failed:
            self.cluster = old
        else:
            self.explorer, self._explorer_box.children, self._out.value = None, (), ""
            self._show_title()
        self._quiet = True  # the picker shows the cluster ranked on
        try:
            show_cluster(self._cluster, self.cluster)
        finally:
            self._quiet = False
        return not failed

    # -- actions (each shows its error inline and returns False) -----------------------------------------------
    def rank(self) -> bool:
        """Re-rank from the inputs."""
        self._status.value = '<div style="font-size:12px;color:#555">ranking…</div>'
        with self._guard(plain=(ValueError, TypeError)) as failed:
            advice = advise(self.model, self.cluster, batch_tokens=self._tokens.value, seq_len=self._seq.value,
                            task=self._task.value, optimizer=self._optimizer.value, constraints=self.constraints)
            options = [(f"{i}: {c.label}", i) for i, c in enumerate(advice.ranked[:self.top], 1)]
        if failed:
            return False
        self.advice = advice
        self._clear_error()
        self._row.options = options
        self._row.value = options[0][1] if options else None
        for button in (self._confirm, self._open, self._export, self._export_recipe):
            button.disabled = not options
        return self._render_table()

    def selected(self) -> Candidate | None:
        if self.advice is None or not self._row.value:
            return None
        return self.advice.ranked[self._row.value - 1]

    def confirm(self) -> bool:
        """Compile the chosen row on the virtual cluster (the program its step runs: a decode step with its KV cache,
        one microbatch of an accumulation) and show it beside its prediction (:func:`_confirmed_html`)."""
        c = self.selected()
        if c is None:
            return False
        self._out.value = f'<div style="font-size:12px;color:#555">compiling {escape(c.label)}…</div>'
        with self._guard("confirm", clear="own") as failed:
            self.advice.confirm_one(c)
            self._out.value = _confirmed_html(c)
            options = [(f"{i}: {x.label}", i) for i, x in enumerate(self.advice.ranked[:self.top], 1)]
            keep = self.advice.ranked.index(c) + 1 if c in self.advice.ranked else \
                (options[0][1] if options else None)
            self._row.options = options
            self._row.value = keep
        if failed:
            self._out.value = ""
            return False
        return self._render_table()

    def open_in_explorer(self) -> bool:
        """A ShardingExplorer on the cluster (the part of it the row runs on, where it leaves chips idle), laid out as
        the chosen row: its mesh, rules, mode and plan (remat policy, pipeline, ZeRO stage, gradient accumulation:
        :meth:`Candidate.layout <workbench.core.advisor.Candidate.layout>`), for the same task, batch and
        optimizer. It counts and prices the step as the advisor did: the row's memory, step time and MFU."""
        c = self.selected()
        if c is None:
            return False
        with self._guard("open in explorer", plain=(ValueError, TypeError), clear="own") as failed:
            model = self.model.with_options(remat=c.remat) if hasattr(self.model, "with_options") else self.model
            cluster = c.cluster or self.cluster
            # Advice.batch is (sequences, length): for decode the length is the KV cache's, as the explorer takes it
            explorer = ShardingExplorer(model, c.layout(model, cluster), cluster=cluster,
                                        batch=self.advice.batch, task=self.advice.task, program=c.plan.program())
            explorer._optimizer_name.value = self.advice.optimizer
            self.explorer = explorer
            self._explorer_box.children = (explorer.widget,)
        return not failed

    def export(self) -> tuple[str, str] | None:
        """The chosen row as a Python snippet and as JSON (``Layout.to_code`` / ``Layout.to_json``: its mesh, rules,
        mode and plan, with the cluster it runs on), shown below; ``Layout.from_json`` reads the row back."""
        c = self.selected()
        if c is None:
            return None
        with self._guard("export", plain=(ValueError, TypeError, AttributeError), clear="own") as failed:
            layout, cluster = c.layout(self.model), c.cluster or self.cluster
            code, text = layout.to_code(cluster=cluster), layout.to_json(cluster=cluster)
        if failed:
            self._out.value = ""
            return None
        self._out.value = (f'<div class="wb-export" style="font-size:12px"><div style="font-weight:600">'
                           f"{escape(c.label)} as code</div><pre>{escape(code)}</pre>"
                           f'<div style="font-weight:600">as JSON (Layout.from_json)</div>'
                           f"<pre>{escape(text)}</pre></div>")
        return code, text

    # -- rendering ---------------------------------------------------------------------------------------------
    def _render_table(self) -> bool:
        if self.advice is None:
            return False
        # the status line is the error area: rank() clears it, a row change keeps it
        with self._guard("table", clear="own") as failed:
            self._table.value = advice_html(self.advice, top=self.top, selected=self._row.value)
        return not failed

    def _repr_mimebundle_(self, **kwargs: tp.Any) -> dict[str, tp.Any]:
        return {**self.widget._repr_mimebundle_(**kwargs), "text/plain": repr(self)}

    def _repr_html_(self) -> str:
        return "" if self.advice is None else advice_html(self.advice, top=self.top)

    def __repr__(self) -> str:
        ranked = "-" if self.advice is None else f"{len(self.advice.ranked)} layouts fit"
        return f"LayoutAdvisor({self._model_name()}, {self.cluster.name}, {ranked})"


def _confirmed_html(c: Candidate) -> str:
    """One confirmed row: what the compiled program is, in words; each main quantity predicted beside compiled (for
    a step of accumulated microbatches, per step and per microbatch side by side), with why they differ beneath it
    (:mod:`workbench.core.cost.reconcile`'s reason); every other reconciled quantity folded below; then the note."""
    conf = c.confirmation
    if c.compiled is None or conf is None:
        return (f'<div class="wb-advisor-confirmed" style="font-size:12px;line-height:1.4">'
                f"{escape(c.confirm_note)}</div>")

    def table(quantities: tp.Sequence[str]) -> str:
        rows = []
        for cells, why in conf.cells(quantities):
            rows.append(Row([Cell(v, "white-space:nowrap;border-bottom:none") for v in cells],
                            {"class": "wb-confirm-row", "data-quantity": cells[0]}))
            rows.append(Row([Cell(why, "color:#555;font-size:11px;padding-left:16px",
                                  {"class": "wb-confirm-why", "colspan": len(cells)})]))
        return html_table(rows, conf.header, css_class="wb-confirm-table", cell=CELL, head=CELL,
                          style="border-collapse:collapse")

    main = [q for q in MAIN_QUANTITIES if any(r.quantity == q for r in conf.rows)]
    rest = [r.quantity for r in conf.rows if r.quantity not in main]
    more = (f"<details><summary>every other quantity reconciled ({len(rest)})</summary>{table(rest)}</details>"
            if rest else "")
    return (f'<div class="wb-advisor-confirmed" style="font-size:12px;line-height:1.4"><div style="font-weight:600">'
            f"{escape(c.label)}: predicted vs compiled</div>"
            f'<div class="wb-confirm-program">The compiled program: {escape(conf.program)}.</div>'
            f"{table(main)}{more}<div class=\"wb-confirm-note\">{escape(c.confirm_note)}</div>"
            f"<div>{escape(c.reason)}</div></div>")
