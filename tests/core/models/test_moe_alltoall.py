"""The ``alltoall`` MoE strategy: equal to ``dense`` when nothing is dropped (8 simulated devices, ep in
{2, 4, 8}, with tp and FSDP), and with a finite capacity it drops exactly the copies a float64 NumPy
reference of the same rule drops, with the same output."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh
from workbench.core.models.moe import MoE
from workbench.core.models.moe_alltoall import capacity, dispatch_slots
from workbench.core.models.sharding import shard_model

D, F, E, K = 16, 24, 8, 2


def moe(strategy="dense", capacity_factor=None, **kw):
    layer = MoE(D, F, E, K, strategy=strategy, capacity_factor=capacity_factor, rngs=nnx.Rngs(0), **kw)
    # a peaked router so experts are unevenly loaded (drops happen at capacity factor 1)
    layer.router_kernel.set_value(layer.router_kernel[...] * 40)
    return layer


def tokens(b=4, t=6, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, t, D)).astype(np.float32))


def numpy_reference(layer: MoE, x_BTD: np.ndarray, capacity_factor: float | None, groups: int) -> tuple:
    """float64: route, keep each expert's first C copies in token order within each of ``groups`` equal
    token groups (the tokens one device dispatches), run the kept copies' experts, combine."""
    x = np.asarray(x_BTD, np.float64).reshape(-1, D)
    w = {n: np.asarray(getattr(layer, n)[...], np.float64) for n in ("router_kernel", "gate_proj", "up_proj",
                                                                     "down_proj")}
    logits = x @ w["router_kernel"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :K]
    weights = np.take_along_axis(probs, experts, 1)
    weights /= weights.sum(1, keepdims=True)
    y, dropped = np.zeros_like(x), np.zeros(experts.shape, bool)
    n_group = len(x) // groups
    c = capacity(n_group, K, E, capacity_factor)
    for g in range(groups):
        used = np.zeros(E, int)
        for n in range(g * n_group, (g + 1) * n_group):
            for j in range(K):
                e = experts[n, j]
                if used[e] >= c:
                    dropped[n, j] = True
                    continue
                used[e] += 1
                h = x[n] @ w["gate_proj"][e]
                h = h / (1 + np.exp(-h)) * (x[n] @ w["up_proj"][e])
                y[n] += weights[n, j] * (h @ w["down_proj"][e])
    return y.reshape(x_BTD.shape), dropped


def test_capacity_and_slots():
    assert capacity(12, 2, 8, 1.0) == 3 and capacity(12, 2, 8, None) == 12 and capacity(12, 2, 8, 100.0) == 12
    slots, keep = dispatch_slots(jnp.asarray([[0, 1], [0, 2], [1, 0], [0, 3]]), 4, 2)
    np.testing.assert_array_equal(slots, [[0, 0], [1, 0], [1, 2], [3, 0]])
    np.testing.assert_array_equal(keep, [[True, True], [True, True], [True, False], [False, True]])
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        capacity(12, 2, 8, 0.0)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, None])
def test_one_device_drops_what_the_numpy_reference_drops(capacity_factor):
    layer, x = moe("alltoall", capacity_factor), tokens()
    want, want_dropped = numpy_reference(layer, x, capacity_factor, groups=1)
    with jax.default_matmul_precision("highest"):
        got, _ = layer(x)
        _, dispatch = layer.dispatch(x)
    assert int(dispatch.dropped) == want_dropped.sum()
    if capacity_factor == 1.0:
        assert want_dropped.sum() > 0  # the test exercises drops
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@functools.cache
def dense_reference_on_8_rows():
    """The dense layer's output on ``tokens(b=8)``: the reference of every mesh below, computed once."""
    with jax.default_matmul_precision("highest"):
        want, _ = moe("dense")(tokens(b=8))
    return np.asarray(want)


@pytest.mark.parametrize("axes", [dict(dp=4, ep=2), dict(dp=2, ep=4), dict(ep=8, dp=1), dict(dp=2, ep=2, tp=2),
                                  dict(fsdp=2, ep=4)])
