"""The ShardingExplorer on a virtual cluster: the cluster picker, the mesh choice, the memory ledger of one step
against HBM, the step predicted from the shapes, and what a compiled step adds to them.

A mixin of :class:`~workbench.widgets.sharding_explorer.ShardingExplorer` (it reads the explorer's layout, with the
plan its controls set: :meth:`~workbench.widgets._explorer_plan.PlanControls.exported_layout`): the numbers come
from :mod:`workbench.core.views.explore_step`, the pictures from :mod:`workbench.widgets._cluster_html`.
"""

from __future__ import annotations

import typing as tp

import numpy as np

from workbench.core.cost import ledger as ledgers
from workbench.core.plan import Plan, microbatch, program_text
from workbench.core.views.explore_step import (
    batch_split,
    compiled_step_time,
    explorer_mesh,
    pipelined,
    predicted_step,
    step_ledger,
)
from workbench.widgets._cluster_html import ledger_html, mesh_label, mesh_options, parse_mesh_label, step_time_html
from workbench.widgets._cluster_picker import cluster_label, picked_cluster, show_cluster

__all__ = ["ClusterPanels"]


class ClusterPanels:
    """The explorer's cluster panels (``_ledger_out``, ``_predicted_out``, ``_mesh_choice``), drawn by
    :meth:`_render_ledger` on every edit, and the cluster picker (``_cluster_choice``: :meth:`set_cluster`)."""

    layout: tp.Any
    cluster: tp.Any
    model: tp.Any
    program: dict[str, tp.Any]
    collectives: tp.Any
    _compiled_key: tuple | None

    def ledger(self) -> ledgers.Ledger:
        """The memory ledger of one step as the controls say (task, optimizer, batch and the plan: remat,
        accumulation, ZeRO stage, a ``pp`` mesh's pipeline), against the cluster's HBM
        (:func:`~workbench.core.views.explore_step.step_ledger`)."""
        return step_ledger(self.model, self.exported_layout(), self.cluster, task=self._task.value,
                           batch=self._batch(), optimizer=self._optimizer_name.value, program=self.program)

    def _step_key(self) -> tuple:
        """What a compiled step was compiled for: when any of it changes, its panels are stale."""
        return (self.layout, self._kind.value, self._attention.value, self._optimizer_name.value,
                self._batch_b.value, self._batch_t.value, *self._plan_values())

    def _compiled_batch(self, layout: tp.Any) -> tuple[int, int]:
        """What a step compiled for the cluster runs: a train step one of ``layout``'s accumulated microbatches (the
        ledger holds one, :func:`~workbench.core.plan.microbatch`), else the controls' ``(B, T)``."""
        if self.cluster is not None and self._kind.value == "train":
            return microbatch(self._batch(), layout.grad_accumulation)
        return self._batch()

    def _compiled_step_time(self, analysis: tp.Any) -> tp.Any:
        """The step just compiled on the cluster, timed on its network (None, saying why, on simulated CPUs)."""
        if self.cluster.platform == "cpu":
            self._step_out.value = ('<div style="font-size:12px;color:#555">simulated CPU devices have no chip or '
                                    "network numbers: no step time (use Cluster.tpu(...) or Cluster.h100(...))</div>")
            return None
        return compiled_step_time(analysis, self.layout, self.cluster, kind=self._kind.value,
                                  batch=self.collectives.batch)

    def predicted_step(self) -> tp.Any:
        """The step the controls describe, run as :meth:`plan` says, timed from the model's shapes on the cluster
        (:func:`workbench.core.cost.price.price`): compute, HBM traffic and each collective per layer kind, before
        any compile."""
        return predicted_step(self.exported_layout(), self.cluster, task=self._task.value, batch=self._batch())

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
            layout = self.exported_layout()
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
            k = layout.grad_accumulation
            note += f" of one of its {k} microbatches; the ledger adds the gradients' sum" if k > 1 else ""
            if self.program != Plan({}).program():
                note += (f"; compiled as the workbench's own program ({program_text(Plan({}).program())}), not the "
                         f"one the ledger counts")
        self._ledger_out.value = ledger_html(led, n_devices=self.layout.mesh.size, compiled_total=compiled,
                                             compiled_note=note, program=program_text(self.program),
                                             tokens=batch_split(layout, self._task.value, self._batch()))

    def _on_mesh_choice(self, change: dict[str, tp.Any]) -> None:
        text = change["new"]
        if text not in self._mesh_choice.options or text == mesh_label(dict(self.layout.mesh.shape)):
            return
        self.set_mesh(parse_mesh_label(text))

    def set_cluster(self, cluster: tp.Any) -> bool:
        """Lay the same rules on another cluster (a Cluster, or a picker's label: a preset's) with every device on
        ``fsdp``: the mesh choice offers its shapes, the ledger and the predicted step follow, and a compiled step
        is marked stale, as after a mesh change. False with the error inline when it does not lay out (the last
        cluster and layout stay)."""
        old = self.cluster
        if old is None:
            self._show_error("cluster: this explorer has no cluster to change: open it with cluster=Cluster...")
            return False

        def build() -> tp.Any:
            new = picked_cluster(cluster, self._clusters)
            mesh = explorer_mesh(None, new)
            layout = self.layout.replace(self.model, mesh=mesh, partition_axis=pipelined(self.partition_axis, mesh),
                                         pipeline=None)
            self.cluster = new  # the panels _try draws count on it
            return layout

        ok = self._try(build, what="cluster")
        if ok:
            self._mesh_choice.options = mesh_options(self.cluster)
            self._mesh_choice.value = mesh_label(dict(self.mesh.shape))
        else:
            self.cluster = old
        if self._cluster_choice.value != cluster_label(self.cluster):
            show_cluster(self._cluster_choice, self.cluster)  # its callback sees the cluster shown: no change
        return ok

    def _on_cluster_choice(self, change: dict[str, tp.Any]) -> None:
        if change["new"] != cluster_label(self.cluster):
            self.set_cluster(change["new"])
