"""ipywidgets views over core objects (meshes, PartitionSpecs, models, attention, generation).

Widgets hold no state the core does not; everything they show is computed by
``workbench.core`` functions, tested without a widget. Names load lazily: ``import
workbench.widgets`` imports neither ipywidgets nor plotly until a widget is used.
"""

from __future__ import annotations

import importlib
import typing as tp

_LAZY = {
    "MeshView": "workbench.widgets.mesh_view",
    "ShardingView": "workbench.widgets.sharding_view",
    "ShardingExplorer": "workbench.widgets.sharding_explorer",
    "AttentionLab": "workbench.widgets.attention_lab",
    "ModuleTree": "workbench.widgets.module_tree",
    "GenerationView": "workbench.widgets.generation_view",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> tp.Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
