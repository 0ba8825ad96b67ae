"""layout_plan: a model's parameters resolved on a mesh as the explorer shows them, checked against
PartitionAxis.resolve, NamedSharding.shard_shape and inspect.memory_per_device; the errors a user can cause."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.axes import EMBED, MODE_TRAIN, TP, VOCAB, PartitionAxis
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny_config
from workbench.core.models.sharding import path_str
from workbench.core.sharding.memory import memory_per_device
from workbench.core.sharding.plan import Layout


def abstract(family="llama", **overrides):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family, **overrides)))


@pytest.mark.parametrize("family, mesh_axes, pa", [
    ("llama", dict(dp=2, fsdp=2, tp=2), PartitionAxis()),
    ("llama", dict(fsdp=8), PartitionAxis(tensor_parallel_axis="fsdp", fully_sharded_data_parallel_axis="tp")),
    ("mixtral", dict(dp=2, ep=4, fsdp=1), PartitionAxis()),
])
def test_layout_matches_resolve_and_shard_shape(family, mesh_axes, pa):
    model = abstract(family)
    mesh = make_mesh(**mesh_axes)
    layout = Layout.of(model, mesh, pa)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert layout.paths == tuple(path_str(p) for p, _ in flat)
    tree = {}
    for path, var in flat:
        row = layout[path_str(path)]
        want = pa.resolve(var.semantic_axes, MODE_TRAIN, shape=var.shape, mesh=mesh)
        sharding = NamedSharding(mesh, want)
        assert row.spec == want, row.path
        assert row.shard_shape == sharding.shard_shape(var.shape), row.path
        assert row.bytes_per_device == np.prod(row.shard_shape) * var.dtype.itemsize
        tree[row.path] = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding)
    reference = memory_per_device(tree)
    assert set(reference.per_device.values()) == {layout.param_bytes}  # every device holds the same


def test_rules_override_semantic_axes_and_the_rule_is_named_once():
    pa = PartitionAxis(hidden_state_axis="fsdp", vocab_axis="tp")
    layout = Layout.of(abstract(), make_mesh(fsdp=4, tp=2), pa, rules=[("embed_tokens", (VOCAB, EMBED))])
    row = layout["embed_tokens"]
    assert row.spec == PartitionSpec("tp", "fsdp") and row.axes == ("VOCAB", "EMBED")
    assert row.reason.count("(rule 'embed_tokens')") == 1 and row.reason.endswith("(rule 'embed_tokens')")
    assert layout.editor_fields()["parameters"] == ("vocab_axis", "hidden_state_axis", "layer_axis")
    assert layout.editor_fields()["kv_cache"] == ("decode_batch_axis", "decode_key_sequence_axis",
                                                  "decode_kv_head_axis", "decode_attention_kv_dim_axis")


@pytest.mark.parametrize("kwargs, match", [
    (dict(partition_axis=PartitionAxis(tensor_parallel_axis="model")), "maps to mesh axis 'model'"),
    (dict(partition_axis=PartitionAxis(batch_axis="data")), "token batch .* mesh axis 'data'"),
    (dict(rules=[("([", (TP,))]), "does not compile"),
    (dict(rules=[("embed_tokens", (TP,))]), "name 1 dimensions but shape"),
])
def test_bad_settings_raise_value_errors_that_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout.of(abstract(), make_mesh(fsdp=4, tp=2), **kwargs)
