"""``flex``: random score and mask mods against the float64 reference (the mods' meaning written again in NumPy, as
dense masks and biases), gradients against ``vanilla``, block masks against a dense evaluation, and the tiles the
kernel visits counted."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.operations.attention.jitting import jitted
from tests.core.operations.attention.reference import reference_attention
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention import block_mask as bm
from workbench.core.operations.attention import flex

MASKS = ("none", "causal", "window", "prefix_lm", "document", "streaming")
SCORES = ("none", "alibi", "soft_cap")


def _dense_mask(kind, t, s, rng, draw):
    """The mask a mod means, in NumPy (positions: query i at s - t + i), and the mod."""
    q = (s - t + np.arange(t))[:, None]
    k = np.arange(s)[None, :]
    if kind == "none":
        return np.ones((t, s), bool), None
    if kind == "causal":
        return q >= k, bm.causal
    if kind == "window":
        w = draw(st.integers(1, s))
        return (q >= k) & (q - k < w), bm.sliding_window(w)
    if kind == "prefix_lm":
        p = draw(st.integers(1, s))
        return (k < p) | (q >= k), bm.prefix_lm(p)
    if kind == "streaming":
        w, n = draw(st.integers(1, s)), draw(st.integers(1, 4))
        return (q >= k) & ((q - k < w) | (k < n)), bm.streaming(w, n)
    bounds = np.sort(rng.choice(np.arange(1, s), size=min(3, s - 1), replace=False))
    doc = np.searchsorted(bounds, np.arange(s), side="right")  # random document boundaries
    return (doc[np.clip(q, 0, s - 1)] == doc[k]) & (q >= k), bm.document(doc)


@st.composite
def flex_case(draw, mask_kind):
    m = MASKS.index(mask_kind)
    kv = draw(st.sampled_from([1, 2]))
    h = kv * draw(st.sampled_from([1, 2]))
    b, d = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    s = draw(st.integers(2, 40))
    t = draw(st.sampled_from(sorted({s, draw(st.integers(1, s))})))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    dense, mask_mod = _dense_mask(mask_kind, t, s, rng, draw)
    # hypothesis runs each mask's simplest example first (every first choice): there mask m has score
    # SCORES[m % 3] and sinks when m is odd, so the six masks' first examples hold every (score, sinks) pair
    score_kind = draw(st.sampled_from(SCORES[m % 3:] + SCORES[:m % 3]))
    ref_kw, score_mod = {}, None
    if score_kind == "alibi":
        h = max(h, 2)
        kv = min(kv, h)
        slopes = np.array([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
        qpos = (s - t + np.arange(t))[:, None]
        ref_kw["bias"] = slopes[None, :, None, None] * (np.arange(s)[None, :] - qpos)[None, None]
        score_mod = bm.alibi(h)
    elif score_kind == "soft_cap":
        cap = draw(st.sampled_from([0.5, 5.0]))
        ref_kw["logits_soft_cap"], score_mod = cap, bm.soft_cap(cap)
    if draw(st.sampled_from([m % 2 == 1, m % 2 == 0]), label="sinks"):
        ref_kw["sinks"] = rng.normal(size=h)
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, kv, d)).astype(np.float32) for _ in range(2))
    blocks = (draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 4, 16])))
    return q, k, v, dense, mask_mod, score_mod, ref_kw, blocks


# Each example compiles programs of its own (~0.5 s of CPU). Four per mask, 24 (one test drawing the mask at random
# ran 40): every mask mod four times, every score mod with sinks on and off in the masks' first examples (see
# flex_case), and 18 random ones for GQA, T < S and blocks of 1, 4 and 16 (clipped to T, S or padded).
@pytest.mark.parametrize("mask_kind", MASKS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_mods_match_the_float64_reference(mask_kind, data):
    q, k, v, dense, mask_mod, score_mod, ref_kw, (block_q, block_k) = data.draw(flex_case(mask_kind), label="case")
    op = OperationRegistry.create("flex", OperationMetadata(options={"block_q": block_q, "block_k": block_k}))
    sinks = ref_kw.get("sinks")
    # NumPy inputs: jit takes them as they are (jnp.asarray would compile a copy program per new shape)
    out = jitted(op, q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                 sinks=None if sinks is None else sinks.astype(np.float32))
    expected, _ = reference_attention(q, k, v, mask=dense[None, None], **ref_kw)
    np.testing.assert_allclose(np.asarray(out.attention_outputs, np.float64), expected, atol=2e-5, rtol=0)
    assert out.kernel_path == "flex/native"


def test_bfloat16_within_2e_2():
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(1, 96, 4, 16)).astype(np.float32) for _ in range(3))
    mod = bm.sliding_window(24)
    out = jitted(OperationRegistry.create("flex", OperationMetadata(options={"block_q": 32, "block_k": 32})),
                 *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), mask_mod=mod, score_mod=bm.soft_cap(5.0))
    i = np.arange(96)
    dense = (i[:, None] >= i[None]) & (i[:, None] - i[None] < 24)
    expected, _ = reference_attention(*(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v)),
                                      mask=dense[None, None], logits_soft_cap=5.0)
    assert np.max(np.abs(np.asarray(out.attention_outputs, np.float64) - expected)) <= 2e-2


@pytest.mark.parametrize("mods", [
    {"causal": True}, {"mask_mod": bm.document(np.repeat(np.arange(4), 16))},
    {"mask_mod": bm.prefix_lm(20), "score_mod": bm.alibi(4)}, {"sliding_window": 9, "logits_soft_cap": 2.0},
])
def test_gradients_match_vanilla(mods):
    """Gradients of q, k, v against ``vanilla`` given the same mask and bias densely (<= 1e-4)."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(2, 64, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 64, 2, 8)), jnp.float32) for _ in range(2))
    dense_kw = {key: val for key, val in mods.items() if key not in ("mask_mod", "score_mod")}
    i = jnp.arange(64)
    if "mask_mod" in mods:
        dense_kw["mask"] = bm.vectorize_mask(mods["mask_mod"])(jnp.arange(1), jnp.arange(1), i, i)
    if "score_mod" in mods:
        dense_kw["bias"] = bm.vectorize_score(mods["score_mod"])(jnp.zeros((1, 4, 64, 64)), jnp.arange(1),
                                                                  jnp.arange(4), i, i)
    fx = OperationRegistry.create("flex", OperationMetadata(options={"block_q": 16, "block_k": 16}))
    van = OperationRegistry.create("vanilla")
    w = jnp.asarray(rng.normal(size=(2, 64, 4, 8)), jnp.float32)
    grad = lambda op, kw: jax.grad(lambda q, k, v: jnp.sum(w * op(q, k, v, **kw).attention_outputs), (0, 1, 2))
    with jax.default_matmul_precision("highest"):  # both in one program: one compile
        got, want = jax.jit(lambda q, k, v: (grad(fx, mods)(q, k, v), grad(van, dense_kw)(q, k, v)))(q, k, v)
    for g, r, name in zip(got, want, "qkv", strict=True):
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-4, name


