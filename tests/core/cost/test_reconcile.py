"""The step model and the ledger beside a compiled step (``workbench.core.cost.reconcile``), and the ledger's attention
backward phase against XLA:TPU's buffer assignment at a long sequence (4096 positions, ``remat="full"``)."""

import importlib.util
import re

import jax.numpy as jnp
import pytest

from workbench.core.compile.steps import full_mesh_shape
from workbench.core.compile.virtual import compile_step
from workbench.core.cost.activations import SCORE_BYTES, activation_bytes, attention_backward_bytes
from workbench.core.cost.compiled_step import step_time
from workbench.core.cost.ledger import ledger, libtpu_version
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.reconcile import collective_roles, reconcile, table
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.hlo.graph import hbm_bytes, hbm_traffic
from workbench.core.mesh import MESH_AXES
from workbench.core.models.presets import full_config
from workbench.core.views.explore import Layout
from workbench.models import CausalLM

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')

# An FSDP gather written as an all-reduce of a zero-filled buffer, and a weight gradient all-reduced whole: the two
# patterns XLA:TPU compiled for Llama-3-70B on 1024 v5p chips.
HLO = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (p: bf16[2,8]) -> (bf16[8,8], bf16[8,8]) {
  %p = bf16[2,8]{1,0} parameter(0)
  %zero = bf16[] constant(0)
  %z = bf16[8,8]{1,0} broadcast(%zero), dimensions={}
  %i = s32[] constant(0)
  %dus = bf16[8,8]{1,0} dynamic-update-slice(%z, %p, %i, %i)
  %ar.g = bf16[8,8]{1,0} all-reduce(%dus), replica_groups={{0,1,2,3}}, to_apply=%add
  %dot = bf16[8,8]{1,0} dot(%ar.g, %ar.g), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_name="jit(train)/transpose(jvp())/dot_general"}
  %ar.d = bf16[8,8]{1,0} all-reduce(%dot), replica_groups={{0,1,2,3}}, to_apply=%add
  %ag = bf16[8,8]{1,0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %t = (bf16[8,8]{1,0}, bf16[8,8]{1,0}, bf16[8,8]{1,0}) tuple(%ar.g, %ar.d, %ag)
}
"""


def test_collective_roles_read_the_hlo():
    assert collective_roles(HLO) == {"ar.g": "gather", "ar.d": "gradient", "ag": "gather"}


def test_hbm_traffic_splits_hbm_bytes_by_instruction():
    rows = {name: (kind, array, nbytes) for name, kind, array, nbytes in hbm_traffic(HLO)}
    assert rows["dot"] == ("dot", "bf16[8,8]", 3 * 8 * 8 * 2)  # two operands read, the result written
    assert rows["z"] == ("broadcast", "bf16[8,8]", 128 + 2)
    assert sum(nbytes for *_, nbytes in rows.values()) == hbm_bytes(HLO)


# A decode step's cache write and layer read as XLA:TPU leaves them outside fusions (Llama-3-70B's decode on v5e:4x4):
# a dynamic-update-slice writing one token into the stacked cache in place, a dynamic-slice reading one layer.
CACHE_HLO = """HloModule m, is_scheduled=true

