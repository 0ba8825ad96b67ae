"""``flex_pallas`` (interpret mode) against a float64 dense reference: masks, score mods, GQA, gradients,
which key blocks are read, list semantics, errors, and that the kernels lower to Triton."""

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.core.operations.attention.flex_pallas import flex_attention_pallas

SCALE = 0.4
SLOPES = (0.5, 0.25, 0.125, 0.0625)  # ALiBi, one per query head
DOC_STARTS = (0, 5, 14, 23)  # document boundaries over 32 positions


def doc_ids(xp, n=32):
    return xp.asarray(np.searchsorted(np.asarray(DOC_STARTS), np.arange(n), side="right") - 1, dtype=np.int32)


# Mods are factories of the array module: ``jnp`` (float32) for the kernel, ``np`` for the forward reference,
# ``jnp`` under x64 for the gradient reference. Written for scalars, they broadcast over index arrays.
def causal(xp):
    return lambda b, h, q, kv: q >= kv


def window(xp, w=10):
    return lambda b, h, q, kv: (q >= kv) & (q - kv < w)


def document(xp):
    doc = doc_ids(xp)
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)


def prefix_lm(xp, prefix=12):
    return lambda b, h, q, kv: (kv < prefix) | (q >= kv)


def late_start(xp):
    """Queries 0..9 see nothing (query block 0 lists no key block; rows 8, 9 sit in a partial tile)."""
    return lambda b, h, q, kv: kv <= q - 10


def soft_cap(xp, c=1.5):
    return lambda s, b, h, q, kv: c * xp.tanh(s / c)


def alibi(xp):
    slope = xp.asarray(SLOPES)
    return lambda s, b, h, q, kv: s + slope[h] * (kv - q)


@dataclasses.dataclass(frozen=True)
class Case:
    mask: tp.Callable
    score: tp.Callable | None = None
    heads: tuple[int, int] = (2, 2)  # H, KV
    t: int = 32
    s: int = 32
    d: int = 8


CASES = {
    "causal": Case(causal),
    "sliding_window": Case(window),
    "document": Case(document),
    "prefix_lm": Case(prefix_lm),
    "soft_cap": Case(causal, soft_cap),
    "alibi": Case(causal, alibi, heads=(4, 4)),
    "gqa": Case(document, alibi, heads=(4, 2)),
    "rows_see_nothing": Case(late_start),
    "queries_at_the_end": Case(causal, soft_cap, t=16),  # q_offset = S - T
    "head_dim_padded": Case(causal, d=12),
}
BQ = BK = 8


def inputs(case: Case, seed=0, b=2):
    h, kv = case.heads
    rng = np.random.default_rng(seed)
    shapes = ((b, case.t, h, case.d), (b, case.s, kv, case.d), (b, case.s, kv, case.d))
    return tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)


def dense_mask(mask_mod, t, s, q_offset):
    """Bool ``(T, S)`` of ``mask_mod`` (numpy) at every query/key pair."""
    q, kv = q_offset + np.arange(t)[:, None], np.arange(s)[None, :]
    return np.broadcast_to(mask_mod(0, 0, q, kv), (t, s))


