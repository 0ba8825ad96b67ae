"""Small HTML helpers shared by the views: device colours, tables, error lines, byte counts.

Everything that comes from data is escaped. Styles are inline, so a static export (``_repr_html_``
stored in a notebook) looks the same without any stylesheet.
"""

from __future__ import annotations

import colorsys
import html
import typing as tp

from workbench.core.tables import cell_style

__all__ = ["CELL", "device_background", "device_color", "device_colors", "error_html", "escape", "ids_text",
           "typed_html"]

_GOLDEN = 0.618033988749895
TEXT_COLOR = "#1b1b1b"
CELL = cell_style("2px 6px")  # a cell of the widgets' tables (html_table's cell=), denser than the core reprs'


def escape(value: tp.Any) -> str:
    return html.escape(str(value), quote=True)


def device_color(device_id: int) -> str:
    """A light colour for device ``device_id``; the same id gets the same colour in every view.

    Hues step by the golden ratio, so neighbouring ids differ clearly whatever the device count.
    """
    hue = (int(device_id) * _GOLDEN) % 1.0
    lightness = 0.78 if int(device_id) % 2 == 0 else 0.70
    r, g, b = colorsys.hls_to_rgb(hue, lightness, 0.70)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def device_colors(n: int) -> list[str]:
    """The colours of devices ``0 .. n-1``."""
    return [device_color(i) for i in range(n)]


def device_background(device_ids: tp.Sequence[int]) -> str:
    """CSS background for a block held by ``device_ids``: one colour, or diagonal stripes of each holder's."""
    colors = [device_color(d) for d in device_ids]
    if len(colors) == 1:
        return colors[0]
    stops = ", ".join(f"{c} {8 * i}px {8 * (i + 1)}px" for i, c in enumerate(colors))
    return f"repeating-linear-gradient(135deg, {stops})"


def ids_text(device_ids: tp.Sequence[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0–3,6"``: runs of consecutive ids shortened."""
    ids = sorted(int(d) for d in device_ids)
    parts: list[str] = []
    start = prev = None
    for d in [*ids, None]:
        if d is not None and prev is not None and d == prev + 1:
            prev = d
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start},{prev}" if prev == start + 1
                         else f"{start}–{prev}")
        start = prev = d
    return ",".join(parts)


def error_html(message: str) -> str:
    """One inline error line (class ``wb-error``); an empty message gives an empty string."""
    if not message:
        return ""
    return (f'<div class="wb-error" style="color:#b00020;background:#fdecee;border-left:3px solid #b00020;'
            f'padding:4px 8px;margin:4px 0;font-size:12px;white-space:pre-wrap">⚠ {escape(message)}</div>')


def typed_html(typed: str, on_mesh: str | None = None) -> str:
    """An array's type on Explicit axes (``float32[8@dp,4@tp]``, :func:`~workbench.core.sharding.blocks.typed_notation`)
    in code font, class ``wb-typed``, the text in ``data-typed``.

    ``on_mesh``: what ``jax.typeof`` prints on the array's own mesh. Where Auto axes keep the sharding
    out of it, the type is marked "if Explicit" and the tooltip gives what ``jax.typeof`` shows there.
    """
    same = on_mesh is None or on_mesh == typed
    tip = ("str(jax.typeof(x)) on this mesh" if same else
           f"the type on Explicit axes; on this mesh's Auto axes jax.typeof(x) shows {on_mesh}")
    note = "" if same else '<span class="wb-typed-note" style="color:#777;font-size:11px"> if Explicit</span>'
    return (f'<code class="wb-typed" data-typed="{escape(typed)}" title="{escape(tip)}" '
            f'style="font-size:12px;white-space:nowrap">{escape(typed)}</code>{note}')
