"""Lazy exports for a package ``__init__``: a name loads its module on first use (and is cached)."""

from __future__ import annotations

import importlib
import typing as tp


def lazy_exports(package: str, names: dict[str, str]) -> tuple[tp.Callable[[str], tp.Any], tp.Callable[[], list]]:
    """``(__getattr__, __dir__)`` for ``package`` exporting ``names`` (name -> defining module)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> tp.Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