def test_the_kernel_visits_only_the_tiles_the_block_mask_lists(monkeypatch):
    """A sliding window of 64 over 1024 positions in 64 x 64 tiles: 31 of 136 causal tiles, counted as the
    forward runs them; the backward recomputes the same ones."""
    visited = []
    monkeypatch.setattr(flex, "_TILE_HOOK", lambda i, j: visited.append((int(i), int(j))))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 1024, 2, 8)), jnp.float32) for _ in range(3))
    mask = bm.create_block_mask(bm.sliding_window(64), None, None, 1024, 1024, 64, 64)
    assert (mask.count(bm.FULL), mask.count(bm.PARTIAL), mask.count(bm.EMPTY)) == (0, 31, 225)
    op = OperationRegistry.create("flex")
    out = jitted(op, q, k, v, block_mask=mask).attention_outputs
    jax.block_until_ready(out)
    expected = {(i, j) for i in range(16) for j in (i - 1, i) if j >= 0}
    assert sorted(visited) == sorted(expected)
    visited.clear()
    jax.block_until_ready(jax.jit(jax.grad(lambda q: op(q, k, v, block_mask=mask).attention_outputs.sum()))(q))
    assert set(visited) == expected and len(visited) >= len(expected)


def test_the_picture_is_html_boxes_one_per_tile_in_the_tiles_proportion():
    """Rows are query blocks, columns key blocks; a 128 x 256 tile is drawn twice as wide as tall; no SVG, which
    JupyterLab's sanitiser strips from an untrusted notebook."""
    mask = bm.create_block_mask(bm.causal, None, None, 1024, 1024, 128, 256)
    picture = mask.picture()
    assert "<svg" not in picture
    rows = re.findall(r'<div style="display:flex">(.*?)</div></div>', picture)
    boxes = [re.findall(r"width:(\d+)px;height:(\d+)px;background:(#\w+)", row) for row in rows]
    assert [len(row) for row in boxes] == [4] * 8
    assert {(int(w), int(h)) for row in boxes for w, h, _ in row} == {(2 * int(boxes[0][0][1]), int(boxes[0][0][1]))}
    colour = {c: k for k, c in bm._COLORS.items()}
    np.testing.assert_array_equal([[colour[c] for *_, c in row] for row in boxes], mask.kinds[0, 0])


