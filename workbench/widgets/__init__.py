"""ipywidgets views over core objects (meshes, PartitionSpecs, models, attention, generation).

Widgets hold no state the core does not; everything they show is computed by
``workbench.core`` functions, tested without a widget. Names load lazily: ``import
workbench.widgets`` imports neither ipywidgets nor plotly until a widget is used.
"""

from __future__ import annotations

from workbench._lazy import lazy_exports

_LAZY = {
    "MeshView": "workbench.widgets.mesh_view",
    "ShardingView": "workbench.widgets.sharding_view",
    "ShardingExplorer": "workbench.widgets.sharding_explorer",
    "AttentionLab": "workbench.widgets.attention_lab",
    "ModuleTree": "workbench.widgets.module_tree",
    "GenerationView": "workbench.widgets.generation_view",
    "PipelineView": "workbench.widgets.pipeline_view",
    "LayoutAdvisor": "workbench.widgets.layout_advisor",
    "frontier_figure": "workbench.widgets.serving_frontier",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
