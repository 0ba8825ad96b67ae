"""tables: the one HTML table helper, every value escaped."""

import html.parser

from workbench.core.tables import CELL, Cell, Html, Row, cell_style, html_table


class _Cells(html.parser.HTMLParser):
    """The text of each cell, as a browser's parser reads it."""

    def __init__(self):
        super().__init__()
        self.cells: list[str] = []
        self._in = False

    def handle_starttag(self, tag, attrs):
        if tag in ("td", "th"):
            self._in, self.cells = True, [*self.cells, ""]

    def handle_endtag(self, tag):
        self._in = self._in and tag not in ("td", "th")

    def handle_data(self, data):
        if self._in:
            self.cells[-1] += data


def test_every_value_is_escaped_and_reads_back():
    text = html_table([["<b>", 1], ["x & y", None]], header=["a&b", "n"])
    assert text.count("&lt;b&gt;") == 1 and "a&amp;b" in text and "<b>" not in text
    parser = _Cells()
    parser.feed(text)
    assert parser.cells == ["a&b", "n", "<b>", "1", "x & y", "None"]


def test_no_header_no_rows():
    parser = _Cells()
    parser.feed(html_table([]))
    assert parser.cells == [] and "<thead>" not in html_table([])


def test_html_values_go_in_as_they_are():
    parser = _Cells()
    parser.feed(html_table([[Html("<code>x</code>"), "<code>"]]))
    assert parser.cells == ["x", "<code>"]


def test_the_output_of_a_plain_table_is_as_before():
    """Rows and cells without attributes write what html_table always wrote (core reprs keep their HTML)."""
    cell = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top"
    assert html_table([["a", 1]], header=["x", "y"]) == (
        f'<table class="wb-table" style="border-collapse:collapse;font-size:12px"><thead><tr>'
        f'<th style="{cell};font-weight:600">x</th><th style="{cell};font-weight:600">y</th></tr></thead>'
        f'<tbody><tr><td style="{cell}">a</td><td style="{cell}">1</td></tr></tbody></table>')
    assert CELL == cell == cell_style()


def test_rows_and_cells_carry_attributes_and_styles():
    text = html_table([Row(["a<", Cell("b", "white-space:nowrap", {"class": "wb-b", "title": 'say "x"'})],
                           {"class": "wb-row", "data-path": "p/<q>", "style": ";background:#fff3c4"}),
                       ["c", Cell(Html("<b>d</b>"), attrs={"colspan": 2})]],
                      header=["x", Cell("y", attrs={"title": "why"})], css_class=None,
                      cell=cell_style("1px 6px"), style="border-collapse:collapse")
    assert text.startswith('<table style="border-collapse:collapse"><thead>')
    assert '<tr class="wb-row" data-path="p/&lt;q&gt;" style=";background:#fff3c4">' in text
    assert (f'<td class="wb-b" style="{cell_style("1px 6px")};white-space:nowrap" title="say &quot;x&quot;">b</td>'
            in text)
    assert f'<td style="{cell_style("1px 6px")}" colspan="2"><b>d</b></td>' in text
    assert f'<th style="{cell_style("1px 6px")};font-weight:600" title="why">y</th>' in text
    parser = _Cells()
    parser.feed(text)
    assert parser.cells == ["x", "y", "a<", "b", "c", "d"]


def test_no_cell_style_and_a_header_style_of_its_own():
    text = html_table([[Cell(1, "color:red"), 2]], header=["h"], cell="", head="font-weight:600")
    assert '<th style="font-weight:600">h</th>' in text and '<td style="color:red">1</td><td>2</td>' in text