def test_block_masks_agree_with_the_dense_mask_and_compose():
    t, s = 100, 130
    doc = np.repeat(np.arange(5), 26)
    a, c = bm.document(doc), bm.sliding_window(30)
    for mod in (a, c, bm.prefix_lm(17), bm.streaming(20, 4)):
        mask = bm.create_block_mask(mod, None, None, t, s, 16, 32)
        dense = np.asarray(bm.vectorize_mask(mod)(jnp.arange(1), jnp.arange(1), jnp.arange(t) + s - t,
                                                  jnp.arange(s)))[0, 0]
        seen, every = np.zeros((7 * 16, 5 * 32), bool), np.ones((7 * 16, 5 * 32), bool)
        seen[:t, :s], every[:t, :] = dense, False  # padded keys are never seen; padded queries do not count
        every[:t, :s] = dense
        every[t:, :s] = True
        any_ = seen.reshape(7, 16, 5, 32).any(axis=(1, 3))
        all_ = every.reshape(7, 16, 5, 32).all(axis=(1, 3))
        want = np.where(all_, bm.FULL, np.where(any_, bm.PARTIAL, bm.EMPTY))
        np.testing.assert_array_equal(mask.kinds[0, 0], want)
    both = bm.create_block_mask(a, None, None, t, s, 16, 32) & bm.create_block_mask(c, None, None, t, s, 16, 32)
    either = bm.create_block_mask(a, None, None, t, s, 16, 32) | bm.create_block_mask(c, None, None, t, s, 16, 32)
    assert both.count(bm.EMPTY) >= max(bm.create_block_mask(m, None, None, t, s, 16, 32).count(bm.EMPTY)
                                       for m in (a, c))
    assert either.count(bm.EMPTY) <= both.count(bm.EMPTY)
    assert 'class="wb-block-mask"' in both._repr_html_() and "sparsity" in repr(both)
    assert bm.create_block_mask(c, None, None, t, s, 16, 32) is bm.create_block_mask(c, None, None, t, s, 16, 32)
    with pytest.raises(ValueError, match="same T, S"):
        _ = both & bm.create_block_mask(c, None, None, t, s, 16, 16)


def test_a_mask_that_reads_the_head_is_built_per_head():
    """Heads 0 and 1 see different halves: the block mask depends on ``h``, and each head's output matches."""
    half = lambda b, h, q, k: (q >= k) & ((k % 2) == h)
    assert bm.depends_on_batch_or_head(half) and not bm.depends_on_batch_or_head(bm.causal)
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(1, 32, 2, 8)).astype(np.float32) for _ in range(3))
    out = jitted(OperationRegistry.create("flex", OperationMetadata(options={"block_q": 8, "block_k": 8})),
                 jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask_mod=half)
    i = np.arange(32)
    dense = np.stack([(i[:, None] >= i[None]) & ((i[None] % 2) == h) for h in range(2)])[None]
    expected, _ = reference_attention(q, k, v, mask=dense)
    np.testing.assert_allclose(np.asarray(out.attention_outputs), expected, atol=2e-5)


def test_bad_mods_and_masks_say_what_to_change():
    q = jnp.ones((1, 8, 2, 4))
    op = OperationRegistry.create("flex")
    with pytest.raises(ValueError, match="write it with jnp ops on scalars"):
        op(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: q_idx.shape[5])
    with pytest.raises(ValueError, match=r"built for \(B, H, T, S\)"):
        op(q, q, q, block_mask=bm.create_block_mask(bm.causal, None, None, 16, 16))
    with pytest.raises(TypeError, match="score_mod must be a function"):
        op(q, q, q, score_mod=3.0)
    with pytest.raises(ValueError, match="positive int"):
        bm.create_block_mask(bm.causal, None, None, 0, 8)


@pytest.mark.parametrize("mods", [{"causal": True}, {"mask_mod": bm.document(np.repeat(np.arange(4), 16))},
                                  {"sliding_window": 20, "logits_soft_cap": 3.0, "score_mod": bm.alibi(4)}])
