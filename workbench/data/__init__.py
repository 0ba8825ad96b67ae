"""Small public-domain texts shipped inside the package, so tiny models train offline.

>>> text = load_text("genesis")
>>> text.splitlines()[0]
'THE FIRST BOOK OF MOSES, CALLED GENESIS'

Sources and copyright status: ``workbench/data/README.md``.
"""

from __future__ import annotations

from importlib import resources

TEXTS = {"genesis": "genesis_kjv.txt"}  # name -> file next to this module


def load_text(name: str = "genesis") -> str:
    """The shipped text ``name`` (see ``TEXTS``) as one string, read with importlib.resources."""
    if name not in TEXTS:
        raise ValueError(f"no shipped text named {name!r}; available: {sorted(TEXTS)}")
    return resources.files(__name__).joinpath(TEXTS[name]).read_text(encoding="utf-8")
