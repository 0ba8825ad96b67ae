"""The ShardingExplorer's plan on a cluster: what a train step runs beside its parameters' specs (the remat policy,
gradient accumulation, ZeRO-1 and a ``pp`` mesh's pipeline), held by controls seeded from a layout, shown where the
task and the mesh use them, and read back as the layout the ledger, the predicted step, a compile and the export all
count (:meth:`PlanControls.exported_layout`; its :func:`~workbench.core.views.explore_step.step_plan` is an advisor
row's plan when the explorer was opened from the row).

A mixin of :class:`~workbench.widgets.sharding_explorer.ShardingExplorer`: it reads the explorer's layout, model,
cluster and step controls.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import ipywidgets as widgets

from workbench.core.plan import Plan
from workbench.core.views.explore_step import chosen_pipeline, step_pipeline, step_plan
from workbench.widgets._explorer_controls import plan_controls

__all__ = ["PlanControls"]


class PlanControls:
    """The explorer's plan controls (``_accumulation``, ``_zero``, ``_schedule``, ``_pipe_m``, ``_virtual``, beside
    the step controls' ``_remat``). On a cluster they hold the plan: :meth:`exported_layout` is the explorer's layout
    with their values; without a cluster there is no step to count and the layout's own plan is exported."""

    layout: tp.Any
    model: tp.Any
    cluster: tp.Any
    _syncing = False  # True while the controls are set from a layout: the explorer draws once, after

    def _build_plan(self) -> list[widgets.Widget]:
        """The plan controls, built and seeded from the layout; the rows they sit in (the first for a train step,
        the second for a train step on a ``pp`` mesh)."""
        (self._accumulation, self._zero, self._schedule, self._pipe_m, self._virtual) = plan_controls()
        self._train_row = widgets.HBox([self._accumulation, self._zero])
        self._pipeline_row = widgets.HBox([self._schedule, self._pipe_m, self._virtual])
        self._seed_plan(self.layout)
        return [self._train_row, self._pipeline_row]

    def _seed_plan(self, layout: tp.Any, *, pipeline_only: bool = False) -> None:
        """The controls set to ``layout``'s plan: its remat policy (when it names one), accumulation, ZeRO stage and
        pipeline (on a ``pp`` mesh without one, 1F1B: :func:`~workbench.core.views.explore_step.step_pipeline`);
        with ``pipeline_only`` only the pipeline (a new mesh keeps the rest)."""
        pipeline = step_pipeline(layout, self._batch_b.value)
        self._syncing = True
        try:
            if not pipeline_only:
                if layout.remat is not None:
                    self._remat.value = layout.remat
                self._accumulation.value = layout.grad_accumulation
                self._zero.value = bool(layout.zero_stage)
            if pipeline is not None:
                self._schedule.value = pipeline.schedule
                self._pipe_m.value = pipeline.num_microbatches
                if pipeline.schedule == "interleaved":
                    self._virtual.value = pipeline.virtual_stages
        finally:
            self._syncing = False
        self._show_plan()

    def _show_plan(self) -> None:
        """Only what the step uses shows: accumulation and ZeRO-1 for a train step, the pipeline on a ``pp`` mesh
        too, its virtual stages for the interleaved schedule."""
        train = self._task.value == "train"
        piped = train and dict(self.layout.mesh.shape).get("pp", 1) > 1
        self._train_row.layout.display = None if train else "none"
        self._pipeline_row.layout.display = None if piped else "none"
        self._virtual.layout.display = None if self._schedule.value == "interleaved" else "none"

    def _plan_values(self) -> tuple:
        """The controls' values (what a compiled step was compiled for, with the step controls)."""
        return (self._remat.value, self._accumulation.value, self._zero.value, self._schedule.value,
                self._pipe_m.value, self._virtual.value)

    def exported_layout(self) -> tp.Any:
        """The current layout with the plan the controls set: on a cluster their remat policy, gradient
        accumulation, ZeRO stage and pipeline (a ValueError saying what to change where they make none); without
        one the layout's own, with the pipeline a ``pp > 1`` mesh runs by default (1F1B)."""
        if self.cluster is None:
            return dataclasses.replace(self.layout, pipeline=step_pipeline(self.layout, self._batch_b.value))
        pipeline = chosen_pipeline(self.layout, self._schedule.value, self._pipe_m.value, self._virtual.value)
        return self.layout.replace(self.model, remat=self._remat.value, zero_stage=int(self._zero.value),
                                   grad_accumulation=self._accumulation.value, pipeline=pipeline)

    def plan(self) -> Plan:
        """The :class:`~workbench.core.plan.Plan` of the step the explorer counts and prices
        (:func:`~workbench.core.views.explore_step.step_plan` of :meth:`exported_layout`)."""
        return step_plan(self.exported_layout(), task=self._task.value, batch=self._batch())