def block_lists(mask_TS, bq, bk, pad_index=0):
    """``kv_indices``, ``kv_kinds`` of a dense mask: a block is empty, partial or full by any/all of it."""
    t, s = mask_TS.shape
    tiles = mask_TS.reshape(t // bq, bq, s // bk, bk)
    kinds = np.where(tiles.all((1, 3)), 2, np.where(tiles.any((1, 3)), 1, 0))
    n_max = max(1, int((kinds > 0).sum(1).max()))
    idx, kd = np.full((t // bq, n_max), pad_index, np.int32), np.zeros((t // bq, n_max), np.int8)
    for i, row in enumerate(kinds):
        listed = np.flatnonzero(row)
        idx[i, :len(listed)], kd[i, :len(listed)] = listed, row[listed]
    return idx, kd


def effective_mask(idx, kinds, mask_TS, bq, bk):
    """What the lists say each query sees: full blocks all, partial blocks the mask, the rest nothing."""
    out = np.zeros_like(mask_TS)
    for i, (row_idx, row_kinds) in enumerate(zip(idx, kinds, strict=True)):
        for j, kind in zip(row_idx, row_kinds, strict=True):
            rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
            if kind == 2:
                out[rows, cols] = True
            elif kind == 1:
                out[rows, cols] = mask_TS[rows, cols]
    return out


def dense_attention(xp, q, k, v, visible_TS, score=None, q_offset=0):
    """Attention over all of T x S with ``xp`` (numpy or jax.numpy); rows that see nothing give 0."""
    b, t, h, _ = q.shape
    s, kv = k.shape[1], k.shape[2]
    k, v = (xp.repeat(x, h // kv, axis=2) for x in (k, v))
    logits = xp.einsum("bthd,bshd->bhts", q, k) * SCALE
    if score is not None:
        idx = lambda n, axis: xp.arange(n).reshape([-1 if a == axis else 1 for a in range(4)])
        logits = score(logits, idx(b, 0), idx(h, 1), q_offset + idx(t, 2), idx(s, 3))
    logits = xp.where(visible_TS, logits, -xp.inf)
    m = logits.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    if xp is jnp:
        m = jax.lax.stop_gradient(m)
    p = xp.exp(logits - m)
    total = p.sum(axis=-1, keepdims=True)
    return xp.einsum("bhts,bshd->bthd", p / xp.where(total == 0, 1.0, total), v)


def run(q, k, v, idx, kinds, mask=None, score=None, q_offset=0, **kw):
    fn = lambda q, k, v: flex_attention_pallas(q, k, v, idx, kinds, block_q=BQ, block_k=BK, scale=SCALE,
                                               score_mod=score, mask_mod=mask, q_offset=q_offset, interpret=True,
                                               **kw)
    return jax.jit(fn)(q, k, v)


def prepared(case: Case):
    q_offset = case.s - case.t
    mask_TS = dense_mask(case.mask(np), case.t, case.s, q_offset)
    idx, kinds = block_lists(mask_TS, BQ, BK)
    assert (effective_mask(idx, kinds, mask_TS, BQ, BK) == mask_TS).all()
    return q_offset, mask_TS, idx, kinds


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_reference(name):
    case = CASES[name]
    q, k, v = inputs(case)
    q_offset, mask_TS, idx, kinds = prepared(case)
    score = case.score and case.score(jnp)
    out = run(q, k, v, idx, kinds, case.mask(jnp), score, q_offset)
    want = dense_attention(np, *(x.astype(np.float64) for x in (q, k, v)), mask_TS,
                           case.score and case.score(np), q_offset)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5)
    if name == "rows_see_nothing":
        assert not np.asarray(out)[:, :10].any()


@pytest.mark.parametrize("name", ["soft_cap", "gqa", "rows_see_nothing", "queries_at_the_end"])
def test_gradients_match_reference(name):
    case = CASES[name]
    q, k, v = inputs(case, seed=1)
    q_offset, mask_TS, idx, kinds = prepared(case)
    cot = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    score = case.score and case.score(jnp)

    def loss(q, k, v):
        out = flex_attention_pallas(q, k, v, idx, kinds, block_q=BQ, block_k=BK, scale=SCALE, score_mod=score,
                                    mask_mod=case.mask(jnp), q_offset=q_offset, interpret=True)
        return jnp.sum(out * cot)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True):
        ref_loss = lambda q, k, v: jnp.sum(dense_attention(jnp, q, k, v, mask_TS, case.score and case.score(jnp),
                                                           q_offset) * cot)
        want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        want = [np.asarray(w) for w in want]
    for name_, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == jnp.float32, name_
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err <= 1e-4, f"d{name_}: relative error {err:.2e}"


def test_never_reads_unlisted_or_padding_blocks():
    """Key block 2 is listed by no query block, and every padding entry points at it: it is all NaN, so
    reading it anywhere, forward or backward, would make the output or the gradients NaN."""
    case = Case(lambda xp: lambda b, h, q, kv: (q >= kv) & ((kv < 16) | (kv >= 24)), heads=(4, 2))
    q, k, v = inputs(case, seed=3)
    mask_TS = dense_mask(case.mask(np), 32, 32, 0)
    idx, kinds = block_lists(mask_TS, BQ, BK, pad_index=2)
    assert not (idx[kinds > 0] == 2).any()
    # Padding in front of and between listed entries, too.
    idx = np.concatenate([np.full((4, 1), 2, np.int32), idx, np.full((4, 1), 2, np.int32)], axis=1)
    kinds = np.concatenate([np.zeros((4, 1), np.int8), kinds, np.zeros((4, 1), np.int8)], axis=1)
    idx[:, [1, 2]], kinds[:, [1, 2]] = idx[:, [2, 1]], kinds[:, [2, 1]]
    poison = np.zeros((1, 32, 1, 1), np.float32)
    poison[:, 16:24] = np.nan
    k_nan, v_nan = k + poison, v + poison
    out = run(q, k_nan, v_nan, idx, kinds, case.mask(jnp))
    want = dense_attention(np, *(x.astype(np.float64) for x in (q, k, v)), mask_TS)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5)

    cot = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v):
        return jnp.sum(flex_attention_pallas(q, k, v, idx, kinds, block_q=BQ, block_k=BK, scale=SCALE,
                                             mask_mod=case.mask(jnp), interpret=True) * cot)

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one compile for the poisoned and the clean inputs
    dq, dk, dv = gradients(q, k_nan, v_nan)
    dq_clean = gradients(q, k, v)[0]
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g)).all()
    assert not np.asarray(dk)[:, 16:24].any() and not np.asarray(dv)[:, 16:24].any()
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_clean), rtol=0, atol=1e-6)


