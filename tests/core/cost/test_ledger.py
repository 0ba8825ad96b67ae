"""The memory ledger against independent references: optax's own state shapes, hand derivations, and XLA's
buffer assignment for the compiled step on a virtual cluster (issue 16's target: within 10 % of the compiled
total for every preset family at the three remat policies: ``test_ledger_families.py``)."""

import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from workbench.core.compile.steps import full_mesh_shape, optimizer
from workbench.core.compile.virtual import TPU_HBM_ONLY, compile_step
from workbench.core.cost.ledger import ledger, libtpu_version, optimizer_bytes
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.mesh import MESH_AXES
from workbench.core.models.stack import REMAT_POLICIES
from workbench.core.views.explore import Layout
from workbench.core.vocab import REMATS
from workbench.models import CausalLM, ModelConfig, tiny_config

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')


def _mesh(**sizes):
    shape = tuple(sizes.get(name, 1) for name in MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def _model(family="llama", dtype=jnp.float32, **overrides):
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(family, **overrides)), dtype=dtype, param_dtype=dtype)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_optimizer_bytes_equal_optax_state(name, dtype):
    """The reference: optax's own ``init`` traced on the parameters (one device: nothing split)."""
    model = _model("qwen3", dtype, hidden_size=128, intermediate_size=256)
    layout = Layout.of(model, _mesh(fsdp=1))
    params = model.split_params()[1]
    state = jax.eval_shape(optimizer(name).init, params)
    expected = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    assert optimizer_bytes(layout, name) == expected


def test_full_remat_keeps_each_layers_input():
    """Hand derivation: with remat="full" the scan keeps one (b, t, D) input per layer, b = B / data shards."""
    model = _model(hidden_size=128)
    layout = Layout.of(model, _mesh(dp=2, fsdp=2, tp=2))
    got = ledger(model, layout, batch=(16, 64), remat="full")
    assert got.activations == model.config.num_hidden_layers * (16 // 4) * 64 * 128 * 4
    assert got.grads == got.params == layout.param_bytes
    assert got.optimizer == 2 * layout.param_bytes + 4


def test_gradient_accumulation_holds_one_microbatch_and_the_sum_of_its_gradients():
    """k microbatches one after another: the activations, temporaries and token ids of a step of B / k rows (by hand
    for full remat: one (b, t, D) input per layer, b = B / k / data shards), the parameters, gradients and optimizer
    state of the whole step, and the running sum of the gradients (one more set) in the temporaries."""
    model = _model(hidden_size=128)
    layout = Layout.of(model, _mesh(dp=2, fsdp=2, tp=2))
    whole = ledger(model, layout, batch=(16, 64), remat="full")
    one = ledger(model, layout, batch=(4, 64), remat="full")  # a step of the microbatch alone
    got = ledger(model, layout, batch=(16, 64), remat="full", grad_accumulation=4)
    assert got.activations == model.config.num_hidden_layers * (16 // 4 // 4) * 64 * 128 * 4 == whole.activations // 4
    assert (got.params, got.grads, got.optimizer) == (whole.params, whole.grads, whole.optimizer)
    assert got.temporaries == one.temporaries + layout.param_bytes and got.inputs == one.inputs
    assert got.total == one.total + one.grads and ledger(model, layout, batch=(16, 64), remat="full",
                                                        grad_accumulation=1) == whole


@pytest.mark.parametrize("kwargs, message", [
    ({"grad_accumulation": 3}, "16 sequences do not split into 3 microbatches; use a count that divides 16: 1, 2, 4"),
    ({"grad_accumulation": 2, "kind": "decode"}, "a decode step takes grad_accumulation=1"),
    ({"grad_accumulation": 0}, "grad_accumulation must be a positive int"),
])
def test_accumulation_the_step_cannot_run_says_what_to_change(kwargs, message):
    model = _model(hidden_size=128)
    with pytest.raises(ValueError, match=message):
        ledger(model, Layout.of(model, _mesh(fsdp=8)), batch=(16, 64), **kwargs)


def test_a_pipeline_s_microbatches_are_its_accumulation():
    from workbench.core.pipeline import PipelineConfig, pipeline_partition_axis

    model = _model(hidden_size=128, num_hidden_layers=4)
    layout = Layout.of(model, _mesh(pp=2, fsdp=4), pipeline_partition_axis())
    with pytest.raises(ValueError, match="fold the accumulation into the pipeline's microbatches"):
        ledger(model, layout, batch=(16, 64), pipeline=PipelineConfig(2, 4), grad_accumulation=2)


def test_the_ledger_holds_a_70b_train_step_against_hbm():
    from workbench.core.models.presets import full_config

    model = CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    v5p = Cluster.tpu("v5p:4x4x4")
    layout = Layout.of(model, _mesh(fsdp=16, tp=4))
    big = ledger(model.with_options(remat="full"), layout, batch=(64, 4096), cluster=v5p)
    # 70.6e9 bf16 parameters over 64 devices = 2.2 GB, AdamW in bf16 twice that, gradients the same
    assert big.params == pytest.approx(70.55e9 * 2 / 64, rel=0.01)
    assert big.fits and big.headroom > 0 and "fits" in str(big)
    huge = ledger(model.with_options(remat="none"), layout, batch=(256, 8192), cluster=v5p)
    assert not huge.fits and huge.headroom < 0 and "does NOT fit" in str(huge)


# Measured gaps (ledger / compiled - 1), 8 CPU devices fsdp=4 x tp=2, batch 16 x 128, float32, hidden 256, MLP 512,
# 4 layers, remat none / dots_saveable / full: llama -1.7 / -2.2 / -2.3 %, qwen3 -3.6 / -6.0 / -9.0 %. Every
# family: test_ledger_families.py.
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("remat", ["none", "dots_saveable", "full"])
def test_ledger_matches_the_compiled_train_step_on_cpu(family, remat):
    cluster, mesh_shape, batch = Cluster.cpu(8), {"fsdp": 4, "tp": 2}, (16, 128)
    model = _model(family, hidden_size=256, intermediate_size=512, num_hidden_layers=4).with_options(remat=remat)
    compiled = compile_step(model, cluster, mesh_shape, batch=batch)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES))
    predicted = ledger(model, layout, batch=batch, cluster=cluster)
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)


