"""ShardingExplorer: every parameter's PartitionSpec, bytes per device and collectives, edited live.

A view over :mod:`workbench.core.views.explore`: each edit of the rules editor resolves a new
:class:`~workbench.core.views.explore.Layout` (shapes only, nothing allocated) and re-renders the table,
the memory chart and the diff; the collectives panel compiles one step on request; "apply"
re-shards the live model; "export" shows the layout as Python and as JSON, and :meth:`ShardingExplorer.load`
(or pasting JSON beside it) switches to a given layout. A bad edit shows an inline error and leaves the last
valid layout.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing as tp

import ipywidgets as widgets
import jax
import numpy as np
from jax.sharding import Mesh

from workbench.core.axes import BATCH, LENGTH, MODE_TRAIN, PartitionAxis, label
from workbench.core.compile.steps import OPTIMIZERS, full_mesh_shape
from workbench.core.compile.virtual import cluster_mesh
from workbench.core.cost import ledger as ledgers
from workbench.core.cost.flops import model_flops
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.step_time import step_time
from workbench.core.mesh import MESH_AXES, describe_mesh
from workbench.core.operations import OperationRegistry
from workbench.core.pipeline import default_config
from workbench.core.sharding import export as layout_export
from workbench.core.units import format_bytes, format_seconds
from workbench.core.views import explore
from workbench.core.views.expert_dispatch import expert_parallel_summary
from workbench.widgets._cluster_html import (
    STEP_ROW_PX,
    collective_seconds,
    ledger_html,
    mesh_label,
    mesh_options,
    parse_mesh_label,
    step_time_html,
)
from workbench.widgets._errors import InlineError
from workbench.widgets._experts import ExpertsPanel, experts_html
from workbench.widgets._explorer_rules import RulesEditor
from workbench.widgets._html import escape

__all__ = ["ShardingExplorer", "collectives_html", "diff_html", "export_html", "layout_html", "memory_figure",
           "memory_html"]

_CELL = "padding:2px 6px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top"
# the widget's parameter table: a row, then its reason on a line of its own (the rule under both)
_ROW_CELL = "padding:2px 4px 0;text-align:left;vertical-align:top"
_WHY_CELL = "padding:0 4px 3px 16px;border-bottom:1px solid #ddd;text-align:left;color:#555;font-size:11px"
_HEAD_CELL = "padding:2px 4px;border-bottom:1px solid #ddd;text-align:left;vertical-align:bottom;font-weight:600"
_WRAPS = (0, 3, 4)  # path (after a /), semantic axes, PartitionSpec: the columns that may wrap
_CHART_PX = 560  # the memory chart's width (memory_figure)
_PARTS = (("params", "parameters", "#4c78a8"), ("optimizer", "optimizer state (AdamW)", "#f58518"),
          ("kv_cache", "KV cache", "#54a24b"))


# -- static HTML (also the widget's panels) ------------------------------------------------------------
def _spec_text(spec: tp.Any) -> str:
    return str(spec).replace("PartitionSpec", "P")


def _names(entry: tp.Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def layout_html(layout: explore.Layout, *, pattern: str = "", changed: tp.Collection[str] = (),
                why_below: bool = False) -> str:
    """The parameter table; rows whose path matches ``pattern`` (regex search), ``changed`` ones marked.

    ``why_below`` (the widget's table): each parameter's reason on a line of its own under its row, paths that may
    wrap after a ``/`` and axes and specs after a space, and a taller scroll box, so that the table reads at any
    width JupyterLab gives it; else the reason is the last column (the static table saved in notebooks)."""
    regex = re.compile(pattern) if pattern else None
    head = ("path", "shape", "dtype", "semantic axes", "PartitionSpec", "type", "shard", "bytes/device")
    head += () if why_below else ("why",)
    explicit = set(layout.mesh.explicit_axes)
    rows = []
    for p in layout.params:
        if regex is not None and not regex.search(p.path):
            continue
        mark = ";background:#fff3c4" if p.path in changed else ""
        cells = (p.path, "×".join(map(str, p.shape)), p.dtype.name, ", ".join(p.axes), _spec_text(p.spec), p.typed,
                 "×".join(map(str, p.shard_shape)), f"{p.bytes_per_device:,}", p.reason)
        classes = ("wb-path", "", "", "", "wb-spec", "wb-type", "wb-shard", "wb-bytes", "wb-reason")
        if not why_below:
            rows.append(f'<tr class="wb-param-row" data-path="{escape(p.path)}" style="{mark}">'
                        + "".join(f'<td class="{c}" style="{_CELL}{"" if c == "wb-reason" else ";white-space:nowrap"}">'
                                  f"{escape(v)}</td>" for c, v in zip(classes, cells, strict=True))
                        + "</tr>")
            continue
        texts = ["/<wbr>".join(map(escape, p.path.split("/"))), *map(escape, cells[1:-1])]
        rows.append(f'<tr class="wb-param-row" data-path="{escape(p.path)}" style="{mark}">'
                    + "".join(f'<td class="{c}" style="{_ROW_CELL}{"" if i in _WRAPS else ";white-space:nowrap"}">'
                              f"{v}</td>" for i, (c, v) in enumerate(zip(classes[:-1], texts, strict=True)))
                    + f'</tr><tr class="wb-param-why" style="{mark}"><td class="wb-reason" colspan="{len(head)}" '
                      f'style="{_WHY_CELL}">{escape(p.reason)}</td></tr>')
    on_auto = any(a not in explicit for p in layout.params for entry in p.spec for a in _names(entry))
    th = _HEAD_CELL if why_below else f"{_CELL};font-weight:600"
    typed_head = (f'<th style="{th}" title="str(jax.typeof(x)) on this mesh">type</th>' if not on_auto else
                  f'<th style="{th}" title="the type on Explicit axes; jax.typeof leaves Auto axes out of types">'
                  "type if Explicit</th>")
    header = "".join(typed_head if h == "type" else f'<th style="{th}">{h}</th>' for h in head)
    shown = f"{len(rows)} of {len(layout.params)}" if regex is not None else str(len(rows))
    total = (f"{shown} parameters · {format_bytes(layout.param_bytes)} of parameters per device, "
             f"{format_bytes(sum(p.nbytes for p in layout.params))} unsharded · {label(layout.mode)}"
             + (" · under each row: why" if why_below else ""))
    return (f'<div class="wb-explorer-table-wrap" style="max-height:{720 if why_below else 420}px;overflow:auto">'
            f'<div style="font-size:12px;color:#555;margin:2px 0">{escape(total)}</div>'
            f'<table class="wb-explorer-table" style="border-collapse:collapse;font-size:12px'
            f'{";line-height:1.4" if why_below else ""}">'
            f"<thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def memory_html(memory: ledgers.Ledger, n_devices: int) -> str:
    """A static stacked bar per device (HTML/CSS boxes, which JupyterLab's sanitiser keeps in an untrusted
    notebook, unlike inline SVG), with the numbers beside it."""
    parts = [(name, title, color, getattr(memory, name)) for name, title, color in _PARTS]
    height, width, top = 90, 22, max(memory.total, 1)
    columns = []
    for d in range(n_devices):
        boxes = "".join(f'<div title="device {d}: {escape(title)} {value:,} B" '
                        f'style="height:{height * value / top:.1f}px;background:{color}"></div>'
                        for _, title, color, value in parts if value > 0)
        columns.append(f'<div style="display:flex;flex-direction:column;align-items:center;width:{width}px">'
                       f'<div style="display:flex;flex-direction:column-reverse;height:{height}px;width:{width}px">'
                       f'{boxes}</div><div style="font-size:10px">{d}</div></div>')
    bars = f'<div class="wb-memory-bars" style="display:flex;gap:4px;align-items:flex-end">{"".join(columns)}</div>'
    legend = "".join(f'<div><span style="display:inline-block;width:10px;height:10px;background:{color};'
                     f'margin-right:4px"></span>{escape(title)}: {escape(format_bytes(value))}</div>'
                     for _, title, color, value in parts if value)
    return (f'<div class="wb-memory-static" style="display:flex;gap:16px;align-items:flex-end;font-size:12px">'
            f'{bars}<div><div style="font-weight:600">memory per device: {escape(format_bytes(memory.total))}'
            f"</div>{legend}</div></div>")


def diff_html(d: explore.LayoutDiff | None) -> str:
    """Which parameters changed spec, and the memory per device before and after."""
    if d is None:
        return '<div class="wb-diff" style="font-size:12px;color:#666">no edit yet</div>'
    sign = "+" if d.delta >= 0 else "-"
    memory = (f"memory per device {format_bytes(d.old_memory.total)} → {format_bytes(d.new_memory.total)} "
              f"({sign}{format_bytes(abs(d.delta))})")
    if not d.changed:
        return f'<div class="wb-diff" style="font-size:12px">no parameter changed spec · {escape(memory)}</div>'
    rows = "".join(f'<tr><td style="{_CELL}">{escape(c.path)}</td><td style="{_CELL}">{escape(_spec_text(c.old_spec))}'
                   f' → <b>{escape(_spec_text(c.new_spec))}</b></td><td style="{_CELL}">{c.old_bytes:,} → '
                   f"{c.new_bytes:,} B</td></tr>" for c in d.changed)
    return (f'<div class="wb-diff" style="font-size:12px"><div>{len(d.changed)} parameter(s) changed spec · '
            f'{escape(memory)}</div><table style="border-collapse:collapse">{rows}</table></div>')


def collectives_html(sc: explore.StepCollectives, *, stale: bool = False,
                     seconds: tp.Mapping[tuple[str, tuple[str, ...]], float] | None = None) -> str:
    """The collectives of one step per kind and mesh axes, with XLA's warnings condensed; with ``seconds``
    (``(kind, axes) -> predicted seconds per step`` on a cluster's network) a column of predicted time."""
    timed = seconds is not None
    rows = "".join(f'<tr class="wb-collective-row"><td style="{_CELL}">{escape(kind)}</td><td style="{_CELL}">'
                   f'{escape(", ".join(axes) or "-")}</td><td style="{_CELL}">{n}</td><td style="{_CELL}">'
                   f"{escape(format_bytes(b))}</td>"
                   + (f'<td class="wb-collective-time" style="{_CELL}">'
                      f"{escape(format_seconds(seconds.get((kind, tuple(axes)), 0.0)))}</td>" if timed else "")
                   + "</tr>" for kind, axes, n, b in sc.by_axes())
    what = (f"{sc.kind} step, batch {sc.batch[0]}×{sc.batch[1]} tokens placed {_spec_text(sc.input_spec)}: "
            f"{sc.runs} collectives run ({len(sc.records)} in the program, those in the layer scan once per layer), "
            f"{format_bytes(sc.bytes_per_device)} per device"
            + f", matmuls {sc.matmul_flops / 1e9:,.3g} GFLOP per device"
            + f" (compiled in {sc.compile_seconds:.2f} s)")
    table = (f'<table style="border-collapse:collapse"><thead><tr><th style="{_CELL}">kind</th>'
             f'<th style="{_CELL}">mesh axes</th><th style="{_CELL}">runs</th><th style="{_CELL}">bytes/device</th>'
             + (f'<th style="{_CELL}" title="predicted on the cluster\'s network, all runs">time</th>' if timed else "")
             + f"</tr></thead><tbody>{rows}</tbody></table>") if rows else "<div>no collective: every device "\
        "computes its part alone</div>"
    warned: dict[str, int] = {}
    for w in sc.warnings:
        first = w.split(". ")[0]
        warned[first] = warned.get(first, 0) + 1
    warnings = "".join(f'<div style="color:#8a5300">XLA warned ×{n}: {escape(w)}</div>' for w, n in warned.items())
    note = '<div style="color:#b00020">stale: computed for an earlier layout; press "collectives" again</div>' \
        if stale else ""
    return (f'<div class="wb-collectives" style="font-size:12px;{"opacity:0.6" if stale else ""}">{note}'
            f"<div>{escape(what)}</div>{table}{warnings}</div>")


def export_html(code: str, json_text: str) -> str:
    """The exported layout: the Python snippet and the JSON, each in a collapsible ``<pre>``."""
    pre = "margin:2px 0;padding:6px;background:#f6f8fa;border:1px solid #ddd;font-size:12px;overflow:auto"
    return (f'<div class="wb-export" style="font-size:12px">'
            f'<details open><summary>Python: paste after <code>import workbench as wb</code>, with <code>model</code> '
            f'defined</summary><pre class="wb-export-code" style="{pre}">{escape(code)}</pre></details>'
            f"<details open><summary>JSON: <code>Layout.from_json(text, model)</code> or "
            f'<code>explorer.load(text)</code> reads it back</summary><pre class="wb-export-json" style="{pre}">'
            f"{escape(json_text)}</pre></details></div>")


# -- the widget ------------------------------------------------------------------------------------------
class ShardingExplorer(InlineError):
    """Every parameter of ``model`` resolved on ``mesh``, with controls that change the rules live.

    ``model`` is a live model or an abstract one (``CausalLM.lazy_init(config)``); only shapes are
    read until "apply". ``explorer.layout``, ``.partition_axis``, ``.rules`` and ``.mode`` are always
    the last valid ones; ``.error`` is the inline error ('' when none); ``.model`` is the model,
    re-sharded after :meth:`apply`. ``explorer.widget`` is the ipywidgets tree (displayed by
    ``display(explorer)``); ``_repr_html_`` is a static table and memory picture.

    With ``cluster`` (a virtual :class:`~workbench.core.hardware.cluster.Cluster`) ``mesh`` may be the axis sizes
    (``{"fsdp": 16, "tp": 4}``; default every device on ``fsdp``) or ``cluster_mesh(cluster, ...)``; a control
    offers the cluster's valid mesh shapes; the memory chart is the ledger (:func:`workbench.core.cost.ledger.ledger`:
    parameters, gradients, optimizer state, activations under the remat policy, temporaries, per device)
    against the device's HBM, re-computed on every edit, beside the step predicted from the shapes
    (:func:`workbench.core.cost.predicted.predict_step`, the measured step model: the advisor's numbers for the same
    layout, task and batch); ``task`` ("train", "prefill" or "decode", a control too) is the step they count, with
    ``batch = (B, T)``: for decode ``B`` sequences each decoding one token against a KV cache of ``T``. "collectives"
    compiles the step for the cluster's devices and adds the compiled step's time
    (:func:`workbench.core.cost.step_time.step_time`), each collective's time on the cluster's network and the
    compiled memory beside the ledger.

    ``mesh`` may also be a :class:`~workbench.core.views.explore.Layout` (e.g. ``candidate.layout(model, cluster)``
    from the advisor): its mesh, partition axis, rules, mode, remat policy, pipeline and ZeRO stage, re-resolved on
    ``model`` (``partition_axis`` and ``rules`` are then not given).

    "export" (:meth:`export`) shows the layout as a Python snippet and as JSON (with the cluster, the remat
    policy and a pp mesh's pipeline); :meth:`load` switches to a Layout or its JSON (e.g. an advised one).
    """

    def __init__(self, model: tp.Any,
                 mesh: Mesh | jax.sharding.AbstractMesh | tp.Mapping[str, int] | explore.Layout | None = None,
                 partition_axis: PartitionAxis | None = None, rules: tp.Sequence[tuple[str, tp.Any]] | None = None,
                 mode: str = MODE_TRAIN, *, optimizer: bool = True, kv_cache: tuple[int, int] | None = None,
                 batch: tuple[int, int] = (8, 64), cluster: tp.Any = None, task: str = "train"):
        self.model = model
        self.cluster = cluster  # a virtual Cluster: "collectives" and "experts" compile for its devices
        if task not in ledgers.TASKS:
            raise ValueError(f"task must be one of {ledgers.TASKS}; got {task!r}")
        # raises on a bad start
        if isinstance(mesh, explore.Layout):  # a planned layout (e.g. an advised one): all it carries
            if partition_axis is not None or rules is not None:
                raise ValueError("give a Layout or partition_axis / rules, not both: a Layout carries its own")
            given = mesh
            self.layout = explore.Layout.of(model, _cluster_mesh(given.mesh, cluster), given.partition_axis,
                                            given.rules, given.mode, remat=given.remat, pipeline=given.pipeline,
                                            zero_stage=given.zero_stage)
        else:
            mesh = _cluster_mesh(mesh, cluster)
            self.layout = explore.Layout.of(model, mesh, _pipelined(partition_axis, mesh), rules, mode)
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

    def ledger(self) -> ledgers.Ledger:
        """The memory ledger of one step as the controls say (task, optimizer, remat, batch), against the
        cluster's HBM; on a mesh with ``pp > 1`` the layout's pipeline, by default 1F1B
        (:func:`workbench.core.pipeline.default_config`)."""
        batch, kv_length = self._step_batch()
        pipeline = self._pipeline() if self._task.value == "train" else None
        return ledgers.ledger(self.model, self.layout, kind=self._task.value, batch=batch, kv_length=kv_length,
                              optimizer=self._optimizer_name.value, remat=self._remat.value, cluster=self.cluster,
                              pipeline=pipeline)

    def _step_batch(self) -> tuple[tuple[int, int], int | None]:
        """``(batch, kv_length)`` of the step the controls describe, as the ledger, the predicted step and the
        advisor (:func:`workbench.core.advisor.advise`) take them: a decode step is ``(B, 1)``, one new token per
        sequence, against a KV cache of ``T`` positions; a train step or a prefill is ``(B, T)``."""
        b, t = self._batch_b.value, self._batch_t.value
        return ((b, 1), t) if self._task.value == "decode" else ((b, t), None)

    def _pipeline(self) -> tp.Any:
        """The layout's pipeline; on a mesh with ``pp > 1`` and none given, 1F1B over the batch
        (:func:`workbench.core.pipeline.default_config`)."""
        if self.layout.pipeline is not None or dict(self.mesh.shape).get("pp", 1) == 1:
            return self.layout.pipeline

        return default_config(self.mesh, self._batch_b.value)

    # -- export and load -------------------------------------------------------------------------------
    def exported_layout(self) -> explore.Layout:
        """The current layout with what the controls add to it: the pipeline on a ``pp > 1`` mesh and, on a
        cluster, the remat policy the ledger counts."""
        remat = self._remat.value if self.cluster is not None else self.layout.remat
        return dataclasses.replace(self.layout, remat=remat, pipeline=self._pipeline())

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
        partition axis, rules and mode, and on a cluster its remat policy. False with an inline error (the
        last valid layout kept) when it does not fit this model or cluster."""
        def build() -> explore.Layout:
            new = self._loaded(layout)
            if self.cluster is not None and new.remat is not None and new.remat not in ledgers.REMATS:
                raise ValueError(f"remat {new.remat!r}: the ledger counts {ledgers.REMATS}")
            return new

        if not self._try(build, what="layout"):
            return False
        if self.cluster is not None:
            if self.layout.remat is not None:
                self._remat.value = self.layout.remat
            self._mesh_choice.value = mesh_label(dict(self.mesh.shape))
        return True

    def _loaded(self, layout: explore.Layout | str) -> explore.Layout:
        """``layout`` resolved on this explorer's model (and cluster)."""
        if isinstance(layout, str):
            doc = layout_export.read(layout)
            shape, _ = doc["mesh"]
            # a cluster export cannot name (a custom GPU one) says so: no layout was planned for it
            if doc["cluster"] is not None and (self.cluster is None or
                                               doc["cluster"] != layout_export.cluster_spec(self.cluster)):
                where = (f"an explorer on {self.cluster.name}" if self.cluster is not None else
                         "an explorer without a cluster")
                raise ValueError(f"this layout was planned for the cluster {doc['cluster']}, not for {where}; "
                                 f"open it in ShardingExplorer(model, cluster=...) with that cluster")
            mesh = (_cluster_mesh(shape, self.cluster) if self.cluster is not None else
                    self.mesh if dict(self.mesh.shape) == shape else None)
            return explore.Layout.from_json(layout, self.model, mesh=mesh)
        if not isinstance(layout, explore.Layout):
            raise TypeError(f"load takes a Layout or its JSON (Layout.to_json()); got {type(layout).__name__}")
        if [(p.path, p.shape) for p in layout.params] != [(p.path, p.shape) for p in self.layout.params]:
            raise ValueError("this layout was resolved for another model (its parameter paths or shapes differ); "
                             "resolve it on this explorer's model: Layout.of(explorer.model, ...)")
        mesh = layout.mesh if self.cluster is None else _cluster_mesh(layout.mesh, self.cluster)
        return explore.Layout.of(self.model, mesh, layout.partition_axis, layout.rules, layout.mode,
                                 remat=layout.remat, pipeline=layout.pipeline, zero_stage=layout.zero_stage)

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
            new = _cluster_mesh(mesh, self.cluster)
            pipeline = self.layout.pipeline
            if pipeline is not None and pipeline.num_stages != dict(new.shape).get("pp", 1):
                pipeline = None  # planned for another pp size: the default one for the new mesh
            return self.layout.replace(self.model, mesh=new, partition_axis=_pipelined(self.partition_axis, new),
                                       pipeline=pipeline)

        ok = self._try(build, what="mesh")
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
            model = self.model
            attention = self._attention.value
            if attention and attention != getattr(model, "attn_mechanism", attention):
                model = model.with_attention(attention)
            if self.cluster is None:
                step = explore.step_collectives
            else:
                if self._remat.value != getattr(model, "remat", self._remat.value):
                    model = model.with_options(remat=self._remat.value)
                step = functools.partial(explore.cluster_step_collectives, cluster=self.cluster,
                                         optimizer=self._optimizer_name.value)
            sc = step(model, self.layout, kind=self._kind.value, batch=(self._batch_b.value, self._batch_t.value))
        if failed:  # the reason is inline; the last compiled step stays (marked stale when it is)
            self._collectives_out.value = before
            return False
        self.collectives, self._collectives_layout = sc, self.layout
        self._compiled_key = self._step_key()
        self.step_time = None
        if sc.analysis is not None and self.cluster.platform == "cpu":
            self._step_out.value = ('<div style="font-size:12px;color:#555">simulated CPU devices have no chip or '
                                    "network numbers: no step time (use Cluster.tpu(...) or Cluster.h100(...))</div>")
        elif sc.analysis is not None:
            share = None  # a forward's model FLOPs depend on which logits it needs: its MFU is not shown
            if self._kind.value == "train":
                batch = (self._batch_b.value, self._batch_t.value)
                share = model_flops(self.layout.config, batch) / self.cluster.num_devices
            self.step_time = step_time(sc.analysis, model_flops=share)
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
                                       batch=(self._batch_b.value, self._batch_t.value), cluster=self.cluster)

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
        self._optimizer = w.Checkbox(optimizer, description="AdamW state", indent=False, layout=w.Layout(width="115px"))
        self._kv_on = w.Checkbox(kv_on, description="KV cache", indent=False, layout=w.Layout(width="90px"))
        self._kv_b = w.BoundedIntText(kv_b, min=1, max=1 << 20, description="batch", layout=w.Layout(width="130px"),
                                      style={"description_width": "40px"})
        self._kv_s = w.BoundedIntText(kv_s, min=1, max=1 << 24, description="length", layout=w.Layout(width="150px"),
                                      style={"description_width": "45px"})
        for control in (self._optimizer, self._kv_on, self._kv_b, self._kv_s):
            control.observe(lambda _: self._on_memory_options(), names="value")
        self._task = w.Dropdown(options=ledgers.TASKS, value=task, description="step", layout=w.Layout(
            width="150px"), style={"description_width": "35px"})
        self._optimizer_name = w.Dropdown(options=OPTIMIZERS, value="adamw", description="optimizer",
                                          layout=w.Layout(width="170px"), style={"description_width": "62px"})
        remat = self.layout.remat or getattr(self.model, "remat", "none")
        self._remat = w.Dropdown(options=ledgers.REMATS, value=remat if remat in ledgers.REMATS else "none",
                                 description="remat", layout=w.Layout(width="170px"),
                                 style={"description_width": "40px"})
        self._ledger_out = w.HTML()
        self._ledger_out.add_class("wb-ledger-html")
        self._predicted_out = w.HTML()
        self._predicted_out.add_class("wb-predicted-step-html")
        self._step_out = w.HTML()
        self._step_out.add_class("wb-step-time-html")
        if self.cluster is not None:
            self._mesh_choice = w.Combobox(options=mesh_options(self.cluster), value=mesh_label(dict(self.mesh.shape)),
                                           ensure_option=True, continuous_update=False, description="mesh",
                                           placeholder="type e.g. tp=8", layout=w.Layout(width="330px"),
                                           style={"description_width": "38px"})
            self._mesh_choice.add_class("wb-mesh-choice")
            self._mesh_choice.observe(self._on_mesh_choice, names="value")
        self._chart = w.Output(layout=w.Layout(width=f"{_CHART_PX}px", min_height="300px"))
        self._chart.add_class("wb-memory-chart")
        self._diff = w.HTML()
        self._filter = w.Text(placeholder="filter paths (regex)", layout=w.Layout(width="300px"))
        self._filter.observe(lambda _: self._render_table(), names="value")
        self._table = w.HTML()
        self._table.add_class("wb-explorer-table-html")
        self._kind = w.ToggleButtons(options=explore.STEP_KINDS, value="forward", style={"button_width": "70px"})
        self._batch_b = w.BoundedIntText(batch[0], min=1, max=1 << 24, description="B", layout=w.Layout(width="100px"),
                                         style={"description_width": "15px"})
        self._batch_t = w.BoundedIntText(batch[1], min=1, max=1 << 20, description="T", layout=w.Layout(width="110px"),
                                         style={"description_width": "15px"})
        self._attention = w.Dropdown(options=_attention_options(self.model), description="attention",
                                     layout=w.Layout(width="210px"), style={"description_width": "60px"},
                                     tooltip="the attention the compiled step runs: ring, ulysses and allgather_kv "
                                             "split the sequence over sp")
        self._collectives_button = go = w.Button(description="collectives", icon="exchange", button_style="info")
        go.add_class("wb-collectives-button")
        go.on_click(lambda _: self.compute_collectives())
        self._collectives_out = w.HTML('<div style="font-size:12px;color:#666">press "collectives" to compile one '
                                       "step from abstract inputs and list what XLA inserted</div>")
        self._apply_button = apply = w.Button(
            description="apply", icon="check", button_style="primary", disabled=not self._live,
            tooltip="re-shard the model as the table says" if self._live else "an abstract model: no arrays to place")
        apply.add_class("wb-apply-button")
        apply.on_click(lambda _: self.apply())
        self._apply_status = w.HTML()
        self._export_shown = False
        self._export_button = export = w.Button(description="export", icon="code",
                                                tooltip="the layout as Python to paste into a script, and as JSON")
        export.add_class("wb-export-button")
        export.on_click(lambda _: self.show_export())
        self._export_out = w.HTML()
        self._export_out.add_class("wb-export-html")
        self._load_text = w.Textarea(placeholder="paste a layout's JSON (Layout.to_json()) and press load",
                                     layout=w.Layout(width="420px", height="32px"))
        self._load_text.add_class("wb-load-json")
        self._load_button = load = w.Button(description="load", icon="upload", tooltip="switch to the pasted layout")
        load.add_class("wb-load-button")
        load.on_click(lambda _: self._load_pasted())
        self._experts = ExpertsPanel(self._expert_summary, self._guard, self._on_experts)
        self._capacity, self._experts_out = self._experts.capacity, self._experts.out
        section = lambda text: w.HTML(f'<div style="font-weight:600;margin-top:6px">{text}</div>')
        moe = getattr(self.layout.config, "num_local_experts", 0) > 0
        experts = [section("expert parallelism (MoE layers)"), self._experts.widget] if moe else []
        if self.cluster is None:
            memory = w.VBox([w.HBox([self._optimizer, self._kv_on, self._kv_b, self._kv_s]), self._chart],
                            layout=w.Layout(flex=f"1 1 {_CHART_PX}px"))
            # the batch sizes the default pipeline of a pp mesh: a shown export follows it
            self._batch_b.observe(lambda _: self._export_shown and self.show_export(), names="value")
            step_controls = [self._kind, self._batch_b, self._batch_t, self._attention, go]
            step_outputs = [self._collectives_out]
        else:
            for control in (self._task, self._optimizer_name, self._remat, self._batch_b, self._batch_t, self._kind,
                            self._attention):
                control.observe(lambda _: self._render(), names="value")
            memory = w.VBox([self._mesh_choice, w.HBox([self._task, self._batch_b, self._batch_t]),
                             w.HBox([self._optimizer_name, self._remat]), self._ledger_out,
                             w.HTML('<div style="font-weight:600;margin-top:6px">predicted step from the shapes '
                                    "(no compile)</div>"), self._predicted_out],
                            layout=w.Layout(flex=f"1 1 {STEP_ROW_PX}px"))
            step_controls = [self._kind, self._attention, go]
            step_outputs = [self._collectives_out, section("predicted step time on the cluster"), self._step_out]
        self.widget = w.VBox([
            self._title, self._error,
            # the memory column beside the rules, or under them where the two do not fit side by side; it is
            # never narrower than its chart or its bars (a squeezed column cut its text off at the explorer's edge)
            w.HBox([self.editor.widget, memory], layout=w.Layout(flex_flow="row wrap")),
            section("change from the previous layout"), self._diff,
            section("parameters"), self._filter, self._table,
            section("collectives of one step"), w.HBox(step_controls),
            *step_outputs, *experts, w.HBox([apply, self._apply_status]),
            section("export"), w.HBox([export, self._load_text, load]), self._export_out])
        self.widget.add_class("wb-sharding-explorer")

    def set_attention(self, name: str) -> None:
        """The attention implementation "collectives" compiles the step with (the dropdown follows)."""
        self._attention.value = name

    def _render(self, first: bool = False) -> None:
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

    def _step_key(self) -> tuple:
        """What a compiled step was compiled for: when any of it changes, its panels are stale."""
        return (self.layout, self._kind.value, self._attention.value, self._optimizer_name.value, self._remat.value,
                self._batch_b.value, self._batch_t.value)

    def predicted_step(self) -> tp.Any:
        """The step the controls describe, timed from the model's shapes on the cluster
        (:func:`workbench.core.cost.predicted.predict_step`): compute, HBM traffic and each collective per layer
        kind, before any compile."""
        batch, kv_length = self._step_batch()
        task = self._task.value
        return predict_step(self.layout.config, self.cluster, dict(self.mesh.shape), batch=batch, task=task,
                            remat=self._remat.value, pipeline=self._pipeline() if task == "train" else None,
                            kv_length=kv_length, zero_stage=self.layout.zero_stage)

    def _render_predicted(self) -> None:
        if self.cluster.chip is None:
            self._predicted_out.value = ('<div style="font-size:12px;color:#555">simulated CPU devices have no chip '
                                         "or network numbers: no step time</div>")
            return
        with self._guard("predicted step", catch=ValueError, clear="own") as failed:
            self._predicted_out.value = step_time_html(self.predicted_step(), top=4)
        if failed:
            self._predicted_out.value = ""

    def _render_ledger(self) -> None:
        self._render_predicted()
        with self._guard("ledger", catch=ValueError, clear="own") as failed:
            led = self.ledger()
        if failed:
            self._ledger_out.value = ""
            return
        compiled, note = None, ""
        analysis = getattr(self.collectives, "analysis", None)
        if analysis is not None and self._compiled_key == self._step_key() and self._task.value == "train" \
                and self._kind.value == "train":
            compiled = analysis.memory.total
            if self.cluster.platform != "tpu":
                note = ("; XLA:CPU's buffer assignment from the worker, which widens bfloat16 math to float32"
                        if np.dtype(getattr(self.model, "dtype", np.float32)) != np.float32 else
                        "; XLA:CPU's buffer assignment from the worker")
            else:
                note = "; XLA:TPU's peak"
        self._ledger_out.value = ledger_html(led, n_devices=self.mesh.size, compiled_total=compiled,
                                             compiled_note=note, tokens=self._tokens_text())

    def _tokens_text(self) -> str:
        """How the step's batch splits over the mesh, with the resolver's reasons (why a split was dropped)."""
        b, t = self._batch_b.value, (1 if self._task.value == "decode" else self._batch_t.value)
        rows, positions = self.layout.partition_axis.explain((BATCH, LENGTH), self.layout.mode, shape=(b, t),
                                                            mesh=self.mesh)
        return f"batch {b} × {t} tokens: rows {rows.reason}; positions {positions.reason}"

    def _on_mesh_choice(self, change: dict[str, tp.Any]) -> None:
        text = change["new"]
        if text not in self._mesh_choice.options or text == mesh_label(dict(self.mesh.shape)):
            return
        self.set_mesh(parse_mesh_label(text))

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
                         suffix=f" (still showing the last valid {'mesh' if what == 'mesh' else 'layout'})") as failed:
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


