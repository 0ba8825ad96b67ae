"""The tutorial notebooks keep the teaching structure they were written to, and their saved figures show
everywhere (reading the saved notebooks only; nbval runs them).

Structure: each numbered notebook opens with what the learner will be able to do, asks at least two
predict-then-check questions (a ``my_guess_...`` variable that starts as ``None`` for the learner to fill in,
never asserted on), keeps every ``assert`` in a hidden cell tagged ``check``, and says nothing about the test
harness in its prose.

Figures: a plotly figure is saved as ``application/vnd.plotly.v1+json``, which only JupyterLab's plotly extension
draws; GitHub and nbconvert's HTML show the ``image/png`` saved beside it (``tools/static_images.py``).
"""

from __future__ import annotations

import ast
import base64
import re
import struct
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PLOTLY, PNG = "application/vnd.plotly.v1+json", "image/png"
GUESS = re.compile(r"^my_guess_\w+$")


def _code(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def _assigned_names(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _used_names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _is_check(cell: nbformat.NotebookNode) -> bool:
    return "check" in cell.metadata.get("tags", [])


@pytest.fixture(params=NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def notebook(request) -> nbformat.NotebookNode:
    return nbformat.read(request.param, as_version=4)


def test_the_numbered_notebooks_are_all_here():
    assert len(NOTEBOOKS) >= 12, [p.name for p in NOTEBOOKS]


def test_it_opens_with_what_the_learner_will_be_able_to_do(notebook):
    first = next(c for c in notebook.cells if c.cell_type == "markdown")
    assert "you will be able to" in first.source, first.source[:300]


def test_it_asks_at_least_two_predict_then_check_questions(notebook):
    """A question is a cell that assigns ``my_guess_...`` followed by a cell that reads it (prints the truth
    beside it); no check cell reads a guess (a learner's guess is never asserted on)."""
    cells = _code(notebook)
    used = [_used_names(c.source) for c in cells]
    asked = 0
    for i, cell in enumerate(cells):
        guesses = {n for n in _assigned_names(cell.source) if GUESS.match(n)}
        if not guesses:
            continue
        answered = [c for c, names in zip(cells[i + 1:], used[i + 1:], strict=True) if guesses & names]
        assert answered, f"nothing reads {sorted(guesses)} after the cell that asks for it"
        assert not any(_is_check(c) for c in answered), f"a check cell asserts on the guess {sorted(guesses)}"
        asked += 1
    assert asked >= 2, f"{asked} predict-then-check question(s); name the guesses my_guess_..."


def _empty(node: ast.expr) -> bool:
    """``None``, or a tuple / dict of ``None`` (one guess per entry): a blank for the learner to fill. A zero, an
    empty string or ``P()`` is not blank: it prints as the learner's guess and can be the answer itself."""
    if isinstance(node, ast.Constant):
        return node.value is None
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_empty(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_empty(v) for v in node.values)
    return False


@pytest.mark.parametrize("source", ["None", "None, None", "(None, None)", "{'window': None, 'documents': None}"])
def test_none_is_an_empty_guess(source):
    assert _empty(ast.parse(source, mode="eval").body)


@pytest.mark.parametrize("source", ["0", "0.0", "''", "P()", "P(None)", "False", "()", "{}", "[]", "0, None",
                                    "(0.0, 0.0)", "{'vanilla': 0.0, 'flash': None}", "{'jax.nn': 0}", "-1"])
def test_a_zero_or_a_blank_spec_is_not_an_empty_guess(source):
    assert not _empty(ast.parse(source, mode="eval").body)


def test_a_guess_starts_empty(notebook):
    """A guess cell holds no answer, not even a near one: the learner writes the guess (issue 34's predict-then-check
    cells pre-filled at or near the answer); the cell that prints it says so while it is None."""
    for cell in _code(notebook):
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Assign) and any(
                    GUESS.match(n.id) for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                assert _empty(node.value), f"start the guess empty (None): {ast.unparse(node)}"


def test_asserts_live_in_hidden_check_cells(notebook):
    for cell in _code(notebook):
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(cell.source)))
        if has_assert:
            assert _is_check(cell), f"an assert in a teaching cell (tag it 'check'):\n{cell.source[:300]}"
        if _is_check(cell):  # folded in JupyterLab (source_hidden) and in exporters such as Jupyter Book (hide-input)
            assert cell.metadata.get("jupyter", {}).get("source_hidden"), f"check cell not hidden:\n{cell.source[:200]}"
            assert "hide-input" in cell.metadata["tags"], f"check cell not tagged 'hide-input':\n{cell.source[:200]}"


def test_the_prose_says_nothing_of_the_test_harness(notebook):
    """Neither the prose nor the code a reader sees speaks of the harness (nbval's markers go in cell tags, such as
    ``nbval-ignore-output``), nor does the prose point at tests or hidden checks."""
    for cell in notebook.cells:
        assert "nbval" not in cell.source.lower(), cell.source[:300]
        if cell.cell_type == "markdown":
            assert not re.search(r"\b(the tests|hidden cell|check cell)\b", cell.source, re.I), cell.source[:300]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _plotly_outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for c in _code(nb) for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]


def test_every_saved_plotly_figure_carries_its_static_image():
    """The PNG is the figure it sits beside: same width and height (plotly's defaults 700 x 500 where unset)."""
    figures = 0
    for path in NOTEBOOKS:
        for output in _plotly_outputs(nbformat.read(path, as_version=4)):
            figures += 1
            assert PNG in output["data"], f"{path.name}: a plotly figure without a PNG (run tools/static_images.py)"
            layout = output["data"][PLOTLY].get("layout", {})
            size = (layout.get("width", 700), layout.get("height", 500))
            assert _png_size(base64.b64decode(output["data"][PNG])) == size, path.name
    assert figures >= 6


def test_exported_html_shows_the_static_image():
    from nbconvert import HTMLExporter

    path = next(p for p in NOTEBOOKS if p.stem.startswith("03"))
    nb = nbformat.read(path, as_version=4)
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert html.count("data:image/png;base64") >= len(_plotly_outputs(nb)) >= 1
