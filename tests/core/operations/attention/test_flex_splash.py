"""``flex`` on splash attention (``kernel="splash"``: Pallas' interpret mode on CPU): masks, GQA / MQA, soft cap and
segment ids against the float64 reference, gradients against the native path, what splash does not serve, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.jitting import jitted
from tests.core.operations.attention.reference import reference_attention
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention import block_mask as bm
from workbench.core.operations.attention import flex, flex_splash
from workbench.core.operations.attention.flex_splash import flex_attention_splash, splash_mask, splash_serves

# one splash block, as at 256 (splash's block is T up to 512); 128 is the smallest splash takes, and there the
# native reference is one tile too: its gradient compiles in about a third less time than at 256
T = 128
SEGMENTS = np.repeat(np.arange(4), (20, 50, 8, 50))  # packed documents over T positions

# (flex kwargs, reference kwargs, (B, H, KV))
CASES = {
    "full": ({}, {}, (1, 2, 2)),
    "causal": ({"causal": True}, {"causal": True}, (2, 2, 2)),
    "sliding_window": ({"sliding_window": 50}, {"sliding_window": 50}, (1, 2, 2)),
    "window_mod_and_causal": ({"mask_mod": bm.sliding_window(70), "causal": True}, {"sliding_window": 70},
                              (1, 2, 2)),
    "gqa": ({"causal": True}, {"causal": True}, (1, 4, 2)),
    "mqa": ({"sliding_window": 90}, {"sliding_window": 90}, (1, 2, 1)),
    "soft_cap": ({"causal": True, "logits_soft_cap": 1.5}, {"causal": True, "logits_soft_cap": 1.5}, (1, 2, 2)),
}


def _inputs(b, h, kv, t=T, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    return q, k, v


def _flex(kernel="auto"):
    return OperationRegistry.create("flex", OperationMetadata(options={"kernel": kernel}))


def _check_against_native(q, k, v, kw, ref_kw):
    """Output against the float64 reference (2e-5), gradients against flex's native path (1e-4); splash's forward
    and both gradients are one compiled program (one compile instead of three)."""
    splash, native, paths = _flex("splash"), _flex("native"), []

    def forward(op, q, k, v):
        out = op(q, k, v, **kw)
        paths.append(out.kernel_path)
        return out.attention_outputs

    grad = lambda op: jax.grad(lambda q, k, v: jnp.sum(forward(op, q, k, v) ** 2), argnums=(0, 1, 2))
    with jax.default_matmul_precision("highest"):
        out, got, ref = jax.jit(lambda q, k, v: (forward(splash, q, k, v), grad(splash)(q, k, v),
                                                 grad(native)(q, k, v)))(q, k, v)
    assert paths[0] == "flex/splash (interpret)"
    want, _ = reference_attention(q, k, v, **ref_kw)
    np.testing.assert_allclose(out, want, atol=2e-5)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_splash_matches_the_reference_and_the_native_gradients(case):
    kw, ref_kw, (b, h, kv) = CASES[case]
    _check_against_native(*_inputs(b, h, kv), kw, ref_kw)


def test_segment_ids_and_rows_that_see_no_key():
    """Splash's SegmentIds are ours (equal ids only); a query whose id no key has gets 0, not splash's mean of V."""
    q, k, v = _inputs(2, 2, 2)
    kv_ids = np.stack([SEGMENTS, SEGMENTS[::-1]]).astype(np.int32)
    q_ids = kv_ids.copy()
    q_ids[1, :8] = 7  # no key has id 7
    ids = {"q_segment_ids": jnp.asarray(q_ids), "kv_segment_ids": jnp.asarray(kv_ids)}
    _check_against_native(q, k, v, {**ids, "causal": True}, {**ids, "causal": True})
    out = jitted(_flex("splash"), q, k, v, **ids).attention_outputs
    assert out.shape == q.shape and not np.any(np.asarray(out[1, :8]))
    np.testing.assert_allclose(out, reference_attention(q, k, v, **ids)[0], atol=2e-5)


def test_block_sparse_window_over_several_blocks():
    """128-blocks at T=512: a window of 100 leaves most tiles empty (skipped); output and gradients still match."""
    q, k, v = _inputs(1, 2, 2, t=512, d=16, seed=3)
    native = _flex("native")
    call = native.prepare(q, k, v, sliding_window=100)
    assert splash_serves(call, None, None, None) is None and splash_mask(call, None, None) == ("window", 100)
    run = lambda q, k, v: flex_attention_splash(native.prepare(q, k, v, sliding_window=100), "window", 100,
                                                interpret=True, block=128)
    grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
    with jax.default_matmul_precision("highest"):  # one program: one compile instead of three
        out, got, ref = jax.jit(lambda q, k, v: (run(q, k, v), grad(run)(q, k, v), grad(
            lambda q, k, v: native(q, k, v, sliding_window=100).attention_outputs)(q, k, v)))(q, k, v)
    np.testing.assert_allclose(out, reference_attention(q, k, v, sliding_window=100)[0], atol=2e-5)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_a_kernel_first_built_under_jit_serves_eager_calls():
    """Splash's kernels are cached: one first built inside a jit trace must hold no tracer."""
    q, k, v = _inputs(1, 2, 1, seed=4)
    flex_splash._kernel.cache_clear()
    run = lambda q, k, v: _flex("splash")(q, k, v, causal=True).attention_outputs
    np.testing.assert_array_equal(jax.jit(run)(q, k, v), run(q, k, v))


