"""ShardingExplorer on a virtual cluster: the cluster's mesh shapes, the memory ledger against HBM, and a
compiled step's predicted time and memory (issue 16, "In the explorer")."""

import html
import importlib.util
import itertools
import math
import re

import jax.numpy as jnp
import pytest

from workbench.core.cost.ledger import ledger
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import collective_time
from workbench.core.mesh import MESH_AXES
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config
from workbench.core.units import format_bytes, format_seconds
from workbench.widgets.sharding_explorer import ShardingExplorer

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')


@pytest.fixture(scope="module")
def llama_70b():
    return CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _parts_shown(explorer):
    """part class -> bytes, read from the ledger bar's hover titles."""
    value = explorer._ledger_out.value
    return {name: int(b.replace(",", "")) for name, b in
            re.findall(r'class="wb-ledger-part wb-ledger-(\w+)" title="[^"]*\(([\d,]+) B\)"', value)}


def _verdict(explorer):
    return html.unescape(re.search(r'wb-ledger-verdict[^>]*>([^<]*)<', explorer._ledger_out.value).group(1))


def test_axis_sizes_or_nothing_give_the_mesh_and_every_shape_of_the_cluster_is_offered():
    cluster = Cluster.h100(nodes=2, gpus_per_node=4)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    ex = ShardingExplorer(model, cluster=cluster)
    assert dict(ex.mesh.shape) == {"pp": 1, "dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
    assert ex._mesh_choice.value == "fsdp=8"
    # every way to split 8 GPUs over the six axes: 2^3 over 6 axes, (3 + 5 choose 5) = 56
    divisors = (1, 2, 4, 8)
    expected = {s for s in itertools.product(divisors, repeat=6) if math.prod(s) == 8}
    assert len(expected) == math.comb(8, 5) == len(ex._mesh_choice.options)
    shown = {tuple(int(dict(p.split("=") for p in o.split(" × ")).get(a, 1)) for a in MESH_AXES)
             for o in ex._mesh_choice.options}
    assert shown == expected
    ex2 = ShardingExplorer(model, {"fsdp": 2, "tp": 4}, cluster=cluster)
    assert ex2._mesh_choice.value == "fsdp=2 × tp=4"


def test_bad_meshes_say_what_to_pass():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    with pytest.raises(ValueError, match="cluster=Cluster"):
        ShardingExplorer(model, {"fsdp": 8})
    with pytest.raises(ValueError, match="has 4 devices; 1 x 8 H100 SXM has 8"):
        ShardingExplorer(model, {"fsdp": 4}, cluster=Cluster.h100(nodes=1))


def test_the_memory_chart_is_the_ledger_against_hbm(llama_70b):
    """Llama-3-70B on 8 x 8 H100 (80 GB each), fsdp=8 x tp=8, batch 16 x 2048: without remat the kept
    activations do not fit; with full remat they do; a decode step shows the KV cache."""
    cluster = Cluster.h100(nodes=8)
    ex = ShardingExplorer(llama_70b, {"fsdp": 8, "tp": 8}, cluster=cluster, batch=(16, 2048))
    ex._remat.value = "none"
    expected = ledger(llama_70b, ex.layout, batch=(16, 2048), remat="none", cluster=cluster)
    assert expected.fits is False
    assert _parts_shown(ex) == {k: v for k, v in expected.parts().items() if v}
    assert _verdict(ex).startswith("does not fit") and format_bytes(-expected.headroom) in _verdict(ex)
    hbm = re.search(r'wb-hbm-line" title="HBM per device ([^"]+)"', ex._ledger_out.value).group(1)
    assert hbm == format_bytes(80e9)  # H100 SXM: 80 GB
    ex._remat.value = "full"
    assert _verdict(ex).startswith("fits")
    assert _parts_shown(ex)["activations"] == ledger(llama_70b, ex.layout, batch=(16, 2048), remat="full",
                                                     cluster=cluster).activations
    ex._task.value = "decode"
    assert "kv_cache" in _parts_shown(ex) and "grads" not in _parts_shown(ex)
    ex._optimizer_name.value = "sgd"  # a decode step has no optimizer: nothing changes, nothing breaks
    assert not ex.error


def test_a_mesh_choice_re_resolves_every_parameter(llama_70b):
    cluster = Cluster.h100(nodes=8)
    ex = ShardingExplorer(llama_70b, {"fsdp": 8, "tp": 8}, cluster=cluster, batch=(16, 2048))
    before = _parts_shown(ex)["params"]
    ex._mesh_choice.value = "fsdp=64"  # taken; only the predicted step cannot split 16 sequences 64 ways
    assert ex.error.startswith("predicted step: 16 sequences do not split") and dict(ex.mesh.shape)["fsdp"] == 64
    assert _parts_shown(ex)["params"] == ex.layout.param_bytes < before * 1.01  # same bytes over 64 devices
    assert "data-path" in ex._table.value and ex.last_diff.changed  # the specs moved from tp to fsdp
    ex.set_mesh({"dp": 2, "fsdp": 32})
    assert ex._mesh_choice.value == "dp=2 × fsdp=32"


@needs_libtpu
def test_a_shape_the_tpu_torus_cannot_hold_is_refused():
    cluster = Cluster.tpu("v5e:2x4")
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    ex = ShardingExplorer(model, {"fsdp": 4, "tp": 2}, cluster=cluster)
    assert not ex.set_mesh({"dp": 2, "fsdp": 2, "tp": 4})  # 16 devices on 8 chips
    assert "has 16 devices; v5e:2x4 has 8" in ex.error
    assert dict(ex.mesh.shape)["tp"] == 2 and ex._mesh_choice.value == "fsdp=4 × tp=2"


def test_a_shape_that_splits_a_physical_axis_is_laid_out_as_jax_lays_it():
    """(2, 2, 2) on a 2x4 torus splits its 4-chip axis (jax's allow_split_physical_axes): accepted now, as MaxText's
    {"fsdp": 64, "ep": 4} on a v6e 16x16 must be; the mesh choices still list whole-axis shapes only."""
    cluster = Cluster.tpu("v5e:2x4")
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))
    ex = ShardingExplorer(model, {"fsdp": 4, "tp": 2}, cluster=cluster)
    assert ex.set_mesh({"dp": 2, "fsdp": 2, "tp": 2}), ex.error
    assert {k: v for k, v in dict(ex.mesh.shape).items() if v > 1} == {"dp": 2, "fsdp": 2, "tp": 2}


