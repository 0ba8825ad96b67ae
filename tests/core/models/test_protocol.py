"""The BaseModuleProtocol surface: every method exists, returns new objects, and the attention
implementation switches inside a model (after a forward, after sharding) without copying weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.core.models.hf_reference import FAMILIES
from workbench.core.mesh import make_mesh
from workbench.core.models import BaseModuleProtocol, CausalLM, ModelConfig
from workbench.core.models.model_methods import ModelMethods


@pytest.fixture(scope="module")
def model():
    return CausalLM(ModelConfig.from_hf(FAMILIES["mistral"]().to_dict()), rngs=nnx.Rngs(0),
                    attn_mechanism="vanilla")


def protocol_names():
    return [*sorted(n for n in vars(BaseModuleProtocol) if not n.startswith("_") and n != "config"), "__call__"]


def test_every_protocol_method_is_implemented(model):
    assert isinstance(model, BaseModuleProtocol)
    for name in protocol_names():
        assert hasattr(model, name), name
    assert model.can_generate() and model.config_class is ModelConfig and model.get_static_arguments() == ()
    own = {n for n in vars(ModelMethods) | vars(CausalLM) if not n.startswith("_")}
    assert set(protocol_names()) - {"__call__", "base_model_prefix"} <= own


def test_with_attention_shares_parameters_and_agrees(model):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 40)))
    mask = jnp.ones((2, 40), jnp.int32).at[1, :7].set(0)
    with jax.default_matmul_precision("highest"):
        want = model(ids, mask).logits
        for name in ("flash", "sdpa", "chunked"):
            switched = model.with_attention(name)
            assert model.attn_mechanism == "vanilla" and switched.attn_mechanism in (name, "flash")
            a = nnx.state(model, nnx.Param)["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
            b = nnx.state(switched, nnx.Param)["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
            assert a is b and a.shape == (2, 64, 64)  # the same stacked array (both layers), no copy
            got = switched(ids, mask).logits
            keep = np.asarray(mask).astype(bool)
            np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], atol=2e-5)
    switched.layers.self_attn.q_proj.kernel.set_value(jnp.zeros_like(a))  # its Variables are its own
    assert model.layers.self_attn.q_proj.kernel.get_value() is a
    with pytest.raises(ValueError, match=r"Did you mean .flash."):
        model.with_attention("flashh")


def test_with_attention_after_sharding(model):
    sharded = model.shard_model(make_mesh(dp=2, fsdp=2, tp=2))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 128, (4, 16)))
    with jax.default_matmul_precision("highest"):
        want = model(ids).logits
        got = nnx.jit(lambda m, x: m(x).logits)(sharded.with_attention("flash"), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_parameter_methods_return_new_models(model):
    half = model.half()
    assert half.embed_tokens.get_value().dtype == jnp.bfloat16 and model.embed_tokens.get_value().dtype == jnp.float32
    assert model.float().embed_tokens.get_value().dtype == jnp.float32
    _, params, _ = model.split_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    assert float(jnp.abs(model.merge_params(zeros).embed_tokens.get_value()).max()) == 0.0
    assert float(jnp.abs(model.embed_tokens.get_value()).max()) > 0.0
    as_dict = model.split_params_dict()
    assert as_dict["norm"]["weight"].shape == (64,)
    again = model.merge_params_dict(jax.tree.map(lambda x: x * 2, as_dict))
    np.testing.assert_allclose(np.asarray(again.norm.weight.get_value()), 2 * np.asarray(model.norm.weight.get_value()))
    assert model.num_params() == sum(x.size for x in jax.tree.leaves(params))
    text = model.get_module_repr()
    assert "layers/self_attn/q_proj/kernel: (2, 64, 64) float32" in text and text == model.prettify_nnx()
    assert "layers/0/" not in text and text.count("layers/self_attn/q_proj/kernel") == 1  # one stacked entry


def test_transform_fn_is_what_loading_uses(model):
    from workbench.core.models import hf_state_dict

    tensors = hf_state_dict(model)
    flat = model.transform_fn(tensors)
    up_L = np.asarray(flat[("layers", "mlp", "up_proj", "kernel")])
    assert up_L.shape == (2, 64, 96)  # both layers stacked on the leading axis
    np.testing.assert_array_equal(up_L, np.asarray(model.layers.mlp.up_proj.kernel.get_value()))
    for i in range(2):  # slice i is layer i: the model's layer view and the checkpoint's (out, in) tensor
        np.testing.assert_array_equal(up_L[i], np.asarray(model.layers[i].mlp.up_proj.kernel.get_value()))
        np.testing.assert_array_equal(up_L[i], np.asarray(tensors[f"model.layers.{i}.mlp.up_proj.weight"]).T)
    assert not np.array_equal(up_L[0], up_L[1])
    nested = model.pure_transform_fn(tensors)
    assert nested["layers"]["input_layernorm"]["weight"].shape == (2, 64)
    loaded = model.get_torch_loader()(tensors)
    np.testing.assert_array_equal(np.asarray(loaded.embed_tokens.get_value()),
                                  np.asarray(model.embed_tokens.get_value()))


def test_inputs_for_generation_round_trip(model):
    inputs = model.prepare_inputs_for_generation(np.array([[1, 2, 3]]), max_length=8)
    out = model(inputs["input_ids"], inputs["attention_mask"], cache=inputs["cache"])
    nxt = model.update_inputs_for_generation(out, {"input_ids": out.logits[:, -1].argmax(-1)})
    assert nxt["input_ids"].shape == (1, 1) and int(nxt["cache"].index) == 3
    assert int(model(**nxt).cache.index) == 4


def test_is_classifier_reads_the_class_or_the_model(model):
    from workbench.core.models import SequenceClassifier
    from workbench.core.models.protocol import check_model_class, is_classifier

    assert not is_classifier(CausalLM) and not is_classifier(model) and is_classifier(SequenceClassifier)
    assert not model.classifier and check_model_class(SequenceClassifier) is SequenceClassifier
    for wrong in (model, ModelConfig, nnx.Linear, "CausalLM"):
        with pytest.raises(TypeError, match="model_cls must be a workbench model class"):
            check_model_class(wrong)
