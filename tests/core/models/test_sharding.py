"""Model sharding: specs from semantic axes (checked against PartitionAxis.explain), placed and
abstract models, rules that override, and sharded logits equal to unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tests.core.models.hf_reference import FAMILIES
from workbench.core.axes import MODE_DECODE, MODE_TRAIN, ColumnWise, DynamicShardingAxes, PartitionAxis, Replicated
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.sharding import explain_params, param_specs


def model_for(family):
    return CausalLM(ModelConfig.from_hf(FAMILIES[family]().to_dict()), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("family, mesh_axes", [("llama", dict(dp=2, fsdp=2, tp=2)), ("mixtral", dict(ep=4, fsdp=2)),
                                               ("gpt2", dict(fsdp=4, tp=2)), ("gemma3", dict(dp=2, fsdp=2, tp=2)),
                                               ("qwen3_moe", dict(ep=2, fsdp=2, tp=2)),
                                               ("gpt_oss", dict(ep=2, dp=2, tp=2)),
                                               ("deepseek_v3", dict(ep=2, fsdp=2, tp=2))])
def test_shard_model_places_every_param_by_its_spec(family, mesh_axes):
    model = model_for(family)
    mesh = make_mesh(**mesh_axes)
    sharded = model.shard_model(mesh)
    pa = PartitionAxis()
    for path, var in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        want = pa.resolve(var.semantic_axes, shape=var.shape, mesh=mesh)
        assert var.get_value().sharding == NamedSharding(mesh, want), path
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # the original is untouched
        assert len(var.get_value().sharding.device_set) == 1
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 8)))
    with jax.default_matmul_precision("highest"):
        want = model(ids).logits
        got = nnx.jit(lambda m, ids: m(ids).logits)(sharded, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    gathered = sharded.gather_model()
    leaf = nnx.state(gathered, nnx.Param)["layers"]["self_attn"]["o_proj"]["kernel"].get_value()
    assert len(leaf.sharding.device_set) == 1


def test_expert_weights_split_over_ep():
    mesh = make_mesh(ep=4, fsdp=2)
    specs = param_specs(model_for("mixtral"), mesh)
    # stacked over layers: the LAYERS axis (first) is replicated by default
    assert specs["layers/mlp/gate_proj"] == PartitionSpec(None, "ep", "fsdp", "tp")  # tp has size 1 here
    assert specs["layers/mlp/down_proj"] == PartitionSpec(None, "ep", "tp", "fsdp")
    assert specs["layers/mlp/router_kernel"] == PartitionSpec(None, None, None)


def test_rules_override_and_are_named_in_the_reason():
    mesh = make_mesh(fsdp=4, tp=2)
    model = model_for("llama")
    rules = [(r"mlp/down_proj/kernel", ColumnWise), (r"embed_tokens", DynamicShardingAxes((None, None), MODE_TRAIN))]
    explained = explain_params(model, mesh, rules=rules)
    specs = param_specs(model, mesh, rules=rules)
    # a rule written for one layer's (D, F) kernel applies to the stacked (L, D, F) one, LAYERS in front
    assert specs["layers/mlp/down_proj/kernel"] == PartitionSpec(None, ("fsdp", "sp"), "tp")
    assert specs["embed_tokens"] == PartitionSpec(None, None)
    assert "rule 'mlp/down_proj/kernel'" in explained["layers/mlp/down_proj/kernel"][1].reason
    assert param_specs(model, mesh)["layers/mlp/down_proj/kernel"] == PartitionSpec(None, "tp", ("fsdp", "sp"))
    with pytest.raises(ValueError, match="does not compile"):
        param_specs(model, mesh, rules=[("(", ColumnWise)])
    with pytest.raises(ValueError, match=r"a rule is \(regex, semantic axes\)"):
        param_specs(model, mesh, rules=["mlp"])
    with pytest.raises(ValueError, match=r"layers/self_attn/q_proj/kernel.*rule"):
        param_specs(model, mesh, rules=[("q_proj/kernel", Replicated)])  # rank 1 axes for a 2-D kernel


def test_lazy_init_allocates_nothing_and_carries_shardings():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    config = ModelConfig.from_hf(FAMILIES["llama"]().to_dict())
    abstract = CausalLM.lazy_init(config, mesh=mesh)
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    specs = param_specs(abstract, mesh)
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        assert var.get_value().sharding.spec == specs["/".join(map(str, path))]
    real = CausalLM(config, rngs=nnx.Rngs(0))
    assert param_specs(real, mesh) == specs


def test_decode_mode_keeps_parameter_specs():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    model = model_for("llama")
    assert param_specs(model, mesh, mode=MODE_DECODE) == param_specs(model, mesh)
