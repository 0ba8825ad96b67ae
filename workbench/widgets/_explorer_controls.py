"""The ShardingExplorer's controls and panes, built: each builder returns ipywidgets with their sizes and CSS
classes (the browser tests find them by class); the explorer wires their callbacks and lays them out."""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets

from workbench.core.operations import OperationRegistry
from workbench.core.pipeline_schedule import SCHEDULES
from workbench.core.views import explore
from workbench.core.vocab import OPTIMIZERS, REMATS, TASKS
from workbench.widgets._cluster_html import mesh_options

__all__ = ["attention_options", "collectives_controls", "export_controls", "html_pane", "memory_controls",
           "mesh_choice", "plan_controls", "section", "step_controls"]

_W = widgets.Layout


def html_pane(css_class: str, value: str = "") -> widgets.HTML:
    pane = widgets.HTML(value)
    pane.add_class(css_class)
    return pane


def section(text: str) -> widgets.HTML:
    return widgets.HTML(f'<div style="font-weight:600;margin-top:6px">{text}</div>')


def memory_controls(optimizer: bool, kv_on: bool, kv_b: int, kv_s: int) -> tuple[widgets.Widget, ...]:
    """AdamW state, KV cache on/off, its batch and length: what the memory chart and the change summary count."""
    return (widgets.Checkbox(optimizer, description="AdamW state", indent=False, layout=_W(width="115px")),
            widgets.Checkbox(kv_on, description="KV cache", indent=False, layout=_W(width="90px")),
            widgets.BoundedIntText(kv_b, min=1, max=1 << 20, description="batch", layout=_W(width="130px"),
                                   style={"description_width": "40px"}),
            widgets.BoundedIntText(kv_s, min=1, max=1 << 24, description="length", layout=_W(width="150px"),
                                   style={"description_width": "45px"}))


def step_controls(task: str, remat: str, batch: tuple[int, int]) -> tuple[widgets.Widget, ...]:
    """``(task, optimizer, remat, B, T, kind)``: the step the ledger counts, the predicted step times and
    "collectives" compiles (``kind``: forward or train)."""
    return (widgets.Dropdown(options=TASKS, value=task, description="step", layout=_W(width="150px"),
                             style={"description_width": "35px"}),
            widgets.Dropdown(options=OPTIMIZERS, value="adamw", description="optimizer", layout=_W(width="170px"),
                             style={"description_width": "62px"}),
            widgets.Dropdown(options=REMATS, value=remat if remat in REMATS else "none",
                             description="remat", layout=_W(width="170px"), style={"description_width": "40px"}),
            widgets.BoundedIntText(batch[0], min=1, max=1 << 24, description="B", layout=_W(width="100px"),
                                   style={"description_width": "15px"}),
            widgets.BoundedIntText(batch[1], min=1, max=1 << 20, description="T", layout=_W(width="110px"),
                                   style={"description_width": "15px"}),
            widgets.ToggleButtons(options=explore.STEP_KINDS, value="forward", style={"button_width": "70px"}))


def plan_controls() -> tuple[widgets.Widget, ...]:
    """``(microbatches, ZeRO-1, schedule, pipeline microbatches, virtual stages)``: what a train step runs beside
    its remat policy (gradient accumulation, the optimizer state over dp, a pp mesh's pipeline); the explorer
    seeds them from its layout."""
    accumulation = widgets.BoundedIntText(1, min=1, max=1 << 20, description="microbatches",
                                          layout=_W(width="190px"), style={"description_width": "initial"},
                                          tooltip="gradient accumulation: microbatches a train step runs one after "
                                                  "another, summing their gradients (a count that divides B)")
    accumulation.add_class("wb-accumulation")
    zero = widgets.Checkbox(False, description="ZeRO-1 (optimizer state over dp)", indent=False,
                            layout=_W(width="250px"))
    zero.add_class("wb-zero")
    schedule = widgets.Dropdown(options=SCHEDULES, value="1f1b", description="pipeline", layout=_W(width="190px"),
                                style={"description_width": "55px"})
    schedule.add_class("wb-pipeline-schedule")
    pipe_m = widgets.BoundedIntText(1, min=1, max=1 << 20, description="m", layout=_W(width="110px"),
                                    style={"description_width": "15px"}, tooltip="the pipeline's microbatches")
    pipe_m.add_class("wb-pipeline-microbatches")
    virtual = widgets.BoundedIntText(2, min=2, max=64, description="v", layout=_W(width="100px"),
                                     style={"description_width": "15px"},
                                     tooltip="stages per device of the interleaved schedule")
    virtual.add_class("wb-pipeline-virtual")
    return accumulation, zero, schedule, pipe_m, virtual


def mesh_choice(cluster: tp.Any, value: str) -> widgets.Combobox:
    """The cluster's valid mesh shapes as labels (``fsdp=16 × tp=4``), typed or picked."""
    choice = widgets.Combobox(options=mesh_options(cluster), value=value, ensure_option=True,
                              continuous_update=False, description="mesh", placeholder="type e.g. tp=8",
                              layout=_W(width="330px"), style={"description_width": "38px"})
    choice.add_class("wb-mesh-choice")
    return choice


def attention_options(model: tp.Any) -> list[str]:
    """The model's own attention, then the sequence-parallel ones (they need an sp axis of size > 1)."""
    own = getattr(model, "attn_mechanism", None)
    if own is None:
        return [""]
    parallel = [n for n in OperationRegistry.list_implementations()
                if "sp" in OperationRegistry.capabilities(n).mesh_axes]
    return [own, *(n for n in parallel if n != own)]


def collectives_controls(model: tp.Any, live: bool) -> tuple[widgets.Widget, ...]:
    """``(attention, collectives button, its pane, apply button)``."""
    attention = widgets.Dropdown(options=attention_options(model), description="attention", layout=_W(width="210px"),
                                 style={"description_width": "60px"},
                                 tooltip="the attention the compiled step runs: ring, ulysses and allgather_kv "
                                         "split the sequence over sp")
    go = widgets.Button(description="collectives", icon="exchange", button_style="info")
    go.add_class("wb-collectives-button")
    out = widgets.HTML('<div style="font-size:12px;color:#666">press "collectives" to compile one step from '
                       "abstract inputs and list what XLA inserted</div>")
    apply = widgets.Button(description="apply", icon="check", button_style="primary", disabled=not live,
                           tooltip="re-shard the model as the table says" if live else
                           "an abstract model: no arrays to place")
    apply.add_class("wb-apply-button")
    return attention, go, out, apply


def export_controls() -> tuple[widgets.Widget, ...]:
    """``(export button, its pane, the JSON box, load button)``."""
    export = widgets.Button(description="export", icon="code",
                            tooltip="the layout as Python to paste into a script, and as JSON")
    export.add_class("wb-export-button")
    text = widgets.Textarea(placeholder="paste a layout's JSON (Layout.to_json()) and press load",
                            layout=_W(width="420px", height="32px"))
    text.add_class("wb-load-json")
    load = widgets.Button(description="load", icon="upload", tooltip="switch to the pasted layout")
    load.add_class("wb-load-button")
    return export, html_pane("wb-export-html"), text, load