def test_the_pallas_kernel_in_interpret_mode_equals_the_native_path(mods):
    """``kernel="pallas"`` on CPU runs the GPU kernel in Pallas' interpret mode: the same output and gradients."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(1, 64, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 64, 2, 16)), jnp.float32) for _ in range(2))
    blocks = {"block_q": 16, "block_k": 16}
    pallas = OperationRegistry.create("flex", OperationMetadata(options={**blocks, "kernel": "pallas"}))
    native = OperationRegistry.create("flex", OperationMetadata(options=blocks))
    with jax.default_matmul_precision("highest"):
        (out, grads, path), (want, want_grads, want_path) = (_output_and_grads(op, q, k, v, mods)
                                                              for op in (pallas, native))
    assert path == "flex/pallas (interpret)" and want_path == "flex/native"
    np.testing.assert_allclose(out, want, atol=2e-5)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _output_and_grads(op, q, k, v, mods):
    """``op``'s output (its forward), the gradients of ``sum(output ** 2)`` and its kernel path: the forward and
    the gradient compiled as one program (one compile instead of two)."""
    paths = []

    def forward(q, k, v):
        out = op(q, k, v, **mods)
        paths.append(out.kernel_path)
        return out.attention_outputs

    grad = jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v) ** 2), argnums=(0, 1, 2))
    out, grads = jax.jit(lambda q, k, v: (forward(q, k, v), grad(q, k, v)))(q, k, v)
    return out, grads, paths[0]


def test_kernels_that_cannot_serve_a_call_say_so():
    q = jnp.ones((1, 16, 2, 8))
    with pytest.raises(ValueError, match="Pallas kernel does not serve kv_lengths"):
        OperationRegistry.create("flex", OperationMetadata(options={"kernel": "pallas"}))(
            q, q, q, causal=True, kv_lengths=jnp.array([9], jnp.int32))
    with pytest.raises(ValueError, match="kernel='cudnn' serves plain causal"):
        OperationRegistry.create("flex", OperationMetadata(options={"kernel": "cudnn"}))(q, q, q, causal=True)
    with pytest.raises(ValueError, match="option kernel must be one of"):
        OperationRegistry.create("flex", OperationMetadata(options={"kernel": "triton"}))(q, q, q)
    # what a GPU would run, decided without one
    call = OperationRegistry.create("flex").prepare(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16),
                                                    q.astype(jnp.bfloat16), causal=True)
    assert flex.cudnn_serves(call) is None and flex.pallas_serves(call, 16, 16) is None
    lengths = OperationRegistry.create("flex").prepare(q, q, q, kv_lengths=jnp.array([3], jnp.int32))
    assert "kv_lengths" in flex.cudnn_serves(lengths) and "kv_lengths" in flex.pallas_serves(lengths, 16, 16)


@pytest.mark.parametrize("mod_kind", ["window", "streaming", "prefix_lm", "alibi"])
def test_with_kv_lengths_a_mod_sees_each_row_s_positions(mod_kind):
    """A decode-like call (3 queries against 20 cache slots, rows filled to 9 and 20): query i of row b is at
    position kv_lengths[b] - 3 + i, for the mods as for ``causal``."""
    rng = np.random.default_rng(11)
    t, s, lengths = 3, 20, np.array([9, 20], np.int32)
    q = rng.normal(size=(2, t, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, s, 2, 8)).astype(np.float32) for _ in range(2))
    pos = lengths[:, None, None] - t + np.arange(t)[None, :, None]  # (B, T, 1)
    key = np.arange(s)[None, None, :]
    kw, ref = {}, {}
    if mod_kind == "window":
        kw["mask_mod"], dense = bm.sliding_window(4), (pos >= key) & (pos - key < 4)
    elif mod_kind == "streaming":
        kw["mask_mod"], dense = bm.streaming(3, 2), (pos >= key) & ((pos - key < 3) | (key < 2))
    elif mod_kind == "prefix_lm":
        kw["mask_mod"], dense = bm.prefix_lm(6), (key < 6) | (pos >= key)
    else:
        kw["score_mod"], dense = bm.alibi(4), np.broadcast_to(pos >= key, (2, t, s))
        slopes = np.array([2.0 ** (-8.0 * (i + 1) / 4) for i in range(4)])
        ref["bias"] = slopes[None, :, None, None] * (key - pos)[:, None]
        kw["causal"] = True
    out = jitted(OperationRegistry.create("flex", OperationMetadata(options={"block_q": 4, "block_k": 8})),
                 jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_lengths=jnp.asarray(lengths), **kw)
    expected, _ = reference_attention(q, k, v, mask=dense[:, None], kv_lengths=lengths, **ref)
    np.testing.assert_allclose(np.asarray(out.attention_outputs, np.float64), expected, atol=2e-5)
