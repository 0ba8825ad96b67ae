"""rules: one record per parameter resolved on a mesh, the same for the explorer's layout and the module tree."""

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.axes import EMBED, VOCAB, DimDecision, PartitionAxis
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.models.sharding import shard_model
from workbench.core.sharding.placement import ParamPlacement, freeze_rules, reason_text, resolve_params
from workbench.core.views.explore import Layout
from workbench.core.views.param_tree import param_rows


def abstract(**overrides):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", **overrides)))


@pytest.mark.parametrize("rules", [None, [("embed_tokens", (VOCAB, EMBED))]])
def test_explorer_and_module_tree_show_the_same_reason(rules):
    model, mesh = tiny("llama"), make_mesh(dp=2, fsdp=2, tp=2)
    layout = Layout.of(model, mesh, rules=rules)
    rows = param_rows(model, mesh, rules=rules)
    table = layout.table().splitlines()[1:]  # the explorer's table, one line per parameter after the header
    assert [r.path for r in rows] == list(layout.paths) and len(table) == len(rows)
    for line, p, row in zip(table, layout.params, rows, strict=True):
        assert row.reason and row.reason == p.reason and line.endswith("  " + row.reason), row.path
        assert row == p  # one record, built once: spec, shard, bytes and decisions too
    if rules:
        assert layout["embed_tokens"].reason.endswith(" (rule 'embed_tokens')")


def test_reason_says_which_axis_was_dropped_and_why():
    params = {p.path: p for p in resolve_params(abstract(vocab_size=260), make_mesh(fsdp=1, tp=8))}
    row = params["embed_tokens"]  # RowWise: (TP, [FSDP, SP]); 260 % 8 != 0
    assert row.spec == PartitionSpec(None, ("fsdp", "sp")) and row.source == "resolved"
    assert row.reason.startswith("dim0 TP: tp dropped: 260 not divisible by 8; replicated | dim1 [FSDP, SP]: ")
    assert params["layers/input_layernorm/weight"].reason == ("dim0 LAYERS: layer_axis = None: replicated | "
                                                              "dim1 EMPTY: not sharded (EMPTY)")


def test_reason_text_names_a_common_rule_once_and_says_replicated_for_all_empty():
    empty = [DimDecision(i, "EMPTY", 4, None, (), (), "not sharded (EMPTY) (rule 'x')") for i in range(2)]
    assert reason_text(empty) == "replicated: no dimension is named for sharding (EMPTY) (rule 'x')"
    assert reason_text(()) == ""


def test_placed_and_unplaced_parameters():
    model, mesh = tiny("llama"), make_mesh(fsdp=2, tp=4)
    bare = resolve_params(model)
    assert all(p.source is None and p.spec is None and p.sharding is None and p.reason == "" for p in bare)
    assert bare[0].nbytes == bare[0].count * 4 and bare[0].axes == ("TP", "[FSDP, SP]")
    resolved, placed = resolve_params(model, mesh), resolve_params(shard_model(model, mesh))
    for r, p in zip(resolved, placed, strict=True):
        assert p.source == "placed" and p.decisions == () and isinstance(p.sharding, NamedSharding)
        assert (p.spec, p.shard_shape, p.bytes_per_device) == (r.spec, r.shard_shape, r.bytes_per_device)
    record = ParamPlacement("a/b", (4, 2), np.dtype("float32"))
    assert (record.name, record.count, record.nbytes, record.typed) == ("b", 8, 32, None)
    with pytest.raises(TypeError, match=r"nnx\.Module"):
        resolve_params({"w": np.zeros(3)}, mesh, PartitionAxis())


def test_rules_are_frozen_into_hashable_data():
    frozen = freeze_rules([("embed", [VOCAB, [EMBED, "x"]])])
    assert frozen == (("embed", (VOCAB, (EMBED, "x"))),) and hash(frozen)