# remat="none" is not repeated here: that program (the same sizes, batch, mesh, v5e:2x4 and TPU_HBM_ONLY) is
# test_ledger_families.py's test_ledger_matches_the_compiled_step_on_a_tpu_slice[llama-none], which runs in every
# run (llama's policy there is "none" outside a sweep) and asserts the same 10 %; a TPU compile takes about 15 CPU
# seconds, and neither XLA's persistent cache nor compile_on's cache shares it across the two test processes.
@needs_libtpu
@pytest.mark.parametrize("remat", ["dots_saveable", "full"])
def test_ledger_matches_the_compiled_train_step_on_a_tpu_slice(remat):
    """XLA's TPU compiler's HBM peak (``peak_memory_in_bytes``, memory-space assignment to VMEM off:
    ``TPU_HBM_ONLY``) for a bfloat16 Llama with 128-wide heads (as real models have: narrower ones pad on TPU) on
    v5e:2x4; measured gaps +0.2 / -0.2 % (+0.4 % without remat: test_ledger_families.py)."""
    cluster, mesh_shape, batch = Cluster.tpu("v5e:2x4", libtpu=libtpu_version()), {"fsdp": 4, "tp": 2}, (16, 256)
    model = _model("llama", jnp.bfloat16, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2048).with_options(remat=remat)
    compiled = compile_step(model, cluster, mesh_shape, batch=batch, compiler_options=TPU_HBM_ONLY)
    layout = Layout.of(model, cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES))
    predicted = ledger(model, layout, batch=batch, cluster=cluster)
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)


@needs_libtpu
@pytest.mark.parametrize(("mesh_shape", "zero_stage", "remat"), [({"fsdp": 8}, 0, "full"), ({"dp": 8}, 1, "none")])
def test_ledger_matches_a_mixed_precision_train_step_on_a_tpu_slice(mesh_shape, zero_stage, remat):
    """Float32 master weights (``param_dtype``) with bfloat16 compute (``dtype``), as MaxText trains: XLA's TPU
    compiler keeps a bfloat16 copy of the weights through the step and gathers that copy, not the float32 weights.
    Its arguments are the float32 parameters and AdamW moments the ledger counts; its HBM peak is within 10 % of
    the ledger's total (measured +7.4 % and -7.1 %; -11.9 % and +22.1 % before the ledger counted the copy)."""
    cluster, batch = Cluster.tpu("v5p:2x2x2", libtpu=libtpu_version()), (32, 256)
    model = CausalLM.lazy_init(ModelConfig.from_hf(tiny_config(
        "llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=4, vocab_size=1024,
        num_attention_heads=4, num_key_value_heads=2)), dtype=jnp.bfloat16, param_dtype=jnp.float32)
    model = model.with_options(remat=remat)
    compiled = compile_step(model, cluster, mesh_shape, batch=batch, zero_stage=zero_stage,
                            compiler_options=TPU_HBM_ONLY)
    mesh = cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES)
    predicted = ledger(model, Layout.of(model, mesh, zero_stage=zero_stage), batch=batch, cluster=cluster)
    assert predicted.params + predicted.optimizer + predicted.inputs == pytest.approx(compiled.memory.argument,
                                                                                       rel=0.01)
    assert predicted.total == pytest.approx(compiled.memory.total, rel=0.10)


def test_the_remat_policies_counted_are_policies_the_model_runs():
    assert set(REMATS) <= set(REMAT_POLICIES)
    assert REMAT_POLICIES["full"] is jax.checkpoint_policies.nothing_saveable
