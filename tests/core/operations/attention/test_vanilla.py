"""``vanilla``: the weights it returns, dtypes, and input errors (shared by every implementation)."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.reference import reference_attention
from workbench.core.operations import OperationMetadata, OperationRegistry


def _qkv(rng, b=2, t=5, s=7, h=4, kv=2, d=8, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.normal(size=shape), dtype) for shape in [(b, t, h, d), (b, s, kv, d), (b, s, kv, d)])


def test_weights_match_the_reference_and_sum_to_one_where_visible():
    q, k, v = _qkv(np.random.default_rng(0))
    kw = dict(causal=True, sliding_window=3, logits_soft_cap=2.0, kv_lengths=np.array([7, 2], np.int32))
    out = OperationRegistry.create("vanilla")(q, k, v, return_weights=True,
                                              **{**kw, "kv_lengths": jnp.asarray(kw["kv_lengths"])})
    ref_out, ref_w = reference_attention(q, k, v, **kw)
    np.testing.assert_allclose(np.asarray(out.attention_weights), ref_w, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.attention_outputs), ref_out, atol=2e-5)
    sums = np.asarray(out.attention_weights).sum(-1)
    assert np.all(np.isclose(sums, 1.0, atol=1e-5) | (sums == 0))
    assert out.kernel_path == "vanilla/native"


def test_bfloat16_inputs_softmax_in_float32():
    q, k, v = _qkv(np.random.default_rng(1), dtype=jnp.bfloat16)
    out = OperationRegistry.create("vanilla")(q, k, v, causal=True)
    assert out.attention_outputs.dtype == jnp.bfloat16
    ref, _ = reference_attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32),
                                 causal=True)
    np.testing.assert_allclose(np.asarray(out.attention_outputs, np.float64), ref, atol=2e-2)


def test_softmax_scale_from_metadata():
    q, k, v = _qkv(np.random.default_rng(2))
    out = OperationRegistry.create("vanilla", OperationMetadata(softmax_scale=0.3))(q, k, v)
    ref, _ = reference_attention(q, k, v, softmax_scale=0.3)
    np.testing.assert_allclose(np.asarray(out.attention_outputs), ref, atol=2e-5)


@pytest.mark.parametrize("call, message", [
    (lambda op, q, k, v: op(q[0], k, v), r"query must be 4-D BTHD"),
    (lambda op, q, k, v: op(q, k, v[:, :3]), r"key .* and value .* must be \(B, S, KV, D\) and \(B, S, KV, Dv\)"),
    (lambda op, q, k, v: op(q[:, :, :3], k, v), r"3 query heads are not a multiple of 2"),
    (lambda op, q, k, v: op(q, k, v, mask=jnp.ones((2, 4, 5, 6), bool)), r"dimension S is 6, expected 1 or 7"),
    (lambda op, q, k, v: op(q, k, v, mask=jnp.ones((5, 7))), r"mask must be bool.*bias="),
    (lambda op, q, k, v: op(q, k, v, kv_lengths=jnp.ones(3, jnp.int32)), r"kv_lengths must be an int array"),
    (lambda op, q, k, v: op(q, k, v, q_segment_ids=jnp.ones((2, 5), jnp.int32)), r"pass both q_segment_ids"),
    (lambda op, q, k, v: op(q, k, v, sliding_window=0), r"sliding_window must be a positive int"),
    (lambda op, q, k, v: op(q, k, v, logits_soft_cap=-1.0), r"logits_soft_cap must be positive"),
])
def test_bad_inputs_say_what_to_change(call, message):
    q, k, v = _qkv(np.random.default_rng(3))
    with pytest.raises(ValueError, match=message):
        call(OperationRegistry.create("vanilla"), q, k, v)