def memory_figure(memory: ledgers.Ledger, mesh: tp.Any) -> dict[str, tp.Any]:
    """The plotly figure of ``memory`` as a dict (``plotly.graph_objects.Figure(d)`` builds it): one
    stacked bar per device. A plain dict, so an edit re-renders without building a Figure object."""
    unit, scale = next((u, s) for u, s in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))
                       if memory.total >= s or s == 1)
    devices = [str(d.id) for d in np.asarray(mesh.devices).flat] if isinstance(mesh, Mesh) else \
        [str(i) for i in range(mesh.size)]
    data = [{"type": "bar", "name": title, "x": devices, "y": [round(getattr(memory, name) / scale, 3)] * len(devices),
             "marker": {"color": color}, "hovertemplate": f"{title}: {getattr(memory, name):,} B<extra>device %{{x}}"
                                                          "</extra>"}
            for name, title, color in _PARTS]
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc"}
    layout = {"barmode": "stack", "height": 300, "width": _CHART_PX, "margin": {"l": 55, "r": 10, "t": 40, "b": 40},
              "title": {"text": f"memory per device: {format_bytes(memory.total)}", "font": {"size": 13}, "x": 0.02},
              "xaxis": {"title": {"text": "device"}, "type": "category", **axis},
              "yaxis": {"title": {"text": unit}, "rangemode": "tozero", **axis},
              "legend": {"orientation": "h", "y": -0.25, "traceorder": "normal"}, "plot_bgcolor": "white",
              "paper_bgcolor": "white"}
    return {"data": data, "layout": layout, "config": {"displayModeBar": False}}


