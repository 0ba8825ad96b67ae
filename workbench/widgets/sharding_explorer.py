"""ShardingExplorer: every parameter's PartitionSpec, bytes per device and collectives, edited live.

A view over :mod:`workbench.core.views.explore`: each edit of the rules editor resolves a new
:class:`~workbench.core.views.explore.Layout` (shapes only, nothing allocated) and re-renders the table,
the memory chart and the diff; the collectives panel compiles one step on request; "apply"
re-shards the live model; "export" shows the layout as Python and as JSON, and :meth:`ShardingExplorer.load`
(or pasting JSON beside it) switches to a given layout. A bad edit shows an inline error and leaves the last
valid layout.
"""

from __future__ import annotations

import functools
import re
import typing as tp

import ipywidgets as widgets
import jax
import numpy as np
from jax.sharding import Mesh

from workbench.core.axes import MODE_TRAIN, PartitionAxis, label
from workbench.core.checks import one_of
from workbench.core.cost import ledger as ledgers
from workbench.core.mesh import describe_mesh
from workbench.core.plan import Plan
from workbench.core.views import explore
from workbench.core.views.expert_dispatch import expert_parallel_summary
from workbench.core.views.explore_step import explorer_mesh, pipelined, resolve_on, step_model
from workbench.core.vocab import REMATS, TASKS
from workbench.widgets._cluster_html import STEP_ROW_PX, collective_seconds, ledger_html, mesh_label, step_time_html
from workbench.widgets._cluster_picker import cluster_label, cluster_picker
from workbench.widgets._errors import InlineError
from workbench.widgets._experts import ExpertsPanel, experts_html
from workbench.widgets._explorer_cluster import ClusterPanels
from workbench.widgets._explorer_controls import (
    collectives_controls,
    export_controls,
    html_pane,
    memory_controls,
    mesh_choice,
    section,
    step_controls,
)
from workbench.widgets._explorer_html import (
    CHART_PX,
    collectives_html,
    diff_html,
    export_html,
    layout_html,
    memory_figure,
    memory_html,
)
from workbench.widgets._explorer_plan import PlanControls
from workbench.widgets._explorer_rules import RulesEditor
from workbench.widgets._html import escape

# the static panels live in _explorer_html; they are this module's public face too
__all__ = ["ShardingExplorer", "collectives_html", "diff_html", "export_html", "layout_html", "memory_figure",
           "memory_html"]