def test_no_drop_equals_dense_on_a_mesh(axes):
    mesh = make_mesh(**({"fsdp": 1} | axes))
    x = tokens(b=8)
    want = dense_reference_on_8_rows()
    with jax.default_matmul_precision("highest"):
        sharded = shard_model(moe("alltoall"), mesh)
        got, _ = jax.jit(lambda m, x: m(x))(sharded, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_gradients_equal_dense():
    mesh = make_mesh(dp=2, fsdp=1, ep=4)
    x = tokens(b=8)

    def grads(layer):
        graphdef, params = nnx.split(layer, nnx.Param)

        def loss(params, x):
            y, _ = nnx.merge(graphdef, params)(x)
            return jnp.sum(y ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    with jax.default_matmul_precision("highest"):
        (want_p, want_x), (got_p, got_x) = grads(moe("dense")), grads(shard_model(moe("alltoall"), mesh))
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(want_x), atol=1e-5)
    for name in ("router_kernel", "gate_proj", "up_proj", "down_proj"):
        np.testing.assert_allclose(np.asarray(got_p[name][...]), np.asarray(want_p[name][...]), atol=1e-5,
                                   err_msg=name)


def test_capacity_on_a_mesh_drops_per_device():
    """dp=2 x ep=4: each of the 8 devices dispatches 1/8 of the tokens, with its own capacity."""
    mesh = make_mesh(dp=2, fsdp=1, ep=4)
    layer, x = moe("alltoall", 1.0), tokens(b=8, t=6)
    want, want_dropped = numpy_reference(layer, x, 1.0, groups=8)
    sharded = shard_model(layer, mesh)
    with jax.default_matmul_precision("highest"):
        got, _ = jax.jit(lambda m, x: m(x))(sharded, x)
        _, dispatch = jax.jit(lambda m, x: m.dispatch(x))(sharded, x)
    assert want_dropped.sum() > 0 and int(dispatch.dropped) == want_dropped.sum()
    assert int(dispatch.tokens_per_expert_E.sum()) == x.shape[0] * x.shape[1] * K
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_the_compiled_program_moves_tokens_with_two_all_to_alls():
    mesh = make_mesh(dp=2, fsdp=1, ep=4)
    sharded = shard_model(moe("alltoall", 1.25), mesh)
    x = jax.ShapeDtypeStruct((8, 6, D), jnp.float32, sharding=NamedSharding(mesh, P(("fsdp", "dp"))))
    graphdef, state = nnx.split(sharded)
    compiled = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0]).lower(state, x).compile()
    kinds = [c.kind for c in collectives(compiled)]
    assert kinds.count("all-to-all") == 2, kinds
    c = capacity(48 // 8, K, E, 1.25)
    a2a = [r for r in collectives(compiled) if r.kind == "all-to-all"]
    for r in a2a:  # (E, C, D) per device each way (XLA may pass it as one operand per destination)
        shapes = r.shape if isinstance(r.shape[0], tuple) else (r.shape,)
        assert sum(math.prod(s) for s in shapes) == E * c * D, r


def test_experts_must_split_over_ep():
    mesh = make_mesh(dp=1, fsdp=1, ep=8)
    layer = MoE(D, F, 4, K, strategy="alltoall", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="4 experts do not split over ep=8"):
        shard_model(layer, mesh)(tokens(b=8))


# Depths: the fewest layers that keep each family's MoE structure (compile time grows with the layers; a scan of one
# layer compiles as no loop at all). One MoE layer for Mixtral, and for DeepSeek-V3 after its dense layer (Qwen3-MoE's
# tiny default already is a dense and an MoE layer); GPT-OSS keeps its 2 MoE layers of alternating kinds, so one
# family runs alltoall inside the layer scan (2 trips, each picking its layer kind with a switch), forward and back.
DEPTH = {"mixtral": 1, "deepseek_v3": 2}


@functools.cache
def tiny_moe(family):
    """The tiny ``family`` model with 8 experts (so they split over every ep) and ``DEPTH`` layers, built once
    for the tests below (``with_options`` and ``shard_model`` return new models; this one stays as built)."""
    from workbench.models import tiny

    names = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}  # the HF configs' names for E
    depth = {"num_hidden_layers": DEPTH[family]} if family in DEPTH else {}
    return tiny(family, **{names.get(family, "num_local_experts"): 8}, **depth)


