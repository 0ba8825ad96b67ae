"""Tables as HTML: the one helper every view (core ``_repr_html_`` and widgets) draws a table with.

Every value is escaped; styles are inline, so a static export looks the same without a stylesheet.
"""

from __future__ import annotations

import html
import typing as tp


class Html(str):
    """Text that is already HTML (its data escaped by whoever built it): :func:`html_table` puts it in as is."""


_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top"


def html_table(rows: tp.Iterable[tp.Sequence[tp.Any]], header: tp.Sequence[tp.Any] | None = None,
               css_class: str = "wb-table") -> str:
    """An HTML table of ``rows`` (every value escaped but :class:`Html`), with an optional header row."""
    head = ""
    if header is not None:
        head = "<thead><tr>" + "".join(f'<th style="{_CELL};font-weight:600">{_escape(h)}</th>'
                                       for h in header) + "</tr></thead>"
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{_escape(v)}</td>' for v in row) + "</tr>"
                   for row in rows)
    return (f'<table class="{_escape(css_class)}" style="border-collapse:collapse;font-size:12px">'
            f"{head}<tbody>{body}</tbody></table>")


def _escape(value: tp.Any) -> str:
    return value if isinstance(value, Html) else html.escape(str(value))
