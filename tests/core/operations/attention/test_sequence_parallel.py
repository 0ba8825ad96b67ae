"""Sequence-parallel attention (``ring``, ``ulysses``, ``allgather_kv``) on 8 simulated devices, against the
float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.reference import reference_attention
from workbench.core.mesh import make_mesh
from workbench.core.operations.attention import allgather_kv, ring, ulysses  # noqa: F401  (registers them)
from workbench.core.operations.base import OperationMetadata, OperationRegistry

IMPLS = ("ring", "ulysses", "allgather_kv")


def inputs(b=2, t=16, h=8, kv=8, d=8, s=None, seed=0):
    rng = np.random.default_rng(seed)
    s = t if s is None else s
    return (rng.standard_normal((b, t, h, d)).astype(np.float32), rng.standard_normal((b, s, kv, d)).astype(np.float32),
            rng.standard_normal((b, s, kv, d)).astype(np.float32))


def create(name, **mesh_axes):
    return OperationRegistry.create(name, OperationMetadata(mesh=make_mesh(**mesh_axes)))


def segments(t, *cuts):
    """Segment ids ``(len(cuts), t)``: row ``i`` starts a new segment at each index in ``cuts[i]``."""
    return np.stack([np.searchsorted(c, np.arange(t), side="right") for c in cuts]).astype(np.int32)


rng = np.random.default_rng(1)
CASES = {  # name: (mesh axes, input sizes, call kwargs)
    "full": (dict(fsdp=4, sp=2), dict(), dict()),
    "causal": (dict(dp=2, sp=4), dict(t=32), dict(causal=True)),
    "gqa_kv2_causal": (dict(dp=2, tp=2, sp=2), dict(kv=2), dict(causal=True)),
    "mqa_kv1_causal": (dict(fsdp=1, sp=8), dict(kv=1), dict(causal=True)),
    "window_softcap": (dict(dp=2, sp=4), dict(kv=2), dict(sliding_window=5, logits_soft_cap=2.0)),
    "kv_lengths": (dict(fsdp=2, sp=4), dict(kv=2, t=8, s=16), dict(causal=True, kv_lengths=np.array([11, 16]))),
    "segment_ids": (dict(dp=2, sp=4), dict(kv=2), dict(q_segment_ids=segments(16, [5, 12], [9]),
                                                      kv_segment_ids=segments(16, [5, 12], [9]), causal=True)),
    "mask_bias": (dict(dp=2, tp=2, sp=2), dict(kv=2), dict(mask=rng.random((2, 1, 16, 16)) > 0.3,
                                                          bias=rng.standard_normal((1, 8, 16, 16)).astype(np.float32))),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", IMPLS)
def test_matches_reference(name, case):
    mesh_axes, sizes, kwargs = CASES[case]
    q, k, v = inputs(**sizes)
    out = create(name, **mesh_axes)(q, k, v, **kwargs)
    want, _ = reference_attention(q, k, v, **kwargs)
    assert out.kernel_path == f"{name}/shard_map"
    assert out.attention_weights is None
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-5, rtol=0)


def grads(op, q, k, v, cotangent, **kwargs):
    def loss(q, k, v):
        return jnp.sum(op(q, k, v, **kwargs).attention_outputs * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(("name", "mesh_axes", "kwargs"), [
    ("ring", dict(dp=2, sp=4), dict(causal=True)),
    ("ring", dict(dp=2, tp=2, sp=2), dict(sliding_window=6, kv_lengths=np.array([13, 16]))),
    ("ulysses", dict(fsdp=2, sp=4), dict(causal=True, logits_soft_cap=3.0)),
    ("ulysses", dict(dp=2, tp=2, sp=2), dict(sliding_window=6, kv_lengths=np.array([13, 16]))),
])
def test_gradients_match_vanilla(name, mesh_axes, kwargs):
    q, k, v = inputs(kv=2)
    cotangent = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    got = grads(create(name, **mesh_axes), q, k, v, cotangent, **kwargs)
    want = grads(OperationRegistry.create("vanilla"), q, k, v, cotangent, **kwargs)
    for g, w, label in zip(got, want, ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


@pytest.mark.parametrize("name", IMPLS)
def test_sp1_equals_vanilla(name):
    q, k, v = inputs(kv=2)
    out = create(name, fsdp=8)(q, k, v, causal=True).attention_outputs
    want = OperationRegistry.create("vanilla")(q, k, v, causal=True).attention_outputs
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "collective"), [("ring", "collective-permute"), ("ulysses", "all-to-all"),
                                                   ("allgather_kv", "all-gather")])
def test_compiled_hlo_has_collective(name, collective):
    op = create(name, fsdp=4, sp=2)
    q, k, v = inputs(kv=2)
    hlo = jax.jit(lambda q, k, v: op(q, k, v).attention_outputs).lower(q, k, v).compile().as_text()
    assert collective in hlo


@pytest.mark.parametrize("name", IMPLS)
def test_needs_a_mesh_with_sp(name):
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"needs a device mesh with a 'sp' axis; pass OperationMetadata\(mesh="):
        OperationRegistry.create(name)(q, k, v)
    other = jax.make_mesh((8,), ("x",))
    with pytest.raises(ValueError, match=r"has axes \('x',\) but no 'sp' axis"):
        OperationRegistry.create(name, OperationMetadata(mesh=other))(q, k, v)


@pytest.mark.parametrize("name", IMPLS)
def test_lengths_must_divide_by_sp(name):
    q, k, v = inputs(t=12, s=16)
    with pytest.raises(ValueError, match="T=12 and key length S=16 must both be divisible by the 'sp' axis size 8"):
        create(name, fsdp=1, sp=8)(q, k, v)


def test_ulysses_heads_must_divide_by_sp():
    q, k, v = inputs(h=4, kv=2)
    with pytest.raises(ValueError, match=r"H=4 query heads and KV=2 key/value heads cannot be split over sp=8.*'ring'"):
        create("ulysses", fsdp=1, sp=8)(q, k, v)


def test_ulysses_leaves_heads_whole_over_tp_when_sp_needs_them():
    q, k, v = inputs(h=2, kv=2)  # 2 heads: split over tp=2 there would be 1 left for sp=2
    out = create("ulysses", dp=2, tp=2, sp=2)(q, k, v, causal=True).attention_outputs
    expected = OperationRegistry.create("vanilla")(q, k, v, causal=True).attention_outputs
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", IMPLS)
def test_capabilities(name):
    caps = OperationRegistry.capabilities(name)
    assert caps.mesh_axes == ("sp",)
    assert {"causal", "gqa", "gradients", "kv_lengths", "segment_ids"} <= caps.features
    q, k, v = inputs()
    with pytest.raises(ValueError, match="does not support return_weights"):
        create(name, fsdp=4, sp=2)(q, k, v, return_weights=True)
