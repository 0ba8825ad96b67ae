"""LoRA adapters: fresh adapters are exact no-ops, unwrap folds them in, only adapters train."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.core.models.tiny_llama import batch, logits, tiny_model
from workbench.core.axes import EMPTY, FSDP, LAYERS, SP, TP, ColumnWise, DynamicShardingAxes, RowWise
from workbench.core.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear, TensorParallelConfig
from workbench.core.mesh import make_mesh
from workbench.core.models.lora import (
    LoRALinear,
    LoRAParam,
    apply_lora_to_layers,
    find_layers,
    merge_lora_params,
    split_lora_params,
    unwrap_lora_to_layers,
)
from workbench.core.models.stack import stacked_axes

L = 2  # layers of the tiny model, stacked on the leading axis of every layers/ parameter
PROJECTIONS = ("mlp/down_proj", "mlp/gate_proj", "mlp/up_proj", "self_attn/k_proj", "self_attn/o_proj",
               "self_attn/q_proj", "self_attn/v_proj")
N_LINEAR = len(PROJECTIONS) + 1  # one stacked module per projection kind (q k v o gate up down), plus lm_head
HI = jax.lax.Precision.HIGHEST


def snapshot(model):
    """Graph and values, to check that a function left ``model`` untouched."""
    return nnx.graphdef(model), jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def assert_untouched(model, snap):
    graphdef, values = snap
    assert nnx.graphdef(model) == graphdef
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)), values)


def randomize_b(model, seed=1):
    """A copy of a LoRA model with random non-zero lora_b (through split/merge_lora_params)."""
    lora, _ = split_lora_params(model)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    pure = nnx.to_pure_dict(lora)

    def fill(tree):
        for k, v in tree.items():
            if isinstance(v, dict):
                fill(v)
            elif k == "lora_b":
                tree[k] = 0.1 * jax.random.normal(next(keys), v.shape, v.dtype)
    fill(pure)
    return merge_lora_params(model, pure)


def test_fresh_adapters_leave_logits_bit_identical_and_input_untouched():
    model = tiny_model()
    ids, mask = batch()
    want = logits(model(ids, mask))
    snap = snapshot(model)
    lora = apply_lora_to_layers(model, 4)
    assert_untouched(model, snap)
    assert type(model.layers[0].self_attn.q_proj) is ColumnParallelLinear
    np.testing.assert_array_equal(logits(lora(ids, mask)), want)
    wrapped = {path: m for path, _, m in find_layers(lora, LoRALinear)}
    assert len(wrapped) == N_LINEAR and set(wrapped) == {f"layers/{p}" for p in PROJECTIONS} | {"lm_head"}
    for path, m in wrapped.items():  # every layer of a stacked projection has its own adapter
        lead = () if path == "lm_head" else (L,)
        assert m.lora_a.shape == (*lead, m.in_features, 4) and m.lora_b.shape == (*lead, 4, m.out_features)
        assert not np.any(np.asarray(m.lora_b[...]))
    for i in range(L):  # each layer view is a fresh adapter too
        assert not np.any(np.asarray(lora.layers[i].self_attn.q_proj.lora_b[...]))


def test_adapter_params_shapes_axes_and_init():
    lora = apply_lora_to_layers(tiny_model(), 8, "self_attn/(q|o)_proj", alpha=16.0)
    q, o = lora.layers[0].self_attn.q_proj, lora.layers[1].self_attn.o_proj
    assert isinstance(q, LoRALinear) and isinstance(lora.layers[0].self_attn.k_proj, ColumnParallelLinear)
    leaves = jax.tree.leaves(nnx.state(lora, LoRAParam))
    assert len(leaves) == 2 * 2 and all(x.shape[0] == L for x in leaves)  # (q, o) x (a, b), each stacked L deep
    stacked_q, stacked_o = lora.layers.self_attn.q_proj, lora.layers.self_attn.o_proj
    assert stacked_q.lora_a.shape == (L, 64, 8) and stacked_q.lora_b.shape == (L, 8, 64)
    assert stacked_o.lora_a.shape == (L, 64, 8) and stacked_o.lora_b.shape == (L, 8, 64)
    for m in (stacked_q, stacked_o):
        for i in range(L):  # a layer view holds that layer's slice
            view = getattr(lora.layers[i].self_attn, "q_proj" if m is stacked_q else "o_proj")
            np.testing.assert_array_equal(np.asarray(view.lora_a[...]), np.asarray(m.lora_a[...][i]))
            np.testing.assert_array_equal(np.asarray(view.lora_b[...]), np.asarray(m.lora_b[...][i]))
    a_L = np.asarray(stacked_q.lora_a[...])
    assert not np.array_equal(a_L[0], a_L[1])  # each layer its own draw
    assert all(abs(a_L[i].std() - 1 / 8) < 0.02 for i in range(L))
    assert isinstance(q.lora_a, LoRAParam) and isinstance(q.lora_a, nnx.Param)
    assert q.lora_a.shape == (64, 8) and q.lora_b.shape == (8, 64) and q.scale == 2.0
    assert not np.any(np.asarray(q.lora_b[...]))
    a = np.asarray(q.lora_a[...])  # PEFT "gaussian": normal with std 1 / rank
    assert abs(a.std() - 1 / 8) < 0.02 and not np.array_equal(a, np.asarray(o.lora_a[...]))
    col, row = ColumnWise.axes, RowWise.axes
    assert q.lora_a.semantic_axes == DynamicShardingAxes((col[0], EMPTY), ColumnWise.mode)
    assert q.lora_b.semantic_axes == DynamicShardingAxes((EMPTY, TP), ColumnWise.mode)
    assert o.lora_a.semantic_axes == DynamicShardingAxes((TP, EMPTY), RowWise.mode)
    assert o.lora_b.semantic_axes == DynamicShardingAxes((EMPTY, row[1]), RowWise.mode)
    assert row[1] == (FSDP, SP)
    # the stacked adapters: LAYERS in front of the one-layer axes
    assert stacked_q.lora_a.semantic_axes == stacked_axes(q.lora_a.semantic_axes)
    assert stacked_q.lora_b.semantic_axes == stacked_axes(q.lora_b.semantic_axes)
    assert stacked_o.lora_a.semantic_axes == DynamicShardingAxes((LAYERS, TP, EMPTY), RowWise.mode)
    assert stacked_o.lora_b.semantic_axes == DynamicShardingAxes((LAYERS, EMPTY, row[1]), RowWise.mode)
    # the base layer's attributes read through
    assert (q.in_features, q.out_features, q.direction, o.direction) == (64, 64, "column", "row")
    assert q.use_bias is False and q.parallel_config is None and q.dtype == q.base.dtype


def test_forward_is_base_plus_scaled_low_rank_product():
    layer = RowParallelLinear(6, 5, rngs=nnx.Rngs(0), precision=HI)
    wrapped = apply_lora_to_layers(nnx.List([layer]), 2, alpha=6.0, rngs=nnx.Rngs(3))[0]
    wrapped = randomize_b(nnx.List([wrapped]))[0]
    x = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    f64 = lambda v: np.asarray(v[...], np.float64)
    want = x @ f64(layer.kernel) + f64(layer.bias) + x @ f64(wrapped.lora_a) @ f64(wrapped.lora_b) * 3.0
    np.testing.assert_allclose(np.asarray(wrapped(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


def test_errors_say_what_to_change():
    model = tiny_model()
    for rank in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rank must be an int >= 1"):
            apply_lora_to_layers(model, rank)
    with pytest.raises(ValueError, match=r"matches no ParallelLinear.*layers/mlp/down_proj"):
        apply_lora_to_layers(model, 4, "attention/query")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        apply_lora_to_layers(model, 4, "q_proj(")
    with pytest.raises(ValueError, match="no LoRA parameters"):
        split_lora_params(model)
    with pytest.raises(ValueError, match="no LoRALinear"):
        unwrap_lora_to_layers(model)
    lora = apply_lora_to_layers(model, 4, "q_proj")
    with pytest.raises(ValueError, match="already sits inside a LoRALinear"):
        apply_lora_to_layers(lora, 4, "self_attn")
    apply_lora_to_layers(lora, 4, "v_proj")  # other layers still can be adapted
    other = apply_lora_to_layers(model, 4, "k_proj")
    with pytest.raises(ValueError, match=r"missing \[layers/self_attn/q_proj/lora_a"):
        merge_lora_params(lora, split_lora_params(other)[0])
    wide = apply_lora_to_layers(model, 8, "q_proj")
    with pytest.raises(ValueError, match=r"mis-shaped.*\(2, 64, 8\) \(expected \(2, 64, 4\)\)"):
        merge_lora_params(lora, split_lora_params(wide)[0])


def test_split_and_merge_lora_params_round_trip():
    lora = apply_lora_to_layers(tiny_model(), 4, "mlp")
    adapters, other = split_lora_params(lora)
    leaves = lambda s: nnx.to_flat_state(s)
    assert all(isinstance(v, LoRAParam) for _, v in leaves(adapters)) and len(leaves(adapters)) == 3 * 2
    assert all(v.shape[0] == L for _, v in leaves(adapters))  # gate/up/down x (a, b), each for both layers
    assert not any(isinstance(v, LoRAParam) for _, v in leaves(other))
    assert len(leaves(adapters)) + len(leaves(other)) == len(leaves(nnx.state(lora)))
    snap = snapshot(lora)
    tuned = randomize_b(lora)
    assert_untouched(lora, snap)
    got, _ = split_lora_params(tuned)
    b_of = lambda state: state["layers"]["mlp"]["up_proj"]["lora_b"]
    assert all(np.any(np.asarray(b_of(got)[...][i])) for i in range(L))
    np.testing.assert_array_equal(np.asarray(b_of(got)[...][1]), np.asarray(tuned.layers[1].mlp.up_proj.lora_b[...]))
    # the states are copies: editing them leaves the model alone
    b_of(adapters)[...] = jnp.ones_like(b_of(adapters)[...])
    assert not np.any(np.asarray(lora.layers.mlp.up_proj.lora_b[...]))
    ids, mask = batch()
    assert not np.allclose(logits(tuned(ids, mask)), logits(lora(ids, mask)))


def test_unwrap_folds_adapters_into_kernels():
    model = tiny_model()
    tuned = randomize_b(apply_lora_to_layers(model, 4, alpha=8.0))
    snap = snapshot(tuned)
    plain = unwrap_lora_to_layers(tuned)
    assert_untouched(tuned, snap)
    assert not any(isinstance(m, LoRALinear) for _, m in nnx.iter_graph(plain))
    assert not jax.tree.leaves(nnx.state(plain, LoRAParam))
    assert nnx.graphdef(plain) == nnx.graphdef(model)  # same structure and attributes as before LoRA
    f64 = lambda v: np.asarray(v[...], np.float64)
    for i in range(L):  # each layer's kernel absorbs that layer's adapter
        q, lq = plain.layers[i].self_attn.q_proj, tuned.layers[i].self_attn.q_proj
        np.testing.assert_allclose(f64(q.kernel), f64(lq.base.kernel) + f64(lq.lora_a) @ f64(lq.lora_b) * 2.0,
                                   rtol=1e-6, atol=1e-6)
        assert q.kernel.semantic_axes == ColumnWise
    assert plain.layers.self_attn.q_proj.kernel.shape == (L, 64, 64)
    assert plain.layers.self_attn.q_proj.kernel.semantic_axes == stacked_axes(ColumnWise)
    ids, mask = batch()
    with jax.default_matmul_precision("highest"):
        want, got = logits(tuned(ids, mask)), logits(plain(ids, mask))
    assert np.abs(want - logits(model(ids, mask))).max() > 1e-2  # the adapters do something
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_gradient_step_on_adapters_only():
    model = tiny_model()
    lora = apply_lora_to_layers(model, 4, "self_attn")
    ids, mask = batch()
    before = logits(lora(ids, mask))
    base_kernels = nnx.to_pure_dict(nnx.state(lora, nnx.Not(LoRAParam)))

    def loss_fn(m):
        return jnp.mean(jnp.square(jnp.asarray(getattr(out := m(ids, mask), "logits", out))))

    @nnx.jit
    def step(m):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LoRAParam))(m)
        nnx.update(m, jax.tree.map(lambda p, g: p - 1.0 * g, nnx.state(m, LoRAParam), grads))
        return loss, grads

    trained = nnx.clone(lora)
    _, grads = step(trained)
    flat = nnx.to_flat_state(grads)
    assert flat and all(isinstance(v, LoRAParam) for _, v in flat)
    b_grads = [(p, np.asarray(v[...])) for p, v in flat if p[-1] == "lora_b"]
    assert len(b_grads) == 4 and all(g.shape[0] == L for _, g in b_grads)
    # the gradient reaches every layer's slice of every stacked adapter through the scan
    assert all(np.any(g[i]) for _, g in b_grads for i in range(L)), [p for p, g in b_grads]
    assert np.abs(logits(trained(ids, mask)) - before).max() > 1e-4
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(trained, nnx.Not(LoRAParam))),
                 base_kernels)
    np.testing.assert_array_equal(logits(lora(ids, mask)), before)  # the step worked on a clone


def test_split_merge_and_jit():
    tuned = randomize_b(apply_lora_to_layers(tiny_model(), 4))
    ids, mask = batch()
    eager = logits(tuned(ids, mask))
    graphdef, state = nnx.split(tuned)
    merged = nnx.merge(graphdef, state)
    assert isinstance(merged.layers[0].mlp.down_proj, LoRALinear) and merged.layers[0].mlp.down_proj.scale == 1.0
    np.testing.assert_array_equal(logits(merged(ids, mask)), eager)
    jitted = jax.jit(lambda s, i, m: getattr(o := nnx.merge(graphdef, s)(i, m), "logits", o))(state, ids, mask)
    np.testing.assert_allclose(np.asarray(jitted), eager, rtol=1e-5, atol=1e-5)
    via_nnx = nnx.jit(lambda m, i, k: getattr(o := m(i, k), "logits", o))(tuned, ids, mask)
    np.testing.assert_allclose(np.asarray(via_nnx), eager, rtol=1e-5, atol=1e-5)
    unwrapped = nnx.jit(unwrap_lora_to_layers)(tuned)
    assert isinstance(unwrapped.layers[0].mlp.down_proj, ParallelLinear)


def lora_loss(ids, mask):
    return lambda m: jnp.mean(jnp.square(m(ids, mask).logits))


def test_lora_model_runs_scanned_and_unrolled_alike():
    tuned = randomize_b(apply_lora_to_layers(tiny_model(), 4))
    a_L = np.asarray(tuned.layers.self_attn.q_proj.lora_a[...])
    b_L = np.asarray(tuned.layers.mlp.down_proj.lora_b[...])
    assert not np.array_equal(a_L[0], a_L[1]) and not np.array_equal(b_L[0], b_L[1])  # layers differ: not trivial
    unrolled = tuned.with_options(scan_layers=False)
    assert tuned.scan_layers and not unrolled.scan_layers
    ids, mask = batch()
    loss_fn = lora_loss(ids, mask)
    grad = nnx.grad(loss_fn, argnums=nnx.DiffState(0, LoRAParam))
    with jax.default_matmul_precision("highest"):
        scanned_logits, unrolled_logits = logits(tuned(ids, mask)), logits(unrolled(ids, mask))
        g_scan, g_unroll = nnx.to_pure_dict(grad(tuned)), nnx.to_pure_dict(grad(unrolled))
    np.testing.assert_allclose(unrolled_logits, scanned_logits, rtol=0, atol=1e-5)
    assert np.abs(scanned_logits - logits(tiny_model()(ids, mask))).max() > 1e-2  # the adapters act
    # the same gradient per layer slice, whichever way the layers run
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 g_unroll, g_scan)
    assert np.any(np.asarray(g_scan["layers"]["self_attn"]["q_proj"]["lora_a"])[1])


def zero_layer_slice(pure, index):
    """``pure`` (split_lora_params as a dict) with every stacked lora_b zero in layer ``index``."""
    def walk(tree, stacked):
        return {k: walk(v, stacked or k == "layers") if isinstance(v, dict) else
                (v.at[index].set(0) if stacked and k == "lora_b" else v) for k, v in tree.items()}
    return walk(pure, False)


@pytest.mark.parametrize("scan", [True, False])
def test_each_layer_has_its_own_adapter(scan):
    """Adapters zero in layer 0 and random in layer 1: exactly the base model with layer 1's kernels changed."""
    model = tiny_model()
    lora = apply_lora_to_layers(model, 4, "^layers/", alpha=8.0)
    tuned = randomize_b(lora)
    only_1 = merge_lora_params(lora, zero_layer_slice(nnx.to_pure_dict(split_lora_params(tuned)[0]), 0))
    ref = nnx.clone(model)
    adapters = {path: m for path, _, m in find_layers(only_1, LoRALinear)}
    assert set(adapters) == {f"layers/{p}" for p in PROJECTIONS}
    for path, _, layer in find_layers(ref, ParallelLinear):
        if path in adapters:
            delta = np.asarray(adapters[path].delta_kernel())
            assert delta.shape == (L, *layer.kernel.shape[1:]) and not np.any(delta[0]) and np.any(delta[1])
            layer.kernel.set_value(layer.kernel[...].at[1].add(delta[1]))  # layer 1 only
    # one projection, layer by layer: layer 0 is the base layer bit for bit, layer 1 is base + its own adapter
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 64)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(only_1.layers[0].self_attn.q_proj(x)),
                                  np.asarray(model.layers[0].self_attn.q_proj(x)))
    assert np.abs(np.asarray(only_1.layers[1].self_attn.q_proj(x)) -
                  np.asarray(model.layers[1].self_attn.q_proj(x))).max() > 1e-3
    ids, mask = batch()
    only_1, ref = only_1.with_options(scan_layers=scan), ref.with_options(scan_layers=scan)
    with jax.default_matmul_precision("highest"):
        got, want, base = logits(only_1(ids, mask)), logits(ref(ids, mask)), logits(model(ids, mask))
    assert np.abs(want - base).max() > 1e-2  # layer 1's adapters change the output
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # and the tuned model (both layers adapted) is not that model: layer 0's adapter is used in layer 0
    with jax.default_matmul_precision("highest"):
        assert np.abs(logits(tuned.with_options(scan_layers=scan)(ids, mask)) - want).max() > 1e-3


