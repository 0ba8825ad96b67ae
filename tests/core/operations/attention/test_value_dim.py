"""Values with a head dim of their own (``value_head_dim``; MLA's absorbed form: one shared key
``[latent; rope key]`` of dim ``C + R``, values the latent alone, dim ``C``): every implementation that claims
it matches the float64 NumPy reference, contiguous and paged; every one that does not refuses naming those
that do."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.core.operations.attention.reference import reference_attention
from tests.core.operations.attention.test_sinks import call, contiguous_impls
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import GQA, VALUE_DIM

B, T, S, H, C, R = 2, 5, 11, 4, 12, 4  # MQA over latents: one key/value head
RNG = np.random.default_rng(3)
Q = RNG.standard_normal((B, T, H, C + R)).astype(np.float32)
K = RNG.standard_normal((B, S, 1, C + R)).astype(np.float32)
V = np.ascontiguousarray(K[..., :C])  # the latent: the keys' first C channels
LENGTHS = np.array([S, S - 4], np.int32)
SCALE = 0.3  # MLA keeps the scale of the un-absorbed head dim, not 1/sqrt(C + R)
CASES = {"causal": dict(causal=True), "window+lengths": dict(causal=True, sliding_window=4, kv_lengths=LENGTHS),
         "mask": dict(mask=RNG.random((B, 1, T, S)) > 0.3)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", contiguous_impls())
def test_claimed_value_dim_matches_the_reference_and_the_others_refuse(name, case):
    kwargs = CASES[case]
    if name not in OperationRegistry.supporting(VALUE_DIM):
        with pytest.raises(ValueError, match=f"does not support {VALUE_DIM}; implementations that do: .*flash.*paged"
                                             f".*vanilla"):
            call(name, jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), softmax_scale=SCALE, **kwargs)
        return
    want, _ = reference_attention(Q, K, V, softmax_scale=SCALE, **kwargs)
    got = call(name, jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), softmax_scale=SCALE, **kwargs)
    assert got.shape == (B, T, H, C)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def test_paged_latent_pages_equal_the_reference():
    page = 4
    pages_K = np.zeros((8, page, 1, C + R), np.float32)
    table = np.array([[5, 1, 2], [3, 4, 0]], np.int32)
    for b in range(B):
        for s in range(S):
            pages_K[table[b, s // page], s % page] = K[b, s]
    out = OperationRegistry.create("paged", OperationMetadata())(
        jnp.asarray(Q[:, -2:]), jnp.asarray(pages_K), jnp.asarray(pages_K[..., :C]), page_table=jnp.asarray(table),
        kv_lengths=jnp.asarray(LENGTHS), causal=True, softmax_scale=SCALE).attention_outputs
    want, _ = reference_attention(Q[:, -2:], K, V, causal=True, kv_lengths=LENGTHS, softmax_scale=SCALE)
    assert out.shape == (B, 2, H, C)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)


def test_capabilities_are_declared():
    assert {"vanilla", "flash", "paged"} <= set(OperationRegistry.supporting(VALUE_DIM))
    assert not {"sdpa", "ring", "ulysses"} & set(OperationRegistry.supporting(VALUE_DIM))
    assert "flash" in OperationRegistry.supporting(GQA)


def test_mismatched_value_rows_say_what_to_pass():
    with pytest.raises(ValueError, match=r"must be \(B, S, KV, D\) and \(B, S, KV, Dv\)"):
        call("vanilla", jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V[:, :-1]))


def test_flash_tiles_of_latent_values():
    impl = OperationRegistry.create("flash", OperationMetadata(options={"block_q": 2, "block_k": 3}))
    got = impl(jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), softmax_scale=SCALE, **CASES["window+lengths"])
    want, _ = reference_attention(Q, K, V, softmax_scale=SCALE, **CASES["window+lengths"])
    np.testing.assert_allclose(np.asarray(got.attention_outputs), want, atol=2e-6)
