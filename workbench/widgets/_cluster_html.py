"""The explorer's virtual-cluster panels: mesh shapes the cluster offers, the memory ledger against HBM, the
predicted step time.

Plain HTML with inline styles (no plotting library), so a saved notebook shows the same picture without a
kernel, and the browser can read every number.
"""

from __future__ import annotations

import typing as tp

from workbench.core.interop.out_of_sample import accuracy_text
from workbench.core.mesh import MESH_AXES
from workbench.core.tables import Row, cell_style, html_table
from workbench.core.units import format_bytes, format_seconds
from workbench.widgets._html import escape

__all__ = ["LEDGER_PARTS", "STEP_ROW_PX", "collective_seconds", "ledger_html", "mesh_label", "mesh_options",
           "parse_mesh_label", "step_time_html"]

LEDGER_PARTS = (("params", "parameters", "#4c78a8"), ("grads", "gradients", "#9ecae9"),
                ("optimizer", "optimizer state", "#f58518"), ("activations", "activations kept for the backward",
                                                               "#e45756"),
                ("kv_cache", "KV cache", "#54a24b"), ("temporaries", "temporaries", "#b279a2"),
                ("inputs", "token ids", "#9d755d"))
_PHASES = (("compute", "#4c78a8"), ("memory", "#72b7b2"))
_LEVEL_COLORS = ("#f58518", "#e45756", "#b279a2", "#9d755d")
_BAR_PX, _STEP_LABEL_PX = 520, 150
# the width step_time_html's bar rows need (label, bar, gaps, the time beside it): a column narrower than this cuts
# their text off
STEP_ROW_PX = _STEP_LABEL_PX + _BAR_PX + 2 * 6 + 70
_STEP_CELL = cell_style("1px 6px")  # the step panel's tables: a line each, tighter than the explorer's


# -- mesh shapes ---------------------------------------------------------------------------------------------
def mesh_label(sizes: tp.Mapping[str, int] | tp.Sequence[int]) -> str:
    """``{"fsdp": 16, "tp": 4}`` (or the six sizes in ``MESH_AXES`` order) -> ``"fsdp=16 × tp=4"``."""
    if not isinstance(sizes, tp.Mapping):
        sizes = dict(zip(MESH_AXES, sizes, strict=True))
    parts = [f"{a}={int(sizes[a])}" for a in MESH_AXES if int(sizes.get(a, 1)) > 1]
    return " × ".join(parts) or "one device"


def parse_mesh_label(text: str) -> dict[str, int]:
    """The inverse of :func:`mesh_label`; a ValueError that shows the form when ``text`` is not one."""
    text = text.strip()
    if text == "one device":
        return {}
    sizes: dict[str, int] = {}
    for part in text.replace("×", "x").split(" x "):
        name, _, size = part.strip().partition("=")
        if name not in MESH_AXES or not size.strip().isdigit() or name in sizes:
            raise ValueError(f"mesh {text!r}: write axes as 'fsdp=16 × tp=4', each one of {MESH_AXES} once")
        sizes[name] = int(size)
    return sizes


def mesh_options(cluster: tp.Any) -> list[str]:
    """Every logical shape of the workbench's six mesh axes that maps onto ``cluster``
    (:meth:`~workbench.core.hardware.cluster.Cluster.valid_mesh_shapes`), as labels: fewest split axes first."""
    shapes = cluster.valid_mesh_shapes(len(MESH_AXES))
    ordered = sorted(shapes, key=lambda s: (sum(n > 1 for n in s), [-n for n in s]))
    return [mesh_label(s) for s in ordered]


# -- the ledger --------------------------------------------------------------------------------------------
def _bar(segments: tp.Sequence[tuple[str, str, float, str]], scale: float, width_px: int, height: int = 18) -> str:
    """A horizontal stacked bar: ``(css class, colour, value, hover title)`` segments, ``scale`` value per bar."""
    cells = []
    for css, color, value, title in segments:
        w = width_px * value / scale if scale else 0
        if w > 0:
            cells.append(f'<div class="{css}" title="{escape(title)}" style="width:{w:.1f}px;height:{height}px;'
                         f'background:{color};flex:none"></div>')
    return "".join(cells)