@pytest.mark.parametrize("direction", ["column", "row"])
def test_adapters_follow_the_base_layer_onto_its_mesh(direction):
    mesh = make_mesh(dp=2, fsdp=1, tp=4)
    config = TensorParallelConfig(mesh)
    layer = ParallelLinear(16, 32, direction=direction, parallel_config=config, precision=HI, rngs=nnx.Rngs(0))
    plain = ParallelLinear(16, 32, direction=direction, precision=HI, rngs=nnx.Rngs(0))
    wrapped = randomize_b(apply_lora_to_layers(nnx.List([layer]), 4))[0]
    ref = merge_lora_params(apply_lora_to_layers(nnx.List([plain]), 4), split_lora_params(
        nnx.List([wrapped]))[0])[0]
    a_spec, b_spec = (P(None, None), P(None, "tp")) if direction == "column" else (P("tp", None), P(None, None))
    assert wrapped.lora_a[...].sharding.is_equivalent_to(NamedSharding(mesh, a_spec), 2)
    assert wrapped.lora_b[...].sharding.is_equivalent_to(NamedSharding(mesh, b_spec), 2)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 16)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(wrapped(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)
    merged = unwrap_lora_to_layers(nnx.List([wrapped]))[0]
    assert merged.kernel[...].sharding.is_equivalent_to(layer.kernel[...].sharding, 2)
    np.testing.assert_allclose(np.asarray(merged(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-5)
