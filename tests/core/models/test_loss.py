"""causal_lm_loss against Hugging Face's ForCausalLMLoss (torch), padding and ignored labels included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workbench.core.models.loss import causal_lm_loss, labels_from

torch = pytest.importorskip("torch")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")

B, T, V = 3, 11, 37


def random_case(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, T, V)) * 4).astype(np.float32)
    ids = rng.integers(0, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    labels = np.array(labels_from(ids, mask)).astype(np.int64)
    labels[0, rng.integers(1, T, 3)] = -100  # ignored targets inside a row
    return logits, labels


def hf_loss(logits, labels, **kwargs):
    return float(loss_utils.ForCausalLMLoss(torch.tensor(logits), torch.tensor(labels), V, **kwargs))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_hf(seed):
    logits, labels = random_case(seed)
    loss, n = causal_lm_loss(jnp.asarray(logits), jnp.asarray(labels))
    assert loss.dtype == jnp.float32 and n.dtype == jnp.int32
    assert int(n) == int((labels[:, 1:] != -100).sum())
    assert abs(float(loss) - hf_loss(logits, labels)) <= 1e-6


def test_matches_hf_with_num_items_in_batch_and_bf16_logits():
    logits, labels = random_case(3)
    loss, _ = causal_lm_loss(jnp.asarray(logits), jnp.asarray(labels), num_items_in_batch=50)
    assert abs(float(loss) - hf_loss(logits, labels, num_items_in_batch=torch.tensor(50))) <= 1e-6
    half = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))  # same rounding both sides
    loss, _ = causal_lm_loss(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(labels))
    assert abs(float(loss) - hf_loss(half, labels)) <= 1e-6


def test_large_logits_are_stable():
    logits, labels = random_case(4)
    loss, _ = causal_lm_loss(jnp.asarray(logits * 1e4), jnp.asarray(labels))
    assert np.isfinite(float(loss))
    assert abs(float(loss) - hf_loss(logits * 1e4, labels)) <= 1e-6 * max(1.0, abs(float(loss)))


def test_all_ignored_gives_zero_not_nan():
    logits, _ = random_case(5)
    labels = np.full((B, T), -100)
    assert np.isnan(hf_loss(logits, labels))  # Hugging Face: 0 / 0
    loss, n = causal_lm_loss(jnp.asarray(logits), jnp.asarray(labels))
    assert float(loss) == 0.0 and int(n) == 0
    grad = jax.grad(lambda x: causal_lm_loss(x, jnp.asarray(labels))[0])(jnp.asarray(logits))
    assert np.all(np.asarray(grad) == 0)


def test_gradient_matches_hf():
    logits, labels = random_case(6)
    ours = jax.grad(lambda x: causal_lm_loss(x, jnp.asarray(labels))[0])(jnp.asarray(logits))
    x = torch.tensor(logits, requires_grad=True)
    loss_utils.ForCausalLMLoss(x, torch.tensor(labels), V).backward()
    np.testing.assert_allclose(np.asarray(ours), x.grad.numpy(), atol=1e-7)


def test_labels_from_and_bad_shapes():
    labels = labels_from(np.array([[1, 2, 3]], np.uint8), np.array([[0, 1, 1]]))
    assert labels.dtype == jnp.int32 and labels.tolist() == [[-100, 2, 3]]
    with pytest.raises(ValueError, match="attention_mask"):
        labels_from(np.zeros((2, 3), int), np.zeros((2, 4), int))
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        causal_lm_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        causal_lm_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)))
