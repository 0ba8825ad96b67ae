"""The KV cache as HTML: coloured slots per row (contiguous) or the page table (paged), from a
:class:`~workbench.core.views.cache_fill.ContiguousFill` / :class:`~workbench.core.views.cache_fill.PagedFill`."""

from __future__ import annotations

import math

import numpy as np

from workbench.core.tables import Cell, Row, html_table
from workbench.core.units import format_bytes
from workbench.core.views.cache_fill import ContiguousFill, PagedFill
from workbench.widgets._html import escape

__all__ = ["cache_html"]

_STATE_COLORS = {0: "#eeeeee", 1: "#c9c9c9", 2: "#7aa6da", 3: "#77c68a"}  # empty, padding, prompt, generated
_STATE_NAMES = {0: "empty", 1: "padding", 2: "prompt", 3: "generated"}
_MAX_CELLS = 256  # cells drawn per row; longer caches draw several slots per cell
_MONO = "font-family:var(--jp-code-font-family,monospace);font-size:12px"


def _contiguous_states(fill: ContiguousFill, prompt_len: int) -> np.ndarray:
    states = np.zeros(fill.valid_BS.shape, np.int8)
    written = np.arange(fill.max_length) < fill.index
    slot_is_prompt = np.arange(fill.max_length) < prompt_len
    states[:, written] = 1
    states[fill.valid_BS & slot_is_prompt[None, :]] = 2
    states[fill.valid_BS & ~slot_is_prompt[None, :]] = 3
    return states


def _cells(states_S: np.ndarray, per_cell: int) -> str:
    out = []
    for start in range(0, len(states_S), per_cell):
        state = int(states_S[start:start + per_cell].max())
        out.append(f'<span class="wb-slot wb-slot-{_STATE_NAMES[state]}" style="display:inline-block;width:7px;'
                   f'height:11px;margin:0 1px 1px 0;background:{_STATE_COLORS[state]}"></span>')
    return "".join(out)


def _legend() -> str:
    return " ".join(f'<span style="display:inline-block;width:9px;height:9px;background:{c}"></span> {n}'
                    for n, c in zip(_STATE_NAMES.values(), _STATE_COLORS.values(), strict=True))


def cache_html(fill: ContiguousFill | PagedFill, *, prompt_len: int, source: str, nbytes: int | None = None) -> str:
    """The cache as coloured slots per row (contiguous) or as its page table (paged); ``source`` says
    where the picture comes from (live prediction or the returned cache)."""
    size = "" if nbytes is None else f" · {format_bytes(nbytes)} of keys and values"
    if isinstance(fill, ContiguousFill):
        per_cell = max(1, math.ceil(fill.max_length / _MAX_CELLS))
        scale = f" · one cell = {per_cell} slots" if per_cell > 1 else ""
        rows = "".join(
            f'<div class="wb-cache-row" data-row="{b}" data-valid="{int(fill.tokens_B[b])}" style="margin:2px 0">'
            f'<span style="display:inline-block;width:46px">row {b}</span>'
            f'<span style="display:inline-block;max-width:{8 * 64 + 8}px;vertical-align:top">'
            f"{_cells(states, per_cell)}</span> {int(fill.tokens_B[b])} valid</div>"
            for b, states in enumerate(_contiguous_states(fill, prompt_len)))
        head = (f"contiguous KV cache ({escape(source)}): index {fill.index} of {fill.max_length} slots written "
                f"in every row{scale}{size}")
        return (f'<div class="wb-cache wb-cache-contiguous" data-index="{fill.index}" style="{_MONO}">'
                f"<div>{head}</div><div style='font-size:11px;color:#555'>{_legend()}</div>{rows}</div>")
    held_B = fill.pages_held_B
    width = fill.page_table_BP.shape[1]
    shown = min(width, max(int(held_B.max(initial=0)) + 2, 8))
    body = []
    for b in range(fill.page_table_BP.shape[0]):
        cells = []
        for p in range(shown):
            n = fill.tokens_in_page(b, p)
            page = int(fill.page_table_BP[b, p])
            text = "" if p >= held_B[b] else str(page) if fill.known and page >= 0 else "·"
            shade = "#f4f4f4" if n == 0 else f"rgba(119,198,138,{0.35 + 0.65 * n / fill.page_size:.2f})"
            cells.append(Cell(text, f"border:1px solid #fff;background:{shade};min-width:26px;text-align:center",
                              {"class": "wb-page", "title": f"row {b}, logical page {p}: {n}/{fill.page_size} tokens"}))
        length = int(fill.lengths_B[b])
        body.append(Row([Cell(f"row {b}", "padding-right:6px"), *cells, Cell(f"{length} tokens", "padding-left:6px")],
                        {"class": "wb-page-row", "data-row": b, "data-length": length}))
    more = f" (first {shown} of {width} logical pages per row)" if shown < width else ""
    ids = "physical page ids" if fill.known else "pages held (physical ids are known when the run ends)"
    head = (f"paged KV cache ({escape(source)}): page_size {fill.page_size} · {fill.pages_in_use} of "
            f"{fill.num_pages} pages in use · {fill.num_free} free{size}; cells: {ids}{more}")
    return (f'<div class="wb-cache wb-cache-paged" data-in-use="{fill.pages_in_use}" data-free="{fill.num_free}" '
            f'style="{_MONO}"><div>{head}</div>'
            f'{html_table(body, css_class=None, cell="", style="border-collapse:collapse")}</div>')