def _attention_options(model: tp.Any) -> list[str]:
    """The model's own attention, then the sequence-parallel ones (they need an sp axis of size > 1)."""
    own = getattr(model, "attn_mechanism", None)
    if own is None:
        return [""]
    parallel = [n for n in OperationRegistry.list_implementations()
                if "sp" in OperationRegistry.capabilities(n).mesh_axes]
    return [own, *(n for n in parallel if n != own)]


def _cluster_mesh(mesh: tp.Any, cluster: tp.Any) -> tp.Any:
    """The explorer's mesh: as given, or with a cluster the mesh of axis sizes (default all on ``fsdp``)."""
    if cluster is None:
        if mesh is None or isinstance(mesh, tp.Mapping):
            raise ValueError("give a mesh (make_mesh(...)), or cluster=Cluster... with the axis sizes "
                             "({'fsdp': 16, 'tp': 4})")
        return mesh

    if mesh is None:
        valid = cluster.valid_mesh_shapes(len(MESH_AXES))
        full = tuple(cluster.num_devices if a == "fsdp" else 1 for a in MESH_AXES)
        mesh = dict(zip(MESH_AXES, full if full in valid else valid[0], strict=True))
    if isinstance(mesh, tp.Mapping):
        return cluster_mesh(cluster, full_mesh_shape(mesh, cluster), MESH_AXES)
    if mesh.size != cluster.num_devices or tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"the mesh has {mesh.size} devices on axes {tuple(mesh.axis_names)}; {cluster.name} has "
                         f"{cluster.num_devices}: pass the axis sizes ({{'fsdp': ..., 'tp': ...}}) or "
                         f"cluster_mesh(cluster, ...)")
    return mesh


def _pipelined(partition_axis: PartitionAxis | None, mesh: tp.Any) -> PartitionAxis | None:
    """On a mesh with pp > 1 the stacked layers are the pipeline's stages: LAYERS over pp unless a rule says
    otherwise (each device then holds its stages' parameters and optimizer state)."""
    sizes = dict(mesh.shape)
    pa = partition_axis or PartitionAxis()
    if sizes.get("pp", 1) > 1 and pa.layer_axis is None:
        return pa.replace(layer_axis="pp")
    return partition_axis
