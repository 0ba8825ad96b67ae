"""``allgather_kv`` (Llama 3's context parallelism): against ``jax.nn.dot_product_attention``, the float64 reference
and ``vanilla``'s gradients, never against itself; its collectives in the compiled HLO; its options' errors.
The contract every sequence-parallel implementation shares (mesh errors, lengths, capabilities, the common cases
with contiguous blocks) is in ``test_sequence_parallel.py``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.reference import reference_attention
from tests.core.operations.attention.test_ring import computation_of
from tests.core.operations.attention.test_sequence_parallel import CASES, grads, inputs, segments
from workbench.core.hlo.collectives import collectives, collectives_in
from workbench.core.mesh import make_mesh
from workbench.core.operations.base import OperationMetadata, OperationRegistry

LAYOUTS = ("contiguous", "zigzag")


def allgather_kv(load_balance="contiguous", **mesh_axes):
    return OperationRegistry.create("allgather_kv", OperationMetadata(mesh=make_mesh(**mesh_axes),
                                                                      options={"load_balance": load_balance}))


@pytest.mark.parametrize("case", CASES)
def test_zigzag_matches_reference(case):
    mesh_axes, sizes, kwargs = CASES[case]
    q, k, v = inputs(**sizes)
    out = allgather_kv("zigzag", **mesh_axes)(q, k, v, **kwargs)
    want, _ = reference_attention(q, k, v, **kwargs)
    assert out.kernel_path == "allgather_kv/shard_map"
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("load_balance", LAYOUTS)
@pytest.mark.parametrize(("mesh_axes", "kwargs"), [
    (dict(fsdp=1, sp=8), dict(causal=True)),
    (dict(dp=2, fsdp=1, sp=4), dict(causal=True)),
    (dict(dp=2, fsdp=1, sp=4), dict(sliding_window=5)),
    (dict(fsdp=1, sp=8), dict(causal=True, sliding_window=9)),
], ids=["sp8-causal", "dp2xsp4-causal", "dp2xsp4-window", "sp8-causal-window"])
def test_matches_jax_nn(load_balance, mesh_axes, kwargs):
    q, k, v = inputs(t=32, kv=2)  # GQA: 8 query heads read 2 key/value heads
    window = kwargs.get("sliding_window")
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0))
    out = allgather_kv(load_balance, **mesh_axes)(q, k, v, **kwargs).attention_outputs
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)


@pytest.mark.parametrize(("load_balance", "mesh_axes", "window"), [
    ("zigzag", dict(fsdp=1, sp=8), None),
    ("contiguous", dict(dp=2, fsdp=1, sp=4), 5),
])
def test_gradients_match_jax_nn(load_balance, mesh_axes, window):
    q, k, v = inputs(t=32, kv=2)
    cotangent = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    local = None if window is None else (window - 1, 0)
    loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)
                                   * cotangent)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    got = grads(allgather_kv(load_balance, **mesh_axes), q, k, v, cotangent, causal=True, sliding_window=window)
    for g, w, label in zip(got, want, ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


@pytest.mark.parametrize(("load_balance", "mesh_axes", "kwargs"), [
    ("contiguous", dict(fsdp=1, sp=8), dict(causal=True)),
    ("contiguous", dict(dp=2, fsdp=1, sp=4), dict(causal=True, sliding_window=5)),
    ("zigzag", dict(dp=2, fsdp=1, sp=4), dict(causal=True, logits_soft_cap=3.0)),
    ("zigzag", dict(fsdp=1, sp=8), dict(causal=True, sliding_window=6)),
    ("zigzag", dict(dp=2, tp=2, sp=2), dict(sliding_window=6, kv_lengths=np.array([13, 16]))),
    ("contiguous", dict(dp=2, sp=4), dict(q_segment_ids=segments(16, [5, 12], [9]),
                                          kv_segment_ids=segments(16, [5, 12], [9]), causal=True)),
])
def test_gradients_match_vanilla(load_balance, mesh_axes, kwargs):
    q, k, v = inputs(kv=2)
    cotangent = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    got = grads(allgather_kv(load_balance, **mesh_axes), q, k, v, cotangent, **kwargs)
    want = grads(OperationRegistry.create("vanilla"), q, k, v, cotangent, **kwargs)
    for g, w, label in zip(got, want, ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


@pytest.mark.parametrize(("load_balance", "mesh_axes", "bias_shape"), [
    ("contiguous", dict(dp=2, tp=2, sp=2), (1, 8, 16, 16)),  # replicated over dp: its gradient sums there
    ("zigzag", dict(fsdp=1, sp=8), (2, 8, 1, 16)),  # the same row for every query: summed over sp
])
def test_bias_gradient_matches_vanilla(load_balance, mesh_axes, bias_shape):
    q, k, v = inputs(kv=2)
    rng = np.random.default_rng(4)
    bias = rng.standard_normal(bias_shape).astype(np.float32)
    mask = rng.random((2, 1, 16, 16)) > 0.2
    cotangent = rng.standard_normal(q.shape).astype(np.float32)

    def all_grads(op):
        loss = lambda q, k, v, bias: jnp.sum(op(q, k, v, bias=bias, mask=mask, causal=True).attention_outputs
                                             * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)

    got, want = all_grads(allgather_kv(load_balance, **mesh_axes)), all_grads(OperationRegistry.create("vanilla"))
    for g, w, label in zip(got, want, ("dq", "dk", "dv", "dbias"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


def test_bias_gradient_is_summed_outside_the_skipped_tiles():
    """A bias replicated over ``sp`` has its gradient summed over ``sp`` once, not by a psum inside a tile's
    ``lax.cond``: devices that skip the tile would never join it (wrong sums or a hang)."""
    q, k, v = inputs(kv=2)
    bias = np.random.default_rng(4).standard_normal((2, 8, 1, 16)).astype(np.float32)
    op = allgather_kv(fsdp=1, sp=8)
    loss = lambda q, k, v, b: jnp.sum(op(q, k, v, bias=b, causal=True).attention_outputs)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, bias).compile().as_text()
    branches = {b.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
                for b in group.split(",")}
    records = collectives_in(hlo)
    assert branches and "all-reduce" in {r.kind for r in records}
    assert not [r.name for r in records if computation_of(hlo, r.name) in branches]


# -- the compiled program -----------------------------------------------------------------------------
def program_collectives(op, q, k, v, gradient=False):
    out = lambda q, k, v: op(q, k, v, causal=True).attention_outputs
    fn = jax.grad(lambda q, k, v: jnp.sum(out(q, k, v)), argnums=(0, 1, 2)) if gradient else out
    return collectives(fn, q, k, v, mesh=op.metadata.mesh)


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_keys_and_values_are_gathered_over_sp_and_nothing_is_permuted(gradient):
    """One all-gather per tensor over ``sp`` (each device receives the whole sequence's keys/values of its batch
    rows); the gradient reduce-scatters them back. No ring: no collective-permute."""
    q, k, v = inputs(t=32, kv=2)  # dp2 x sp4: a device holds 1 batch row, 8 of the 32 positions
    records = program_collectives(allgather_kv(dp=2, fsdp=1, sp=4), q, k, v, gradient)
    kinds = sorted(r.kind for r in records)
    assert kinds == ["all-gather"] * 2 + ["reduce-scatter"] * 2 * gradient
    assert all(r.mesh_axes == ("sp",) and r.trips == 1 for r in records)
    assert [r.shape for r in records if r.kind == "all-gather"] == [(1, 32, 2, 8)] * 2  # the whole sequence
    assert [r.shape for r in records if r.kind == "reduce-scatter"] == [(1, 8, 2, 8)] * 2 * gradient


def test_zigzag_moves_only_the_queries():
    """Zig-zag: the keys and values are gathered in sequence order as before; the queries go into the layout
    and the output back out with two half-shard permutes each (``T / 2 sp`` positions of every head)."""
    q, k, v = inputs(t=32, kv=2)
    records = program_collectives(allgather_kv("zigzag", dp=2, fsdp=1, sp=4), q, k, v)
    assert sorted(r.kind for r in records) == ["all-gather"] * 2 + ["collective-permute"] * 4
    assert [r.shape for r in records if r.kind == "collective-permute"] == [(1, 4, 8, 8)] * 4
    assert all(r.mesh_axes == ("sp",) for r in records)


def test_no_array_holds_a_row_of_logits():
    """The local attention is tiled (flash, checkpointed tiles): no array of the gradient program is as large as a
    ``(T/sp, S)`` row of logits for every head, ``sp`` tiles; the largest measured are the saved per-tile outputs
    (``T H D``, one ``(T/sp, H, D)`` per key block). T=1024, sp=8, GQA 8/2 heads."""
    t, sp, h, d = 1024, 8, 8, 32
    op = OperationRegistry.create("allgather_kv", OperationMetadata(mesh=make_mesh(fsdp=1, sp=sp)))
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, t, 2, d), jnp.float32)
    loss = lambda q, k, v: jnp.sum(op(q, k, v, causal=True).attention_outputs)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().as_text()
    sizes = {int(np.prod([int(n) for n in dims.split(",")])) for dims in re.findall(r"f32\[([\d,]+)\]", hlo)}
    assert h * (t // sp) ** 2 in sizes  # a tile of logits
    assert max(sizes) <= max(h * (t // sp) ** 2, t * h * d) < h * (t // sp) * t  # below a row of logits


def test_load_balance_option_errors():
    q, k, v = inputs(t=20)
    with pytest.raises(ValueError, match=r"allgather_kv: option load_balance must be one of \('contiguous', "
                                         r"'zigzag'\); got 'striped'"):
        allgather_kv("striped", dp=2, sp=4)(q, k, v)
    with pytest.raises(ValueError, match="allgather_kv: load_balance='zigzag' cuts the sequence into 2 \\* sp = 8 "
                                         "chunks, so T=20 and S=20 must both be divisible by 8"):
        allgather_kv("zigzag", dp=2, sp=4)(q, k, v)
    assert allgather_kv("contiguous", dp=2, sp=4)(q, k, v).attention_outputs.shape == q.shape

