"""The one abstract step (workbench.core.compile.steps), run on real arrays placed as its arguments say, against
an unsharded reference built here: a train step is the next-token cross-entropy (optax's), its gradients
(jax.value_and_grad) and the optimizer's update (for "adamw" the optimizer train() runs: make_optimizer, which clips
the gradients to global norm 1); a forward is the model's logits, on a pp mesh through the
pipeline; a decode step is the model's cached call (one new token per sequence against a prefilled KV cache), its
logits and the cache it returns. The explorer, the compile path and the pipeline widget build their steps with it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from workbench.core.axes import EMPTY, TP
from workbench.core.compile import steps
from workbench.core.mesh import make_mesh
from workbench.core.models.presets import tiny
from workbench.core.models.training import make_optimizer
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.sharding.plan import Layout
from workbench.core.views import explore

BATCH = (8, 16)


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", num_hidden_layers=2)


def _ids(model, batch=BATCH):
    return jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, batch), jnp.int32)


def _placed(step, *values):
    """``values`` (a tree shaped like ``step.args``) copied onto the devices each abstract argument names (a copy:
    the step donates its state, and on CPU a placed array may share the original's buffer)."""
    abstract, treedef = jax.tree.flatten(step.args)
    leaves = jax.tree.leaves(values)
    assert len(leaves) == len(abstract)
    placed = [jax.device_put(np.array(x), a.sharding) for x, a in zip(leaves, abstract, strict=True)]
    return jax.tree.unflatten(treedef, placed)


# LLVM at -O0 for every program these tests compile and run (the steps and the references): the same XLA program
# after the same HLO passes, compiled in about half the time; the programs run in milliseconds. Only the machine
# code differs from the default level's, and with it the last bits of a float32 sum (measured: the reference
# gradients by at most 6.5e-7, 7 % of _close's tolerance).
O0 = {"xla_backend_optimization_level": 0}


def _compiled(step):
    """``step.jit()`` (its donation and output placement) compiled at -O0 for its abstract arguments; call it with
    what ``_placed`` returns."""
    return step.jit().lower(*step.args).compile(O0)


def _run(fn, *args):
    """``jax.jit(fn)(*args)``, compiled at -O0."""
    return jax.jit(fn).lower(*args).compile(O0)(*args)


def _reference_loss_and_grads(model, ids):
    graphdef, params, other = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = nnx.merge(graphdef, p, other)(ids).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    with jax.default_matmul_precision("highest"):  # jitted whole on one device: op by op took four times as long
        return (*_run(jax.value_and_grad(loss), params), params, other)


@pytest.fixture(scope="module")
def train_reference(llama):
    """The unsharded loss and gradients both optimizers' train steps are checked against, computed once."""
    ids = _ids(llama)
    return ids, *_reference_loss_and_grads(llama, ids)


@pytest.fixture(scope="module")
def reference_logits(llama):
    """The unsharded model's logits that the forward step and the pipeline's forward are checked against."""
    with jax.default_matmul_precision("highest"):
        return llama(_ids(llama)).logits


def _close(a, b, rtol=2e-5, scale=1e-5):
    """Leaf by leaf within ``rtol``, and ``scale`` of the leaf's largest entry: float32 sums over the batch,
    reduced over devices in another order, leave that much in the small entries."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=scale * float(np.max(np.abs(y), initial=0)))


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_a_train_step_is_the_loss_its_gradients_and_the_optimizer_update(llama, train_reference, optimizer_name):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    step = steps.abstract_step(llama, mesh, kind="train", batch=BATCH, optimizer_name=optimizer_name)
    assert step.kind == "train" and step.donate_argnums == (0, 1)
    ids, loss_ref, grads, params, other = train_reference
    tx = make_optimizer(lr=1e-3) if optimizer_name == "adamw" else steps.optimizer(optimizer_name)
    opt_state = tx.init(params)
    updates, opt_ref = _run(tx.update, grads, opt_state, params)  # optax's update, jitted whole
    params_ref = optax.apply_updates(params, updates)
    with jax.default_matmul_precision("highest"):
        new_params, new_opt, loss = _compiled(step)(*_placed(step, params, opt_state, other, ids))
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    if optimizer_name == "adamw":
        # the first moments are (1 - b1) g and the second (1 - b2) g^2: smooth in g, unlike the first update,
        # whose m / sqrt(v) is the sign of a gradient that may be rounding noise; g is clipped to global norm 1
        # (train()'s optimizer), which these gradients exceed, so the moments show the clipping
        assert float(optax.tree.norm(grads)) > 1.0
        _close(new_opt, opt_ref)
        assert int(optax.tree.get(new_opt, "count")) == 1
    else:
        _close(new_params, params_ref)
        _close(new_opt, opt_ref)
    for leaf, abstract in zip(jax.tree.leaves(new_params), jax.tree.leaves(step.args[0]), strict=True):
        assert leaf.sharding.is_equivalent_to(abstract.sharding, leaf.ndim)  # updated where they live


def test_a_forward_step_is_the_logits(llama, reference_logits):
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    step = steps.layout_step(llama, Layout.of(llama, mesh, rules=[("embed_tokens", (TP, EMPTY))]), kind="forward",
                             batch=BATCH)
    assert step.kind == "forward" and step.donate_argnums == ()
    _, params, other = nnx.split(llama, nnx.Param, ...)
    ids = _ids(llama)
    with jax.default_matmul_precision("highest"):
        logits = _compiled(step)(*_placed(step, params, other, ids))
    _close(logits, reference_logits)


def test_a_decode_step_is_the_cached_call_with_the_cache_donated(llama):
    """Against the unsharded model decoding one token after a 5-token prefill into a 12-position cache: the
    step's logits and returned cache (keys, values, positions, the slots written) equal it; the cache is the
    donated argument, laid out as ``init_cache`` lays it on the mesh, and the step's parameters resolve in decode
    mode."""
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    b, max_length = BATCH[0], 12
    step = steps.abstract_step(llama, mesh, kind="decode", batch=(b, 1), kv_length=max_length)
    assert step.kind == "decode" and step.donate_argnums == (2,)
    placed = llama.init_cache(b, max_length, mesh=mesh)
    assert jax.tree.map(lambda x: x.sharding, step.args[2]) == jax.tree.map(lambda x: x.sharding, placed)
    assert step.args[2].keys.shape == (llama.config.num_hidden_layers, b, max_length, 2, llama.config.head_dim)
    ids = _ids(llama, (b, 6))
    graphdef, params, other = nnx.split(llama, nnx.Param, ...)

    def prefill_then_decode(params, other, ids):  # the unsharded model's two cached calls, jitted whole
        model = nnx.merge(graphdef, params, other)
        cache = model(ids[:, :5], cache=model.init_cache(b, max_length)).cache
        reference = model(ids[:, 5:], cache=cache)
        return cache, reference.logits, reference.cache

    with jax.default_matmul_precision("highest"):
        cache, reference_logits, reference_cache = _run(prefill_then_decode, params, other, ids)
        logits, new_cache = _compiled(step)(*_placed(step, params, other, cache, ids[:, 5:]))
    _close(logits, reference_logits)
    _close(new_cache.keys, reference_cache.keys)
    _close(new_cache.values, reference_cache.values)
    np.testing.assert_array_equal(new_cache.valid_BS, reference_cache.valid_BS)
    assert int(new_cache.index) == 6 and (np.asarray(new_cache.positions_B) == 6).all()


def test_a_decode_step_says_what_it_needs(llama):
    with pytest.raises(ValueError, match="needs kv_length="):
        steps.abstract_step(llama, make_mesh(dp=2, fsdp=2, tp=2), kind="decode", batch=(8, 1))
    with pytest.raises(ValueError, match="compiles on pp=1"):
        steps.abstract_step(llama, make_mesh(pp=2, dp=4, fsdp=1), kind="decode", batch=(8, 1), kv_length=16)


def test_on_a_pp_mesh_the_steps_run_as_the_pipeline(llama, reference_logits):
    mesh = make_mesh(pp=2, dp=4, fsdp=1)
    step = steps.abstract_step(llama, mesh, kind="forward", batch=BATCH)
    # the stacked layers split over pp by default: each stage holds its own layers
    layers = [a.sharding.spec for p, a in nnx.to_flat_state(step.args[0]) if p[0] == "layers"]
    assert layers and all(spec[0] == "pp" for spec in layers)
    _, params, other = nnx.split(llama, nnx.Param, ...)
    ids = _ids(llama)
    with jax.default_matmul_precision("highest"):  # compiled once: the program read is the program run
        compiled = _compiled(step)
        assert "collective-permute" in compiled.as_text()  # the stages pass activations on
        logits = compiled(*_placed(step, params, other, ids))
    _close(logits, reference_logits)


def test_one_builder_and_one_list_of_kinds(llama):
    assert explore.STEP_KINDS is steps.STEP_KINDS == ("forward", "train")  # the explorer's: no cache to size
    assert steps.KINDS == ("forward", "train", "decode")
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    with pytest.raises(ValueError, match="kind must be one of"):
        steps.abstract_step(llama, mesh, kind="prefill")
    with pytest.raises(ValueError, match="resolved for another model"):
        steps.layout_step(tiny("gpt2"), Layout.of(llama, mesh))
    with pytest.raises(ValueError, match="pp axis has size 1"):
        steps.abstract_step(llama, mesh, pipeline=PipelineConfig(2, 2, "1f1b"))