def test_a_compiled_step_gives_step_time_collective_times_and_memory_beside_the_ledger():
    """Tiny bfloat16 Llama on 2 nodes x 4 H100, fsdp=4 x tp=2 (tp inside a node, fsdp across): the train step
    compiled in the worker; each collective row's time is the network model's for its bytes, axes and runs."""
    cluster = Cluster.h100(nodes=2, gpus_per_node=4)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")), dtype=jnp.bfloat16,
                               param_dtype=jnp.bfloat16)
    ex = ShardingExplorer(model, {"fsdp": 4, "tp": 2}, cluster=cluster, batch=(8, 64))
    ex._kind.value = "train"
    assert ex.compute_collectives(), ex._collectives_out.value
    st, analysis = ex.step_time, ex.collectives.analysis
    assert st is not None and st.cluster == cluster and analysis.memory.total > 0
    # every (kind, axes) row: the sum over its records of collective_time x loop trips
    groups: dict = {}
    for r in analysis.collectives:
        t = collective_time(r.kind, r.bytes, r.mesh_axes, dict(ex.mesh.shape), cluster)
        groups[(r.kind, r.mesh_axes)] = groups.get((r.kind, r.mesh_axes), 0.0) + t * r.trips
    cells = re.findall(r'<td[^>]*>([^<]*)</td><td[^>]*>([^<]*)</td><td[^>]*>\d+</td><td[^>]*>[^<]*</td>'
                       r'<td class="wb-collective-time"[^>]*>([^<]*)</td>', ex._collectives_out.value)
    assert len(cells) == len(groups)
    for kind, axes, shown in cells:
        key = (kind, tuple(a.strip() for a in axes.split(",")) if axes != "-" else ())
        assert shown == format_seconds(groups[key])
    assert "predicted step: " + format_seconds(st.time_s) in html.unescape(ex._step_out.value)
    assert "compiled step: " + format_bytes(analysis.memory.total) in html.unescape(ex._ledger_out.value)
    ex._remat.value = "full" if model.remat != "full" else "none"  # the compiled step no longer matches
    assert "compiled step" not in ex._ledger_out.value and "stale" in ex._step_out.value
    ex._remat.value = model.remat
    assert "compiled step" in ex._ledger_out.value and "stale" not in ex._step_out.value
    assert ex.edit(partition_axis=ex.partition_axis.replace(tensor_parallel_axis="fsdp")), ex.error
    assert "stale" in ex._step_out.value and "stale" in ex._collectives_out.value


