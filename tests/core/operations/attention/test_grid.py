"""Every registered attention implementation against the float64 reference, on the features it declares.

One hypothesis grid for all of them, so an implementation registered later is tested too.
Per-implementation files test their own specifics (blocks, meshes, pages, cuDNN choice).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.operations.attention.jitting import jitted
from tests.core.operations.attention.reference import reference_attention
from workbench.core.mesh import make_mesh
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention import common

STANDARD = [n for n in OperationRegistry.list_implementations()
            if not OperationRegistry.capabilities(n).supports("paged_kv")]


def _metadata(name):
    if "sp" in OperationRegistry.capabilities(name).mesh_axes:
        return OperationMetadata(mesh=make_mesh(fsdp=2, sp=2, tp=2))
    return OperationMetadata()


@st.composite
def attention_case(draw, features, head_multiple=1):
    kv = draw(st.sampled_from([1, 2]))
    h = kv * draw(st.sampled_from([1, 2])) if common.GQA in features else kv
    h = h if h % head_multiple == 0 else h * head_multiple  # ulysses splits heads over sp=2
    b, d = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    s = 2 * draw(st.integers(1, 12))  # even: the sequence-parallel ones split by sp=2
    t = draw(st.sampled_from(sorted({s, 2 * draw(st.integers(1, s // 2))})))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kw = {}
    on = lambda f: f in features and draw(st.booleans(), label=f)
    if on(common.CAUSAL):
        kw["causal"] = True
    if on(common.SLIDING_WINDOW):
        kw["sliding_window"] = draw(st.integers(1, s))
    if on(common.SOFT_CAP):
        kw["logits_soft_cap"] = draw(st.sampled_from([0.5, 5.0]))
    if on(common.KV_LENGTHS):
        kw["kv_lengths"] = rng.integers(0, s + 1, size=b).astype(np.int32)
    if on(common.SEGMENT_IDS):
        kw["q_segment_ids"] = rng.integers(0, 2, size=(b, t)).astype(np.int32)
        kw["kv_segment_ids"] = rng.integers(0, 2, size=(b, s)).astype(np.int32)
    if on(common.BIAS):
        kw["bias"] = rng.normal(size=(b, 1, t, s)).astype(np.float32)
    if on(common.MASK):
        kw["mask"] = rng.random((1, h, t, s)) < 0.8
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, kv, d)).astype(np.float32) for _ in range(2))
    return q, k, v, kw


@pytest.mark.parametrize("name", STANDARD)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_matches_float64_reference(name, data):
    features = OperationRegistry.capabilities(name).features
    q, k, v, kw = data.draw(attention_case(features, head_multiple=2 if name == "ulysses" else 1))
    op = OperationRegistry.create(name, _metadata(name))
    # NumPy inputs, placed by jit from the host: jax.Arrays on one device are re-split over the mesh by a small
    # program compiled per shape (10 to 17 more compiles for each sequence-parallel implementation)
    out = jitted(op, q, k, v, **kw)
    expected, _ = reference_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out.attention_outputs, np.float64), expected, atol=2e-5, rtol=0)
    assert out.kernel_path.startswith(OperationRegistry.canonical_name(name) + "/")


@pytest.mark.parametrize("name", STANDARD)
def test_declared_capabilities_are_enforced(name):
    caps = OperationRegistry.capabilities(name)
    q = jnp.ones((1, 4, 2, 8))
    op = OperationRegistry.create(name, _metadata(name))
    if not caps.supports(common.RETURN_WEIGHTS):
        with pytest.raises(ValueError, match=rf"{name}.*does not support return_weights.*vanilla"):
            op(q, q, q, return_weights=True)
    if not caps.supports(common.SOFT_CAP):
        with pytest.raises(ValueError, match=r"does not support logits_soft_cap.*'vanilla'"):
            op(q, q, q, logits_soft_cap=1.0)


def test_rows_that_see_nothing_are_zero_everywhere():
    """kv_lengths = 0 for one sequence: every implementation returns zeros there, never NaN or mean(V)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 4, 2, 8)).astype(np.float32) for _ in range(3))  # NumPy: as above
    lengths = np.array([4, 0], np.int32)
    for name in STANDARD:
        out = jitted(OperationRegistry.create(name, _metadata(name)), q, k, v, causal=True, kv_lengths=lengths)
        np.testing.assert_array_equal(np.asarray(out.attention_outputs[1]), 0.0, err_msg=name)
        assert np.isfinite(np.asarray(out.attention_outputs)).all(), name


def test_switching_by_name_reuses_compiled_code():
    """A static impl name selects the kernel; switching back hits jit's cache, nothing recompiles."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 16, 4, 8)), jnp.float32) for _ in range(3))

    @jax.jit
    def embed(x):
        return x * 2.0

    def attend(q, k, v, impl):
        return OperationRegistry.create(impl)(q, k, v, causal=True).attention_outputs

    attend = jax.jit(attend, static_argnames="impl")
    outs = {name: attend(embed(q), k, v, impl=name) for name in ["vanilla", "flash", "sdpa"]}
    assert attend._cache_size() == 3 and embed._cache_size() == 1
    for name in ["flash", "vanilla", "sdpa", "blockwise"]:
        attend(embed(q), k, v, impl=name)
    # "blockwise" is an alias of flash but a new static value: one more entry, nothing else recompiled
    assert attend._cache_size() == 4 and embed._cache_size() == 1
    np.testing.assert_allclose(outs["flash"], outs["vanilla"], atol=2e-5)
    np.testing.assert_allclose(outs["sdpa"], outs["vanilla"], atol=2e-5)
