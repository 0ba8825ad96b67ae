"""The decode loop over per-layer views of the stacked weights (``layer_views.py``): the views alias the stacked
buffers (pointer arithmetic), the compiled loop slices no weight (XLA's own optimized HLO), and the tokens are
Hugging Face's for every cache kind a single-device model decodes with: contiguous, paged, streaming, beams."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import batch, hf_generate, pair
from workbench.core.mesh import make_mesh
from workbench.core.models import layer_views as lv
from workbench.core.models import tiny
from workbench.core.models.generation import GenerationConfig, generate, is_compiled
from workbench.core.programs import PROGRAMS

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def llama():
    return pair("llama")


def ours(model, ids, mask, config, **kw):
    with jax.default_matmul_precision("highest"):
        out = generate(model, ids, config, attention_mask=mask, layer_loop="views", **kw)
    assert out.layer_loop == "views"
    return np.asarray(out.sequences)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])  # bfloat16: a dtype DLPack cannot name
def test_each_view_aliases_its_layer_of_the_stacked_buffer(dtype):
    model = tiny("llama", attn_mechanism="vanilla")
    nnx.update(model, jax.tree.map(lambda a: a.astype(dtype), nnx.state(model)))
    assert lv.viewable(model) and lv.stack_paths(model) == [("layers",)]
    views = lv.layer_views(model)[("layers",)]
    stacked = jax.tree.leaves(nnx.state(model.layers))
    assert len(views) == model.config.num_hidden_layers
    for i, view in enumerate(views):
        for a, v in zip(stacked, jax.tree.leaves(view), strict=True):
            assert v.shape == a.shape[1:] and v.dtype == a.dtype
            # the same memory: layer i starts i slices into the stacked buffer
            assert v.unsafe_buffer_pointer() == a.unsafe_buffer_pointer() + i * a[0].nbytes
            np.testing.assert_array_equal(np.asarray(v), np.asarray(a)[i])
    ids = jnp.full((1, 4), 7, jnp.int32)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=model.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(generate(model, ids, config, layer_loop="views").sequences),
                                  np.asarray(generate(model, ids, config).sequences))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_oss", "deepseek_v3"])
def test_greedy_over_views_matches_hf(family, llama):
    # gemma3: local and global layers (two rotary tables, sliding windows); gpt_oss: attention sinks and experts;
    # deepseek_v3: a stack of leading dense layers before the MoE stack, and MLA
    hf, model = llama if family == "llama" else pair(family)
    ids, mask = batch()
    config = GenerationConfig(max_new_tokens=24, eos_token_id=EOS, pad_token_id=PAD)
    np.testing.assert_array_equal(ours(model, ids, mask, config), hf_generate(hf, ids, mask, config))


def test_beam_search_and_the_paged_cache_over_views_match_hf(llama):
    hf, model = llama
    ids, mask = batch(seed=1)
    beams = GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=EOS, pad_token_id=PAD)
    np.testing.assert_array_equal(ours(model, ids, mask, beams), hf_generate(hf, ids, mask, beams))
    greedy = GenerationConfig(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    paged = model.init_ragged_pages(batch_size=2, page_size=4, num_pages=16, max_model_length=32)
    np.testing.assert_array_equal(ours(model, ids, mask, greedy, cache=paged), hf_generate(hf, ids, mask, greedy))


def test_the_streaming_cache_over_views_equals_its_scan():
    model = tiny("llama", attn_mechanism="vanilla")
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 264, (1, 8)))
    config = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=model.config.vocab_size)
    stream = lambda: model.init_streaming_cache(1, sinks=4, window=12)  # evicts after 16 tokens
    scan = generate(model, ids, config, cache=stream(), layer_loop="scan")
    views = generate(model, ids, config, cache=stream(), layer_loop="views")
    np.testing.assert_array_equal(np.asarray(views.sequences), np.asarray(scan.sequences))
    for a, b in zip(jax.tree.leaves(views.cache), jax.tree.leaves(scan.cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _shapes(text: str, pattern: str) -> set[str]:
    return {m.group(1).split("{")[0] for m in re.finditer(r"= (\S+) [^=]*?" + pattern, text)}


def test_the_loop_over_views_slices_no_weight():
    model = tiny("llama", attn_mechanism="vanilla")
    ids = jnp.ones((1, 4), jnp.int32)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=model.config.vocab_size)
    PROGRAMS.clear("generate")
    for loop in ("scan", "views"):
        generate(model, ids, config, layer_loop=loop)
    texts = {k[-3]: v[0].as_text() for k, v in PROGRAMS.items() if k[0] == "generate" and k[-2] == "decode"}
    weights = {f"f32[{','.join(map(str, a.shape[1:]))}]" for a in jax.tree.leaves(nnx.state(model.layers))
               if a.ndim == 3}
    # XLA's optimized program: the scanned loop slices each stacked weight (a copy XLA:CPU makes before the dot) ...
    assert weights & _shapes(texts["scan"], r"dynamic.slice")
    # ... the loop over views has no instruction making a weight-shaped array from a slice
    assert not weights & _shapes(texts["views"], r"slice")


def test_the_scan_is_the_default_and_each_loop_compiles_once():
    model = tiny("llama", attn_mechanism="vanilla")
    ids = jnp.full((1, 5), 9, jnp.int32)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=model.config.vocab_size)
    PROGRAMS.clear("generate")
    runs = [generate(model, ids, config) for _ in range(2)]
    assert [out.layer_loop for out in runs] == ["scan", "scan"] and runs[1].timings["compile"] == 0.0
    assert not is_compiled(model, ids, config, layer_loop="views")  # its own program, compiled on first use
    views = [generate(model, ids, config, layer_loop="views") for _ in range(2)]
    assert views[0].timings["compile"] > 0 and views[1].timings["compile"] == 0.0
    assert is_compiled(model, ids, config, layer_loop="views")
    np.testing.assert_array_equal(np.asarray(views[1].sequences), np.asarray(runs[0].sequences))
    streamed = generate(model, ids, config, streamer=lambda tokens: None, layer_loop="views")
    np.testing.assert_array_equal(np.asarray(streamed.sequences), np.asarray(runs[0].sequences))


def test_where_views_do_not_apply_it_says_so(monkeypatch):
    model = tiny("llama", attn_mechanism="vanilla")
    ids = jnp.full((1, 5), 4, jnp.int32)
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=model.config.vocab_size)
    sharded = model.shard_model(make_mesh(fsdp=-1))  # over simulated devices: shown, not sped up
    assert not lv.viewable(sharded) and generate(sharded, ids, config).layer_loop == "scan"
    with pytest.raises(ValueError, match="layer_loop='views' needs every stacked weight as one array on one device"):
        generate(sharded, ids, config, layer_loop="views")
    monkeypatch.setitem(lv.LAYER_LOOP, "cpu", "scan")  # a platform recorded as scanning
    assert not lv.viewable(model)
    with pytest.raises(ValueError, match="use layer_loop='scan'"):
        generate(model, ids, config, layer_loop="views")
    with pytest.raises(ValueError, match="layer_loop must be None or 'scan'"):
        generate(model, ids, config, layer_loop="unrolled")