def test_a_pipeline_mesh_counts_its_ledger_and_compiles_on_a_tpu_slice_only():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))
    ex = ShardingExplorer(model, {"pp": 2, "dp": 4}, cluster=Cluster.h100(nodes=1), batch=(8, 64))
    assert "wb-ledger-verdict" in ex._ledger_out.value, ex._ledger_out.value
    ex._kind.value = "train"
    assert not ex.compute_collectives()
    assert ex.error.startswith("collectives: ") and "TPU clusters only" in ex.error


@needs_libtpu
def test_a_pipelined_step_compiles_for_a_tpu_slice_with_its_ppermutes_over_pp():
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=4)))
    ex = ShardingExplorer(model, {"pp": 2, "dp": 4}, cluster=Cluster.tpu("v5e:2x4"), batch=(8, 64))
    ex._kind.value = "train"
    assert ex.compute_collectives(), ex._collectives_out.value
    assert any(r.kind == "collective-permute" and r.mesh_axes == ("pp",) for r in ex.collectives.records)


def test_the_static_picture_is_the_ledger(llama_70b):
    ex = ShardingExplorer(llama_70b, {"fsdp": 8, "tp": 8}, cluster=Cluster.h100(nodes=8), batch=(16, 2048))
    static = ex._repr_html_()
    assert "wb-ledger-verdict" in static and "wb-hbm-line" in static and "q_proj" in static


def test_the_predicted_step_per_layer_kind_follows_every_edit(llama_70b):
    """Before any compile: the step timed from the shapes (layout_cost.predict_step), per layer kind."""
    from workbench.core.cost.predicted import predict_step

    cluster = Cluster.h100(nodes=8)
    ex = ShardingExplorer(llama_70b, {"fsdp": 8, "tp": 8}, cluster=cluster, batch=(16, 2048))
    ex._remat.value = "full"
    expected = predict_step(llama_70b.config, cluster, dict(ex.mesh.shape), batch=(16, 2048), remat="full")
    shown = html.unescape(ex._predicted_out.value)
    assert "predicted step: " + format_seconds(expected.time_s) in shown
    kinds = re.findall(r'<tr class="wb-step-kind"><td[^>]*>([^<]*)</td>', ex._predicted_out.value)
    assert kinds == list(expected.by_kind()) and "attention" in kinds and "mlp" in kinds
    ex._mesh_choice.value = "dp=2 × fsdp=8 × tp=4"
    moved = predict_step(llama_70b.config, cluster, dict(ex.mesh.shape), batch=(16, 2048), remat="full")
    assert "predicted step: " + format_seconds(moved.time_s) in html.unescape(ex._predicted_out.value)
    ex._mesh_choice.value = "fsdp=64"  # 16 sequences over 64 devices: the step model says what to change
    assert ex.error.startswith("predicted step: ") and "do not split over the batch axes" in ex.error
    assert ex._predicted_out.value == ""
