"""Stacked, scanned decoder layers: the same numbers as the unrolled loop and as Hugging Face, a compiled
program whose size does not grow with depth, layer views, remat policies, and caches that write only the
new tokens. References: transformers (logits), the unrolled run, and XLA's own compiled HLO and memory
analysis."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import batch, hf_forward, hf_model
from tests.float32_error import assert_float32_close
from workbench.core.axes import LAYERS
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.decoder import DecoderBlock
from workbench.core.models.hf_convert import hf_state_dict
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.stack import REMAT_POLICIES, layer_kinds


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def ours_from(hf) -> CausalLM:
    from workbench.core.models.auto import from_hf_state_dict

    config = ModelConfig.from_hf(hf.config.to_dict())
    return from_hf_state_dict(config, {k: v.detach().numpy() for k, v in hf.state_dict().items()},
                              attn_mechanism="vanilla")


@pytest.mark.parametrize("family", ["llama", "qwen2-sliding-layers", "gpt2", "mixtral", "deepseek_v3"])
def test_scanned_and_unrolled_agree_with_transformers(family):
    hf = hf_model(family, num_hidden_layers=3)
    ours = ours_from(hf)
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()
    real = mask.astype(bool)
    scanned = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    unrolled = np.asarray(ours.with_options(scan_layers=False)(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert np.abs(scanned - want)[real].max() <= 1e-5
    assert np.abs(unrolled - want)[real].max() <= 1e-5
    np.testing.assert_allclose(scanned[real], unrolled[real], atol=1e-6)


def test_parameters_are_stacked_with_a_layers_axis_and_round_trip_per_layer():
    hf = hf_model("llama", num_hidden_layers=3)
    ours = ours_from(hf)
    kernel = ours.layers.self_attn.q_proj.kernel
    assert kernel.shape == (3, 64, 64) and kernel.semantic_axes.axes[0] == LAYERS
    for i in range(3):  # layer i of the stack is HF's layer i, transposed
        want = hf.model.layers[i].self_attn.q_proj.weight.detach().numpy().T
        np.testing.assert_array_equal(np.asarray(kernel[...][i]), want)
    tensors = hf_state_dict(ours)  # and back to HF's per-layer names
    assert {k for k in tensors if ".layers." in k} == {k for k in hf.state_dict() if ".layers." in k}
    np.testing.assert_array_equal(tensors["model.layers.2.mlp.down_proj.weight"],
                                  hf.model.layers[2].mlp.down_proj.weight.detach().numpy())


def test_a_layer_view_is_that_layer():
    model = tiny("llama", num_hidden_layers=3)
    assert len(model.layers) == 3 and len(list(model.layers)) == 3
    layer = model.layers[1]
    assert isinstance(layer, DecoderBlock) and layer.num_layers is None
    assert layer.self_attn.q_proj.kernel.shape == (64, 64)
    assert layer.self_attn.q_proj.kernel.semantic_axes.axes[0] != LAYERS
    np.testing.assert_array_equal(np.asarray(model.layers[-1].mlp.up_proj.kernel[...]),
                                  np.asarray(model.layers.mlp.up_proj.kernel[...][2]))
    with pytest.raises(IndexError, match="out of range: the model has 3 layers"):
        model.layers[3]
    with pytest.raises(TypeError, match="one layer, not a stack"):
        len(layer)
    # the views composed by hand (embedding, layer 0, 1, 2, norm, head) give the model's logits
    ids = jnp.asarray([[5, 6, 7, 8, 9]])
    x = jnp.take(model.embed_tokens[...], ids, axis=0)
    for i in range(3):
        x, _, _ = model.layers[i](x, *_rope(model, 5), None)
    np.testing.assert_allclose(np.asarray(model.head(model.norm(x))), np.asarray(model(ids).logits), atol=1e-5)


def _rope(model, t):
    from workbench.core.models.rope import cos_sin, inv_frequencies

    c = model.config
    return cos_sin(jnp.arange(t)[None], inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))


def _hlo_ops(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"^\s+\S+ = ", text, re.M))


def test_the_compiled_program_does_not_grow_with_depth_when_scanned():
    ids = jnp.zeros((1, 8), jnp.int32)
    sizes = {}
    for scan in (True, False):
        for layers in (2, 8):
            model = tiny("llama", num_hidden_layers=layers).with_options(scan_layers=scan)
            graphdef, state = nnx.split(model)
            sizes[scan, layers] = _hlo_ops(lambda s, ids, g=graphdef: nnx.merge(g, s)(ids).logits, state, ids)
    assert sizes[True, 8] == sizes[True, 2]  # one layer body, whatever the depth
    assert sizes[False, 8] > 3 * sizes[False, 2] // 2  # unrolled: every layer its own instructions


def test_lazy_init_traces_one_block_whatever_the_depth(monkeypatch):
    calls = []
    original = DecoderBlock.__init__

    def counting(self, *args, **kwargs):
        calls.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderBlock, "__init__", counting)
    counts = {}
    for layers in (2, 80):
        calls.clear()
        abstract = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=layers)))
        counts[layers] = len(calls)
        assert abstract.layers.self_attn.q_proj.kernel.shape == (layers, 64, 64)
    assert counts[2] == counts[80] <= 3


REMAT_IDS = np.random.default_rng(0).integers(0, 264, (2, 16))


@functools.cache
def remat_model():
    """A 3-layer tiny Llama: the model the remat tests below differentiate (built once)."""
    return tiny("llama", num_hidden_layers=3)


@functools.cache
def compiled_gradient(policy):
    """``(compiled gradient of the loss, params)`` of ``remat_model()`` under ``policy``: compiled once, for the
    gradient comparison and for XLA's memory analysis alike."""
    model = remat_model() if policy == "none" else remat_model().with_options(remat=policy)
    ids = jnp.asarray(REMAT_IDS)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: nnx.merge(graphdef, p, rest).compute_loss(ids)[0]
    return jax.jit(jax.grad(loss)).lower(params).compile(), params


