"""One step of a model, abstract, on a mesh: the one builder of the steps the explorer lists the collectives of,
:func:`~workbench.core.compile.virtual.compile_step` compiles for a cluster and the widgets show.

A step is a function and its ``ShapeDtypeStruct`` arguments placed on a mesh (nothing allocated):

- ``"train"``: ``(params, opt_state, other, ids) -> (params, opt_state, loss)``: the loss, its gradients and the
  optimizer's update, the state donated (updated in place, as a training loop does). Loss, update and the
  optimizer state's placement are :func:`~workbench.core.models.training.train`'s own (``train_loss``,
  ``apply_update``, ``opt_state_shardings`` of :mod:`workbench.core.models.training`), so what is compiled and
  priced is what runs;
- ``"forward"``: ``(params, other, ids) -> logits``, the forward pass of a prefill without a cache;
- ``"decode"``: ``(params, other, cache, ids) -> (logits, cache)``: ``ids`` of ``(B, T)`` new tokens (a decode
  step: ``T = 1``) written into a contiguous KV cache of ``kv_length`` positions and attending over it, the cache
  donated (updated in place, as :func:`~workbench.core.models.generation.generate`'s decode loop does) and placed as
  the model's ``init_cache`` places it on the mesh (``CausalLM.abstract_cache``); parameters and ids resolved in
  decode mode. No pipeline: a cached step runs on ``pp = 1``.

On a mesh with ``pp > 1`` both run as the pipeline (:mod:`workbench.core.pipeline`). Parameters are placed as a
:class:`workbench.core.sharding.plan.Layout` resolves them; optimizer moments shaped like their parameter share its
sharding (ZeRO-1: split over ``dp`` too), other optimizer state (counts, Adafactor's factored statistics) is
replicated; the token ids are split as ``(BATCH, LENGTH)`` resolves in the layout's mode.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core import pipeline as pipelines
from workbench.core.axes import MODE_DECODE, MODE_TRAIN, PartitionAxis
from workbench.core.checks import one_of
from workbench.core.hardware.cluster import Cluster
from workbench.core.models.causal_lm import LOGITS_AXES
from workbench.core.models.loss import labels_from
from workbench.core.models.sharding import path_str, with_mesh
from workbench.core.models.training import apply_update, make_optimizer, opt_state_shardings, train_loss
from workbench.core.sharding.plan import INPUT_AXES, Layout
from workbench.core.vocab import OPTIMIZERS

STEP_KINDS = ("forward", "train")  # the steps the explorer lists the collectives of
KINDS = (*STEP_KINDS, "decode")  # every step this module builds: those and a decode step with its KV cache


def optimizer(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The optax optimizer of a name: ``"adamw"`` is the one :func:`~workbench.core.models.training.train` runs
    (:func:`~workbench.core.models.training.make_optimizer` at a constant ``learning_rate``: gradients clipped to
    global norm 1, weight decay on matrices only; two moments in the parameters' dtype and an int32 count);
    ``"adafactor"`` (factored second moments of matrices whose two largest dims are >= 128, else a full one, and a
    count), ``"sgd"`` (SGD with momentum 0.9: one trace per parameter), both as optax makes them, unclipped, as
    ``train(optimizer=...)`` runs a given optimizer."""
    one_of("optimizer", name, OPTIMIZERS)
    makers = {"adamw": lambda lr: make_optimizer(lr=lr), "adafactor": optax.adafactor,
              "sgd": lambda lr: optax.sgd(lr, momentum=0.9)}
    return makers[name](learning_rate)


def full_mesh_shape(mesh_shape: tp.Mapping[str, int], cluster: Cluster) -> tuple[int, ...]:
    """``{"fsdp": 16, "tp": 4}`` -> the sizes of the workbench's mesh axes ``(pp, dp, fsdp, ep, tp, sp)``."""
    return tuple(cluster.axis_sizes(mesh_shape).values())


@dataclasses.dataclass(frozen=True)
class Step:
    """A step's function, its abstract arguments and how to jit it (``donate_argnums``, ``out_shardings``)."""

    kind: str
    fn: tp.Callable
    args: tuple[tp.Any, ...]
    donate_argnums: tuple[int, ...]
    out_shardings: tp.Any
    mesh: tp.Any
    batch: tuple[int, int]

    def jit(self) -> tp.Any:
        """``fn`` jitted as the step runs: its state donated, its outputs placed."""
        placed = {} if self.out_shardings is None else {"out_shardings": self.out_shardings}
        return jax.jit(self.fn, donate_argnums=self.donate_argnums, **placed)


