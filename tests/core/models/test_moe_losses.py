"""MoE balancing: the Switch auxiliary loss and the loss with it against transformers, the router z-loss,
expert counts and DeepSeek-V3's bias update against float64 NumPy from the papers' formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import batch, hf_forward, hf_model, state_dict, torch
from workbench.core.models import ModelConfig, from_hf_state_dict
from workbench.core.models.moe_losses import (
    expert_counts,
    load_balancing_loss,
    router_z_loss,
    update_correction_bias,
)

L, N, E, K = 3, 10, 8, 2


def logits_and_mask(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((L, N, E)).astype(np.float32) * 2
    mask = np.ones((2, N // 2), np.int64)
    mask[1, :2] = 0
    return logits, mask


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits, mask = logits_and_mask()
    want = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), E, K,
                                    torch.tensor(mask) if masked else None).item()
    got = float(load_balancing_loss(jnp.asarray(logits), K, jnp.asarray(mask) if masked else None))
    assert abs(got - want) <= 1e-6 * max(1, abs(want)), (got, want)


def test_router_z_loss_and_counts_against_numpy():
    logits, mask = logits_and_mask(1)
    w = mask.reshape(-1).astype(np.float64)
    x = logits.astype(np.float64)
    z = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    want_z = (z ** 2 * w).sum() / (w.sum() * L)  # ST-MoE eq. 5, over layers and real tokens
    np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits), jnp.asarray(mask))), want_z, rtol=1e-6)
    top = np.argsort(-x, axis=-1)[..., :K]
    want_counts = np.zeros((L, E))
    for layer in range(L):
        for n in range(N):
            want_counts[layer, top[layer, n]] += w[n]
    np.testing.assert_array_equal(np.asarray(expert_counts(jnp.asarray(logits), K, jnp.asarray(mask))), want_counts)


def test_deepseek_bias_update():
    """DeepSeek-V3 report, section 2.1.2: decrease the bias of an overloaded expert by gamma, increase an
    underloaded one's; an expert exactly at the mean load keeps its bias."""
    bias = np.array([0.1, -0.2, 0.0, 0.3], np.float32)
    load = np.array([10, 2, 4, 8])  # mean 6
    got = np.asarray(update_correction_bias(jnp.asarray(bias), jnp.asarray(load), rate=0.01))
    np.testing.assert_allclose(got, bias + 0.01 * np.array([-1, 1, 1, -1]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(update_correction_bias(jnp.asarray(bias), jnp.full(4, 5))), bias)
    with pytest.raises(ValueError, match="rate"):
        update_correction_bias(jnp.asarray(bias), jnp.asarray(load), rate=0.0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_loss_with_aux_loss_equals_transformers(family):
    coef = 0.02
    model = hf_model(family, router_aux_loss_coef=coef, output_router_logits=True)
    ours = from_hf_state_dict(ModelConfig.from_hf(model.config.to_dict()), state_dict(model))
    ids, mask = batch()
    labels = np.where(mask.astype(bool) & np.pad(mask[:, :-1], ((0, 0), (1, 0)), constant_values=1), ids, -100)
    out = hf_forward(model, ids, mask, labels=torch.tensor(labels))
    assert out.aux_loss.item() > 0
    with jax.default_matmul_precision("highest"):
        got, _ = ours.compute_loss(jnp.asarray(ids), jnp.asarray(mask), router_aux_loss_coef=coef)
    assert abs(float(got) - out.loss.item()) <= 1e-5, (float(got), out.loss.item())


def test_router_losses_need_a_mixture_of_experts():
    from workbench.models import tiny

    ids = jnp.ones((1, 4), jnp.int32)
    # compute_loss raises while tracing (after the forward, before any loss is added): eval_shape runs that
    # Python without compiling and running the two forwards whose results the errors discard
    with pytest.raises(ValueError, match="this llama model has none"):
        jax.eval_shape(lambda ids: tiny("llama").compute_loss(ids, router_aux_loss_coef=0.01), ids)
    with pytest.raises(ValueError, match="update_correction_bias"):
        jax.eval_shape(lambda ids: tiny("deepseek_v3").compute_loss(ids, router_aux_loss_coef=0.01), ids)
    mixtral = tiny("mixtral")
    plain, _ = mixtral.compute_loss(ids)
    with_z, _ = mixtral.compute_loss(ids, router_z_loss_coef=0.001)
    assert float(with_z) > float(plain)


def test_train_step_adds_the_router_losses_and_reports_expert_load():
    """The step's loss is compute_loss's with the same coefficients (compute_loss is checked against
    transformers above); expert_load counts every real token's k choices per layer. On a dp x ep mesh
    (alltoall dispatch) the step's loss and updated parameters equal the unsharded step's."""
    import optax

    from workbench.core.mesh import make_mesh
    from workbench.core.models.training import from_state, make_train_step, to_state
    from workbench.models import tiny

    model = tiny("mixtral")
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (4, 16)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, :3].set(0)
    coefs = dict(router_aux_loss_coef=0.02, router_z_loss_coef=0.001)
    with jax.default_matmul_precision("highest"):
        want, _ = model.compute_loss(ids, mask, labels=ids, **coefs)
        step = make_train_step(**coefs)
        state, metrics = step(to_state(model, optax.sgd(0.1)), {"input_ids": ids, "attention_mask": mask,
                                                                  "labels": ids})
        sharded = model.shard_model(make_mesh(dp=2, fsdp=1, ep=4))
        state_ep, metrics_ep = step(to_state(sharded, optax.sgd(0.1)), {"input_ids": ids, "attention_mask": mask,
                                                                         "labels": ids})
    assert abs(float(metrics["loss"]) - float(want)) <= 1e-6
    load = np.asarray(metrics["expert_load"])
    assert load.shape == (model.config.num_hidden_layers, model.config.num_local_experts)
    np.testing.assert_array_equal(load.sum(1), int(mask.sum()) * model.config.num_experts_per_tok)
    assert abs(float(metrics_ep["loss"]) - float(metrics["loss"])) <= 1e-5
    np.testing.assert_array_equal(np.asarray(metrics_ep["expert_load"]), load)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(from_state(state), nnx.Param)),
                                 nnx.to_flat_state(nnx.state(from_state(state_ep), nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(b.get_value()), np.asarray(a.get_value()), atol=1e-5, err_msg=str(path))
