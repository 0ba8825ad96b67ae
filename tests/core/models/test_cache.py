"""KV caches: prefill + decode through a cache equals the full forward pass; the paged cache's
page table and free list stay consistent; bad sizes say what to change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import FAMILIES, VOCAB
from workbench.core.models import CausalLM, KVCache, ModelConfig, PagedKVCache

B, T, PREFILL = 3, 9, 6


def model_for(family, **kwargs):
    return CausalLM(ModelConfig.from_hf(FAMILIES[family]().to_dict()), rngs=nnx.Rngs(0), **kwargs)


def left_padded():
    ids = np.random.default_rng(1).integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int32)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


def incremental_logits(model, cache, ids, mask):
    """Prefill the first PREFILL tokens, then one token per call (eager: every check runs)."""
    out = model(ids[:, :PREFILL], mask[:, :PREFILL], cache=cache)
    logits = [out.logits]
    for t in range(PREFILL, T):
        out = model(ids[:, t:t + 1], mask[:, t:t + 1], cache=out.cache)
        logits.append(out.logits)
    return jnp.concatenate(logits, axis=1), out.cache


def jitted_incremental_logits(model, cache, ids, mask):
    """:func:`incremental_logits` in one compiled program: the prefill, then the decode steps as a ``lax.scan``
    (as ``generate``'s loop runs them), so the model is compiled twice, not once per step."""
    graphdef, state = nnx.split(model)

    def run(state, cache, ids, mask):
        out = nnx.merge(graphdef, state)(ids[:, :PREFILL], mask[:, :PREFILL], cache=cache)

        def step(cache, ids_and_mask_B):
            ids_B, mask_B = ids_and_mask_B
            out = nnx.merge(graphdef, state)(ids_B[:, None], mask_B[:, None], cache=cache)
            return out.cache, out.logits[:, 0]

        cache, logits_SBV = jax.lax.scan(step, out.cache, (ids[:, PREFILL:].T, mask[:, PREFILL:].T))
        return jnp.concatenate([out.logits, jnp.swapaxes(logits_SBV, 0, 1)], axis=1), cache

    return jax.jit(run)(state, cache, ids, mask)


@pytest.mark.parametrize("family, kind", [
    *[(f, "contiguous") for f in ("llama", "mistral", "qwen2-sliding-layers", "qwen3", "gpt2", "mixtral", "gemma3",
                                  "qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v3-no-q-lora")],
    *[(f, "paged") for f in ("llama", "qwen2-sliding-layers", "gpt2", "gemma3", "gpt_oss", "deepseek_v3")]])
def test_cached_decoding_equals_full_forward(family, kind):
    model = model_for(family)
    ids, mask = left_padded()
    with jax.default_matmul_precision("highest"):
        full = model(ids, mask).logits
        cache = (model.init_cache(B, 16) if kind == "contiguous" else
                 model.init_ragged_pages(batch_size=B, page_size=4, num_pages=12, max_model_length=16))
        got, cache = jitted_incremental_logits(model, cache, ids, mask)
    keep = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(full)[keep], atol=2e-5)
    if kind == "contiguous":
        assert int(cache.index) == T and cache.positions_B.tolist() == np.asarray(mask).sum(1).tolist()
    else:
        assert cache.lengths.tolist() == np.asarray(mask).sum(1).tolist()


def test_paged_cache_stores_no_padding_and_pages_are_distinct():
    model = model_for("llama")
    ids, mask = left_padded()
    cache = model.init_ragged_pages(batch_size=B, page_size=4, num_pages=12, max_model_length=16)
    empty = cache
    with jax.default_matmul_precision("highest"):
        eager_logits, cache = incremental_logits(model, empty, ids, mask)
        jit_logits, jit_cache = jitted_incremental_logits(model, empty, ids, mask)
    np.testing.assert_allclose(np.asarray(jit_logits), np.asarray(eager_logits), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(jit_cache.page_table), np.asarray(cache.page_table))
    lengths = np.asarray(cache.lengths)  # 9, 7, 5 real tokens -> 3, 2, 2 pages
    held = -(-lengths // 4)
    table = np.asarray(cache.page_table)
    used = np.concatenate([table[b, :held[b]] for b in range(B)])
    assert len(set(used.tolist())) == len(used) == held.sum()
    free = set(np.asarray(cache.free_pages)[: int(cache.num_free)].tolist())
    assert int(cache.num_free) == 12 - held.sum() and not free & set(used.tolist())
    released = cache.release([0])
    assert released.lengths.tolist() == [0, *lengths[1:]] and int(released.num_free) == int(cache.num_free) + held[0]
    assert int(cache.num_free) == 12 - held.sum()  # release returned a new cache


def test_cache_reorder_gathers_rows():
    model = model_for("llama")
    ids, mask = left_padded()
    cache = model(ids[:, :PREFILL], mask[:, :PREFILL], cache=model.init_cache(B, 16)).cache
    moved = cache.reorder(jnp.array([2, 2, 0]))
    np.testing.assert_array_equal(np.asarray(moved.keys[1][1]), np.asarray(cache.keys[1][2]))
    np.testing.assert_array_equal(np.asarray(moved.valid_BS[2]), np.asarray(cache.valid_BS[0]))
    paged = model.init_ragged_pages(batch_size=B, page_size=4, num_pages=12, max_model_length=16)
    with pytest.raises(ValueError, match="beam search needs the contiguous cache"):
        paged.reorder(jnp.array([0, 1, 2]))


def test_cache_is_a_pytree_with_static_sizes():
    model = model_for("llama")
    cache = model.init_cache(2, 8)
    assert isinstance(cache, KVCache) and (cache.batch_size, cache.max_length) == (2, 8)
    assert len(jax.tree.leaves(cache)) == 2 + 3  # stacked keys and values (layers first), mask, positions, index
    assert cache.keys.shape == (2, 2, 8, 2, 16) and cache.num_layers == 2
    meta = model.create_cache_metadata(2, 8)
    assert meta["nbytes"] == cache.nbytes == 2 * 2 * 2 * 8 * 2 * 16 * 4
    paged = model.init_ragged_pages(batch_size=2, page_size=4, num_pages=6, max_model_length=10)
    assert isinstance(paged, PagedKVCache) and paged.page_table.shape == (2, 3) and paged.max_length == 12
    assert model.create_paged_metadata(batch_size=2, page_size=4, num_pages=6)["nbytes"] == paged.nbytes


def test_bad_cache_sizes_say_what_to_change():
    model = model_for("llama")
    ids, mask = left_padded()
    with pytest.raises(ValueError, match=r"do not fit.*max_length=8"):
        model(ids, mask, cache=model.init_cache(B, 8))
    with pytest.raises(ValueError, match="holds 2 rows but the input has 3"):
        model(ids, mask, cache=model.init_cache(2, 16))
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        model.init_cache(2, 0)
    with pytest.raises(ValueError, match=r"out of pages.*num_pages"):
        model(ids, mask, cache=model.init_ragged_pages(batch_size=B, page_size=4, num_pages=4, max_model_length=16))
    with pytest.raises(ValueError, match="max_model_length allows 8"):
        model(ids, mask, cache=model.init_ragged_pages(batch_size=B, page_size=4, num_pages=12, max_model_length=8))
    with pytest.raises(ValueError, match="exactly one of num_pages= or hbm_utilization="):
        model.init_ragged_pages(batch_size=B)
    with pytest.raises(ValueError, match="report no memory limit; pass num_pages="):
        model.init_ragged_pages(batch_size=B, hbm_utilization=0.5)
