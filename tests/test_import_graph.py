"""Dependencies point one way (DESIGN.md): packages in layers that import only downward (the README's layout draws
them), no import cycle among workbench's modules, counting every import (top level, inside functions, under
``if TYPE_CHECKING``: an import that closes a cycle there only hides it);
nothing in core imports widgets; workbench imports sit at the top of a module (a function-level one only for a
heavy optional dependency, saying so on its line); no module named like a standard-library module; no import of
another module's private name."""

import ast
import pathlib
import subprocess
import sys

import workbench

ROOT = pathlib.Path(workbench.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = ("workbench", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The workbench modules ``path`` imports anywhere in its code, ``if TYPE_CHECKING`` blocks included."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != here}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


# The layers, bottom first: a package may import its own layer's packages (without a cycle) and any below, never
# one above. Within the fourth layer the order is models < sharding < pipeline < compile (held by the cycle test).
# A package is a folder under workbench/core (``core.cost``) or a module directly in it (``core.axes``), or a
# folder or module directly under workbench (``widgets``, ``models``: the public face of ``core.models``).
LAYERS = (
    # the shared vocabulary: units, checks, tables, tasks/remats/optimizers, the program cache, XLA's log
    {"_lazy", "core", "core.units", "core.checks", "core.tables", "core.vocab", "core.programs", "core.xla_log"},
    # semantic axes and meshes, HLO text, attention kernels, parallel layers, schedules as data, ZeRO, shape rules,
    # the plan record
    {"core.axes", "core.mesh", "core.hlo", "core.operations", "core.linear", "core._collective_matmul",
     "core.matmul_sharding", "core.pipeline_schedule", "core.zero", "core.shapes", "core.plan"},
    {"core.hardware"},  # chips, calibration evidence, clusters and their networks
    {"core.cost"},  # arithmetic over shapes: no flax, no optax
    {"core.models", "core.sharding", "core.pipeline", "core.compile"},
    {"core.views", "core.advisor", "core.interop"},
    {"widgets", "models", "data", "workbench"},
)


def package_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "workbench"
    if parts[0] == "core":
        return ".".join(parts[:2])
    return parts[0]


def layer_of(package: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) if package in layer]
    assert len(found) == 1, f"package {package} is in {len(found)} layers: give it one in LAYERS"
    return found[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, deps in graph.items():
        packages[package_of(module)] |= {package_of(d) for d in deps} - {package_of(module)}
    return packages


def test_packages_import_only_their_own_layer_or_below():
    packages = package_graph(import_graph())
    assert {"core.cost", "core.hardware", "core.interop", "widgets", "models"} <= packages.keys()
    upward = sorted(f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, deps in packages.items()
                    for b in deps if layer_of(b) > layer_of(a))
    assert upward == []


def test_no_package_level_cycle():
    assert cycles(package_graph(import_graph())) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"workbench.core.cost.ledger": {"workbench.core.sharding.plan"}, "workbench.core.sharding.plan": set()}
    packages = package_graph(graph)
    assert packages == {"core.cost": {"core.sharding"}, "core.sharding": set()}
    assert layer_of("core.sharding") > layer_of("core.cost")


def test_the_cost_model_loads_no_flax_optax_or_pallas():
    """``import workbench.core.cost.predicted`` (arithmetic) in a fresh process: none of flax, optax, Pallas."""
    code = ("import sys, workbench.core.cost.predicted; "
            "print(sorted(m for m in ('flax', 'optax', 'jax.experimental.pallas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    some = {"workbench.core.models.causal_lm", "workbench.core.views.explore", "workbench.widgets.attention_lab"}
    assert some <= graph.keys()
    assert "workbench.core.models.hf_convert" in graph["workbench.core.models.checkpoint"]
    assert cycles(graph) == []


def test_core_imports_no_widget():
    graph = import_graph()
    assert {m: sorted(d for d in deps if d.startswith("workbench.widgets"))
            for m, deps in graph.items() if m.startswith("workbench.core")
            and any(d.startswith("workbench.widgets") for d in deps)} == {}


def _workbench_imports(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """Every ``import``/``from`` statement naming a workbench module, and whether it is at the module's top level."""
    top = {id(n) for n in tree.body}
    return [(n, id(n) in top) for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name.startswith("workbench") for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("workbench"))]


def test_workbench_imports_are_at_the_top_unless_a_comment_says_why():
    """A function-level import of a workbench module hides a dependency; it is allowed only where importing a heavy
    optional dependency (torch, transformers, ipywidgets, libtpu, ...) eagerly would cost every user, and then its
    line (or the line above) says so in a comment."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node, at_top in _workbench_imports(ast.parse(path.read_text())):
            said = "#" in lines[node.lineno - 1] or "#" in lines[node.lineno - 2]
            if not at_top and not said:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert found == []


def test_no_module_is_named_like_a_standard_library_module():
    shadowing = sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
                       if p.stem in sys.stdlib_module_names or p.parent.name in sys.stdlib_module_names)
    assert shadowing == []


def test_no_module_imports_another_module_s_private_name():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node, _ in _workbench_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [f"{path.relative_to(ROOT.parent)}:{node.lineno} {a.name} from {node.module}"
                          for a in node.names if a.name.startswith("_")
                          and not (node.module or "").rsplit(".", 1)[-1].startswith("_")]
    assert found == []


def test_the_finders_find_what_they_look_for():
    tree = ast.parse("import os\nfrom workbench.core import mesh\ndef f():\n    from workbench.core.axes import _x\n")
    assert [(n.lineno, top) for n, top in _workbench_imports(tree)] == [(2, True), (4, False)]