def layout_step(model: nnx.Module, layout: Layout, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
                optimizer_name: str = "adamw", kv_length: int | None = None) -> Step:
    """The ``kind`` step of ``model`` (live or abstract: only shapes are read) placed as ``layout`` says.

    On a mesh with ``pp > 1`` the step runs as the layout's pipeline (default
    :func:`workbench.core.pipeline.default_config`): a forward through
    :func:`~workbench.core.pipeline.pipeline_logits`, a train step's loss and gradients through
    :func:`~workbench.core.pipeline.pipeline_loss_and_grads`. A train step's optimizer state is split over ``dp``
    too with the layout's ``zero_stage=1`` (:mod:`workbench.core.zero`). A ``"decode"`` step writes ``batch``'s
    tokens into a KV cache of ``kv_length`` positions (see the module doc)."""
    one_of("kind", kind, KINDS)
    mesh, pa = layout.mesh, layout.partition_axis
    if kind == "decode":
        _check_decode(model, mesh, batch, kv_length)
    graphdef, params, other = nnx.split(with_mesh(model, mesh, pa), nnx.Param, ...)
    if tuple(path_str(p) for p, _ in nnx.to_flat_state(params)) != layout.paths:
        raise ValueError("this layout was resolved for another model: the parameter paths differ")
    shardings = layout.shardings()
    params = nnx.map_state(lambda path, var: var.replace(jax.ShapeDtypeStruct(
        var.shape, var.dtype, sharding=shardings[path_str(path)])), params)
    replicated = NamedSharding(mesh, PartitionSpec())
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), other)
    b, t = batch
    spec = pa.resolve(INPUT_AXES, layout.mode, shape=(b, t), mesh=mesh)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, spec))
    pp = dict(mesh.shape).get("pp", 1)
    pipeline = (layout.pipeline or pipelines.default_config(mesh, b)) if pp > 1 else None

    def logits(params, other, ids):
        if pipeline is not None:
            return pipelines.pipeline_logits(graphdef, params, other, ids, None, pipeline, mesh)
        return nnx.merge(graphdef, params, other)(ids).logits

    if kind == "forward":
        return Step(kind, logits, (params, other, ids), (), None, mesh, batch)
    if kind == "decode":
        cache = model.abstract_cache(b, kv_length, mesh=mesh, partition_axis=pa)

        def decode(params, other, cache, ids):
            out = nnx.merge(graphdef, params, other)(ids, cache=cache)
            return out.logits, out.cache

        vocab = layout.config.vocab_size
        logits_sharding = NamedSharding(mesh, pa.resolve(LOGITS_AXES, shape=(b, t, vocab), mesh=mesh))
        out = (logits_sharding, jax.tree.map(lambda x: x.sharding, cache))
        return Step(kind, decode, (params, other, cache, ids), (2,), out, mesh, batch)

    tx = optimizer(optimizer_name)
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                             opt_state, opt_state_shardings(tx, opt_state, params, mesh, layout.zero_stage))

    def loss_and_grads(params, other, ids):
        batch = {"input_ids": ids, "labels": labels_from(ids)}
        if pipeline is not None:
            loss, _, grads = pipelines.pipeline_loss_and_grads(graphdef, params, other, batch, pipeline, mesh)
            return loss, grads
        # the loss train() differentiates (its router coefficients: none)
        loss_of = lambda p: train_loss(graphdef, p, other, batch)[0]
        return jax.value_and_grad(loss_of)(params)

    def train(params, opt_state, other, ids):
        loss, grads = loss_and_grads(params, other, ids)
        return *apply_update(tx, grads, params, opt_state), loss

    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    out = (sharding_of(params), sharding_of(opt_state), replicated)
    return Step(kind, train, (params, opt_state, other, ids), (0, 1), out, mesh, batch)


def abstract_step(model: nnx.Module, mesh: tp.Any, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
                  optimizer_name: str = "adamw", partition_axis: PartitionAxis | None = None,
                  rules: tp.Sequence[tuple[str, tp.Any]] | None = None, pipeline: tp.Any = None,
                  zero_stage: int = 0, kv_length: int | None = None) -> Step:
    """:func:`layout_step` on the layout of ``model`` on ``mesh`` by ``partition_axis`` and ``rules`` (in decode
    mode for a ``"decode"`` step, whose KV cache holds ``kv_length`` positions).

    On a mesh with ``pp > 1`` the stacked layers are split over ``pp`` unless ``partition_axis`` says otherwise,
    and the step runs as ``pipeline`` (a ``PipelineConfig``; default :func:`workbench.core.pipeline.default_config`).
    ``zero_stage=1`` splits the optimizer state over ``dp`` as well (:mod:`workbench.core.zero`)."""
    pa = partition_axis or PartitionAxis()
    if dict(mesh.shape).get("pp", 1) > 1 and pa.layer_axis is None:
        pa = pipelines.pipeline_partition_axis(pa)
    mode = MODE_DECODE if kind == "decode" else MODE_TRAIN
    layout = Layout.of(model, mesh, pa, rules, mode, pipeline=pipeline, zero_stage=zero_stage)
    return layout_step(model, layout, kind=kind, batch=batch, optimizer_name=optimizer_name, kv_length=kv_length)


def _check_decode(model: nnx.Module, mesh: tp.Any, batch: tuple[int, int], kv_length: int | None) -> None:
    """A decode step's arguments: a model with a KV cache, a cache that holds the new tokens, no pipeline."""
    if not hasattr(model, "abstract_cache"):
        raise TypeError(f"a decode step writes a KV cache: {type(model).__name__} has no abstract_cache (a CausalLM "
                        f"has); compile kind='forward' instead")
    if kv_length is None or int(kv_length) < batch[1]:
        raise ValueError(f"a decode step needs kv_length= (the KV cache's positions, at least the {batch[1]} new "
                         f"tokens); got {kv_length!r}")
    if dict(mesh.shape).get("pp", 1) > 1:
        raise ValueError("a decode step with a KV cache compiles on pp=1: the pipeline runs train steps and "
                         "cache-less forwards; choose a mesh without pp")

