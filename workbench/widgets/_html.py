"""Small HTML helpers shared by the views: device colours, tables, error lines, byte counts.

Everything that comes from data is escaped. Styles are inline, so a static export (``_repr_html_``
stored in a notebook) looks the same without any stylesheet.
"""

from __future__ import annotations

import colorsys
import html
import typing as tp

__all__ = ["device_background", "device_color", "device_colors", "error_html", "escape", "format_bytes",
           "html_table", "ids_text", "typed_html"]

_GOLDEN = 0.618033988749895
TEXT_COLOR = "#1b1b1b"


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


def format_bytes(n: int | float) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.5 KiB"``, ``2**21`` -> ``"2 MiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit == "B" or value == int(value) else f"{value:.3g}"
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top"


def html_table(rows: tp.Iterable[tp.Sequence[tp.Any]], header: tp.Sequence[tp.Any] | None = None,
               css_class: str = "wb-table") -> str:
    """An HTML table of ``rows`` (every value escaped), with an optional header row."""
    head = ""
    if header is not None:
        head = "<thead><tr>" + "".join(f'<th style="{_CELL};font-weight:600">{escape(h)}</th>'
                                       for h in header) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{escape(v)}</td>' for v in row) + "</tr>"
                   for row in rows)
    return (f'<table class="{escape(css_class)}" style="border-collapse:collapse;font-size:12px">'
            f"{head}<tbody>{body}</tbody></table>")


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