class ShardingExplorer(PlanControls, ClusterPanels, InlineError):
    """Every parameter of ``model`` resolved on ``mesh``, with controls that change the rules live.

    ``model`` is a live model or an abstract one (``CausalLM.lazy_init(config)``); only shapes are
    read until "apply". ``explorer.layout``, ``.partition_axis``, ``.rules`` and ``.mode`` are always
    the last valid ones; ``.error`` is the inline error ('' when none); ``.model`` is the model,
    re-sharded after :meth:`apply`. ``explorer.widget`` is the ipywidgets tree (displayed by
    ``display(explorer)``); ``_repr_html_`` is a static table and memory picture.

    With ``cluster`` (a virtual :class:`~workbench.core.hardware.cluster.Cluster`) ``mesh`` may be the axis sizes
    (``{"fsdp": 16, "tp": 4}``; default every device on ``fsdp``) or ``cluster_mesh(cluster, ...)``; a control
    offers the cluster's valid mesh shapes, another the cluster presets (:meth:`set_cluster`); the memory chart is
    the ledger (:func:`workbench.core.cost.ledger.ledger`: parameters, gradients, optimizer state, activations under
    the remat policy, temporaries, per device) against the device's HBM, re-computed on every edit, beside the step
    predicted from the shapes (:func:`workbench.core.cost.predicted.predict_step`, the measured step model: the
    advisor's numbers for the same layout, task and batch); ``task`` ("train", "prefill" or "decode", a control too)
    is the step they count, with ``batch = (B, T)``: for decode ``B`` sequences each decoding one token against a KV
    cache of ``T``. "collectives" compiles the step for the cluster's devices (a train step: one of its accumulated
    microbatches) and adds the compiled step's time (:func:`workbench.core.cost.compiled_step.step_time`), each
    collective's time on the cluster's network and the compiled memory beside the ledger.

    On a cluster the step runs a plan (:meth:`plan`, a :class:`~workbench.core.plan.Plan`) that controls hold beside
    the remat policy: a train step's gradient accumulation (microbatches per step: the ledger holds one
    microbatch's activations and the gradients' sum, the step runs the microbatches one after another), ZeRO-1 and,
    on a ``pp`` mesh, the pipeline (schedule, microbatches, interleaved stages per device). They start as the
    layout's; :meth:`exported_layout` is the layout with their values, which the ledger, the predicted step, a compile
    and the export count. A value that makes no step (microbatches that do not divide ``B``) shows inline, saying
    what to change.

    ``mesh`` may also be a :class:`~workbench.core.views.explore.Layout` (e.g. ``candidate.layout(model, cluster)``
    from the advisor): its mesh, partition axis, rules, mode and plan (remat policy, pipeline, ZeRO stage,
    accumulation), re-resolved on ``model`` (``partition_axis`` and ``rules`` are then not given); opened so from an
    advisor's row it shows the row's memory and step time.

    "export" (:meth:`export`) shows the layout as a Python snippet and as JSON (with the cluster and the plan);
    :meth:`load` switches to a Layout or its JSON (e.g. an advised one).
    """

    def __init__(self, model: tp.Any,
                 mesh: Mesh | jax.sharding.AbstractMesh | tp.Mapping[str, int] | explore.Layout | None = None,
                 partition_axis: PartitionAxis | None = None, rules: tp.Sequence[tuple[str, tp.Any]] | None = None,
                 mode: str = MODE_TRAIN, *, optimizer: bool = True, kv_cache: tuple[int, int] | None = None,
                 batch: tuple[int, int] = (8, 64), cluster: tp.Any = None, task: str = "train",
                 program: tp.Mapping[str, tp.Any] | None = None):
        self.model = model
        self.cluster = cluster  # a virtual Cluster: "collectives" and "experts" compile for its devices
        # the program the ledger counts (Plan.program(): attention kernel, vocab tiles, offload, sequence
        # parallelism); the workbench's own, which "collectives" compiles, unless given (an advised row's, a recipe's)
        self.program = Plan({}, **dict(program or {})).program()
        one_of("task", task, TASKS)
        # raises on a bad start
        if isinstance(mesh, explore.Layout):  # a planned layout (e.g. an advised one): all it carries
            if partition_axis is not None or rules is not None:
                raise ValueError("give a Layout or partition_axis / rules, not both: a Layout carries its own")
            given = mesh
            self.layout = explore.Layout.of(model, explorer_mesh(given.mesh, cluster), given.partition_axis,
                                            given.rules, given.mode, remat=given.remat, pipeline=given.pipeline,
                                            zero_stage=given.zero_stage, grad_accumulation=given.grad_accumulation)
        else:
            mesh = explorer_mesh(mesh, cluster)
            self.layout = explore.Layout.of(model, mesh, pipelined(partition_axis, mesh), rules, mode)
        self.step_time: tp.Any = None  # cost.StepTime of the last compiled step on the cluster
        self._compiled_key: tuple | None = None
        self.collectives: explore.StepCollectives | None = None
        self.experts: tp.Any = None  # moe_view.ExpertParallelSummary after "experts"
        self._experts_layout: explore.Layout | None = None
        self.last_diff: explore.LayoutDiff | None = None
        self._diff_from: explore.Layout | None = None  # the layout last_diff compares against
        self._collectives_layout: explore.Layout | None = None
        self._changed: tuple[str, ...] = ()
        self._live = all(isinstance(x, jax.Array) for x in jax.tree.leaves(_params(model)))
        self._kv_dtype = np.dtype(getattr(model, "dtype", np.float32))
        kv_b, kv_s = kv_cache or (8, getattr(self.layout.config, "max_position_embeddings", 256))
        self._build(optimizer, kv_cache is not None, kv_b, kv_s, batch, task)
        self._render(first=True)

    # -- state ---------------------------------------------------------------------------------------
    @property
    def partition_axis(self) -> PartitionAxis:
        return self.layout.partition_axis

    @property
    def rules(self) -> tuple[tuple[str, tp.Any], ...]:
        return self.layout.rules

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def mesh(self) -> Mesh | jax.sharding.AbstractMesh:
        return self.layout.mesh

    def memory(self) -> ledgers.Ledger:
        """Bytes per device of the current layout, with the optimizer and KV cache the controls choose."""
        return explore.layout_memory(self.layout, **self._memory_options())

    def _batch(self) -> tuple[int, int]:
        """``(B, T)`` as the controls say (a decode step's ``T`` is its KV cache: :func:`step_batch`)."""
        return self._batch_b.value, self._batch_t.value

    # -- export and load -------------------------------------------------------------------------------
    def export(self) -> tuple[str, str]:
        """``(code, json)`` of the current layout (:meth:`exported_layout`): a snippet to paste after
        ``import workbench as wb`` and the JSON that :meth:`load` or ``Layout.from_json`` read back."""
        layout = self.exported_layout()
        return layout.to_code(cluster=self.cluster), layout.to_json(cluster=self.cluster)

    def show_export(self) -> bool:
        """Show :meth:`export` under the "export" button (kept current on every edit); False with the error
        inline when the layout cannot be exported."""
        self._export_shown = True
        with self._guard("export", catch=(ValueError, TypeError), clear="own") as failed:
            code, text = self.export()
        self._export_out.value = "" if failed else export_html(code, text)
        return not failed

    def load(self, layout: explore.Layout | str) -> bool:
        """Switch to ``layout`` (a Layout of this model, e.g. an advised one, or the JSON of one): its mesh,
        partition axis, rules and mode, and on a cluster its plan (remat policy, accumulation, ZeRO stage,
        pipeline) in the controls. False with an inline error (the last valid layout kept) when it does not fit
        this model or cluster."""
        def build() -> explore.Layout:
            new = resolve_on(layout, self.model, self.layout, self.cluster)
            if self.cluster is not None and new.remat is not None and new.remat not in REMATS:
                raise ValueError(f"remat {new.remat!r}: the ledger counts {REMATS}")
            return new

        if not self._try(build, what="layout"):
            return False
        if self.cluster is not None:
            self._seed_plan(self.layout)
            self._mesh_choice.value = mesh_label(dict(self.mesh.shape))
            self._render()
        return True

    def _load_pasted(self) -> None:
        if self.load(self._load_text.value):
            self._load_text.value = ""

    # -- actions (the buttons call these; each shows its error inline and returns False) -----------------
    def edit(self, *, partition_axis: PartitionAxis | None = None,
             rules: tp.Sequence[tuple[str, tp.Any]] | None = None, mode: str | None = None) -> bool:
        """Change the layout from code (the controls follow); False and an inline error when it does not resolve."""
        changes = {k: v for k, v in dict(partition_axis=partition_axis, mode=mode).items() if v is not None}
        if rules is not None:
            changes["rules"] = tuple(rules)
        return self._try(lambda: self.layout.replace(self.model, **changes))

    def set_mesh(self, mesh: Mesh | jax.sharding.AbstractMesh | tp.Mapping[str, int]) -> bool:
        """Resolve the same rules on another mesh (``mesh_view.on_change(explorer.set_mesh)``); with a cluster,
        the axis sizes (``{"fsdp": 8, "tp": 8}``) will do."""
        def build() -> explore.Layout:
            new = explorer_mesh(mesh, self.cluster)
            pipeline = self.layout.pipeline
            if pipeline is not None and pipeline.num_stages != dict(new.shape).get("pp", 1):
                pipeline = None  # planned for another pp size: the default one for the new mesh
            return self.layout.replace(self.model, mesh=new, partition_axis=pipelined(self.partition_axis, new),
                                       pipeline=pipeline)

        pp = dict(self.mesh.shape).get("pp", 1)
        ok = self._try(build, what="mesh")
        if self.cluster is not None and ok and dict(self.mesh.shape).get("pp", 1) != pp:
            self._seed_plan(self.layout, pipeline_only=True)  # the new pp's default pipeline
            self._render()
        if self.cluster is not None:
            label_ = mesh_label(dict(self.mesh.shape))
            if self._mesh_choice.value != label_:
                self._mesh_choice.value = label_
        return ok

    def compute_collectives(self) -> bool:
        """Compile one step for the current layout (forward or train, as the toggle says) and show its collectives."""
        before = self._collectives_out.value
        self._collectives_out.value = '<div style="font-size:12px;color:#555">compiling…</div>'
        with self._guard("collectives", catch=(ValueError, TypeError), clear="own") as failed:
            model = step_model(self.model, self._attention.value, None if self.cluster is None else self._remat.value)
            step = explore.step_collectives if self.cluster is None else functools.partial(
                explore.cluster_step_collectives, cluster=self.cluster, optimizer=self._optimizer_name.value)
            layout = self.layout if self.cluster is None else self.exported_layout()
            sc = step(model, layout, kind=self._kind.value, batch=self._compiled_batch(layout))
        if failed:  # the reason is inline; the last compiled step stays (marked stale when it is)
            self._collectives_out.value = before
            return False
        self.collectives, self._collectives_layout = sc, self.layout
        self._compiled_key = self._step_key()
        self.step_time = None if sc.analysis is None else self._compiled_step_time(sc.analysis)
        self._render()
        return True

    def compute_experts(self) -> bool:
        """For a MoE model: the alltoall forward's all-to-alls and matmul FLOPs against dense, and the drops
        of a sample batch at the chosen capacity factor (see :mod:`workbench.core.views.expert_dispatch`)."""
        return self._experts.run()

    def _on_experts(self, summary: tp.Any) -> None:
        self.experts, self._experts_layout = summary, self.layout

    def _expert_summary(self, capacity_factor: float | None) -> tp.Any:
        return expert_parallel_summary(self.model, self.layout, capacity_factor=capacity_factor,
                                       batch=self._batch(), cluster=self.cluster)

    def apply(self) -> float | None:
        """Re-shard the live model as the layout says; the seconds it took (None, with an inline error, if not)."""
        with self._guard("apply", catch=(ValueError, TypeError), clear="own") as failed:
            model, seconds = explore.apply(self.model, self.layout)
        if failed:
            self._apply_status.value = ""
            return None
        self.model = model
        self._apply_status.value = (f'<span class="wb-apply-status" style="font-size:12px">re-sharded '
                                    f"{len(self.layout.params)} parameters in {seconds * 1e3:.1f} ms</span>")
        return seconds

    # -- rendering ------------------------------------------------------------------------------------
    def _build(self, optimizer: bool, kv_on: bool, kv_b: int, kv_s: int, batch: tuple[int, int],
               task: str = "train") -> None:
        w = widgets
        self._title = w.HTML()
        self._error_area()
        self.editor = RulesEditor(self.layout, self._on_edit)
        self._optimizer, self._kv_on, self._kv_b, self._kv_s = memory_controls(optimizer, kv_on, kv_b, kv_s)
        for control in (self._optimizer, self._kv_on, self._kv_b, self._kv_s):
            control.observe(lambda _: self._on_memory_options(), names="value")
        remat = self.layout.remat or getattr(self.model, "remat", "none")
        (self._task, self._optimizer_name, self._remat, self._batch_b, self._batch_t,
         self._kind) = step_controls(task, remat, batch)
        self._plan_rows = self._build_plan()
        self._ledger_out = html_pane("wb-ledger-html")
        self._predicted_out = html_pane("wb-predicted-step-html")
        self._step_out = html_pane("wb-step-time-html")
        if self.cluster is not None:
            self._mesh_choice = mesh_choice(self.cluster, mesh_label(dict(self.mesh.shape)))
            self._mesh_choice.observe(self._on_mesh_choice, names="value")
            self._clusters = {cluster_label(self.cluster): self.cluster}  # given or set, by their picker label
            self._cluster_choice = cluster_picker(self.cluster, "wb-explorer-cluster")
            self._cluster_choice.observe(self._on_cluster_choice, names="value")
        self._chart = w.Output(layout=w.Layout(width=f"{CHART_PX}px", min_height="300px"))
        self._chart.add_class("wb-memory-chart")
        self._diff = w.HTML()
        self._filter = w.Text(placeholder="filter paths (regex)", layout=w.Layout(width="300px"))
        self._filter.observe(lambda _: self._render_table(), names="value")
        self._table = html_pane("wb-explorer-table-html")
        self._attention, self._collectives_button, self._collectives_out, self._apply_button = \
            collectives_controls(self.model, self._live)
        self._collectives_button.on_click(lambda _: self.compute_collectives())
        self._apply_button.on_click(lambda _: self.apply())
        self._apply_status = w.HTML()
        self._export_shown = False
        self._export_button, self._export_out, self._load_text, self._load_button = export_controls()
        self._export_button.on_click(lambda _: self.show_export())
        self._load_button.on_click(lambda _: self._load_pasted())
        self._experts = ExpertsPanel(self._expert_summary, self._guard, self._on_experts)
        self._capacity, self._experts_out = self._experts.capacity, self._experts.out
        self.widget = self._layout_widget()
        self.widget.add_class("wb-sharding-explorer")

    def _memory_column(self) -> tuple[widgets.Widget, list[widgets.Widget], list[widgets.Widget]]:
        """The memory column beside the rules, and the controls and panes of the "collectives" row."""
        w, go = widgets, self._collectives_button
        if self.cluster is None:
            memory = w.VBox([w.HBox([self._optimizer, self._kv_on, self._kv_b, self._kv_s]), self._chart],
                            layout=w.Layout(flex=f"1 1 {CHART_PX}px"))
            # the batch sizes the default pipeline of a pp mesh: a shown export follows it
            self._batch_b.observe(lambda _: self._export_shown and self.show_export(), names="value")
            return memory, [self._kind, self._batch_b, self._batch_t, self._attention, go], [self._collectives_out]
        for control in (self._task, self._optimizer_name, self._remat, self._batch_b, self._batch_t, self._kind,
                        self._attention, self._accumulation, self._zero, self._schedule, self._pipe_m, self._virtual):
            control.observe(lambda _: self._syncing or self._render(), names="value")
        memory = w.VBox([w.HBox([self._cluster_choice, self._mesh_choice]),
                         w.HBox([self._task, self._batch_b, self._batch_t]),
                         w.HBox([self._optimizer_name, self._remat]), *self._plan_rows, self._ledger_out,
                         w.HTML('<div style="font-weight:600;margin-top:6px">predicted step from the shapes '
                                "(no compile)</div>"), self._predicted_out],
                        layout=w.Layout(flex=f"1 1 {STEP_ROW_PX}px"))
        return (memory, [self._kind, self._attention, go],
                [self._collectives_out, section("predicted step time on the cluster"), self._step_out])

    def _layout_widget(self) -> widgets.VBox:
        w = widgets
        memory, step_controls_, step_outputs = self._memory_column()
        moe = getattr(self.layout.config, "num_local_experts", 0) > 0
        experts = [section("expert parallelism (MoE layers)"), self._experts.widget] if moe else []
        return w.VBox([
            self._title, self._error,
            # the memory column beside the rules, or under them where the two do not fit side by side; it is
            # never narrower than its chart or its bars (a squeezed column cut its text off at the explorer's edge)
            w.HBox([self.editor.widget, memory], layout=w.Layout(flex_flow="row wrap")),
            section("change from the previous layout"), self._diff,
            section("parameters"), self._filter, self._table,
            section("collectives of one step"), w.HBox(step_controls_),
            *step_outputs, *experts, w.HBox([self._apply_button, self._apply_status]),
            section("export"), w.HBox([self._export_button, self._load_text, self._load_button]), self._export_out])

    def set_attention(self, name: str) -> None:
        """The attention implementation "collectives" compiles the step with (the dropdown follows)."""
        self._attention.value = name

    def _render(self, first: bool = False) -> None:
        if self.cluster is not None:
            self._show_plan()
        name = getattr(self.layout.config, "model_type", type(self.model).__name__)
        self._title.value = (f'<div style="font-size:13px"><b>ShardingExplorer</b> · {escape(name)} · '
                             f"<code>{escape(describe_mesh(self.mesh))}</code>"
                             + ("" if self.cluster is None else f" · {escape(str(self.cluster))}") + "</div>")
        self._diff.value = diff_html(self.last_diff)
        self._render_table()
        self._render_memory()
        if self.collectives is not None:
            stale = self._collectives_layout is not self.layout or (
                self.step_time is not None and self._compiled_key != self._step_key())
            seconds = None if self.step_time is None else collective_seconds(self.step_time)
            self._collectives_out.value = collectives_html(self.collectives, stale=stale, seconds=seconds)
            if self.step_time is not None:
                note = ('<div style="color:#b00020;font-size:12px">stale: computed for an earlier layout</div>'
                        if stale else "")
                self._step_out.value = note + step_time_html(self.step_time)
        if self.experts is not None:
            self._experts_out.value = experts_html(self.experts, stale=self._experts_layout is not self.layout)
        if self._export_shown:
            self.show_export()

    def _render_table(self) -> None:
        pattern = self._filter.value
        with self._guard("filter", catch=ValueError, clear="own") as failed:
            try:
                html = layout_html(self.layout, pattern=pattern, changed=self._changed, why_below=True)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regex: {e}") from None
        if not failed:  # else the last table stays
            self._table.value = html

    def _memory_options(self) -> dict[str, tp.Any]:
        kv = (self._kv_b.value, self._kv_s.value, self._kv_dtype) if self._kv_on.value else None
        return {"optimizer": "adamw" if self._optimizer.value else None, "kv_cache": kv}

    def _on_memory_options(self) -> None:
        """The optimizer / KV cache controls changed: the chart and the change summary count the same parts."""
        if self.last_diff is not None and self._diff_from is not None:
            with self._guard(catch=ValueError) as failed:
                self.last_diff = explore.diff(self._diff_from, self.layout, **self._memory_options())
            if not failed:
                self._diff.value = diff_html(self.last_diff)
        self._render_memory()

    def _render_memory(self) -> None:
        if self.cluster is not None:
            self._render_ledger()
            return
        with self._guard(catch=ValueError) as failed:
            memory = self.memory()
        if failed:
            return
        self._chart.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": {"application/vnd.plotly.v1+json": memory_figure(memory, self.mesh),
                                         "text/plain": f"memory per device: {memory.total:,} B"}},)

    # -- edits -----------------------------------------------------------------------------------------
    def _on_edit(self) -> None:
        def read() -> explore.Layout:
            pa, rules, mode = self.editor.read(self.layout.partition_axis)
            return self.layout.replace(self.model, partition_axis=pa, rules=rules, mode=mode)

        self._try(read)

    def _try(self, build: tp.Callable[[], explore.Layout], what: str = "edit") -> bool:
        """Resolve a new layout; on success show it, else show why and keep the last valid one."""
        # a callback must not raise: say why, keep the last valid layout
        with self._guard(plain=(ValueError, TypeError, KeyError, re.error),
                         suffix=f" (still showing the last valid {what if what in ('mesh', 'cluster') else 'layout'})"
                         ) as failed:
            new = build()
            d = explore.diff(self.layout, new, **self._memory_options())
        if failed:
            return False
        self._diff_from, self.layout, self.last_diff = self.layout, new, d
        self._changed = tuple(c.path for c in d.changed)
        self._clear_error()
        self.editor.show(new)
        self._render()
        return True

    # -- display -----------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: tp.Any) -> dict[str, tp.Any]:
        return {**self.widget._repr_mimebundle_(**kwargs), "text/plain": repr(self)}

    def _repr_html_(self) -> str:
        memory = (memory_html(self.memory(), self.mesh.size) if self.cluster is None else
                  ledger_html(self.ledger(), n_devices=self.mesh.size))
        return (f'<div class="wb-sharding-explorer-static"><div style="font-size:13px"><b>ShardingExplorer</b> · '
                f"<code>{escape(describe_mesh(self.mesh))}</code></div>"
                f"{memory}{layout_html(self.layout)}</div>")

    def __repr__(self) -> str:
        name = getattr(self.layout.config, "model_type", type(self.model).__name__)
        shape = ", ".join(f"{a}={n}" for a, n in zip(self.mesh.axis_names, self.mesh.axis_sizes, strict=True))
        return f"ShardingExplorer({name}, {len(self.layout.params)} parameters, mesh {shape}, {label(self.mode)})"


def _params(model: tp.Any) -> tp.Any:
    from flax import nnx

    return nnx.state(model, nnx.Param)