def ledger_html(ledger: tp.Any, *, n_devices: int, compiled_total: int | None = None, compiled_note: str = "",
                tokens: str = "", width_px: int = _BAR_PX, program: str = "") -> str:
    """The ledger's parts per device as one stacked bar against the device's HBM (a red line), the verdict
    (fits, or by how much it does not), ``tokens`` (how the batch splits: a line of text), the ``program`` counted
    (``plan.program_text``) and what it keeps in host memory, and, once a step is compiled, XLA's total beside the
    prediction."""
    hbm = ledger.hbm_per_device
    parts = [(name, title, color, getattr(ledger, name)) for name, title, color in LEDGER_PARTS]
    scale = max(ledger.total, hbm or 0, compiled_total or 0, 1) * 1.05
    bar = _bar([(f"wb-ledger-part wb-ledger-{name}", color, value, f"{title}: {format_bytes(value)} ({value:,} B)")
                for name, title, color, value in parts], scale, width_px)
    rows = [f'<div style="display:flex;align-items:center;gap:6px"><div style="width:78px">predicted</div>'
            f'<div style="display:flex;position:relative;width:{width_px}px;border-left:1px solid #999">{bar}'
            + (f'<div class="wb-hbm-line" title="HBM per device {format_bytes(hbm)}" style="position:absolute;'
               f'left:{width_px * hbm / scale:.1f}px;top:-3px;height:24px;border-left:2px dashed #b00020"></div>'
               if hbm else "") + "</div></div>"]
    if compiled_total is not None:
        compiled = _bar([("wb-ledger-compiled", "#8c8c8c", compiled_total, f"compiled: {compiled_total:,} B")],
                        scale, width_px, 10)
        rows.append(f'<div style="display:flex;align-items:center;gap:6px;margin-top:3px"><div style="width:78px">'
                    f'compiled</div><div style="display:flex;width:{width_px}px;border-left:1px solid #999">'
                    f"{compiled}</div></div>")
    if hbm is None:
        verdict = f"{format_bytes(ledger.total)} per device (no HBM: a CPU cluster)"
        color = "#1b1b1b"
    elif ledger.fits:
        verdict = (f"fits: {format_bytes(ledger.total)} of {format_bytes(hbm)} HBM per device, "
                   f"{format_bytes(ledger.headroom)} free ({ledger.total / hbm:.0%} used)")
        color = "#1a7f37"
    else:
        verdict = (f"does not fit: {format_bytes(ledger.total)} per device, {format_bytes(-ledger.headroom)} over "
                   f"the {format_bytes(hbm)} HBM")
        color = "#b00020"
    legend = "".join(f'<span style="margin-right:10px;white-space:nowrap"><span style="display:inline-block;'
                     f'width:10px;height:10px;background:{color_};margin-right:3px"></span>{escape(title)} '
                     f"{escape(format_bytes(value))}</span>" for _, title, color_, value in parts if value)
    versus = ""
    if compiled_total is not None:
        versus = (f'<div class="wb-ledger-versus">compiled step: {escape(format_bytes(compiled_total))} per device '
                  f"(ledger {ledger.total / compiled_total - 1:+.1%}){escape(compiled_note)}</div>")
    what = f"{ledger.kind} step, remat={ledger.remat}, each of {n_devices} devices"
    return (f'<div class="wb-ledger" style="font-size:12px"><div style="font-weight:600">memory ledger · '
            f"{escape(what)}</div>"
            f'<div class="wb-ledger-verdict" style="color:{color};margin:2px 0">{escape(verdict)}</div>'
            f'{"".join(rows)}<div style="margin-top:4px;line-height:1.7">{legend}</div>'
            + (f'<div class="wb-ledger-tokens" style="color:#555">{escape(tokens)}</div>' if tokens else "")
            + (f'<div class="wb-ledger-program" style="color:#555">counted for {escape(program)}'
               + (f"; {escape(format_bytes(ledger.host))} of saved activations in host memory" if ledger.host else "")
               + "</div>" if program else "")
            + f"{versus}</div>")


