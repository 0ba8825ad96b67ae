"""One home per concept (issue 31): each quantity is computed by one function and each constant is written once;
every other module imports it. The scan reads workbench's source with ``ast``, so a second copy fails here."""

import ast
import pathlib

import workbench

ROOT = pathlib.Path(workbench.__file__).parent

# name -> the one module (relative to workbench/) that defines it
HOMES = {
    "format_bytes": "core/units.py", "format_seconds": "core/units.py", "format_count": "core/units.py",
    "format_guess": "core/units.py", "format_flops": "core/units.py",
    "html_table": "core/tables.py",
    "collective_time": "core/hardware/network.py", "transfer": "core/hardware/network.py",
    "array_bytes": "core/hardware/network.py",
    "roofline": "core/cost/roofline.py", "step_time": "core/cost/compiled_step.py",
    "mfu": "core/cost/flops.py", "hfu": "core/cost/flops.py",
    "parse": "core/hlo/text.py", "element_bits": "core/hlo/text.py",
    "positive_int": "core/checks.py",
    "layout_step": "core/compile/steps.py", "mesh_factorizations": "core/mesh.py", "mesh_of": "core/mesh.py",
    # gradient accumulation's microbatch, and uneven pipeline stages held as equal ones: the advisor's and explorer's
    "microbatch": "core/plan.py", "stage_padded": "core/pipeline.py",
}
# a constant's value -> the one module that writes it
CONSTANTS = {
    ("train", "prefill", "decode"): "core/vocab.py",
    ("none", "dots_saveable", "full"): "core/vocab.py",
    ("adamw", "adafactor", "sgd"): "core/vocab.py",
    ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"): "core/hlo/text.py",
    ("forward", "train"): "core/compile/steps.py",
}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py"))}


def test_each_function_has_one_home():
    """Module-level definitions (a method of the same name, e.g. ``StepTime.mfu``, calls the one function)."""
    defined: dict[str, list[str]] = {name: [] for name in HOMES}
    for path, tree in _modules().items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in HOMES:
                defined[node.name].append(path)
    assert defined == {name: [home] for name, home in HOMES.items()}


def test_each_constant_is_written_once():
    written: dict[tuple, list[str]] = {value: [] for value in CONSTANTS}
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
                value = tuple(e.value for e in node.elts)
                if value in written:
                    written[value].append(path)
    assert written == {value: [home] for value, home in CONSTANTS.items()}
