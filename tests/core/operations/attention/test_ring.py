"""``ring``: double buffering seen in the compiled HLO, zig-zag load balance (exactness, gradients, the tiles
each device computes), against the float64 reference and ``vanilla``, never against ring itself."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.core.operations.attention.reference import reference_attention
from tests.core.operations.attention.test_sequence_parallel import grads, inputs, segments
from workbench.core.hlo.collectives import collectives_in, loop_collectives
from workbench.core.mesh import make_mesh
from workbench.core.operations.attention.ring import ring_work
from workbench.core.operations.attention.zigzag import from_zigzag, to_zigzag, zigzag_chunks, zigzag_order
from workbench.core.operations.base import OperationMetadata, OperationRegistry

LAYOUTS = ("contiguous", "zigzag")
MESHES = {2: dict(dp=2, tp=2, sp=2), 4: dict(dp=2, sp=4), 8: dict(fsdp=1, sp=8)}


def ring(load_balance, **mesh_axes):
    return OperationRegistry.create("ring", OperationMetadata(mesh=make_mesh(**mesh_axes),
                                                              options={"load_balance": load_balance}))


rng = np.random.default_rng(3)
CASES = {  # name: (input sizes, call kwargs); lengths divisible by 2 * 8
    "causal_gqa": (dict(t=32, kv=2), dict(causal=True)),
    "full_mqa": (dict(t=16, kv=1), dict()),
    "window_softcap": (dict(t=32, kv=2), dict(sliding_window=7, logits_soft_cap=2.0)),
    "causal_window": (dict(t=32, kv=2), dict(causal=True, sliding_window=5)),
    "kv_lengths": (dict(t=16, s=32, kv=2), dict(causal=True, kv_lengths=np.array([21, 32]))),
    "segment_ids": (dict(t=32, kv=2), dict(q_segment_ids=segments(32, [5, 20], [11]),
                                           kv_segment_ids=segments(32, [5, 20], [11]), causal=True)),
    "mask_bias": (dict(t=16, kv=2), dict(mask=rng.random((2, 1, 16, 16)) > 0.3,
                                         bias=rng.standard_normal((1, 8, 16, 16)).astype(np.float32))),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sp", MESHES)
@pytest.mark.parametrize("load_balance", LAYOUTS)
def test_matches_reference(load_balance, sp, case):
    sizes, kwargs = CASES[case]
    q, k, v = inputs(**sizes)
    out = ring(load_balance, **MESHES[sp])(q, k, v, **kwargs)
    want, _ = reference_attention(q, k, v, **kwargs)
    assert out.kernel_path == "ring/shard_map"
    np.testing.assert_allclose(np.asarray(out.attention_outputs), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize(("load_balance", "mesh_axes", "kwargs"), [
    ("contiguous", dict(dp=2, sp=4), dict(causal=True)),
    ("zigzag", dict(dp=2, sp=4), dict(causal=True)),
    ("zigzag", dict(fsdp=1, sp=8), dict(causal=True, logits_soft_cap=3.0)),
    ("zigzag", dict(dp=2, tp=2, sp=2), dict(sliding_window=6, kv_lengths=np.array([13, 16]))),
    ("zigzag", dict(dp=2, sp=4), dict(q_segment_ids=segments(16, [5, 12], [9]),
                                      kv_segment_ids=segments(16, [5, 12], [9]), causal=True)),
])
def test_gradients_match_vanilla(load_balance, mesh_axes, kwargs):
    q, k, v = inputs(kv=2)  # GQA: 8 query heads, 2 key/value heads
    cotangent = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    got = grads(ring(load_balance, **mesh_axes), q, k, v, cotangent, **kwargs)
    want = grads(OperationRegistry.create("vanilla"), q, k, v, cotangent, **kwargs)
    for g, w, label in zip(got, want, ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


@pytest.mark.parametrize(("load_balance", "mesh_axes", "bias_shape"), [
    ("contiguous", dict(dp=2, tp=2, sp=2), (1, 8, 16, 16)),  # replicated over dp: its gradient sums there
    ("zigzag", dict(dp=2, sp=4), (2, 1, 16, 16)),
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

    got, want = all_grads(ring(load_balance, **mesh_axes)), all_grads(OperationRegistry.create("vanilla"))
    for g, w, label in zip(got, want, ("dq", "dk", "dv", "dbias"), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=0, err_msg=label)


def test_backward_memory_stays_tile_sized():
    """The custom backward holds a few (T/sp)^2 tiles per device, not vanilla's (T, T) logits, and no
    per-step copies of the key/value blocks: T=2048, sp=8, 8 heads, causal."""
    mesh = make_mesh(fsdp=1, sp=8)
    args = [jax.ShapeDtypeStruct((1, 2048, 8, 32), jnp.float32)] * 3

    def temp(op):
        loss = lambda q, k, v: jnp.sum(op(q, k, v, causal=True).attention_outputs)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    tile = 8 * (2048 // 8) ** 2 * 4  # one step's float32 logits, 2 MiB
    vanilla = temp(OperationRegistry.create("vanilla"))
    ring_temp = temp(OperationRegistry.create("ring", OperationMetadata(mesh=mesh)))
    assert vanilla >= 2 * 8 * 2048 ** 2 * 4  # the logits and their gradient
    assert ring_temp <= 8 * tile < vanilla / 40


# -- double buffering -------------------------------------------------------------------------------
def compiled_hlo(op, q, k, v, **kwargs):
    return jax.jit(lambda q, k, v: op(q, k, v, **kwargs).attention_outputs).lower(q, k, v).compile().as_text()


@pytest.mark.parametrize("load_balance", LAYOUTS)
def test_permutes_do_not_depend_on_the_step_computation(load_balance):
    """In the loop body each permute reads the block carried in and writes the block carried out: nothing this
    trip computes feeds it, nothing this trip computes waits for it (CPU: synchronous collective-permutes)."""
    q, k, v = inputs(t=64, kv=2)
    hlo = compiled_hlo(ring(load_balance, dp=2, sp=4), q, k, v, causal=True)
    records = loop_collectives(hlo)
    assert [r.kind for r in records] == ["collective-permute"] * 2  # a key and a value block
    assert all(r.from_carry and r.to_carry_only for r in records)
    trips = [c.trips for c in collectives_in(hlo) if c.name in {r.name for r in records}]
    assert trips == [3, 3]  # sp - 1: the last block is folded after the loop


@pytest.mark.parametrize("load_balance", LAYOUTS)
def test_backward_loop_sends_ahead_and_keeps_collectives_out_of_conditionals(load_balance):
    """The gradient program: the forward loop's 2 permutes (sp - 1 trips) and the backward loop's 4 (sp - 2 trips
    plus the peeled first and last steps): key and value blocks sent ahead, independent of the trip; their
    gradients read from the carry (what arrived is added after the trip's tiles). No collective sits inside a
    skipped tile's ``lax.cond`` (devices branch differently), the bias gradient's all-reduce runs once."""
    q, k, v = inputs(t=64, kv=2)
    bias = np.random.default_rng(5).standard_normal((1, 8, 64, 64)).astype(np.float32)
    op = ring(load_balance, dp=2, sp=4)
    loss = lambda q, k, v, b: jnp.sum(op(q, k, v, bias=b, causal=True).attention_outputs)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, k, v, bias).compile().as_text()
    records = loop_collectives(hlo)
    trips = {c.name: c.trips for c in collectives_in(hlo)}
    assert sorted((trips[r.name], r.from_carry, r.to_carry_only) for r in records) == \
        [(2, True, False)] * 2 + [(2, True, True)] * 2 + [(3, True, True)] * 2
    assert [c.trips for c in collectives_in(hlo) if c.kind == "all-reduce"] == [1]
    branches = {b.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
                for b in group.split(",")}
    assert branches and not [c for c in collectives_in(hlo) if computation_of(hlo, c.name) in branches]


def computation_of(hlo: str, instruction: str) -> str:
    """The name of the HLO computation that holds ``instruction``."""
    computation = None
    for line in hlo.splitlines():
        if (header := re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line)) is not None:
            computation = header.group(1)
        elif re.match(rf"^\s*(?:ROOT\s+)?%{re.escape(instruction)}\s*=", line):
            return computation
    raise AssertionError(f"{instruction} not in the HLO")


def test_loop_collectives_sees_a_permute_the_step_waits_for():
    """The HLO check is not vacuous: permuting first and folding what arrived is flagged."""
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    perm = [(j, (j + 1) % 8) for j in range(8)]

    def folds_what_arrived(x):
        def step(_, carry):
            acc, block = carry
            block = jax.lax.ppermute(block, "sp", perm)
            return acc + jnp.tanh(block @ block.T).sum(), block

        acc = jax.lax.pcast(jnp.zeros((), x.dtype), "sp", to="varying")
        return jax.lax.fori_loop(0, 7, step, (acc, x))[0][None]

    fn = jax.jit(jax.shard_map(folds_what_arrived, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    (record,) = loop_collectives(fn.lower(jnp.ones((64, 16))).compile().as_text())
    assert record.from_carry and not record.to_carry_only


# -- zig-zag ----------------------------------------------------------------------------------------
def test_zigzag_order():
    assert zigzag_chunks(4).tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert zigzag_order(16, 4).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="length 12 must be divisible by 2 \\* sp = 8"):
        zigzag_order(12, 4)


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_to_and_from_zigzag_inside_shard_map(sp):
    mesh = make_mesh(fsdp=8 // sp, sp=sp)
    x = np.arange(2 * 32 * 3, dtype=np.float32).reshape(2, 32, 3)

    def there_and_back(x):
        z = to_zigzag(x, "sp", sp, 1)
        return z, from_zigzag(z, "sp", sp, 1)

    fn = jax.jit(jax.shard_map(there_and_back, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    zig, back = fn(x)
    np.testing.assert_array_equal(np.asarray(zig), x[:, zigzag_order(32, sp)])
    np.testing.assert_array_equal(np.asarray(back), x)


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_tiles_per_device(sp):
    """Causal: contiguous device i computes i + 1 of sp block tiles; zig-zag every device 2 sp + 1 of the
    (2 sp)^2 half-block tiles. Without a mask every tile is computed."""
    mesh = make_mesh(fsdp=8 // sp, sp=sp)
    t = 64
    contiguous = ring_work(mesh, t, causal=True)
    zigzag = ring_work(mesh, t, causal=True, load_balance="zigzag")
    assert contiguous.tile == (t // sp, t // sp) and contiguous.tiles == tuple(range(1, sp + 1))
    assert zigzag.tile == (t // (2 * sp), t // (2 * sp)) and zigzag.tiles == (2 * sp + 1,) * sp
    assert max(zigzag.pairs) * 4 * sp == max(contiguous.pairs) * (2 * sp + 1)  # slowest device: (2sp+1)/4sp
    assert sum(zigzag.pairs) == sum(range(1, 2 * sp + 1)) * (t // (2 * sp)) ** 2  # the causal triangle, in chunks
    assert ring_work(mesh, t).tiles == (sp,) * sp
    assert ring_work(mesh, t, load_balance="zigzag").tiles == (4 * sp,) * sp


def test_load_balance_option_errors():
    q, k, v = inputs(t=20)
    with pytest.raises(ValueError, match=r"load_balance must be one of \('contiguous', 'zigzag'\); got 'striped'"):
        ring("striped", dp=2, sp=4)(q, k, v)
    with pytest.raises(ValueError, match="T=20 and S=20 must both be divisible by 8; pad the sequences or use "
                                         "load_balance='contiguous'"):
        ring("zigzag", dp=2, sp=4)(q, k, v)
    assert ring("contiguous", dp=2, sp=4)(q, k, v).attention_outputs.shape == q.shape
