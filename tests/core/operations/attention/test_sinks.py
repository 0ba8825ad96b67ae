"""Learned attention sinks (GPT-OSS): every implementation that claims ``sinks`` matches a float64 NumPy
reference and transformers' own ``eager_attention_forward`` of GPT-OSS (values and gradients, sinks
included); every one that does not refuses with the error naming those that do."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.reference import reference_attention
from workbench.core.mesh import make_mesh
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import GRADIENTS, SINKS
from workbench.core.operations.attention.paged import PAGED_KV

B, T, S, H, KV, D = 2, 6, 9, 4, 2, 8
RNG = np.random.default_rng(0)
Q, K, V = (RNG.standard_normal(shape).astype(np.float32) for shape in ((B, T, H, D), (B, S, KV, D), (B, S, KV, D)))
SINK_H = (2.0 * RNG.standard_normal(H)).astype(np.float32)
LENGTHS = np.array([S, S - 3], np.int32)
CASES = {"causal": dict(causal=True), "causal+lengths": dict(causal=True, kv_lengths=LENGTHS),
         "window": dict(causal=True, sliding_window=3), "decode": dict(causal=True, kv_lengths=LENGTHS)}


def contiguous_impls():
    return [n for n in OperationRegistry.list_implementations() if n not in OperationRegistry.supporting(PAGED_KV)]


def call(name, q, k, v, **kwargs):
    impl = OperationRegistry.get(name)
    metadata = OperationMetadata(mesh=make_mesh(sp=2)) if impl.capabilities.mesh_axes else OperationMetadata()
    return OperationRegistry.create(name, metadata)(q, k, v, **kwargs).attention_outputs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", contiguous_impls())
def test_claimed_sinks_match_the_reference_and_the_others_refuse(name, case):
    kwargs = CASES[case]
    q = Q[:, -1:] if case == "decode" else Q
    supporting = OperationRegistry.supporting(SINKS)
    if name not in supporting:
        with pytest.raises(ValueError, match=f"does not support {SINKS}; implementations that do: .*vanilla"):
            call(name, q, K, V, sinks=SINK_H, **kwargs)
        return
    want, _ = reference_attention(q, K, V, sinks=SINK_H, **kwargs)
    got = call(name, jnp.asarray(q), jnp.asarray(K), jnp.asarray(V), sinks=jnp.asarray(SINK_H), **kwargs)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def test_sinks_take_weight_and_a_query_that_sees_nothing_stays_zero():
    mask = np.ones((B, 1, T, S), bool)
    mask[0, :, 0] = False  # query 0 of row 0 sees no key
    out = OperationRegistry.create("vanilla", OperationMetadata())(
        jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), mask=jnp.asarray(mask), sinks=jnp.asarray(SINK_H),
        return_weights=True)
    weights = np.asarray(out.attention_weights)
    assert np.all(weights.sum(-1)[1] < 1) and np.all(np.isfinite(np.asarray(out.attention_outputs)))
    assert not np.asarray(out.attention_outputs)[0, 0].any() and not weights[0, :, 0].any()
    want, want_w = reference_attention(Q, K, V, mask=mask, sinks=SINK_H)
    np.testing.assert_allclose(weights, want_w, atol=2e-6)
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-6)


def test_equal_to_transformers_gpt_oss_eager_attention():
    torch = pytest.importorskip("torch")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = types.SimpleNamespace(sinks=torch.tensor(SINK_H), num_key_value_groups=H // KV, training=False)
    pad = 3  # row 1 left-padded: its first 3 keys are padding
    visible = np.tril(np.ones((T, S), bool), k=S - T)[None].repeat(B, 0)
    visible[1, :, :pad] = False
    additive = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]
    scale = D ** -0.5
    t = lambda x: torch.tensor(x).transpose(1, 2)  # BTHD -> BHTD
    want, _ = eager_attention_forward(module, t(Q), t(K), t(V), torch.tensor(additive), scaling=scale)
    for name in sorted(set(OperationRegistry.supporting(SINKS)) & set(contiguous_impls())):
        got = call(name, jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), mask=jnp.asarray(visible[:, None]),
                   sinks=jnp.asarray(SINK_H), softmax_scale=scale)
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-6, err_msg=name)


@pytest.mark.parametrize("name", sorted(set(OperationRegistry.supporting(SINKS)) & set(contiguous_impls())
                                        & set(OperationRegistry.supporting(GRADIENTS))))
def test_gradients_reach_the_sinks(name):
    """Gradients w.r.t. q, k, v and sinks equal those of a plain jnp float64 formula of the same math."""
    x64 = jax.config.jax_enable_x64
    dtype = jnp.float64 if x64 else jnp.float32

    def loss(fn):
        return lambda q, k, v, sinks: jnp.sum(jnp.sin(fn(q, k, v, sinks)))

    def formula(q, k, v, sinks):
        kr, vr = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, kr) * D ** -0.5
        causal = np.tril(np.ones((T, S), bool), k=S - T)
        logits = jnp.where(causal, logits, -jnp.inf)
        sink = jnp.broadcast_to(sinks[None, :, None, None], (B, H, T, 1))
        w = jax.nn.softmax(jnp.concatenate([logits, sink], -1), axis=-1)[..., :-1]
        return jnp.einsum("bhts,bshd->bthd", w, vr)

    impl = lambda q, k, v, sinks: call(name, q, k, v, sinks=sinks, causal=True)
    args = [jnp.asarray(x, dtype) for x in (Q, K, V, SINK_H)]
    got = jax.grad(loss(impl), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(loss(formula), argnums=(0, 1, 2, 3))(*args)
    for g, w, what in zip(got, want, "qkvs", strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, err_msg=what)


def test_paged_attention_with_sinks_equals_the_reference():
    page = 4
    pages_K = np.zeros((8, page, KV, D), np.float32)
    pages_V = np.zeros_like(pages_K)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    for b in range(B):
        for s in range(S):
            pages_K[table[b, s // page], s % page], pages_V[table[b, s // page], s % page] = K[b, s], V[b, s]
    out = OperationRegistry.create("paged", OperationMetadata())(
        jnp.asarray(Q[:, -2:]), jnp.asarray(pages_K), jnp.asarray(pages_V), page_table=jnp.asarray(table),
        kv_lengths=jnp.asarray(LENGTHS), causal=True, sinks=jnp.asarray(SINK_H)).attention_outputs
    want, _ = reference_attention(Q[:, -2:], K, V, causal=True, kv_lengths=LENGTHS, sinks=SINK_H)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)


def test_bad_sinks_say_what_to_pass():
    with pytest.raises(ValueError, match=r"sinks must be a float array \(H,\) = \(4,\)"):
        call("vanilla", jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), sinks=jnp.zeros((2,)))
