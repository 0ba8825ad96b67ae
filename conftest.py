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

# One persistent XLA compilation cache shared by the pytest workers of one run: many test files compile the same
# tiny programs (a tiny Llama's forward, its train step), and a worker that meets a program the other compiled
# loads it instead. The controller makes a fresh folder (its path travels to the workers in the environment)
# and removes it at the end, so nothing carries over between runs. Only the test processes use it: notebook
# kernels and the tests' subprocesses compile as a user's would. WORKBENCH_TEST_COMPILE_CACHE=0 turns it off.
if os.environ.get("WORKBENCH_TEST_COMPILE_CACHE", "1") != "0":
    import atexit
    import shutil
    import tempfile

    import jax

    if "WORKBENCH_TEST_COMPILE_CACHE_DIR" not in os.environ:  # the controller (or a run without xdist)
        os.environ["WORKBENCH_TEST_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="workbench-xla-cache-")
        atexit.register(shutil.rmtree, os.environ["WORKBENCH_TEST_COMPILE_CACHE_DIR"], ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ["WORKBENCH_TEST_COMPILE_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

REFERENCE = ("torch", "transformers")
# `make test-quick` sets it: every test that asks libtpu for a TPU topology (an ahead-of-time compile for a TPU
# cluster) skips at that call, saying so; the notebooks and browser tests are deselected by the make target.
QUICK = os.environ.get("WORKBENCH_TEST_QUICK") == "1"

if QUICK:
    from jax.experimental import topologies

    def _no_tpu_topology(*args, **kwargs):
        pytest.skip("make test-quick compiles nothing for TPU clusters (make test does)")

    topologies.get_topology_desc = _no_tpu_topology


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


# Seconds each test file took in a recent run: a run with WORKBENCH_FILE_SECONDS=path adds them there (make
# test does, into build/legs/, after removing the last run's); copy the default leg's over tests/file_seconds.json
# to refresh it.
# pytest-xdist's --dist loadfile hands whole files to the workers in collection order, so the files run
# longest first (longest-processing-time-first scheduling): a long notebook dealt out last would leave one
# core idle for minutes at the end. Files it does not list run after, in their usual order.
FILE_SECONDS = os.path.join(os.path.dirname(__file__), "tests", "file_seconds.json")


@functools.cache
def _file_seconds() -> dict[str, float]:
    if not os.path.exists(FILE_SECONDS):
        return {}
    with open(FILE_SECONDS, encoding="utf-8") as f:
        return json.load(f)


def _file_key(item) -> str:
    return os.path.relpath(str(item.path), os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb" and _notebook_imports_torch(str(item.path)):
            item.add_marker(pytest.mark.reference)
    seconds = _file_seconds()
    first = {}  # a file's first position: sorting is stable, so a file's items keep their order
    for i, item in enumerate(items):
        first.setdefault(_file_key(item), i)
    items.sort(key=lambda item: (-seconds.get(_file_key(item), 0.0), first[_file_key(item)]))


def pytest_runtest_setup(item):
    if item.get_closest_marker("reference") is not None and _missing_reference():
        pytest.skip(f"compares with the PyTorch/transformers reference: {', '.join(_missing_reference())} "
                    f"not installed (make test-newest has no torch: no CPU wheel for this Python here)")


_seconds_by_file: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # with xdist, the controller receives every worker's reports: it alone writes the totals
    file = report.nodeid.split("::")[0]
    _seconds_by_file[file] = _seconds_by_file.get(file, 0.0) + (report.duration or 0.0)


def pytest_sessionfinish(session):
    out = os.environ.get("WORKBENCH_FILE_SECONDS")
    if out and not hasattr(session.config, "workerinput") and _seconds_by_file:
        totals = {}  # a leg runs pytest twice (tools/pytest_leg.sh): the second run adds its files to the first's
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                totals = json.load(f)
        totals |= {k: round(v, 1) for k, v in _seconds_by_file.items()}
        with open(out, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(totals.items(), key=lambda kv: -kv[1])), f, indent=0)
