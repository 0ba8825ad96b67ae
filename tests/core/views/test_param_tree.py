"""tree_view: parameter rows against the model's own params, param_specs, shard_model and memory_per_device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from workbench.core.axes import MODE_DECODE, ColumnWise
from workbench.core.mesh import make_mesh
from workbench.core.models.causal_lm import CausalLM
from workbench.core.models.config import ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import lazy_init, param_specs, params_sharding, path_str, shard_model
from workbench.core.sharding.memory import memory_per_device
from workbench.core.units import format_count
from workbench.core.views.param_tree import param_rows, subtree_totals

MESH = make_mesh(fsdp=2, tp=4)


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


def test_rows_match_the_model(model):
    rows = param_rows(model)
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert [r.path for r in rows] == [path_str(p) for p, _ in flat]
    for row, (_, var) in zip(rows, flat, strict=True):
        assert row.shape == var.shape and row.dtype == var.dtype
        assert row.count == var.size and row.nbytes == var.nbytes
        assert row.spec is None and row.source is None and row.bytes_per_device is None  # not placed
    assert sum(r.count for r in rows) == model.num_params()
    by_path = {r.path: r for r in rows}
    q = by_path["layers/self_attn/q_proj/kernel"]  # both layers in one stacked row
    assert q.axes == ("LAYERS", "[FSDP, SP]", "TP")  # ColumnWise, LAYERS in front
    assert q.name == "kernel" and q.shape == (model.config.num_hidden_layers, 64, 64)
    assert not any(r.path.startswith("layers/0") for r in rows)


def test_resolved_on_a_mesh_equals_param_specs_and_shard_model(model):
    rows = param_rows(model, MESH)
    specs = param_specs(model, MESH)
    assert {r.path: r.spec for r in rows} == specs
    assert all(r.source == "resolved" and len(r.decisions) == len(r.shape) for r in rows)
    q = next(r for r in rows if r.path == "layers/self_attn/q_proj/kernel")
    layers = model.config.num_hidden_layers
    assert q.spec == PartitionSpec(None, ("fsdp", "sp"), "tp") and q.shard_shape == (layers, 32, 16)
    assert q.reason.startswith("dim0 LAYERS: layer_axis = None: replicated | ")  # every device holds every layer
    assert q.reason.endswith(" | dim2 TP: sharded 4 ways over tp, 16 per shard")
    # placed: the same specs read back from the arrays
    placed = param_rows(shard_model(model, MESH))
    assert [(r.path, r.spec, r.source) for r in placed] == [(r.path, r.spec, "placed") for r in rows]
    # bytes per device equal what memory_per_device computes from the shardings (every device: even split)
    mem = memory_per_device(nnx.state(model, nnx.Param), params_sharding(model, MESH))
    total = subtree_totals(rows)[""]
    assert set(mem.per_device.values()) == {total.bytes_per_device} and mem.logical == total.nbytes


def test_rules_mode_and_abstract_models():
    config = ModelConfig.from_hf(tiny_config("llama"))
    abstract = lazy_init(lambda: CausalLM(config, rngs=nnx.Rngs(0)),
                         AbstractMesh((1, 2, 1, 4, 1), ("dp", "fsdp", "ep", "tp", "sp")))
    rows = param_rows(abstract)  # ShapeDtypeStructs with NamedShardings: nothing allocated
    assert all(isinstance(r.sharding, NamedSharding) and r.source == "placed" for r in rows)
    assert sum(r.count for r in rows) == tiny("llama").num_params()
    ruled = param_rows(abstract, MESH, rules=[("embed_tokens", ColumnWise)])
    embed = next(r for r in ruled if r.path == "embed_tokens")
    assert embed.spec == PartitionSpec(("fsdp", "sp"), "tp") and embed.reason.endswith("(rule 'embed_tokens')")
    decode = param_rows(abstract, MESH, mode=MODE_DECODE)
    assert {r.path: r.spec for r in decode} == param_specs(abstract, MESH, mode=MODE_DECODE)


def test_subtree_totals(model):
    rows = param_rows(model, MESH)
    totals = subtree_totals(rows)
    assert totals[""].count == model.num_params() and totals[""].num_arrays == len(rows)
    for prefix, total in totals.items():
        under = [r for r in rows if not prefix or r.path.startswith(prefix + "/")]
        assert total.count == sum(r.count for r in under) and total.nbytes == sum(r.nbytes for r in under)
        assert total.bytes_per_device == sum(r.bytes_per_device for r in under)
        assert total.depth == (0 if not prefix else prefix.count("/") + 1)
    layers = model.config.num_hidden_layers
    for i in range(layers):  # the stacked "layers" subtree holds every layer: L times one layer's count
        layer = nnx.state(model.layers[i], nnx.Param)
        assert totals["layers"].count == layers * sum(x.size for x in jax.tree.leaves(layer))
    attn = nnx.state(model.layers.self_attn, nnx.Param)
    assert totals["layers/self_attn"].count == sum(x.size for x in jax.tree.leaves(attn))
    assert totals["layers/self_attn"].num_arrays == 4  # q k v o, each one stacked array
    assert list(totals)[:3] == ["", "layers", "layers/input_layernorm"]  # tree order
    assert subtree_totals(param_rows(model))["layers"].bytes_per_device is None  # not placed: unknown


def test_errors_and_format_count(model):
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        param_rows({"w": np.zeros(3)})
    with pytest.raises(ValueError, match="rule is"):
        param_rows(model, MESH, rules=["not a pair"])
    assert format_count(0) == "0" and format_count(1_500_000) == "1.5M" and format_count(2_000) == "2K"
