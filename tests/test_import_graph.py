"""Dependencies point one way (DESIGN.md): no import cycle among workbench's modules, counting the
imports inside functions too (a function-level import that closes a cycle only hides it), and nothing
in core imports widgets."""

import ast
import pathlib

import workbench

ROOT = pathlib.Path(workbench.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = ("workbench", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The workbench modules ``path`` imports anywhere in its code, except under ``if TYPE_CHECKING``."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
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