def test_which_masks_splash_takes():
    q, k, v = _inputs(1, 2, 2)
    prepare = _flex().prepare
    plain = prepare(q, k, v)
    assert splash_mask(plain, None, None) == ("full", None)
    assert splash_mask(prepare(q, k, v, causal=True), None, None) == ("causal", None)
    assert splash_mask(plain, bm.causal, None) == ("causal", None)
    assert splash_mask(prepare(q, k, v, sliding_window=30), bm.sliding_window(60), None) == ("window", 30)
    both = bm.create_block_mask(bm.causal, None, None, T, T) & bm.create_block_mask(bm.sliding_window(40), None,
                                                                                     None, T, T)
    assert splash_mask(plain, None, both) == ("window", 40)
    assert "prefix_lm(8)" in splash_mask(plain, bm.prefix_lm(8), None)
    assert "(causal | sliding_window(4))" in splash_mask(plain, bm._Combined(jnp.logical_or, bm.causal,
                                                                              bm.sliding_window(4), "|"), None)


def test_what_splash_does_not_serve_says_why():
    q, k, v = _inputs(1, 2, 2)
    prepare = _flex().prepare
    assert splash_serves(prepare(q, k, v), None, bm.soft_cap(2.0), None) == "a score_mod"
    lengths = prepare(q, k, v, causal=True, kv_lengths=jnp.array([100], jnp.int32))
    assert splash_serves(lengths, None, None, None) == "kv_lengths"
    assert "T=64 != S=128" in splash_serves(prepare(q[:, :64], k, v, causal=True), None, None, None)
    assert "not a multiple of 128" in splash_serves(prepare(q[:, :100], k[:, :100], v[:, :100]), None, None, None)
    assert "sinks" in splash_serves(prepare(q, k, v, sinks=jnp.zeros(2)), None, None, None)
    assert "another head dim" in splash_serves(prepare(q, k, v[..., :16]), None, None, None)
    assert "mask_mod document" in splash_serves(prepare(q, k, v), bm.document(SEGMENTS), None, None)
    # on a TPU (backend="tpu") such calls run the native path, saying why
    tpu = OperationRegistry.create("flex", OperationMetadata(backend="tpu"))
    out = jitted(tpu, q, k, v, causal=True, score_mod=bm.alibi(2))
    assert out.kernel_path == "flex/native (splash does not serve a score_mod)"
    np.testing.assert_allclose(out.attention_outputs, jitted(_flex("native"), q, k, v, causal=True,
                                                             score_mod=bm.alibi(2)).attention_outputs)


def test_kernel_splash_raises_where_it_cannot_serve():
    q, k, v = _inputs(1, 2, 2)
    with pytest.raises(ValueError, match="splash attention does not serve a score_mod; use kernel='native'"):
        _flex("splash")(q, k, v, score_mod=bm.soft_cap(2.0))
    with pytest.raises(ValueError, match=r"T=64 != S=128"):
        _flex("splash")(q[:, :64], k, v, causal=True)
    with pytest.raises(ValueError, match="option kernel must be one of"):
        _flex("tpu")(q, k, v)
    assert "splash" in flex.KERNELS
    call = _flex().prepare(q, k, v)
    with pytest.raises(ValueError, match="mask_kind must be one of"):
        flex_attention_splash(call, "window", None, interpret=True)
    with pytest.raises(ValueError, match="check splash_serves first"):
        flex_attention_splash(call, "full", None, interpret=True, block=96)
