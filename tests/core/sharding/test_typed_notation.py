"""typed_notation against JAX's own truth: ``str(jax.typeof(x))`` of arrays placed on real meshes."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.mesh import make_mesh
from workbench.core.sharding.blocks import sharding_layout, typed_notation

EXPLICIT = make_mesh(dp=2, fsdp=2, tp=2, axis_types=AxisType.Explicit)
AUTO = make_mesh(dp=2, fsdp=2, tp=2)
# a mixed mesh: JAX types the Explicit axis only
MIXED = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto))

CASES = [  # shape, dtype, spec
    ((8, 4), "float32", P("dp", "tp")),
    ((8, 4), "float32", P()),  # replicated
    ((8, 4), "float32", P(None, "tp")),
    ((8, 4), "float32", P(("fsdp", "dp"), "tp")),  # two axes on one dimension, major first
    ((8, 4), "float32", P(("dp", "fsdp"), None)),
    ((8, 4), "float32", P(("pp", "dp"), "tp")),  # a size-1 axis still shows
    ((8, 4, 6), "bfloat16", P("dp", None, "tp")),  # rank 3
    ((4, 8, 2, 6), "bfloat16", P(None, ("fsdp", "tp"), None, "dp")),
    ((8,), "int32", P("tp")),
    ((8,), "int32", P(("dp",))),  # a one-axis group is the axis
    ((), "float32", P()),  # a scalar
    ((8, 4), "bool", P("dp")),  # a short spec: the rest unsplit
    ((8, 4), "uint8", P("fsdp")),
    ((8, 4), "float16", P(None, "dp")),
    ((8, 4), "complex64", P("dp", "tp")),
    ((8, 4), "float8_e4m3fn", P("dp")),
]


def placed(shape, dtype, spec, mesh):
    return jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))


@pytest.mark.parametrize("shape, dtype, spec", CASES)
def test_matches_jax_typeof_on_an_explicit_mesh(shape, dtype, spec):
    x = placed(shape, dtype, spec, EXPLICIT)
    assert typed_notation(shape, dtype, spec) == str(jax.typeof(x))
    assert typed_notation(shape, dtype, spec, EXPLICIT) == str(jax.typeof(x))
    assert typed_notation(shape, dtype, spec, short_dtypes=True) == jax.typeof(x).str_short(short_dtypes=True)
    # the layout of the same array says the same
    assert sharding_layout(x).typed_notation() == sharding_layout(x).typed_notation(on_mesh=True) == str(jax.typeof(x))


def test_the_examples_jax_prints():
    """What JAX 0.10 prints, written out: the full dtype name, sizes global, groups in parentheses."""
    assert str(jax.typeof(placed((8, 4), "float32", P("dp", "tp"), EXPLICIT))) == "float32[8@dp,4@tp]"
    assert str(jax.typeof(placed((8, 4), "float32", P(("fsdp", "dp"), "tp"), EXPLICIT))) == "float32[8@(fsdp,dp),4@tp]"
    assert str(jax.typeof(placed((8, 4), "float32", P(), EXPLICIT))) == "float32[8,4]"
    assert typed_notation((8, 4), "float32", P("dp", "tp"), short_dtypes=True) == "f32[8@dp,4@tp]"
    assert typed_notation((8, 4), "bfloat16", "(fsdp, dp), tp") == "bfloat16[8@(fsdp,dp),4@tp]"  # spec text
    assert typed_notation((8, 4), jnp.int32, None) == "int32[8,4]"


@pytest.mark.parametrize("shape, dtype, spec", CASES[:8])
def test_on_an_auto_mesh_jax_keeps_the_sharding_out_of_the_type(shape, dtype, spec):
    x = placed(shape, dtype, spec, AUTO)
    assert typed_notation(shape, dtype, spec, AUTO) == str(jax.typeof(x)) == f"{dtype}[{','.join(map(str, shape))}]"
    assert sharding_layout(x).typed_notation(on_mesh=True) == str(jax.typeof(x))


@pytest.mark.parametrize("spec", [P("a", "b"), P(("a", "b")), P(("b", "a")), P("b"), P(None, "a"), P()])
def test_on_a_mixed_mesh_only_explicit_axes_show(spec):
    x = placed((8, 4), "float32", spec, MIXED)
    assert typed_notation((8, 4), "float32", spec, MIXED) == str(jax.typeof(x))


def test_unconstrained_stays_out_of_the_type_and_needs_an_auto_axis():
    # JAX refuses P.UNCONSTRAINED on a mesh without Auto axes; so does typed_notation
    with pytest.raises(ValueError, match="UNCONSTRAINED"):
        placed((8, 4), "float32", P(P.UNCONSTRAINED, "tp"), EXPLICIT)
    with pytest.raises(ValueError, match=r"UNCONSTRAINED.*only Auto axes"):
        typed_notation((8, 4), "float32", P(P.UNCONSTRAINED, "tp"), EXPLICIT)
    # with an Auto axis it is allowed, and XLA's choice is not part of the type
    assert typed_notation((8, 4), "float32", P(P.UNCONSTRAINED, "a"), MIXED) == "float32[8,4@a]"
    assert typed_notation((8, 4), "float32", P(P.UNCONSTRAINED, "a")) == "float32[8,4@a]"


def test_inside_jit_the_traced_types_match():
    x = placed((8, 4), "float32", P(("fsdp", "dp"), "tp"), EXPLICIT)
    seen = []
    jax.jit(lambda y: seen.append(str(jax.typeof(y * 2))) or y)(x)
    assert seen == [typed_notation((8, 4), "float32", P(("fsdp", "dp"), "tp"))]


@pytest.mark.parametrize("shape, spec, error, message", [
    ((8, 4), P("dp", "dp"), ValueError, "mesh axis 'dp' shards both dim 0 and dim 1"),
    ((8, 4), P("data"), ValueError, "unknown mesh axis 'data'"),
    ((8, 4), P("dp", None, "tp"), ValueError, "3 entries but the array has 2"),
    ((6, 4), P(("tp", "dp", "fsdp")), ValueError, "not divisible"),  # 6 over 8 ways
    ((8, 4), P(1), TypeError, "must be a mesh axis name"),
])
def test_what_jax_refuses_raises_a_clear_error(shape, spec, error, message):
    with pytest.raises(Exception):  # noqa: B017 - JAX refuses it too, in its own words
        placed(shape, "float32", spec, EXPLICIT)
    with pytest.raises(error, match=message):
        typed_notation(shape, "float32", spec, EXPLICIT)


def test_bad_inputs_say_what_to_pass():
    with pytest.raises(TypeError, match="unknown dtype"):
        typed_notation((8,), "floaty", P())
    with pytest.raises(TypeError, match="PartitionSpec, spec text"):
        typed_notation((8,), "float32", ("dp",))
    with pytest.raises(TypeError, match="must be a mesh axis name"):
        typed_notation((8,), "float32", P(1))  # without a mesh too
    with pytest.raises(TypeError, match="Mesh or AbstractMesh"):
        typed_notation((8,), "float32", P("dp"), mesh={"dp": 2})
