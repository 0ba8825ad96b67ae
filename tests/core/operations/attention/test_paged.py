"""``paged`` against the float64 NumPy reference on the same cache laid out contiguously."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.operations.attention.reference import reference_attention
from workbench.core.operations.attention import paged
from workbench.core.operations.base import OperationRegistry


def paged_cache(rng, b, s, kv, d, page_size, spare=3):
    """A random contiguous cache ``(B, S, KV, D)`` and the same keys/values scattered into shuffled pages.

    ``S`` is rounded up to whole pages; ``spare`` pages belong to no sequence.
    """
    per_seq = -(-s // page_size)
    s = per_seq * page_size
    k, v = rng.standard_normal((b, s, kv, d)), rng.uniform(-1, 1, (b, s, kv, d))
    order = rng.permutation(b * per_seq + spare)
    table = order[: b * per_seq].reshape(b, per_seq)
    k_pages = rng.standard_normal((len(order), page_size, kv, d))
    v_pages = rng.standard_normal((len(order), page_size, kv, d))
    k_pages[table] = k.reshape(b, per_seq, page_size, kv, d)
    v_pages[table] = v.reshape(b, per_seq, page_size, kv, d)
    return k, v, k_pages, v_pages, table.astype(np.int32)


def run_paged(q, k_pages, v_pages, table, lengths, **kw):
    op = OperationRegistry.create("paged")
    f = jax.jit(lambda q, kp, vp, table, lengths: op(q, kp, vp, page_table=table, kv_lengths=lengths, **kw))
    return f(*(jnp.asarray(x, jnp.float32) for x in (q, k_pages, v_pages)), jnp.asarray(table), jnp.asarray(lengths))


@st.composite
def cases(draw):
    b, t, s = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4])), draw(st.integers(4, 13))
    kv, g, d = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([4, 8]))
    page_size = draw(st.sampled_from([1, 3, 4, 5]))
    kw = {"causal": draw(st.booleans()), "sliding_window": draw(st.sampled_from([None, 1, 3, 6])),
          "logits_soft_cap": draw(st.sampled_from([None, 2.0]))}
    return (b, t, s, kv * g, kv, d, page_size), draw(st.integers(0, 2**16)), kw


@settings(max_examples=25, deadline=None)
@given(cases())
def test_matches_reference(case):
    (b, t, s, h, kv, d, page_size), seed, kw = case
    rng = np.random.default_rng(seed)
    k, v, k_pages, v_pages, table = paged_cache(rng, b, s, kv, d, page_size)
    lengths = rng.integers(0, s + 1, b).astype(np.int32)
    table = np.where(np.arange(table.shape[1]) * page_size < lengths[:, None], table, -1)  # unused: -1
    q = rng.standard_normal((b, t, h, d))
    out = run_paged(q, k_pages, v_pages, table, lengths, **kw)
    assert out.kernel_path == "paged/native" and out.attention_weights is None
    want, _ = reference_attention(q, k, v, kv_lengths=lengths, **kw)
    assert np.max(np.abs(np.asarray(out.attention_outputs, np.float64) - want)) <= 2e-5


@pytest.mark.parametrize("t", [1, 4])
def test_decode_and_prefill_chunk_gqa(t):
    """Lengths that pages of 5 do not divide; a chunk whose first queries sit before the sequence starts."""
    rng = np.random.default_rng(t)
    k, v, k_pages, v_pages, table = paged_cache(rng, 3, 17, 2, 8, page_size=5)
    lengths = np.array([17, 9, 2], np.int32)
    q = rng.standard_normal((3, t, 8, 8))
    for kw in ({"causal": True}, {"causal": False, "sliding_window": 4}):
        want, _ = reference_attention(q, k, v, kv_lengths=lengths, **kw)
        got = run_paged(q, k_pages, v_pages, table, lengths, **kw).attention_outputs
        np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("page_size", [1, 3])
def test_window_skips_only_unseen_pages(page_size):
    """The earliest key any window sees (5: position 9 - 2 with w = 3) ends a page: off by one would drop it."""
    rng = np.random.default_rng(page_size)
    k, v, k_pages, v_pages, table = paged_cache(rng, 2, 12, 1, 4, page_size)
    lengths = np.array([9, 12], np.int32)
    q = rng.standard_normal((2, 2, 2, 4))
    want, _ = reference_attention(q, k, v, kv_lengths=lengths, sliding_window=3)
    got = run_paged(q, k_pages, v_pages, table, lengths, sliding_window=3).attention_outputs
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_never_builds_the_contiguous_cache():
    rng = np.random.default_rng(0)
    _, _, k_pages, v_pages, table = paged_cache(rng, 2, 21, 2, 8, page_size=3)  # S = 21, 7 pages a sequence
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    op = OperationRegistry.create("paged")
    jaxpr = str(jax.make_jaxpr(lambda q, kp, vp, t, n: op(q, kp, vp, page_table=t, kv_lengths=n))(
        q, jnp.asarray(k_pages, jnp.float32), jnp.asarray(v_pages, jnp.float32), table, jnp.asarray([21, 5])))
    assert "while" in jaxpr and "[2,21," not in jaxpr and "f32[2,3,2,8]" in jaxpr


def test_eager_matches_jit_and_rows_that_see_nothing_are_zero():
    rng = np.random.default_rng(1)
    _, _, k_pages, v_pages, table = paged_cache(rng, 2, 8, 1, 4, page_size=4)
    q = jnp.asarray(rng.standard_normal((2, 4, 2, 4)), jnp.float32)
    lengths = np.array([0, 2], np.int32)  # sequence 1: queries 0 and 1 sit at positions -2, -1
    out = OperationRegistry.create("paged")(q, jnp.asarray(k_pages, jnp.float32), jnp.asarray(v_pages, jnp.float32),
                                            page_table=table, kv_lengths=lengths).attention_outputs
    assert not np.asarray(out[0]).any() and not np.asarray(out[1, :2]).any() and np.asarray(out[1, 2:]).all()
    np.testing.assert_allclose(out, run_paged(q, k_pages, v_pages, table, lengths).attention_outputs, atol=1e-6)


def test_capabilities_name_the_signature():
    caps = OperationRegistry.capabilities("paged")
    assert caps.supports(paged.PAGED_KV) and "page_table" in caps.description
    assert OperationRegistry.supporting(paged.PAGED_KV) == ["paged"]


def test_errors():
    rng = np.random.default_rng(2)
    _, _, k_pages, v_pages, table = paged_cache(rng, 2, 8, 2, 8, page_size=4, spare=0)
    k_pages, v_pages = jnp.asarray(k_pages, jnp.float32), jnp.asarray(v_pages, jnp.float32)
    q = jnp.zeros((2, 1, 4, 8))
    op = OperationRegistry.create("paged")
    lengths = np.array([8, 3], np.int32)
    with pytest.raises(ValueError, match="page_table must be"):
        op(q, k_pages, v_pages, page_table=table[0], kv_lengths=lengths)
    with pytest.raises(ValueError, match="page_table must be"):
        op(q, k_pages, v_pages, page_table=table.astype(np.float32), kv_lengths=lengths)
    with pytest.raises(ValueError, match=r"key_pages .* and value_pages"):  # values of another head dim are MLA's
        op(q, k_pages, v_pages[:, :2], page_table=table, kv_lengths=lengths)
    with pytest.raises(ValueError, match="key_pages must be 4-D"):
        op(q, k_pages[0], v_pages, page_table=table, kv_lengths=lengths)
    with pytest.raises(ValueError, match="kv_lengths must be an int array"):
        op(q, k_pages, v_pages, page_table=table, kv_lengths=lengths[:1])
    with pytest.raises(ValueError, match=r"kv_lengths .* is required"):
        op(q, k_pages, v_pages, page_table=table, kv_lengths=None)
    with pytest.raises(ValueError, match=r"kv_lengths \[9, 3\] must lie in \[0, .*8\]"):
        op(q, k_pages, v_pages, page_table=table, kv_lengths=np.array([9, 3], np.int32))
    with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 7 is not a page index in \[0, 4\)"):
        op(q, k_pages, v_pages, page_table=np.array([[0, 1], [7, -1]], np.int32), kv_lengths=lengths)
    with pytest.raises(ValueError, match=r"return_weights.*vanilla"):
        op(q, k_pages, v_pages, page_table=table, kv_lengths=lengths, return_weights=True)
    with pytest.raises(ValueError, match="H % KV"):
        op(jnp.zeros((2, 1, 3, 8)), k_pages, v_pages, page_table=table, kv_lengths=lengths)