ENTRY %main (cache: bf16[4,8,512,64], new: bf16[1,8,1,64], i: s32[]) -> (bf16[4,8,512,64], bf16[1,8,512,64]) {
  %cache = bf16[4,8,512,64]{3,2,1,0} parameter(0)
  %new = bf16[1,8,1,64]{3,2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %write = bf16[4,8,512,64]{3,2,1,0} dynamic-update-slice(%cache, %new, %i, %zero, %i, %zero)
  %layer = bf16[1,8,512,64]{3,2,1,0} dynamic-slice(%write, %i, %zero, %zero, %zero), dynamic_slice_sizes={1,8,512,64}
  ROOT %t = (bf16[4,8,512,64]{3,2,1,0}, bf16[1,8,512,64]{3,2,1,0}) tuple(%write, %layer)
}
"""


def test_an_unfused_cache_write_moves_the_update_and_a_slice_its_result():
    """As XLA's HloCostAnalysis counts them (HandleDynamicUpdateSlice: the update read and written, the buffer
    aliased to the result and not read; HandleDynamicSlice: the result read and written), not the whole cache."""
    rows = {name: nbytes for name, _, _, nbytes in hbm_traffic(CACHE_HLO)}
    update, layer, index = 8 * 64 * 2, 8 * 512 * 64 * 2, 4
    assert rows["write"] == 2 * update + 4 * index  # four start indices, each read
    assert rows["layer"] == 2 * layer + 4 * index
    assert hbm_bytes(CACHE_HLO) == rows["write"] + rows["layer"] < 4 * 8 * 512 * 64 * 2  # under one cache read


# A 2-layer Llama (hidden 1024, 8 heads of 128, 4096 positions) on v5p:2x2x1, fsdp=4, remat="full": each device
# computes one sequence's f32[8, 4096, 4096] scores (512 MiB). Compiled peak (libtpu 0.0.42) 1.87 GiB: the ledger
# said 1.12 (-40.0 %) before it counted the attention backward phase, 1.84 (-1.6 %) with it.
@pytest.fixture(scope="module")
def long_sequence():
    config = full_config("llama-3-70b").replace(num_hidden_layers=2, layer_types=None, hidden_size=1024,
                                                intermediate_size=3584, num_attention_heads=8, num_key_value_heads=1,
                                                head_dim=128, vocab_size=32768)
    model = CausalLM.lazy_init(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).with_options(remat="full")
    cluster, mesh_shape, batch = Cluster.tpu("v5p:2x2x1", libtpu=libtpu_version()), {"fsdp": 4}, (4, 4096)
    compiled = compile_step(model, cluster, mesh_shape, batch=batch)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES))
    return config, model, cluster, mesh_shape, batch, compiled, layout


@needs_libtpu
def test_the_attention_backward_is_the_peak_at_long_sequences(long_sequence):
    _, model, cluster, _, batch, compiled, layout = long_sequence
    predicted = ledger(model, layout, batch=batch, cluster=cluster)
    attention = attention_backward_bytes(layout, batch, "full", jnp.bfloat16)
    assert attention >= SCORE_BYTES["tpu"]["full"] * 4096 * 8 * 4096  # one sequence a device, 8 heads
    assert activation_bytes(layout, batch, "full", jnp.bfloat16)[1] == attention  # the largest phase
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)
    # the compiled program materialises float32 scores of that size (what the phase counts)
    assert re.search(r"f32\[(1,)?1,8,4096,4096\]", compiled.hlo_text)


@needs_libtpu
def test_reconcile_against_the_hlo(long_sequence):
    config, model, cluster, mesh_shape, batch, compiled, layout = long_sequence
    predicted_step = predict_step(config, cluster, mesh_shape, batch=batch, remat="full")
    compiled_step = step_time(compiled)
    rows = {r.quantity: r for r in reconcile(predicted_step, compiled_step,
                                             ledger(model, layout, batch=batch, cluster=cluster), compiled,
                                             seq_len=4096)}
    assert "quantity" in table(list(rows.values()))
    assert rows["memory: arguments"].compiled == compiled.memory.argument
    assert rows["memory: total"].compiled == compiled.memory.total
    assert rows["HBM traffic"].compiled == compiled.hbm_bytes == pytest.approx(
        sum(nbytes for *_, nbytes in hbm_traffic(compiled.hlo_text)))
    assert "attention scores" in rows["HBM traffic"].why
    # independently of the collectives parser: every all-gather's result bytes in the HLO text, those in a loop body
    # (the layer scans) once per layer
    bodies = set(re.findall(r"body=%?([\w.\-]+)", compiled.hlo_text))
    gathered, current = 0, None
    for line in compiled.hlo_text.splitlines():
        if header := re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line):
            current = header[1]
        elif gather := re.search(r"= (\([^)]*\)|\S+) all-gather(?:-start)?\(", line):
            arrays = re.findall(r"(bf16|f32|s32)\[([\d,]*)\]", gather[1])
            dtype, dims = arrays[-1]  # an all-gather-start's result is (operand, gathered): the last
            size = {"bf16": 2, "f32": 4, "s32": 4}[dtype]
            for d in dims.split(","):
                size *= int(d)
            gathered += size * (config.num_hidden_layers if current in bodies else 1)
    roles = collective_roles(compiled.hlo_text)
    parsed = sum(r.bytes * r.trips for r in compiled.collectives if roles[r.name] == "gather")
    assert gathered and parsed >= gathered  # zero-filled all-reduces (if any) add to the gathers
    assert sum(r.bytes * r.trips for r in compiled.collectives if r.kind == "all-gather") == gathered
    assert rows["weight gathers over fsdp"].compiled == pytest.approx(sum(
        t.total_s for t in compiled_step.collectives if roles[t.name] == "gather"))
