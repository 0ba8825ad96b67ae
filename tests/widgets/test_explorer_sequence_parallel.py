"""The explorer compiles a model's step with sequence-parallel attention on an sp mesh: the ring's permutes
over sp appear beside tensor parallelism's all-reduces over tp, read from the compiled HLO."""

from __future__ import annotations

import jax
import pytest

from workbench.core.mesh import make_mesh
from workbench.core.models.presets import tiny
from workbench.widgets.sharding_explorer import ShardingExplorer

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")


@pytest.mark.parametrize("attention, sp_kind", [("ring", "collective-permute"), ("ulysses", "all-to-all"),
                                                ("allgather_kv", "all-gather")])
def test_sequence_parallel_collectives_next_to_tp(attention, sp_kind):
    model = tiny("llama")
    explorer = ShardingExplorer(model, make_mesh(dp=2, fsdp=1, tp=2, sp=2))
    assert explorer._attention.options[0] == model.attn_mechanism and attention in explorer._attention.options
    explorer.set_attention(attention)
    assert explorer.compute_collectives()
    kinds = {(c.kind, c.mesh_axes) for c in explorer.collectives.records}
    assert (sp_kind, ("sp",)) in kinds
    assert ("all-reduce", ("tp",)) in kinds
    assert "sp" in explorer._collectives_out.value
    assert explorer.model.attn_mechanism == model.attn_mechanism  # the explorer's model is left as it was


def test_ring_on_an_sp_axis_of_one_device_moves_nothing():
    explorer = ShardingExplorer(tiny("llama"), make_mesh(dp=2, fsdp=1, tp=4))
    explorer.set_attention("ring")
    assert explorer.compute_collectives()
    assert not [c for c in explorer.collectives.records if "sp" in (c.mesh_axes or ())]


def test_a_pp_mesh_splits_the_layers_and_compiles_the_pipeline():
    model = tiny("llama", num_hidden_layers=4)
    flat = ShardingExplorer(model, make_mesh(dp=4, fsdp=1, tp=2))
    explorer = ShardingExplorer(model, make_mesh(pp=2, dp=2, fsdp=1, tp=2))
    assert explorer.partition_axis.layer_axis == "pp"
    layers = [p for p in explorer.layout.params if p.path.startswith("layers/")]
    assert all(p.decisions[0].chosen == ("pp",) for p in layers)
    assert explorer.memory().params < flat.memory().params
    for kind in ("forward", "train"):
        explorer._kind.value = kind
        assert explorer.compute_collectives(), explorer._collectives_out.value
        assert ("collective-permute", ("pp",)) in {(c.kind, c.mesh_axes) for c in explorer.collectives.records}
