"""Tables as HTML: the one helper every view (core ``_repr_html_`` and widgets) draws a table with.

Every value is escaped; styles are inline, so a static export looks the same without a stylesheet. A row may carry
attributes (:class:`Row`: a class, ``data-`` attributes, a style) and a cell its own (:class:`Cell`: a class, a
title, a colspan, a style added to the table's cell style), which is what the widgets' tables need: a browser test
finds a row by its class and data, and a column may keep its text on one line.

>>> html_table([Row(["a", Cell(1, "white-space:nowrap", {"class": "n"})], {"class": "r", "data-k": "x<y"})],
...            cell="", css_class=None)
'<table style="border-collapse:collapse;font-size:12px"><tbody><tr class="r" data-k="x&lt;y"><td>a</td><td class="n" \
style="white-space:nowrap">1</td></tr></tbody></table>'
"""

from __future__ import annotations

import dataclasses
import html
import typing as tp

__all__ = ["CELL", "TABLE_STYLE", "Cell", "Html", "Row", "cell_style", "html_table"]


class Html(str):
    """Text that is already HTML (its data escaped by whoever built it): :func:`html_table` puts it in as is."""


def cell_style(padding: str = "2px 8px") -> str:
    """The one style of a table cell: ``padding`` (CSS), a line under it, text at its top left."""
    return f"padding:{padding};border-bottom:1px solid #ddd;text-align:left;vertical-align:top"


CELL = cell_style()  # the core reprs' tables; the widgets' denser ones are cell_style("2px 6px")
TABLE_STYLE = "border-collapse:collapse;font-size:12px"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A cell with its own ``style`` (added after the table's cell style) and ``attrs`` (``class``, ``title``,
    ``colspan``, ``data-...``; values escaped; None leaves one out) on its ``<td>`` (or ``<th>`` in a header),
    written ``class``, ``style``, then the rest in the order given."""

    value: tp.Any
    style: str = ""
    attrs: tp.Mapping[str, tp.Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of cells with ``attrs`` on its ``<tr>`` (``class``, ``data-...``, ``style``; values escaped)."""

    cells: tp.Sequence[tp.Any]
    attrs: tp.Mapping[str, tp.Any] = dataclasses.field(default_factory=dict)


def html_table(rows: tp.Iterable[tp.Sequence[tp.Any] | Row], header: tp.Sequence[tp.Any] | None = None,
               css_class: str | None = "wb-table", *, cell: str = CELL, head: str | None = None,
               style: str = TABLE_STYLE) -> str:
    """An HTML table of ``rows`` (every value escaped but :class:`Html`), with an optional header row.

    A row is a sequence of values or a :class:`Row`; a value may be a :class:`Cell`. ``cell`` is every cell's style
    (default :data:`CELL`; ``""`` for none), ``head`` the header cells' (default ``cell`` in bold), ``style`` the
    table's; ``css_class=None`` leaves the table without a class."""
    head_style = f"{cell};font-weight:600" if head is None else head
    thead = ""
    if header is not None:
        thead = "<thead><tr>" + "".join(_cell("th", h, head_style) for h in header) + "</tr></thead>"
    body = "".join(_row(row, cell) for row in rows)
    klass = "" if css_class is None else f' class="{_escape(css_class)}"'
    return f'<table{klass} style="{_escape(style)}">{thead}<tbody>{body}</tbody></table>'


def _row(row: tp.Sequence[tp.Any] | Row, style: str) -> str:
    cells, attrs = (row.cells, row.attrs) if isinstance(row, Row) else (row, {})
    return f"<tr{_attrs(attrs)}>" + "".join(_cell("td", v, style) for v in cells) + "</tr>"


def _cell(tag: str, value: tp.Any, style: str) -> str:
    attrs: tp.Mapping[str, tp.Any] = {}
    if isinstance(value, Cell):
        style = ";".join(s for s in (style, value.style) if s)
        value, attrs = value.value, value.attrs
    # class first, then style, then the rest as given: the order the widgets' tables always wrote
    ordered = {"class": attrs.get("class"), "style": style or None, **{k: v for k, v in attrs.items() if k != "class"}}
    return f"<{tag}{_attrs(ordered)}>{_escape(value)}</{tag}>"


def _attrs(attrs: tp.Mapping[str, tp.Any]) -> str:
    return "".join(f' {name}="{html.escape(str(value))}"' for name, value in attrs.items() if value is not None)


def _escape(value: tp.Any) -> str:
    return value if isinstance(value, Html) else html.escape(str(value))
