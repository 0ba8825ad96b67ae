"""Every test process (and the notebook kernels nbval starts) sees 8 simulated CPU devices.

Tests and notebooks that compare with the PyTorch / transformers reference are marked ``reference`` (a
notebook is when it imports torch): where those libraries are missing (``make test-newest``: torch has no
CPU wheel for the newest Python here) they skip, saying which is missing, instead of failing.
"""

import functools
import importlib.util
import json
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from workbench.core.mesh import simulate_devices

simulate_devices(8)

REFERENCE = ("torch", "transformers")


@functools.cache
def _missing_reference() -> tuple[str, ...]:
    return tuple(name for name in REFERENCE if importlib.util.find_spec(name) is None)


@functools.cache
def _notebook_imports_torch(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    return any(line.startswith(("import torch", "from torch"))
               for cell in cells if cell["cell_type"] == "code"
               for line in "".join(cell["source"]).splitlines())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb" and _notebook_imports_torch(str(item.path)):
            item.add_marker(pytest.mark.reference)


def pytest_runtest_setup(item):
    if item.get_closest_marker("reference") is not None and _missing_reference():
        pytest.skip(f"compares with the PyTorch/transformers reference: {', '.join(_missing_reference())} "
                    f"not installed (make test-newest has no torch: no CPU wheel for this Python here)")
