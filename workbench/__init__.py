"""workbench: a Jupyter-first research workbench for JAX parallelism.

``import workbench`` is cheap: names below load their module on first use, and model
families, widgets, torch and transformers are never imported until asked for.

>>> import workbench as wb
>>> wb.simulate_devices(8)          # before any JAX computation
>>> dict(wb.make_mesh(dp=2, tp=4).shape)
{'pp': 1, 'dp': 2, 'fsdp': 1, 'ep': 1, 'tp': 4, 'sp': 1}
"""

from __future__ import annotations

import importlib
import typing as tp

__version__ = "0.1.0"

_LAZY = {
    "simulate_devices": "workbench.core.mesh",
    "make_mesh": "workbench.core.mesh",
    "initialize_distributed": "workbench.core.mesh",
    "describe_mesh": "workbench.core.mesh",
    "PartitionAxis": "workbench.core.axes",
    "explain_table": "workbench.core.axes",
    "OperationRegistry": "workbench.core.operations",
    "OperationMetadata": "workbench.core.operations",
    "create_block_mask": "workbench.core.operations.attention.block_mask",
    "BlockMask": "workbench.core.operations.attention.block_mask",
    "flex_variant": "workbench.core.operations.attention.flex",
}
_SUBMODULES = ("core", "models")

__all__ = sorted([*_LAZY, *_SUBMODULES])


def __getattr__(name: str) -> tp.Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"workbench.{name}")
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
