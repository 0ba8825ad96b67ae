"""``PipelineView``: a pipeline schedule's timeline, bubble and activation memory, with controls for stages,
microbatches and schedule that re-draw at once; on request, the ppermutes of the compiled step."""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets

from workbench.core.compile.steps import abstract_step
from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh
from workbench.core.pipeline_schedule import SCHEDULES, PipelineConfig, pipeline_schedule
from workbench.core.tables import html_table
from workbench.core.units import format_bytes
from workbench.widgets._errors import InlineError
from workbench.widgets._html import escape
from workbench.widgets._pipeline_html import schedule_html

__all__ = ["PipelineView", "collectives_html", "schedule_html"]


class PipelineView(InlineError):
    """Controls (stages, microbatches, schedule, stages per device) over :func:`pipeline_schedule`'s table.

    With ``model`` and ``batch_shape=(B, T)`` the memory line is in bytes (one microbatch's hidden states) and
    "compile" lists the collectives of the pipelined train step on a ``pp`` mesh of ``num_stages`` devices
    (the rest on fsdp). ``view.schedule`` is the table drawn; ``view.error`` the inline error ('' when none).
    """

    def __init__(self, num_stages: int = 4, num_microbatches: int = 8, schedule: str = "1f1b", *,
                 virtual_stages: int | None = None, model: tp.Any = None, batch_shape: tuple[int, int] = (16, 32)):
        self.model, self.batch_shape = model, batch_shape
        style = {"description_width": "90px"}
        self.stages = widgets.Dropdown(options=[1, 2, 4, 8], value=num_stages, description="stages (p)", style=style)
        self.microbatches = widgets.Dropdown(options=[1, 2, 4, 8, 16, 32], value=num_microbatches,
                                             description="microbatches", style=style)
        self.schedule_control = widgets.ToggleButtons(options=list(SCHEDULES), value=schedule,
                                                      description="schedule", style=style)
        self.virtual = widgets.Dropdown(options=[2, 3, 4], value=virtual_stages or 2, description="stages/device",
                                        style=style)
        self.timeline = widgets.HTML()
        self.compile_button = widgets.Button(description="compile", icon="cogs", button_style="info",
                                             disabled=model is None,
                                             tooltip="compile the pipelined train step and list its collectives")
        self.compile_button.add_class("wb-pipeline-compile")
        self.collectives = widgets.HTML("" if model is not None else
                                        '<div style="font-size:12px;color:#666">pass model= to compile the step '
                                        "and see its ppermutes</div>")
        self.compile_button.on_click(lambda _: self.compile())
        for control in (self.stages, self.microbatches, self.schedule_control, self.virtual):
            control.observe(lambda _: self.redraw(), names="value")
        self.schedule = None
        self.widget = widgets.VBox([
            widgets.HBox([self.stages, self.microbatches, self.virtual]), self.schedule_control, self._error_area(),
            self.timeline, widgets.HBox([self.compile_button]), self.collectives])
        self.redraw()

    @property
    def config(self) -> PipelineConfig:
        interleaved = self.schedule_control.value == "interleaved"
        return PipelineConfig(self.stages.value, self.microbatches.value, self.schedule_control.value,
                              self.virtual.value if interleaved else None)

    def _microbatch_bytes(self) -> int | None:
        if self.model is None:
            return None
        b, t = self.batch_shape
        return b // self.microbatches.value * t * self.model.config.hidden_size * 4

    def redraw(self) -> bool:
        """Re-draw from the controls; a bad combination shows why inline (and keeps the controls working)."""
        self.virtual.layout.display = None if self.schedule_control.value == "interleaved" else "none"
        with self._guard(clear=True) as failed:
            self.schedule = pipeline_schedule(self.config)
            self.timeline.value = schedule_html(self.schedule, microbatch_bytes=self._microbatch_bytes())
        if failed:
            self.schedule, self.timeline.value = None, ""
        return not failed

    def compile(self) -> bool:
        """Compile the pipelined train step of ``model`` and list its collectives (from the HLO)."""
        self.collectives.value = '<div style="font-size:12px;color:#555">compiling…</div>'
        with self._guard("compile", clear=True) as failed:
            self.collectives.value = collectives_html(self.model, self.config, self.batch_shape)
        if failed:
            self.collectives.value = ""
        return not failed

    def _repr_mimebundle_(self, **kwargs: tp.Any) -> dict[str, tp.Any]:
        return self.widget._repr_mimebundle_(**kwargs)

    def _repr_html_(self) -> str:
        return self._error_html() + self.timeline.value


def collectives_html(model: tp.Any, config: PipelineConfig, batch_shape: tuple[int, int]) -> str:
    """The collectives XLA put in the pipelined train step (loss, gradients and the AdamW update:
    :func:`workbench.core.compile.steps.abstract_step`) of ``model``, compiled from abstract arguments."""
    mesh = make_mesh(pp=config.num_stages, fsdp=-1)
    step = abstract_step(model, mesh, kind="train", batch=batch_shape, pipeline=config)
    found = collectives(step.jit(), *step.args, mesh=mesh)
    rows = [(c.kind, ",".join(c.mesh_axes or ()) or "-", c.shape, format_bytes(c.bytes), c.trips)
            for c in found]
    return (f'<div style="font-size:12px">the compiled step on {escape(dict(mesh.shape))}: {len(found)} '
            f"collectives</div>" + html_table(rows, header=("kind", "mesh axes", "shape", "bytes/device", "runs")))
