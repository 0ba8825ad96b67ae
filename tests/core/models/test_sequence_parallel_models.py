"""Sequence (context) parallelism inside models: a model laid on an ``sp`` mesh passes its mesh to its
attention, so ``ring``, ``ulysses`` and ``allgather_kv`` run in every layer with the hidden states split along
the sequence. Against the unsharded model with ``vanilla`` attention (float32, left padding)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from workbench.core.mesh import make_mesh
from workbench.core.models.training import from_state, make_train_step, to_state
from workbench.models import GenerationConfig, tiny


def batch(model, b=2, t=64):
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (b, t)), jnp.int32)
    return ids, jnp.ones_like(ids).at[1, :5].set(0)


def max_diff(got, want, mask):
    return float(jnp.max(jnp.abs(got - want) * mask[..., None]))  # padded rows' logits mean nothing


@functools.cache
def unsharded_logits(family):
    """``(model, ids, mask, logits)``: the unsharded model with ``vanilla`` attention, once per family."""
    model = tiny(family)
    ids, mask = batch(model)
    with jax.default_matmul_precision("highest"):
        return model, ids, mask, model.with_attention("vanilla")(ids, mask).logits


@pytest.mark.parametrize("family, impl, axes, options", [
    ("llama", "ring", dict(fsdp=1, sp=8), {}),
    ("llama", "ring", dict(fsdp=1, sp=8), {"load_balance": "zigzag"}),
    ("llama", "ulysses", dict(dp=2, fsdp=1, sp=4), {}),
    ("qwen3", "ring", dict(dp=2, fsdp=1, sp=4), {}),
    ("gemma3", "ring", dict(fsdp=1, sp=8), {}),  # sliding and full layers, soft-capped logits
    ("mixtral", "ring", dict(fsdp=1, sp=8), {}),
    ("llama", "ring", dict(fsdp=2, tp=2, sp=2), {}),
    ("llama", "allgather_kv", dict(fsdp=1, sp=8), {}),
    ("qwen3", "allgather_kv", dict(dp=2, fsdp=1, sp=4), {"load_balance": "zigzag"}),
    ("gemma3", "allgather_kv", dict(fsdp=1, sp=8), {}),
    ("mixtral", "allgather_kv", dict(dp=2, fsdp=1, sp=4), {}),
])
def test_logits_equal_vanilla(family, impl, axes, options):
    model, ids, mask, want = unsharded_logits(family)
    with jax.default_matmul_precision("highest"):
        sharded = model.shard_model(make_mesh(**axes)).with_attention(impl, **options)
        got = sharded(ids, mask).logits
    assert max_diff(got, want, mask) <= 2e-5
    assert "sp" in str(got.sharding.spec)  # the hidden states stayed split along the sequence


@functools.cache
def unsharded_step():
    """``(loss, [(path, updated parameter)])`` of one SGD step of the unsharded tiny Llama with ``vanilla``
    attention: the reference both implementations below are compared with, computed once."""
    model = tiny("llama")
    ids, mask = batch(model)
    with jax.default_matmul_precision("highest"):
        plain, metrics = make_train_step()(to_state(model.with_attention("vanilla"), optax.sgd(0.1)),
                                           {"input_ids": ids, "attention_mask": mask})
    params = [(path, np.asarray(a.get_value())) for path, a in nnx.to_flat_state(nnx.state(from_state(plain),
                                                                                             nnx.Param))]
    return float(metrics["loss"]), params


@pytest.mark.parametrize("impl", ["ring", "allgather_kv"])
def test_a_train_step_on_an_sp_mesh_equals_the_unsharded_step(impl):
    plain_loss, plain_params = unsharded_step()
    model = tiny("llama")
    ids, mask = batch(model)
    data = {"input_ids": ids, "attention_mask": mask}
    with jax.default_matmul_precision("highest"):
        sharded = model.shard_model(make_mesh(dp=2, fsdp=1, sp=4)).with_attention(impl)
        state, metrics = make_train_step()(to_state(sharded, optax.sgd(0.1)), data)
    assert abs(float(metrics["loss"]) - plain_loss) <= 1e-5
    for (path, a), (_, b) in zip(plain_params, nnx.to_flat_state(nnx.state(from_state(state), nnx.Param)),
                                 strict=True):
        np.testing.assert_allclose(np.asarray(b.get_value()), a, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("impl", ["ring", "allgather_kv"])
def test_decoding_says_which_implementations_decode(impl):
    model = tiny("llama").shard_model(make_mesh(fsdp=1, sp=8)).with_attention(impl)
    ids, mask = batch(model, t=16)
    with pytest.raises(ValueError, match=rf"'{impl}' splits the sequence.*with_attention\(\.\.\.\) one of .*flash"):
        model.generate(ids, GenerationConfig(max_new_tokens=2, do_sample=False), attention_mask=mask)
    with pytest.raises(TypeError, match="hashable"):
        model.with_attention("ring", block_sizes=[1, 2])
