"""One step of a model, abstract, on a cluster's mesh: what :func:`compile_step` compiles and the ledger predicts.

A step is a function and its ``ShapeDtypeStruct`` arguments placed on a mesh (nothing allocated):

- ``"train"``: ``(params, opt_state, other, ids) -> (params, opt_state, loss)``: the causal LM loss, its
  gradient and the optimizer's update, the state donated (updated in place, as a training loop does);
- ``"forward"``: ``(params, other, ids) -> logits``, the forward pass of a prefill without a cache.

Parameters are placed as :class:`workbench.core.sharding.plan.Layout` resolves them; optimizer moments shaped like
their parameter share its sharding, other optimizer state (counts, Adafactor's factored statistics) is
replicated; the token ids are split as ``(BATCH, LENGTH)`` resolves.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core import pipeline as pipelines
from workbench.core.axes import BATCH, LENGTH, PartitionAxis
from workbench.core.cluster import Cluster
from workbench.core.mesh import MESH_AXES
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.sharding import path_str, with_mesh
from workbench.core.sharding.plan import Layout
from workbench.core.sharding.zero import check_zero_stage, state_sharding

STEP_KINDS = ("train", "forward")
OPTIMIZERS = ("adamw", "adafactor", "sgd")


def optimizer(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The optax optimizer of a name: ``"adamw"`` (two moments in the parameters' dtype and an int32 count),
    ``"adafactor"`` (factored second moments of matrices whose two largest dims are >= 128, else a full one,
    and a count), ``"sgd"`` (SGD with momentum 0.9: one trace per parameter)."""
    if name == "adamw":
        return optax.adamw(learning_rate)
    if name == "adafactor":
        return optax.adafactor(learning_rate)
    if name == "sgd":
        return optax.sgd(learning_rate, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")


def full_mesh_shape(mesh_shape: tp.Mapping[str, int], cluster: Cluster) -> tuple[int, ...]:
    """``{"fsdp": 16, "tp": 4}`` -> the sizes of the workbench's mesh axes ``(pp, dp, fsdp, ep, tp, sp)``."""
    unknown = sorted(set(mesh_shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not the workbench's {MESH_AXES}")
    shape = tuple(int(mesh_shape.get(name, 1)) for name in MESH_AXES)
    if math.prod(shape) != cluster.num_devices:
        raise ValueError(f"mesh {dict(mesh_shape)} has {math.prod(shape)} devices; {cluster.name} has "
                         f"{cluster.num_devices}")
    return shape


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


def abstract_step(model: nnx.Module, mesh: tp.Any, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
                  optimizer_name: str = "adamw", partition_axis: PartitionAxis | None = None,
                  rules: tp.Sequence[tuple[str, tp.Any]] | None = None, pipeline: tp.Any = None,
                  zero_stage: int = 0) -> Step:
    """The ``kind`` step of ``model`` (live or abstract: only shapes are read) with its arguments on ``mesh``.

    On a mesh with ``pp > 1`` a train step runs as a pipeline (:func:`workbench.core.pipeline.pipeline_loss_and_grads`)
    with ``pipeline`` (a ``PipelineConfig``; default :func:`workbench.core.pipeline.default_config`), the stacked
    layers split over ``pp`` unless ``partition_axis`` says otherwise. ``zero_stage=1`` splits the optimizer state
    over ``dp`` as well (:mod:`workbench.core.sharding.zero`)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind must be one of {STEP_KINDS}; got {kind!r}")
    pa = partition_axis or PartitionAxis()
    pp = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get("pp", 1)
    if pp > 1 and kind == "train":
        pipeline = pipeline or pipelines.default_config(mesh, batch[0])
        if pa.layer_axis is None:
            pa = pipelines.pipeline_partition_axis(pa)
    elif pipeline is not None:
        raise ValueError(f"a pipeline runs a train step on a mesh with pp > 1; this is a {kind} step on pp={pp}")
    layout = Layout.of(model, mesh, pa, rules)
    shardings = layout.shardings()
    graphdef, params, other = nnx.split(with_mesh(model, mesh, pa), nnx.Param, ...)
    params = nnx.map_state(lambda path, var: var.replace(jax.ShapeDtypeStruct(
        var.shape, var.dtype, sharding=shardings[path_str(path)])), params)
    replicated = NamedSharding(mesh, PartitionSpec())
    other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), other)
    b, t = batch
    spec = pa.resolve((BATCH, LENGTH), layout.mode, shape=(b, t), mesh=mesh)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=NamedSharding(mesh, spec))

    def logits(params, other, ids):
        return nnx.merge(graphdef, params, other)(ids).logits

    if kind == "forward":
        return Step(kind, logits, (params, other, ids), (), None, mesh, batch)

    tx = optimizer(optimizer_name)
    opt_state = _place_like_params(tx, jax.eval_shape(tx.init, params), params, replicated,
                                   check_zero_stage(zero_stage))

    def train(params, opt_state, other, ids):
        if pipeline is not None:
            loss, _, grads = pipelines.pipeline_loss_and_grads(graphdef, params, other, {"input_ids": ids}, pipeline,
                                                               mesh)
        else:
            loss_of = lambda p: causal_lm_loss(logits(p, other, ids), labels_from(ids))[0]
            loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    out = (sharding_of(params), sharding_of(opt_state), replicated)
    return Step(kind, train, (params, opt_state, other, ids), (0, 1), out, mesh, batch)


def _place_like_params(tx: optax.GradientTransformation, opt_state: tp.Any, params: nnx.State,
                       replicated: NamedSharding, zero_stage: int = 0) -> tp.Any:
    """Optimizer state leaves shaped like their parameter take its sharding (split over ``dp`` too at
    ``zero_stage=1``: :func:`workbench.core.sharding.zero.state_sharding`); the rest is replicated."""

    def place(state_leaf: tp.Any, param: tp.Any = None) -> jax.ShapeDtypeStruct:
        same = param is not None and tuple(state_leaf.shape) == tuple(param.shape)
        sharding = state_sharding(param.sharding, param.shape, zero_stage) if same else replicated
        return jax.ShapeDtypeStruct(state_leaf.shape, state_leaf.dtype, sharding=sharding)

    return optax.tree_map_params(tx, place, opt_state, params, transform_non_params=place)
