"""Training: the jitted step (sharded = unsharded), batches, and a loss that falls on the shipped text."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import PartitionAxis
from workbench.core.mesh import make_mesh
from workbench.core.models.loss import causal_lm_loss
from workbench.core.models.presets import tiny
from workbench.core.models.tokenizer import ByteTokenizer
from workbench.core.models.training import (
    TrainState,
    batches,
    from_state,
    make_eval_step,
    make_optimizer,
    make_train_step,
    to_state,
    train,
)
from workbench.data import load_text

IDS = np.asarray(ByteTokenizer().encode(load_text("genesis")), np.int32)


def place(model, mesh):
    """A copy of ``model`` with every variable placed by its semantic axes (what shard_model does)."""
    partition_axis = PartitionAxis()
    graphdef, state = nnx.split(model)

    def put(var):
        spec = partition_axis.resolve(var.semantic_axes, shape=var.shape, mesh=mesh)
        return var.replace(jax.device_put(var[...], NamedSharding(mesh, spec)))

    return nnx.merge(graphdef, jax.tree.map(put, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_batches_are_random_windows():
    a, b = next(batches(IDS, 4, 16, seed=1)), next(batches(IDS, 4, 16, seed=1))
    ids = a["input_ids"]
    assert ids.shape == (4, 16) and ids.dtype == np.int32 and np.array_equal(ids, b["input_ids"])
    for row in ids:  # each row is a contiguous slice of the text
        starts = np.flatnonzero(np.lib.stride_tricks.sliding_window_view(IDS, 16).__eq__(row).all(1))
        assert starts.size >= 1
    with pytest.raises(ValueError, match="fewer than seq_len"):
        next(batches(IDS[:10], 2, 16))
    with pytest.raises(ValueError, match="flat"):
        next(batches(IDS.reshape(-1, 1), 2, 16))


def test_sharded_step_equals_unsharded_step_and_keeps_shardings():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    model = tiny("llama", attn_mechanism="vanilla", num_hidden_layers=1)  # one layer compiles faster
    sharded = place(model, mesh)
    # SGD with momentum: a param-shaped optimizer state, and updates linear in the gradient. (AdamW's first
    # update is g / (|g| + eps): where a byte never occurs |g| ~ eps, so 1e-9 differences in the summation
    # order of the sharded gradient move such params by ~2e-5; the gradients themselves agree to 1e-9.)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    batch = next(batches(IDS, 8, 32, seed=1))
    step = make_train_step()
    with jax.default_matmul_precision("highest"):
        plain, plain_metrics = step(to_state(model, optimizer), batch)
        state = to_state(sharded, optimizer)
        before = jax.tree.map(lambda x: x.sharding, state)
        state, metrics = step(state, batch)
    for key in ("loss", "grad_norm"):
        assert abs(float(metrics[key]) - float(plain_metrics[key])) <= 1e-5
    assert int(metrics["num_tokens"]) == 8 * 31 and int(state.step) == 1
    for got, want in zip(leaves((state.params, state.opt_state)), leaves((plain.params, plain.opt_state)), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    after = jax.tree.map(lambda x: x.sharding, state)
    assert jax.tree.leaves(after) == jax.tree.leaves(before)
    specs = {s.spec for s in jax.tree.leaves(after)}
    assert any("tp" in str(spec) for spec in specs) and any("fsdp" in str(spec) for spec in specs)
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(sharded)))  # the model was not donated


def test_adamw_state_follows_param_shardings():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    state = to_state(place(tiny("llama", attn_mechanism="vanilla", num_hidden_layers=1), mesh), make_optimizer(10))
    adam = state.opt_state[1][0]
    param_shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.params))
    for moments in (adam.mu, adam.nu):
        assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments)) == param_shardings
    assert adam.count.sharding.mesh == mesh and adam.count.sharding.spec == P()
    assert state.step.sharding.mesh == mesh


def test_loss_falls_on_the_shipped_text():
    model = tiny("llama", attn_mechanism="vanilla")
    before = leaves(nnx.state(model, nnx.Param))
    trained, losses = train(model, load_text("genesis"), steps=30, batch_size=8, seq_len=64, progress=False)
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses  # ~6.0 -> ~2.6 (unigram statistics of English)
    for a, b in zip(before, leaves(nnx.state(model, nnx.Param)), strict=True):  # the caller's model is unchanged
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(before, leaves(nnx.state(trained, nnx.Param)), strict=True))


def test_state_round_trip_and_errors():
    model = tiny("llama", attn_mechanism="vanilla")
    state = to_state(model)
    assert isinstance(state, TrainState) and int(state.step) == 0
    back = from_state(state)
    for a, b in zip(leaves(nnx.state(model)), leaves(nnx.state(back)), strict=True):
        np.testing.assert_array_equal(a, b)
    ids = next(batches(IDS, 2, 16))["input_ids"]
    reference = nnx.jit(lambda m, ids: causal_lm_loss(getattr(out := m(ids), "logits", out), ids))
    want, n = reference(model, jnp.asarray(ids))
    got = make_eval_step()(state, {"input_ids": ids})
    assert abs(float(got["loss"]) - float(want)) <= 1e-5 and int(got["num_tokens"]) == int(n) == 2 * 15
    with pytest.raises(ValueError, match="input_ids"):
        make_train_step()(state, {"tokens": np.zeros((2, 4), np.int32)})
    with pytest.raises(TypeError, match="TrainState"):
        make_train_step()(model, {"input_ids": np.zeros((2, 4), np.int32)})
    with pytest.raises(ValueError, match="vocab_size"):
        train(model, np.array([0, 1, 300, 2] * 20), steps=1, progress=False)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(10, warmup_steps=10)
