"""The one HLO parser, on the text of programs compiled here, against what JAX and XLA say of the same program:
XLA's own module object (``compiled.runtime_executable().hlo_modules()``: its computations, and each instruction's
name, opcode and operands) and the jaxpr's avals (the shapes and dtypes of the entry's parameters and result)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from workbench.core.hlo.text import Array, dtype_name, element_bits, leaves, parse, shape_tree
from workbench.core.mesh import make_mesh

# XLA's HloOpcode enum names that are not the printed opcode in CamelCase (hlo_opcode.h)
_OPCODE_TEXT = {"sin": "sine", "cos": "cosine", "exp": "exponential", "expm1": "exponential-minus-one",
                "log1p": "log-plus-one"}


def _opcode(enum) -> str:
    text = re.sub(r"(?<!^)(?=[A-Z])", "-", enum.name.removeprefix("k")).lower()  # kGetTupleElement
    return _OPCODE_TEXT.get(text, text)


def _ring(a):
    a = jax.lax.psum(jax.lax.all_gather(a, "tp", axis=1, tiled=True), "dp")
    hop = lambda _, x: jax.lax.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)])
    return jax.lax.fori_loop(0, 3, hop, a)


def _programs():
    mesh = make_mesh(dp=2, tp=4)
    scan = lambda ws, x: jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
    switch = lambda x, i: jax.lax.switch(i, [lambda x: x @ x, jnp.sin, lambda x: x.T @ x], x)
    ring = jax.shard_map(_ring, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P(None, "tp"), check_vma=False)
    return {"scan": jax.jit(scan).lower(jnp.ones((3, 8, 8)), jnp.ones((2, 8))).compile(),
            "switch": jax.jit(switch).lower(jnp.ones((4, 4)), 1).compile(),
            "ring": jax.jit(ring).lower(jnp.ones((8, 16))).compile()}


@pytest.fixture(scope="module")
def programs():
    return _programs()


@pytest.mark.parametrize("name", ["scan", "switch", "ring"])
def test_computations_and_instructions_are_xlas(programs, name):
    compiled = programs[name]
    module = parse(compiled.as_text())
    xla = compiled.runtime_executable().hlo_modules()[0]
    expected = {c.name: {i.name: (_opcode(i.opcode), tuple(o.name for o in i.operands())) for i in c.instructions()}
                for c in xla.computations()}
    assert module.name == xla.name
    assert len(module.computations) == len(expected)
    assert {c.name: {i.name: (i.opcode, i.operands) for i in c.instructions}
            for c in module.computations.values()} == expected
    # every computation but the entry is called by an instruction (fusion, loop, branch, reducer)
    called = {c for comp in module.computations.values() for op in comp.instructions for c in op.called}
    assert called == set(expected) - {module.entry}
    entry = module.computations[module.entry]
    assert sum(op.root for op in entry.instructions) == 1 and entry.root is entry.instructions[-1]
    assert module.attribute("is_scheduled") == "true"


def test_a_loop_names_its_body_and_condition(programs):
    module = parse(programs["scan"].as_text())
    (loop,) = [op for c in module.computations.values() for op in c.instructions if op.opcode == "while"]
    assert {loop.attribute("body"), loop.attribute("condition")} == set(loop.called)
    assert loop.attribute("body") in module.computations and loop.attribute("nonexistent") is None


def test_a_sharded_program_runs_on_the_meshs_devices(programs):
    module = parse(programs["ring"].as_text())
    assert int(module.attribute("num_partitions")) == make_mesh(dp=2, tp=4).size
    kinds = {op.opcode for c in module.computations.values() for op in c.instructions}
    assert {"all-gather", "all-reduce", "collective-permute"} <= kinds


def test_entry_parameters_and_result_are_the_jaxprs_avals():
    """One parameter and one output per dtype; seven outputs make the root a tuple whose text carries an
    ``/*index=5*/`` comment."""
    def f(a, b, i, m, u, z, e):
        return a * 2, b + 1, i + 1, ~m, u + 1, z * 2, e

    args = (jnp.ones((8, 16), jnp.float32), jnp.ones(16, jnp.bfloat16), jnp.int32(3), jnp.ones(4, bool),
            jnp.ones((3, 2), jnp.uint8), jnp.ones(2, jnp.complex64), jnp.ones(8, jnp.float8_e4m3fn))
    jaxpr = jax.make_jaxpr(f)(*args)
    module = parse(jax.jit(f).lower(*args).compile().as_text())
    entry = module.computations[module.entry]
    params = sorted((int(op.operand_text), op) for op in entry.instructions if op.opcode == "parameter")
    assert [i for i, _ in params] == list(range(len(jaxpr.in_avals)))
    root = shape_tree(entry.root.shape)
    assert isinstance(root, list) and len(root) == len(jaxpr.out_avals) == 7 and "/*index=5*/" in entry.root.shape
    shapes = [shape_tree(op.shape) for _, op in params] + leaves(root)
    for array, aval in zip(shapes, jaxpr.in_avals + jaxpr.out_avals, strict=True):
        assert isinstance(array, Array)
        assert (dtype_name(array.dtype), array.dims) == (str(aval.dtype), aval.shape)
        assert element_bits(array.dtype) == 8 * np.dtype(aval.dtype).itemsize


def test_layouts_are_the_compiled_programs_formats():
    """HLO prints a layout minor-to-major; JAX's ``Format`` gives it major-to-minor."""
    x = jnp.ones((2, 3, 4))
    compiled = jax.jit(lambda x: jnp.transpose(x, (2, 0, 1)) + 1).lower(x).compile()
    module = parse(compiled.as_text())
    (param,) = [op for op in module.computations[module.entry].instructions if op.opcode == "parameter"]
    minor_to_major = tuple(int(d) for d in shape_tree(param.shape).layout.split(","))
    assert minor_to_major[::-1] == tuple(compiled.input_formats[0][0].layout.major_to_minor)


def test_text_without_a_module_reads_as_empty():
    module = parse("")
    assert (module.name, module.entry, module.computations, module.attribute("num_partitions")) == ("", None, {}, None)
