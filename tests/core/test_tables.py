"""tables: the one HTML table helper, every value escaped."""

import html.parser

from workbench.core.tables import Html, html_table


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
