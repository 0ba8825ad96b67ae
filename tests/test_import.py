"""`import workbench` stays cheap: heavy libraries load only when used."""

import subprocess
import sys

import pytest

HEAVY = ["flax", "torch", "transformers", "ipywidgets", "plotly", "treescope", "IPython"]


@pytest.mark.parametrize("stmt, allowed", [
    ("import workbench", []),
    ("import workbench.core.axes, workbench.core.mesh, workbench.core.operations, workbench.core.sharding.blocks", []),
    ("import workbench.models, workbench.widgets", []),
])
def test_import_loads_no_heavy_library(stmt, allowed):
    code = f"import sys; {stmt}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ",".join(allowed), f"{stmt} imported {out.stdout.strip()}"


def test_import_workbench_does_not_start_jax():
    code = "import sys, workbench; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_lazy_names_resolve():
    import workbench as wb

    assert wb.make_mesh.__module__ == "workbench.core.mesh"
    assert wb.PartitionAxis.__module__ == "workbench.core.axes"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        wb.nope  # noqa: B018