def gradients(policy):
    program, params = compiled_gradient(policy)
    return program(params)


@pytest.mark.parametrize("policy", ["dots_saveable", "full"])
def test_remat_policies_give_the_same_gradients(policy):
    want = gradients("none")
    got = gradients(policy)
    # Recomputed in another fusion: float32 rounding only. Each gradient passes through the head and the 3
    # layers' backward (4 stages), its longest contraction the MLP's 128 units (measured: 6 to 17 u times each
    # gradient's largest magnitude, alike with XLA:CPU's AVX-512 and AVX2 code; the bound is 4 sqrt(128) = 45 u).
    config = remat_model().config
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert_float32_close(b, a, accumulation=config.intermediate_size, stages=config.num_hidden_layers + 1)


def test_full_remat_keeps_less_for_the_backward_pass():
    """XLA's own memory analysis of the compiled gradient: recomputing blocks needs fewer live activations.
    The programs the test above compares (3 layers, batch 2 x 16 tokens): activations already dominate the
    temporaries there (measured: 893 kB without remat, 368 kB with full remat), as at larger sizes."""
    none, full = (compiled_gradient(p)[0].memory_analysis().temp_size_in_bytes for p in ("none", "full"))
    assert full < none


def test_options_are_checked():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"unknown remat policy 'some'.*'dots_saveable'"):
        model.with_options(remat="some")
    with pytest.raises(TypeError, match="scan_layers must be True or False"):
        model.with_options(scan_layers="yes")
    assert set(REMAT_POLICIES) >= {"none", "dots_saveable", "save_dots", "full"}
    kinds, kind_L = layer_kinds([None, 4, None, 4])
    assert kinds == (None, 4) and kind_L.tolist() == [0, 1, 0, 1]


def test_decode_writes_only_the_new_tokens_and_skips_the_empty_tail():
    model = tiny("llama", num_hidden_layers=2)
    ids = jnp.asarray([[5, 6, 7, 8]])
    cache = model.init_cache(1, 64)
    out = model(ids, cache=cache)
    keys = np.asarray(out.cache.keys)
    assert np.abs(keys[:, :, :4]).min() > 0 and not keys[:, :, 4:].any()  # slots past the prompt stay zero
    step = model(jnp.asarray([[9]]), cache=out.cache)
    full = model(jnp.asarray([[5, 6, 7, 8, 9]])).logits[:, -1]
    np.testing.assert_allclose(np.asarray(step.logits[:, -1]), np.asarray(full), atol=2e-5)
    flash = model.with_attention("flash")  # takes kv_lengths: tiles past the filled slots are skipped
    step_flash = flash(jnp.asarray([[9]]), cache=flash(ids, cache=model.init_cache(1, 64)).cache)
    np.testing.assert_allclose(np.asarray(step_flash.logits), np.asarray(step.logits), atol=2e-5)


def test_mixed_layer_kinds_compile_one_body_per_kind():
    hf = hf_model("qwen2-sliding-layers", num_hidden_layers=6)
    ours = ours_from(hf)
    assert ours.config.layer_types.count("sliding_attention") == 5
    kinds, kind_L = layer_kinds([ours.config.layer_window(i) for i in range(6)])
    assert len(kinds) == 2 and list(kind_L) == [0, 1, 1, 1, 1, 1]
    ids, mask = batch()
    want = hf_forward(hf, ids, mask).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)).logits)
    assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-5  # the lax.switch picks each layer's window