# -- the step time -----------------------------------------------------------------------------------------
def step_time_html(st: tp.Any, *, width_px: int = _BAR_PX, top: int = 8) -> str:
    """A :class:`~workbench.core.cost.step.StepTime` as bars: compute, HBM traffic and communication per network
    level (each on the same scale; with overlap the step takes the longest), the bounding resource, MFU and HFU, XLA's
    own estimate where there is one, and the longest collective groups."""
    levels = [(level, s) for level, s in st.by_level().items() if s > 0]
    phases = [(name, color, getattr(st, f"{name}_s")) for name, color in _PHASES]
    phases += [(f"communication ({level})", _LEVEL_COLORS[i % len(_LEVEL_COLORS)], s)
               for i, (level, s) in enumerate(levels)]
    scale = max([st.time_s, *(s for _, _, s in phases), 1e-12]) * 1.05
    rows = "".join(f'<div class="wb-step-phase" data-phase="{escape(name)}" style="display:flex;align-items:center;'
                   f'gap:6px"><div style="width:{_STEP_LABEL_PX}px">{escape(name)}</div>'
                   f'<div style="display:flex;width:{width_px}px">'
                   f'{_bar([("wb-step-bar", color, s, f"{name}: {format_seconds(s)}")], scale, width_px, 12)}</div>'
                   f"<div>{escape(format_seconds(s))}</div></div>" for name, color, s in phases)
    if st.measured_model:
        moe = any(p.kind == "experts" and p.flops for p in st.parts)  # any MoE: the step does not know its experts
        how = ("the step is the sum of its terms: " + ", ".join(f"{t.name} {format_seconds(t.seconds)}"
                                                                for t in st.terms if t.seconds)
               + f". How true: {accuracy_text(st.cluster.chip, moe=moe)}")
    else:
        how = "the parts overlap: the step takes the longest" if st.overlap else "the parts run one after another"
    xla = (f" · XLA's own estimate {format_seconds(st.xla_seconds)} (counts a loop body once: about one layer)"
           if st.xla_seconds is not None else "")
    head = (f'<div class="wb-step-total" style="font-weight:600">predicted step: {escape(format_seconds(st.time_s))}, '
            f"{escape(st.bound)}-bound · {escape(st.utilisation())}"
            f"</div><div style='color:#555'>{escape(how)}{escape(xla)}</div>")
    kinds = ""
    if st.parts:
        rows_ = []
        for kind, v in st.by_kind().items():
            parts = {"compute": v["compute_s"], "memory": v["memory_s"], "communication": v["comm_s"]}
            rows_.append(Row([kind, *map(format_seconds, parts.values()), max(parts, key=parts.get)],
                             {"class": "wb-step-kind"}))
        kinds = html_table(rows_, ("layer kind", "compute", "HBM traffic", "communication", "bound by"),
                           css_class=None, cell=_STEP_CELL, head=_STEP_CELL,
                           style="border-collapse:collapse;margin-top:4px")
    groups = st.rows()[:top]
    table = ""
    if groups:
        body = [(k, ",".join(a) or "-", lv, b, runs, format_bytes(nb), format_seconds(t))
                for k, a, lv, b, runs, nb, t in groups]
        table = (f"<div style='margin-top:4px;color:#555'>longest collectives ({len(groups)} of "
                 f"{len(st.rows())} groups)</div>"
                 + html_table(body, ("collective", "mesh axes", "network", "bound by", "runs", "bytes/device", "time"),
                              css_class=None, cell=_STEP_CELL, head=_STEP_CELL, style="border-collapse:collapse"))
    return f'<div class="wb-step-time" style="font-size:12px">{head}{rows}{kinds}{table}</div>'


def collective_seconds(st: tp.Any) -> dict[tuple[str, tuple[str, ...]], float]:
    """Predicted seconds per step of each (kind, mesh axes) group (what the collectives table lists)."""
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in st.collectives:
        out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0.0) + c.total_s
    return out
