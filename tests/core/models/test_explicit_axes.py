"""A model on a mesh of Explicit axes: forward, loss, a train step and generation equal the same model on
Auto axes (the reference), and what comes out carries its sharding in its type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import PartitionAxis
from workbench.core.mesh import as_auto, call_on_auto_axes, explicit_mesh_of, explicit_spec, make_mesh
from workbench.core.models.causal_lm import LOGITS_AXES
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.presets import tiny
from workbench.core.models.training import make_train_step, to_state
from workbench.core.sharding.blocks import typed_notation

IDS = jnp.asarray(np.random.RandomState(0).randint(3, 250, (4, 16)), jnp.int32)
EXPLICIT = make_mesh(dp=2, tp=4, axis_types=AxisType.Explicit)
AUTO = make_mesh(dp=2, tp=4)


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def models(request):
    """The same weights on the Auto and on the Explicit mesh."""
    base = tiny(request.param)
    return base.shard_model(AUTO), base.shard_model(EXPLICIT)


@pytest.fixture(scope="module")
def llama():
    base = tiny("llama")
    return base.shard_model(AUTO), base.shard_model(EXPLICIT)


def test_params_are_typed_on_the_explicit_mesh(models):
    auto, explicit = models
    for x_auto, x in zip(jax.tree.leaves(nnx.state(auto, nnx.Param)), jax.tree.leaves(nnx.state(explicit, nnx.Param)),
                         strict=True):
        assert str(jax.typeof(x)) == typed_notation(x.shape, x.dtype, x.sharding.spec)
        assert str(jax.typeof(x_auto)) == typed_notation(x.shape, x.dtype, None)  # Auto axes stay out of types
        assert explicit_mesh_of(x) is EXPLICIT and explicit_mesh_of(x_auto) is None


def test_forward_and_loss_equal_the_auto_model(models):
    auto, explicit = models
    want, got = auto(IDS), explicit(IDS)
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    spec = PartitionAxis().resolve(LOGITS_AXES, shape=got.logits.shape, mesh=EXPLICIT)
    assert str(jax.typeof(got.logits)) == typed_notation(got.logits.shape, "float32", spec)
    assert "264@tp" in str(jax.typeof(got.logits))  # the vocab stays split, as the head computed it
    np.testing.assert_allclose(float(explicit.compute_loss(IDS)[0]), float(auto.compute_loss(IDS)[0]), rtol=1e-6)


def test_the_forward_traces_inside_a_users_jit(models):
    _, explicit = models
    graphdef, state = nnx.split(explicit)
    ids = jax.device_put(IDS, NamedSharding(EXPLICIT, P("dp")))
    loss = jax.jit(lambda s, i: causal_lm_loss(nnx.merge(graphdef, s)(i).logits, labels_from(i))[0])(state, ids)
    np.testing.assert_allclose(float(loss), float(explicit.compute_loss(IDS)[0]), rtol=1e-6)


def test_a_train_step_equals_the_auto_one_and_keeps_the_types(models):
    auto, explicit = models
    step = make_train_step()
    (new_auto, m_auto), (new, m) = (step(to_state(mod), {"input_ids": IDS}) for mod in (auto, explicit))
    np.testing.assert_allclose(float(m["loss"]), float(m_auto["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(m_auto["grad_norm"]), rtol=1e-5)
    for before, after, ref in zip(jax.tree.leaves(to_state(explicit).params), jax.tree.leaves(new.params),
                                  jax.tree.leaves(new_auto.params), strict=True):
        assert str(jax.typeof(after)) == str(jax.typeof(before))
        np.testing.assert_allclose(np.asarray(after), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", [GenerationConfig(max_new_tokens=4), GenerationConfig(max_new_tokens=3,
                                                                                         num_beams=2)],
                         ids=["greedy", "beam"])
def test_generation_equals_the_auto_model(llama, config):
    auto, explicit = llama
    prompt = IDS[:, :6]
    want = auto.generate(prompt, config).sequences
    np.testing.assert_array_equal(np.asarray(explicit.generate(prompt, config).sequences), np.asarray(want))


def test_a_cache_is_typed_by_its_spec_and_comes_back_so(llama):
    _, explicit = llama
    cache = explicit.init_cache(4, 20)
    assert all(explicit_mesh_of(x) is EXPLICIT for x in jax.tree.leaves(cache))
    # rows over (fsdp, dp), the 2 KV heads repeated to one per tp device (tests/core/models/test_repeated_kv_cache.py)
    assert str(jax.typeof(cache.keys)) == "float32[2,4@(fsdp,dp),20@sp,4@tp,16]"
    assert not any(x.sharding.spec for x in (cache.valid_BS, cache.positions_B, cache.index))
    out = explicit(IDS, cache=cache)
    assert [str(jax.typeof(x)) for x in jax.tree.leaves(out.cache)] == \
        [str(jax.typeof(x)) for x in jax.tree.leaves(cache)]


def test_inputs_on_another_mesh_say_what_to_do(llama):
    _, explicit = llama
    other = make_mesh(dp=4, tp=2, axis_types=AxisType.Explicit)
    with pytest.raises(ValueError, match=r"typed on different meshes.*place them on one"):
        explicit(jax.device_put(IDS, NamedSharding(other, P("dp"))))


# -- the bridge itself (workbench.core.mesh) ---------------------------------------------------------------
def test_call_on_auto_axes_runs_gspmd_code_and_types_the_outputs():
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(EXPLICIT, P("dp", "tp")))
    idx = jnp.array([3, 0, 1])
    with pytest.raises(Exception, match="out_sharding"):  # a gather Explicit axes call ambiguous
        jax.jit(lambda x: jnp.take(x, idx, axis=1))(x)
    seen = []

    def gather(x):
        seen.append(jax.typeof(x).sharding.mesh.axis_types)
        return jnp.take(x, idx, axis=1)

    out = jax.jit(lambda x: call_on_auto_axes(gather, (x,), EXPLICIT, lambda out: P("dp", None)))(x)
    assert set(seen[0]) == {AxisType.Auto}
    assert str(jax.typeof(out)) == "float32[4@dp,3]"
    np.testing.assert_array_equal(np.asarray(out), np.arange(32.0).reshape(4, 8)[:, [3, 0, 1]])


def test_auto_twins_and_explicit_specs():
    mixed = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto))
    assert tuple(as_auto(mixed).axis_types) == (AxisType.Auto, AxisType.Auto)
    assert as_auto(EXPLICIT).devices.tolist() == EXPLICIT.devices.tolist()
    assert explicit_spec(P(("b", "a"), "b", None), mixed) == P("a", None, None)
    assert explicit_mesh_of({"x": 1.0, "y": np.zeros(3)}) is None