def forward_batch(family):
    model = tiny_moe(family)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (8, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[:2, :3].set(0)  # left padding in two rows
    return ids, mask


@functools.cache
def dense_logits(family):
    """The unsharded model's logits on ``forward_batch``: the reference of every ep, computed once."""
    ids, mask = forward_batch(family)
    with jax.default_matmul_precision("highest"):
        return np.asarray(tiny_moe(family)(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_models_alltoall_equals_dense(family, ep):
    model = tiny_moe(family)
    mesh = make_mesh(dp=8 // ep, fsdp=1, ep=ep)
    ids, mask = forward_batch(family)
    want = dense_logits(family)
    with jax.default_matmul_precision("highest"):
        sharded = model.with_options(moe_strategy="alltoall").shard_model(mesh)
        got = sharded(ids, attention_mask=mask).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_with_options_checks_the_moe_options():
    from workbench.models import tiny

    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        tiny("llama").with_options(moe_strategy="alltoall")
    with pytest.raises(ValueError, match="unknown MoE strategy 'a2a'"):
        tiny("mixtral").with_options(moe_strategy="a2a")
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        tiny("mixtral").with_options(capacity_factor=-1.0)
    model = tiny("mixtral")
    changed = model.with_options(moe_strategy="alltoall", capacity_factor=1.25)
    assert changed.layers.mlp.strategy == "alltoall" and changed.layers.mlp.capacity_factor == 1.25
    assert model.layers.mlp.strategy == "auto"  # the original is unchanged


def test_auto_is_alltoall_on_an_ep_mesh_and_dense_elsewhere():
    from workbench.models import tiny

    model = tiny("mixtral")
    assert model.layers.mlp.resolved_strategy() == "dense"  # no mesh
    assert model.shard_model(make_mesh(dp=8, fsdp=1)).layers.mlp.resolved_strategy() == "dense"
    assert model.shard_model(make_mesh(dp=2, fsdp=1, ep=4)).layers.mlp.resolved_strategy() == "alltoall"


def test_token_counts_that_ep_does_not_divide_are_padded():
    """dp=2 x ep=4 with one row of 7 tokens per dp shard: 7 tokens split 2, 2, 2, 1 (one padded) over ep;
    logits equal the unsharded model's, and greedy decoding (one token per row a step) gives the same
    tokens."""
    from workbench.models import GenerationConfig, tiny

    model = tiny("mixtral", num_hidden_layers=1)  # the padding is each MoE layer's: one shows it
    ids = jnp.asarray(np.random.default_rng(3).integers(1, model.config.vocab_size, (2, 7)), jnp.int32)
    sharded = model.shard_model(make_mesh(dp=2, fsdp=1, ep=4))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(sharded(ids).logits), np.asarray(model(ids).logits), atol=1e-5)
        config = GenerationConfig(max_new_tokens=6, do_sample=False)
        want = model.generate(ids, config).sequences
        got = sharded.generate(ids, config).sequences
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def loss_grads(m, ids):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    loss = lambda p: nnx.merge(graphdef, p, rest).compute_loss(ids)[0]
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.grad(loss))(params)


def grads_batch(family):
    return jnp.asarray(np.random.default_rng(1).integers(1, tiny_moe(family).config.vocab_size, (8, 12)), jnp.int32)


@functools.cache
def dense_grads(family):
    """The dense model's gradients on one device: the reference of every ep, compiled and computed once."""
    return loss_grads(tiny_moe(family).with_options(moe_strategy="dense"), grads_batch(family))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_models_alltoall_gradients_equal_dense(family, ep):
    """Gradients of the loss with respect to every parameter: alltoall on a dp x ep mesh vs dense on one device."""
    model = tiny_moe(family)
    want = dense_grads(family)
    got = loss_grads(model.with_options(moe_strategy="alltoall").shard_model(make_mesh(dp=8 // ep, fsdp=1, ep=ep)),
                     grads_batch(family))
    for (path, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got), strict=True):
        np.testing.assert_allclose(np.asarray(b.get_value()), np.asarray(a.get_value()), atol=1e-5, err_msg=str(path))
