"""Give every plotly figure saved in a notebook a static PNG beside it.

A plotly output is saved as ``application/vnd.plotly.v1+json``: JupyterLab draws it with plotly's extension, but
GitHub's notebook view and nbconvert's HTML export know no renderer for it and show nothing. With an ``image/png``
in the same output they show the image (JupyterLab keeps the interactive figure: it ranks plotly's type higher).

The PNG is rendered from the saved figure itself by kaleido (headless Chromium), at the figure's own width and
height. ``make notebooks`` runs this after re-executing the notebooks; nothing in CI needs kaleido
(``tests/test_notebook_structure.py`` checks the saved images are there and match their figures).

    python tools/static_images.py notebooks/*.ipynb
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import nbformat

PLOTLY = "application/vnd.plotly.v1+json"
PNG = "image/png"


def _render(figure_json: dict) -> bytes:
    import plotly.graph_objects as go
    import plotly.io as pio

    return pio.to_image(go.Figure(figure_json), format="png")


def add_static_images(path: Path) -> int:
    """Add (or refresh) the PNG of each plotly output in the notebook at ``path``; returns how many it wrote."""
    nb = nbformat.read(path, as_version=4)
    written = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if PLOTLY in data:
                data[PNG] = base64.b64encode(_render(data[PLOTLY])).decode("ascii")
                written += 1
    if written:
        nbformat.write(nb, path)
    return written


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit("usage: python tools/static_images.py NOTEBOOK.ipynb [...]")
    try:
        import kaleido  # noqa: F401
    except ImportError:
        sys.exit("tools/static_images.py needs kaleido (pip install 'kaleido==1.5.0') and a Chromium on PATH "
                 "(or BROWSER_PATH=/usr/bin/chromium); `make notebooks` installs kaleido")
    for path in paths:
        n = add_static_images(Path(path))
        if n:
            print(f"{path}: {n} static image{'s' if n > 1 else ''}")


if __name__ == "__main__":
    main(sys.argv[1:])
