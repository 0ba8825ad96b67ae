"""The pipelined step on 8 simulated devices equals the unpipelined one (reference: ``jax.value_and_grad`` of
the plain model's loss, and the plain model's logits), for every schedule, pp in {2, 4, 8}, with dp / fsdp / tp;
its activation buffers are what ``memory_analysis()`` of the compiled step shows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from workbench.core.hlo.collectives import collectives
from workbench.core.mesh import make_mesh
from workbench.core.models.loss import causal_lm_loss
from workbench.core.models.presets import tiny
from workbench.core.models.training import make_train_step, to_state
from workbench.core.pipeline import (
    PipelineConfig,
    activation_stash_bytes,
    make_pipeline_train_step,
    pipeline_forward,
    pipeline_loss_and_grads,
    pipeline_partition_axis,
    pipeline_value_and_grad,
)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")

LAYOUTS = [  # (mesh, schedule, microbatches, layers)
    (dict(pp=2, dp=2, tp=2, fsdp=1), "gpipe", 4, 4),
    (dict(pp=2, dp=2, tp=2, fsdp=1), "1f1b", 4, 4),
    (dict(pp=2, fsdp=4), "interleaved", 4, 4),
    (dict(pp=4, dp=2, fsdp=1), "1f1b", 8, 4),
    (dict(pp=4, fsdp=1, tp=2), "interleaved", 4, 8),
    (dict(pp=8, fsdp=1), "gpipe", 8, 8),
    (dict(pp=8, fsdp=1), "1f1b", 16, 8),
]


def _ids(batch=16, length=16, seed=0):
    return np.random.default_rng(seed).integers(0, 250, (batch, length)).astype(np.int32)


def _reference(model, ids, mask=None):
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def loss(params):
        from workbench.core.models.loss import labels_from

        out = nnx.merge(graphdef, params, other).forward(jnp.asarray(ids), None if mask is None else jnp.asarray(mask))
        return causal_lm_loss(out.logits, labels_from(jnp.asarray(ids), None if mask is None else jnp.asarray(mask)))[0]

    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_close(grads, ref_grads, atol=1e-5):
    flat, ref = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    assert {k for k, _ in flat} == set(ref)
    for key, g in flat:
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref[key]), atol=atol, rtol=1e-5, err_msg=str(key))


@functools.cache
def _plain_llama(layers):
    """The tiny Llama of ``layers`` layers, its reference ``(loss, grads)`` on ``_ids()`` and its logits: built,
    compiled and computed once for every layout with that many layers."""
    model = tiny("llama", num_hidden_layers=layers)
    ids = _ids()
    return model, _reference(model, ids), np.asarray(model(ids).logits)


_FORWARD_LOGITS = {}


def _pipeline_logits(sharded, config, mesh_kwargs, layers):
    """``pipeline_forward``'s logits. It runs GPipe's forward ticks for a GPipe and a 1F1B config alike (the
    interleaved ones for interleaved), one program per mesh, forward schedule and m: compiled once for the
    layouts that share it (1F1B configs still reach ``pipeline_forward`` through the layouts they do not share)."""
    key = (tuple(mesh_kwargs.items()), "interleaved" if config.schedule == "interleaved" else "gpipe",
           config.num_microbatches, layers)
    if key not in _FORWARD_LOGITS:
        _FORWARD_LOGITS[key] = np.asarray(pipeline_forward(sharded, _ids(), config=config))
    return _FORWARD_LOGITS[key]


@pytest.mark.parametrize("mesh_kwargs, schedule, m, layers", LAYOUTS)
def test_loss_gradients_and_forward_equal_the_plain_model(mesh_kwargs, schedule, m, layers):
    model, (ref_loss, ref_grads), ref_logits = _plain_llama(layers)
    ids = _ids()
    mesh = make_mesh(**mesh_kwargs)
    sharded = model.shard_model(mesh, pipeline_partition_axis())
    config = PipelineConfig(mesh_kwargs["pp"], m, schedule)
    loss, grads = pipeline_value_and_grad(sharded, {"input_ids": ids}, config)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    _assert_close(grads, ref_grads)
    logits = _pipeline_logits(sharded, config, mesh_kwargs, layers)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5)


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "mixtral", "deepseek_v3"])
def test_families_with_padding(family):
    """Alternating local/global layers (gemma3), learned positions and tied head (gpt2), experts (mixtral), a
    dense prefix before the pipelined experts (deepseek_v3), left padding."""
    # one layer per stage (compile time grows with the layers; stages of several layers are the layouts' test's),
    # but gemma3 keeps a local and a global layer in each stage
    overrides = {"gemma3": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
                 "gpt2": dict(n_layer=2), "mixtral": dict(num_hidden_layers=2),
                 "deepseek_v3": dict(num_hidden_layers=3)}[family]  # deepseek_v3: 1 dense + 2 MoE layers
    model = tiny(family, **overrides)
    ids = _ids()
    mask = np.ones_like(ids)
    mask[:3, :5] = 0
    ref_loss, ref_grads = _reference(model, ids, mask)
    mesh = make_mesh(pp=2, dp=2, fsdp=1, tp=2)
    config = PipelineConfig(2, 4, "1f1b")
    loss, grads = pipeline_value_and_grad(model.shard_model(mesh, pipeline_partition_axis()),
                                          {"input_ids": ids, "attention_mask": mask}, config)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    _assert_close(grads, ref_grads)


def test_train_step_equals_the_unpipelined_step():
    model = tiny("llama")  # 2 layers: one per stage
    ids = _ids(seed=1)
    optimizer = optax.sgd(0.1)  # the update is the gradient, scaled (Adam's would amplify float32 noise)
    plain_state, plain_metrics = make_train_step()(to_state(model, optimizer), {"input_ids": ids})
    mesh = make_mesh(pp=2, dp=2, tp=2, fsdp=1)
    state = to_state(model.shard_model(mesh, pipeline_partition_axis()), optimizer)
    layer = next(v for k, v in nnx.to_flat_state(state.params) if k[0] == "layers")
    assert layer.sharding.spec[0] == "pp"  # each device stores its stage's layers only
    step = make_pipeline_train_step(PipelineConfig(2, 4, "1f1b"))
    state, metrics = step(state, {"input_ids": ids})
    assert abs(float(metrics["loss"]) - float(plain_metrics["loss"])) < 1e-5
    assert int(metrics["num_tokens"]) == int(plain_metrics["num_tokens"])
    assert float(metrics["grad_norm"]) == pytest.approx(float(plain_metrics["grad_norm"]), rel=1e-5)
    _assert_close(state.params, plain_state.params)
    state, _ = step(state, {"input_ids": ids})  # compiled once, runs again on the donated state
    assert int(state.step) == 2


def test_compiled_step_moves_activations_with_ppermute_over_pp():
    model = tiny("llama", num_hidden_layers=4)
    mesh = make_mesh(pp=4, dp=2, fsdp=1)
    sharded = model.shard_model(mesh, pipeline_partition_axis())
    graphdef, params, other = nnx.split(sharded, nnx.Param, ...)
    config = PipelineConfig(4, 4, "1f1b")
    fn = jax.jit(lambda p, o, b: pipeline_loss_and_grads(graphdef, p, o, b, config, mesh))
    found = collectives(fn, params, other, {"input_ids": jnp.asarray(_ids())}, mesh=mesh)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert permutes and all(c.mesh_axes == ("pp",) for c in permutes)
    assert all(c.trips == 14 for c in permutes)  # once per tick of the 1F1B table: 2 (m + p - 1)


def test_activation_buffers_match_memory_analysis():
    """GPipe keeps all m microbatches' stage inputs, 1F1B at most p: the compiled steps' temporary memory
    differs by exactly the predicted difference of their activation buffers."""
    model = tiny("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=256)
    mesh = make_mesh(pp=4, dp=2, fsdp=1)
    sharded = model.shard_model(mesh, pipeline_partition_axis())
    graphdef, params, other = nnx.split(sharded, nnx.Param, ...)
    batch = {"input_ids": jnp.zeros((32, 128), jnp.int32)}
    temp, predicted = {}, {}
    for schedule in ("gpipe", "1f1b"):
        config = PipelineConfig(4, 16, schedule)
        fn = jax.jit(lambda p, o, b, config=config: pipeline_loss_and_grads(graphdef, p, o, b, config, mesh))
        temp[schedule] = fn.lower(params, other, batch).compile().memory_analysis().temp_size_in_bytes
        predicted[schedule] = activation_stash_bytes(config, batch_size=32, seq_len=128, hidden_size=128,
                                                     data_ways=2)
    assert predicted["gpipe"] > 4 * predicted["1f1b"]
    diff = temp["gpipe"] - temp["1f1b"]
    assert diff == pytest.approx(predicted["gpipe"] - predicted["1f1b"], rel=0.05)


def test_errors_say_what_to_change():
    model = tiny("llama", num_hidden_layers=4)
    ids = _ids()
    with pytest.raises(ValueError, match="needs the model on a mesh with a 'pp' axis"):
        pipeline_value_and_grad(model, {"input_ids": ids}, PipelineConfig(2, 4))
    mesh = make_mesh(pp=2, fsdp=-1)
    sharded = model.shard_model(mesh, pipeline_partition_axis())
    with pytest.raises(ValueError, match=r"num_stages=4.*pp axis has 2 devices"):
        pipeline_value_and_grad(sharded, {"input_ids": ids}, PipelineConfig(4, 4))
    with pytest.raises(ValueError, match=r"4 layers do not split into 8 equal stages"):
        pipeline_value_and_grad(sharded, {"input_ids": ids}, PipelineConfig(2, 4, "interleaved", virtual_stages=4))
    with pytest.raises(ValueError, match=r"a batch of 16 rows does not split into 3 microbatches x 4 data-parallel"):
        pipeline_value_and_grad(sharded, {"input_ids": ids}, PipelineConfig(2, 3))
    with pytest.raises(ValueError, match="'ring' is sequence-parallel attention"):
        pipeline_value_and_grad(sharded.with_attention("ring"), {"input_ids": ids}, PipelineConfig(2, 4))
    from jax.sharding import AxisType

    explicit = model.shard_model(make_mesh(pp=2, fsdp=-1, axis_types=AxisType.Explicit), pipeline_partition_axis())
    with pytest.raises(ValueError, match="the pipeline runs on Auto mesh axes"):
        pipeline_value_and_grad(explicit, {"input_ids": ids}, PipelineConfig(2, 4))
    fsdp_tp = model.shard_model(make_mesh(pp=2, fsdp=2, tp=2), pipeline_partition_axis())
    with pytest.raises(ValueError, match=r"fsdp=2 and tp=2 together does not compile.*put the data-parallel devices "
                                         r"on dp instead"):
        pipeline_value_and_grad(fsdp_tp, {"input_ids": ids}, PipelineConfig(2, 4))
