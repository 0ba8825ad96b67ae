"""``workbench.core.views.attention_lab``: differences checked against a float64 NumPy reference and against
``jax.nn.dot_product_attention``; unsupported options reported, not run; compiled calls cached."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.operations.attention.reference import reference_attention
from workbench.core.operations import AttentionOutput, Capabilities, OperationImpl, OperationRegistry
from workbench.core.operations.attention.common import (
    CAUSAL,
    GQA,
    MASK,
    SLIDING_WINDOW,
    SOFT_CAP,
    AttentionImplMixin,
    dense_attention,
)
from workbench.core.views import attention_lab as lab

SHAPE = dict(seq_len=32, heads=4, kv_heads=2, head_dim=16)


def register(cls):
    """Register ``cls`` for one test; the fixture ``registered`` removes it afterwards."""
    OperationRegistry.register(cls, override=True)
    _REGISTERED.append(cls.get_impl_name())
    return cls


_REGISTERED: list[str] = []


@pytest.fixture(autouse=True)
def registered():
    yield
    while _REGISTERED:
        name = _REGISTERED.pop()
        if name in OperationRegistry.list_implementations(include_aliases=True):
            OperationRegistry.unregister(name)


def jax_nn_impl(name: str, **fixed):
    """An implementation that is ``jax.nn.dot_product_attention`` (XLA), with ``fixed`` arguments."""

    class JaxNN(OperationImpl):
        capabilities = Capabilities(features={CAUSAL, GQA})

        @classmethod
        def get_impl_name(cls):
            return name

        def forward_native(self, query, key, value, *, causal=False):
            out = jax.nn.dot_product_attention(query, key, value, is_causal=causal, implementation="xla", **fixed)
            return AttentionOutput(out, None, kernel_path=f"{name}/xla")

    return register(JaxNN)


def test_make_inputs_shapes_dtype_and_seed():
    q, k, v = lab.make_inputs(seq_len=16, heads=8, kv_heads=2, head_dim=4, batch=3, dtype="bfloat16", seed=1)
    assert (q.shape, k.shape, v.shape) == ((3, 16, 8, 4), (3, 16, 2, 4), (3, 16, 2, 4))
    assert q.dtype == k.dtype == jnp.bfloat16
    again = lab.make_inputs(seq_len=16, heads=8, kv_heads=2, head_dim=4, batch=3, dtype="bfloat16", seed=1)
    for a, b in zip((q, k, v), again, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert not np.array_equal(np.asarray(lab.make_inputs(16, 8, 2, 4, 3, "float32", seed=2)[0]), np.asarray(q))
    with pytest.raises(ValueError, match=r"heads=8 is not a multiple of kv_heads=3; pick kv_heads among "
                                         r"\[1, 2, 4, 8\]"):
        lab.make_inputs(heads=8, kv_heads=3)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        lab.make_inputs(seq_len=0)
    with pytest.raises(ValueError, match="float dtype"):
        lab.make_inputs(dtype="int32")


def test_flash_against_vanilla_matches_the_numpy_reference_and_reports_costs():
    q, k, v = lab.make_inputs(**SHAPE)
    options = dict(causal=True, sliding_window=8, logits_soft_cap=5.0)
    c = lab.compare("flash", q, k, v, runs=3, **options)
    expected, _ = reference_attention(q, k, v, **options)
    for run in (c.impl, c.reference):
        np.testing.assert_allclose(np.asarray(run.output), expected, atol=2e-5)
        assert run.median_ms > 0 and run.compile_ms > 0 and isinstance(run.temp_bytes, int) and run.note == ""
    assert (c.impl.kernel_path, c.reference.kernel_path) == ("flash/native", "vanilla/native")
    # the reported difference is the one between the two outputs, per element
    assert c.max_abs_diff == pytest.approx(float(np.abs(np.asarray(c.impl.output) - np.asarray(c.reference.output))
                                                 .max()), abs=0)
    assert c.max_abs_diff < 2e-5
    head_diff = c.output_difference(head=3)
    assert head_diff.shape == (32, 16) and head_diff.max() <= c.max_abs_diff
    assert c.position_difference().shape == (32,)
    rows = c.rows()
    assert [r["implementation"] for r in rows] == ["flash", "vanilla"] and rows[1]["max_abs_diff"] == 0.0


def test_differences_are_those_of_jax_nn_dot_product_attention():
    q, k, v = lab.make_inputs(**SHAPE)
    jax_nn_impl("jaxnn_test")
    same = lab.compare("jaxnn_test", q, k, v, runs=1)  # T == S: its top-left causal mask is our bottom-right one
    assert same.impl.kernel_path == "jaxnn_test/xla" and same.max_abs_diff < 2e-5

    # decoding shape: 4 queries over 32 keys; jax.nn aligns is_causal top-left, the workbench bottom-right
    q4 = q[:, -4:]
    wrong = lab.compare("jaxnn_test", q4, k, v, runs=1)
    expected, _ = reference_attention(q4, k, v, causal=True)
    jax_nn = np.asarray(jax.nn.dot_product_attention(q4, k, v, is_causal=True), np.float64)
    np.testing.assert_allclose(np.asarray(wrong.reference.output), expected, atol=2e-5)
    assert wrong.max_abs_diff == pytest.approx(np.abs(jax_nn - expected).max(), abs=2e-5)
    assert wrong.max_abs_diff > 0.1


def test_an_unsupported_option_is_reported_with_who_supports_it():
    q, k, v = lab.make_inputs(**SHAPE)
    c = lab.compare("sdpa", q, k, v, logits_soft_cap=30.0, runs=1)
    others = ", ".join(n for n in OperationRegistry.supporting(SOFT_CAP) if n != "sdpa")
    assert c.impl.unsupported == f"unsupported: logits_soft_cap; supported by: {others}"
    assert not c.impl.ok and c.impl.kernel_path is None and c.max_abs_diff is None
    assert c.reference.ok  # the reference still ran
    with pytest.raises(ValueError, match="no difference to show: unsupported: logits_soft_cap"):
        c.output_difference()

    ref_missing = lab.compare("vanilla", q, k, v, reference="sdpa", logits_soft_cap=30.0, runs=1)
    assert ref_missing.impl.ok and ref_missing.reference.unsupported.startswith("unsupported: logits_soft_cap")

    @register
    class Float32Only(AttentionImplMixin, OperationImpl):
        capabilities = Capabilities(features={CAUSAL, GQA}, dtypes=("float32",))

        @classmethod
        def get_impl_name(cls):
            return "float32_only_test"

        def forward_native(self, query, key, value, **kwargs):
            return AttentionOutput(dense_attention(self.prepare(query, key, value, **kwargs))[0], None, "f32/native")

    qb, kb, vb = lab.make_inputs(**SHAPE, dtype="bfloat16")
    c = lab.compare("float32_only_test", qb, kb, vb, reference="float32_only_test", runs=1)
    assert c.impl.unsupported.startswith("unsupported: dtype bfloat16; supported by: ") and "vanilla" in c.impl.note


def test_an_implementation_that_raises_is_reported_not_raised():
    q, k, v = lab.make_inputs(**SHAPE)

    @register
    class Refuses(OperationImpl):
        capabilities = Capabilities(features={CAUSAL, GQA})

        @classmethod
        def get_impl_name(cls):
            return "refuses_test"

        def forward_native(self, query, key, value, **kwargs):
            raise ValueError("refuses_test: T must be a multiple of 1000")

    c = lab.compare("refuses_test", q, k, v, runs=1)
    assert c.impl.error == "ValueError: refuses_test: T must be a multiple of 1000"
    assert c.impl.note == "error: ValueError: refuses_test: T must be a multiple of 1000" and c.reference.ok
    # ulysses on the lab's default mesh (sp over all 8 devices) cannot split 4 heads: said, not raised
    c = lab.compare("ulysses", q, k, v, runs=1)
    assert "cannot be split over sp=8" in c.impl.error


def test_user_errors_raise_value_errors_that_say_what_to_change():
    q, k, v = lab.make_inputs(**SHAPE)
    with pytest.raises(ValueError, match=r"no operation implementation named 'flsh'\. Did you mean 'flash'"):
        lab.compare("flsh", q, k, v)
    with pytest.raises(ValueError, match="sliding_window must be a positive int; got -1"):
        lab.compare("flash", q, k, v, sliding_window=-1)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive number"):
        lab.LabOptions(logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="runs must be a positive int"):
        lab.compare("flash", q, k, v, runs=0)
    with pytest.raises(ValueError, match="4-D BTHD"):
        lab.compare("flash", q[0], k, v)


def test_compiled_calls_are_cached_until_options_shapes_or_the_class_change():
    q, k, v = lab.make_inputs(**SHAPE)
    jax_nn_impl("jaxnn_test")
    first = lab.compare("jaxnn_test", q, k, v, runs=1)
    again = lab.compare("jaxnn_test", q, k, v, runs=1)
    assert not first.impl.cached and again.impl.cached and again.impl.compile_ms == first.impl.compile_ms
    assert not lab.compare("jaxnn_test", q, k, v, causal=False, runs=1).impl.cached
    jax_nn_impl("jaxnn_test")  # re-registered (a re-run notebook cell): a new class, compiled anew
    assert not lab.compare("jaxnn_test", q, k, v, runs=1).impl.cached


def test_paged_and_sequence_parallel_implementations_run_on_the_same_inputs():
    q, k, v = lab.make_inputs(seq_len=40, heads=8, kv_heads=8, head_dim=16)  # 40: not a multiple of the page size
    paged = lab.compare("paged", q, k, v, runs=1)
    assert paged.impl.kernel_path == "paged/native" and paged.max_abs_diff < 2e-5
    ulysses = lab.compare("ulysses", q, k, v, runs=1)  # default mesh: sp over the 8 devices
    assert ulysses.impl.kernel_path == "ulysses/shard_map" and ulysses.max_abs_diff < 2e-5
    assert lab.default_metadata("ulysses", 40).mesh.shape["sp"] == 8
    mesh = lab.default_metadata("ulysses", 36).mesh  # 36 = 4 x 9: sp=4, the other 2 devices on fsdp
    assert (mesh.shape["sp"], mesh.shape["fsdp"]) == (4, 2)
    assert lab.default_metadata("flash", 40).mesh is None


def test_attention_weights_of_one_head_match_the_reference():
    q, k, _ = lab.make_inputs(**SHAPE)
    options = dict(causal=True, sliding_window=6, logits_soft_cap=3.0)
    w = lab.attention_weights(q, k, head=3, **options)
    _, expected = reference_attention(q, k, k, **options)
    assert w.shape == (32, 32) and w.dtype == np.float32
    np.testing.assert_allclose(w, expected[0, 3], atol=1e-6)
    with pytest.raises(ValueError, match=r"flash: no attention weights: unsupported: return_weights; supported by: "
                                         r".*vanilla"):
        lab.attention_weights(q, k, impl="flash")
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 4\)"):
        lab.attention_weights(q, k, head=4)


def test_capability_summary_names_what_is_missing():
    assert lab.capability_summary("vanilla") == "vanilla · all features"
    assert lab.capability_summary("chunked") == "flash · no return_weights"
    assert lab.capability_summary("ring") == "ring · no return_weights, sinks, value_head_dim; needs mesh axis sp"
    assert "+paged_kv" in lab.capability_summary("paged")


@functools.cache
def tiny_llama():
    """A one-layer tiny Llama with random weights, built once per session without compiling its init."""
    from workbench.core.models.presets import tiny

    graphdef, state = nnx.split(nnx.eval_shape(lambda: tiny("llama", num_hidden_layers=1)))
    rng = np.random.default_rng(0)  # norm weights 1, matrices N(0, 0.1)

    def draw(path, var):
        norm = any("norm" in str(part) for part in path)
        x = var.get_value()
        return var.replace(jnp.ones(x.shape, x.dtype) if norm else jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype))

    return nnx.merge(graphdef, nnx.map_state(draw, state))


def test_model_comparison_switches_attention_without_touching_the_model():
    from workbench.core.models.tokenizer import ByteTokenizer

    @register
    class Capped(AttentionImplMixin, OperationImpl):  # vanilla with a soft cap of 0.1: another model entirely
        capabilities = Capabilities(features={CAUSAL, GQA, MASK, SLIDING_WINDOW})

        @classmethod
        def get_impl_name(cls):
            return "capped_test"

        def forward_native(self, query, key, value, **kwargs):
            call = self.prepare(query, key, value, **kwargs)
            return AttentionOutput(dense_attention(dataclasses.replace(call, logits_soft_cap=0.1))[0], None, "capped")

    model = tiny_llama()
    ids = np.array([[256, 256, 72, 101, 108, 108, 111, 33]])  # left padding (256 = <pad>), then "Hello!"
    mask = (ids != 256).astype(np.int32)
    result = lab.model_comparison(model, "capped_test", ids, mask, max_new_tokens=3, tokenizer=ByteTokenizer())
    assert result.impl.model.attn_mechanism == "capped_test" and result.reference.model.attn_mechanism == "vanilla"
    assert model.attn_mechanism == "vanilla"  # the model passed in is unchanged
    per_position = result.position_max_abs_diff
    assert per_position[:2].max() == 0  # padding: not compared
    assert per_position[2] < 1e-6  # the first real token sees one key: softmax 1 whatever the logits
    assert per_position[3:].min() > 1e-4 and result.logits_max_abs_diff == per_position.max()
    np.testing.assert_allclose(np.abs(result.impl.logits - result.reference.logits)[0, 3:].max(-1), per_position[3:])
    assert [len(r.new_tokens[0]) for r in (result.impl, result.reference)] == [3, 3]
    assert result.impl.text == [ByteTokenizer().decode(result.impl.new_tokens[0])]
    with pytest.raises(ValueError, match="paged reads a paged KV cache"):
        lab.model_comparison(model, "paged", ids, mask)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\); it must be \(B, T\) = \(1, 8\)"):
        lab.model_comparison(model, "flash", ids, mask[:, :3])


def test_model_comparison_decodes_with_a_hugging_face_tokenizer(smollm2_hf_tokenizer, smollm2_dir):
    from workbench.core.models.presets import tiny
    from workbench.core.models.tokenizer import as_tokenizer

    hf = smollm2_hf_tokenizer
    model = tiny("llama", num_hidden_layers=1, vocab_size=49152)  # random, with SmolLM2's BPE vocab
    ref = hf(["Hello world", "日本語 🙂"], padding=True, padding_side="left", add_special_tokens=False,
             return_tensors="np")
    for tokenizer in (hf, smollm2_dir):  # a transformers tokenizer, or the directory holding it
        result = lab.model_comparison(model, "vanilla", ref["input_ids"], ref["attention_mask"], max_new_tokens=3,
                                      tokenizer=tokenizer)
        for run in (result.impl, result.reference):
            assert run.text == hf.batch_decode(run.new_tokens, skip_special_tokens=True)
    assert as_tokenizer(hf)(["Hello world"])["input_ids"].tolist() == [hf.encode("Hello world",
                                                                                 add_special_tokens=False)]


def test_the_lab_compares_mla_shaped_inputs():
    """MLA's absorbed form (one key [latent; rope key], values the latent, a head dim of their own): flash and
    paged against vanilla, and an implementation without value_head_dim refused naming those that have it."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 64, 4, 40)), jnp.float32)  # latent 32 + rope 8
    k = jnp.asarray(rng.standard_normal((1, 64, 1, 40)), jnp.float32)
    v = k[..., :32]  # values: the latent channels of the keys
    for impl in ("flash", "paged"):
        result = lab.compare(impl, q, k, v, runs=1)
        assert result.impl.ok and result.max_abs_diff < 1e-5, (impl, result.impl.note)
        assert result.impl.output.shape == (1, 64, 4, 32)
    refused = lab.compare("sdpa", q, k, v, runs=1)
    assert refused.impl.unsupported.startswith("unsupported: value_head_dim; supported by:")
    assert "flash" in refused.impl.unsupported and "vanilla" in refused.impl.unsupported


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")
@pytest.mark.parametrize("impl, kind", [("ring", "collective-permute over sp"), ("ulysses", "all-to-all over sp"),
                                        ("allgather_kv", "all-gather over sp")])
def test_sequence_parallel_runs_show_their_collectives(impl, kind):
    from workbench.core.views.attention_lab import compare, make_inputs

    q, k, v = make_inputs(seq_len=128, heads=8, kv_heads=8, head_dim=16)  # ulysses splits heads over sp=8
    result = compare(impl, q, k, v, runs=1)
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-4
    assert any(c.startswith(kind) for c in result.impl.collectives), result.impl.collectives
    assert result.reference.collectives == ()  # vanilla on one device moves nothing