def test_lists_decide_what_is_seen():
    """Unlisted blocks are empty even where mask_mod says True; full blocks skip mask_mod even where it
    says False; partial blocks apply it."""
    case = Case(causal)
    q, k, v = inputs(case, seed=5)
    mask_TS = dense_mask(causal(np), 32, 32, 0)
    idx = np.array([[0, 3, 0], [1, 0, 0], [2, 0, 1], [3, 0, 0]], np.int32)
    kinds = np.array([[1, 2, 0], [2, 0, 0], [1, 2, 2], [1, 2, 0]], np.int32)
    visible = effective_mask(idx, kinds, mask_TS, BQ, BK)
    assert visible[:8, 24:].all() and visible[8:16, 8:16].all() and not visible[24:, 8:16].any()
    out = run(q, k, v, idx, kinds, causal(jnp))
    want = dense_attention(np, *(x.astype(np.float64) for x in (q, k, v)), visible)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5)


def test_traced_lists_and_no_mods():
    """Lists passed through jit (traced) and neither mod: every listed block is seen whole."""
    case = Case(causal)
    q, k, v = inputs(case, seed=6)
    idx = np.array([[0, 2], [1, 0], [3, 0], [0, 1]], np.int32)
    kinds = np.array([[2, 2], [2, 0], [1, 0], [2, 1]], np.int8)
    fn = jax.jit(lambda q, k, v, i, kd: flex_attention_pallas(q, k, v, i, kd, block_q=BQ, block_k=BK,
                                                              scale=SCALE, interpret=True))
    out = fn(q, k, v, idx, kinds)
    visible = effective_mask(idx, kinds, np.ones((32, 32), bool), BQ, BK)
    want = dense_attention(np, *(x.astype(np.float64) for x in (q, k, v)), visible)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-5)


def test_bfloat16_inputs():
    case = CASES["gqa"]
    q, k, v = inputs(case, seed=7)
    _, mask_TS, idx, kinds = prepared(case)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out = run(q, k, v, idx, kinds, case.mask(jnp), case.score(jnp))
    want = dense_attention(np, *(np.asarray(x, np.float64) for x in (q, k, v)), mask_TS, case.score(np))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=3e-2)


# The GPU that lowering for CUDA on a machine without one targets. JAX 0.10 fell back to compute capability
# 9.0 (an H100); JAX 0.12's Triton lowering asks for it, as the abstract mesh's device.
ON_AN_H100 = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100", num_cores=None, platform="gpu"))


def test_lowers_to_triton():
    """With interpret=False the three kernels (forward, dq, dk/dv) lower to Triton for CUDA, including a
    document mask and ALiBi (their captured arrays are read by ref loads: Triton has no gather)."""
    case = CASES["gqa"]
    idx, kinds = block_lists(dense_mask(case.mask(np), 32, 32, 0), 16, 16)
    shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((1, 32, 4, 16), (1, 32, 2, 16), (1, 32, 2, 16))]

    def fwd(q, k, v):
        return flex_attention_pallas(q, k, v, idx, kinds, block_q=16, block_k=16, scale=SCALE,
                                     score_mod=case.score(jnp), mask_mod=case.mask(jnp))

    grad = jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for fn, calls in ((fwd, 1), (grad, 3)):
        with jax.sharding.use_abstract_mesh(ON_AN_H100):
            text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == calls


def bad(**changes):
    q, k, v = np.zeros((1, 16, 4, 8), np.float32), np.zeros((1, 16, 2, 8), np.float32), None
    args = {"q": q, "k": k, "v": v if v is not None else k, "idx": np.zeros((2, 1), np.int32),
            "kinds": np.ones((2, 1), np.int32), "block_q": 8, "block_k": 8, "mask_mod": None}
    args.update(changes)
    return flex_attention_pallas(args["q"], args["k"], args["v"], args["idx"], args["kinds"],
                                 block_q=args["block_q"], block_k=args["block_k"], scale=1.0,
                                 mask_mod=args["mask_mod"], interpret=True)


@pytest.mark.parametrize("changes, message", [
    ({"block_q": 6}, "multiple of block_q"),
    ({"block_k": 5}, "multiple of block_k"),
    ({"k": np.zeros((1, 16, 3, 8), np.float32), "v": np.zeros((1, 16, 3, 8), np.float32)}, "H % KV"),
    ({"idx": np.zeros((3, 1), np.int32), "kinds": np.ones((3, 1), np.int32)}, "one row per query block"),
    ({"kinds": np.ones((2, 2), np.int32)}, "same shape"),
    ({"kinds": np.array([[3], [1]], np.int32)}, "0 \\(padding\\), 1 \\(partial\\) or 2 \\(full\\)"),
    ({"idx": np.array([[0], [2]], np.int32)}, "must lie in \\[0, nk\\)"),
    ({"idx": np.zeros((2, 2), np.int32), "kinds": np.ones((2, 2), np.int32)}, "repeats"),
    ({"idx": np.zeros((2, 1), np.float32)}, "int array"),
    ({"mask_mod": lambda b, h, q, kv: q - kv}, "must return a bool"),
])
def test_bad_inputs(changes, message):
    with pytest.raises(ValueError, match=message):
        bad(**changes)
