"""Pipeline parallelism: a model's stacked layers cut into stages over the ``pp`` mesh axis, run by a schedule.

The step is one ``jax.shard_map`` that is manual over ``pp`` and ``dp`` (each data-parallel replica runs its
own rows and its gradients are summed over dp once, after the loop); fsdp / tp / ep stay automatic inside, so
pipelining combines with the other parallelisms (not fsdp with tp / ep / sp at once: XLA 0.10 aborts there,
so that raises). Each device holds its stages' slice of the stacked layers
(``PartitionAxis(layer_axis="pp")``) and plays its column of :func:`pipeline_schedule`'s table in a
``lax.scan`` over ticks: a forward of one microbatch through one stage, or a backward (the stage recomputed
from its saved input and differentiated with ``jax.vjp``), or nothing. After every tick two ``ppermute`` s move
activations one device forward and gradients one device back (``p - 1 -> 0`` closes the ring for the
interleaved schedule's wrap from stage ``p - 1`` to stage ``p``). So the executed order IS the table's, and a
device keeps only the stage inputs the table says are alive: all ``m`` microbatches with GPipe, at most ``p``
with 1F1B.

What runs outside the pipeline: the embedding (and a MoE family's leading dense layers) before it, on every
device, differentiated with ``jax.vjp`` from the gradient the first stage sends back; the final norm, LM head
and loss run inside the last stage, which starts each microbatch's backward.

The loss is the unpipelined one: the sum over microbatches of each one's summed token losses divided by the
batch's total token count, so loss and gradients equal the plain step's (``tests/core/test_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import PartitionAxis
from workbench.core.mesh import mesh_of
from workbench.core.models.block import ACTIVATION_AXES
from workbench.core.models.causal_lm import CausalLM, SequenceClassifier
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.sharding import with_mesh
from workbench.core.models.stack import layer_kinds, run_layers, run_stack
from workbench.core.models.training import TrainState, advance, checked_state, place_batch, prepare_batch
from workbench.core.operations import OperationRegistry
from workbench.core.pipeline_schedule import (
    EXECUTOR_ACTIONS,
    FORWARD,
    IDLE,
    SCHEDULES,
    PipelineConfig,
    PipelineSchedule,
    activation_stash_bytes,
    executor_tables,
    pipeline_schedule,
)
from workbench.core.programs import PROGRAMS, signature

__all__ = [
    "SCHEDULES",
    "PipelineConfig",
    "PipelineSchedule",
    "activation_stash_bytes",
    "default_config",
    "executor_tables",
    "make_pipeline_train_step",
    "pipeline_forward",
    "pipeline_logits",
    "pipeline_loss_and_grads",
    "pipeline_partition_axis",
    "pipeline_schedule",
    "pipeline_value_and_grad",
    "stage_padded",
]

Array = jax.Array
PP = "pp"
DP_AXIS = "dp"
# executor actions: a forward through a stage that is not the last, one through the last (head and loss too), a backward
_IDLE, _FWD, _FWD_LAST, _BWD = EXECUTOR_ACTIONS


def pipeline_partition_axis(partition_axis: PartitionAxis | None = None) -> PartitionAxis:
    """``partition_axis`` (default ``PartitionAxis()``) with the stacked layers split over ``pp``: each
    pipeline device stores only its stages' layers (and their gradients and optimizer state)."""
    return (partition_axis or PartitionAxis()).replace(layer_axis=PP)


# -- the schedule as executor tables ------------------------------------------------------------------------
def _split_microbatches(x: Array, m: int) -> Array:
    """``(B, ...) -> (m, B/m, ...)`` with microbatch ``i`` = rows ``i, i + m, ...``: each microbatch takes
    rows from every data-parallel shard, so splitting moves no data."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _stage_layers(layers: tp.Any, config: PipelineConfig) -> tp.Any:
    """Stacked ``(L, ...)`` -> ``(v, p, L / V, ...)``: ``[j, d]`` is stage ``j p + d``, device ``d``'s j-th."""
    v, p = config.virtual_stages, config.num_stages
    return jax.tree.map(lambda a: a.reshape(v, p, a.shape[0] // (v * p), *a.shape[1:]), layers)


def _unstage_layers(staged: tp.Any) -> tp.Any:
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:]), staged)


class _Parts(tp.NamedTuple):
    graphdef: nnx.GraphDef
    rest: nnx.State  # every parameter but the pipelined stack's
    layers: nnx.State  # the pipelined stack's parameters (L, ...)
    other: nnx.State


def _parts(graphdef: nnx.GraphDef, params: nnx.State, other: nnx.State) -> _Parts:
    params = nnx.State(dict(params))
    layers = params.pop("layers")
    return _Parts(graphdef, params, layers, other)


def _model(parts: _Parts, rest: nnx.State, layers: nnx.State) -> nnx.Module:
    return nnx.merge(parts.graphdef, nnx.State({**dict(rest), "layers": layers}), parts.other)


def _check_model(model: nnx.Module, config: PipelineConfig) -> int:
    if not hasattr(model, "layers") or not hasattr(model, "rope_tables"):
        raise TypeError(f"pipeline parallelism runs a workbench CausalLM (stacked layers); got {type(model).__name__}")
    if isinstance(model, SequenceClassifier):
        raise TypeError("pipeline parallelism trains causal LMs; a SequenceClassifier's head reads one token")
    if OperationRegistry.capabilities(model.attn_mechanism).mesh_axes:
        raise ValueError(f"{model.attn_mechanism!r} is sequence-parallel attention, which runs its own shard_map "
                         f"over sp; inside a pipeline use a local attention (vanilla, flash)")
    n = model.config.num_hidden_layers - model.config.first_dense_layers
    return config.check_layers(n)


class _StageRunner(tp.NamedTuple):
    """How a stage runs its slice of the stack, the same on every device and tick: the layers' graph, their
    kinds, and each stage's kind and global index per layer ``(V, L / V)``."""

    layers_gd: nnx.GraphDef
    kinds: tp.Any
    kind_VL: Array
    layer_VL: Array
    scan: bool
    remat: tp.Any


def _stage_runner(model: nnx.Module, config: PipelineConfig) -> _StageRunner:
    """The pipelined stack of ``model`` (its layers past the leading dense ones) as ``config``'s stages run it."""
    c = model.config
    first = c.first_dense_layers
    per_stage = config.check_layers(c.num_hidden_layers - first)
    kinds_all = [c.layer_kind(i) for i in range(first, c.num_hidden_layers)]

    kinds, kind_L = layer_kinds(kinds_all)
    kind_VL = jnp.asarray(kind_L.reshape(config.total_stages, per_stage))
    layer_VL = jnp.asarray(first + np.arange(c.num_hidden_layers - first, dtype=np.int32)
                           .reshape(config.total_stages, per_stage))
    return _StageRunner(nnx.graphdef(model.layers), kinds, kind_VL, layer_VL, model.scan_layers, model.remat)


def _manual_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The shard_map's manual axes: pp, and dp when it has more than one device.

    dp is manual too: each data-parallel replica runs its own rows and accumulates its own gradients, summed
    over dp once after the loop, as data parallelism does (left automatic, XLA all-reduces each tick's gradient
    over dp)."""
    return (PP, DP_AXIS) if mesh.shape.get(DP_AXIS, 1) > 1 else (PP,)


def _place_inputs(mesh: jax.sharding.Mesh, act_spec: P, x_mBTD: Array, mask_mBT: Array | None,
                  labels_mBT: Array | None, n_f: int, n_b: int, *, train: bool):
    """The microbatches split like the activations, and the buffers of stage inputs, outputs and gradients.
    The buffers are made here, outside the shard_map, split like the microbatches (made inside, XLA would
    replicate them over the automatic axes); each has a spare last row that takes the writes that should not
    happen."""
    mb_shape = x_mBTD.shape[1:]
    split = NamedSharding(mesh, P(None, *act_spec))
    x_mBTD = jax.lax.with_sharding_constraint(x_mBTD, split)
    rows = NamedSharding(mesh, P(*split.spec[:3]))
    mask_mBT, labels_mBT = (None if a is None else jax.lax.with_sharding_constraint(a, rows)
                            for a in (mask_mBT, labels_mBT))
    buffer = lambda n: jax.lax.with_sharding_constraint(jnp.zeros((n, *mb_shape), x_mBTD.dtype), split)
    buffers = dict(fbuf=buffer(n_f + 1), out=buffer(x_mBTD.shape[0] + 1))
    if train:
        buffers["bbuf"] = buffer(n_b + 1)
    return x_mBTD, mask_mBT, labels_mBT, buffers


def _run_pipeline(parts: _Parts, schedule: PipelineSchedule, mesh: jax.sharding.Mesh, x_mBTD: Array,
                  mask_mBT: Array | None, labels_mBT: Array | None, num_tokens: Array, *, train: bool):
    """The shard_map: ``(loss, grads of rest, grads of the staged layers, grads of x)`` when ``train``,
    else the last stage's hidden states ``(m, mb, T, D)``."""
    config = schedule.config
    tables, n_f, n_b = executor_tables(schedule)
    model0 = _model(parts, parts.rest, parts.layers)
    runner = _stage_runner(model0, config)
    staged = _stage_layers(parts.layers, config)

    act_spec = (model0.partition_axis or PartitionAxis()).resolve(ACTIVATION_AXES, shape=x_mBTD.shape[1:], mesh=mesh)
    act_spec = _drop_unit_axes(act_spec, mesh)
    manual = _manual_axes(mesh)
    rows_spec = P(None, DP_AXIS) if DP_AXIS in manual else P()
    x_mBTD, mask_mBT, labels_mBT, buffers = _place_inputs(mesh, act_spec, x_mBTD, mask_mBT, labels_mBT, n_f, n_b,
                                                          train=train)

    def body(rest, staged_local, x_mBTD, mask_mBT, labels_mBT, num_tokens, buffers):
        loop = _DeviceLoop.start(parts, runner, manual, config.num_stages, train, rest, staged_local,
                                 _Microbatches(x_mBTD, mask_mBT, labels_mBT, num_tokens))
        return loop.run(buffers, tables)

    layer_spec = jax.tree.map(lambda _: P(None, PP), staged)
    rest_spec = jax.tree.map(lambda _: P(), parts.rest)
    in_specs = (rest_spec, layer_spec, rows_spec, rows_spec, rows_spec, P(), jax.tree.map(lambda _: rows_spec, buffers))
    out_specs = (P(), rest_spec, layer_spec, rows_spec) if train else rows_spec
    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(manual))
    return run(parts.rest, staged, x_mBTD, mask_mBT, labels_mBT, num_tokens, buffers)


class _Microbatches(tp.NamedTuple):
    """One device's rows of every microbatch: ``x (m, mb, T, D)``, its mask and labels, and the batch's token
    count (the loss's divisor)."""

    x_mBTD: Array
    mask_mBT: Array | None
    labels_mBT: Array | None
    num_tokens: Array


@dataclasses.dataclass(frozen=True)
class _DeviceLoop:
    """One pipeline device inside the shard_map: its stages' layers and its microbatches, and the ``lax.scan``
    over ticks that plays its column of the executor tables."""

    parts: _Parts
    runner: _StageRunner
    manual: tuple[str, ...]
    num_stages: int
    train: bool
    device: Array  # this device's index along pp
    rest: nnx.State  # typed as varying over the manual axes
    model: nnx.Module
    layers_v: tp.Any  # this device's v stages' layers (v, L/V, ...)
    data: _Microbatches

    @classmethod
    def start(cls, parts: _Parts, runner: _StageRunner, manual: tuple[str, ...], num_stages: int, train: bool,
              rest: nnx.State, staged_local: tp.Any, data: _Microbatches) -> _DeviceLoop:
        device = jax.lax.axis_index(PP)
        # every device differentiates its own copy of the replicated parameters (no implicit psum inside a
        # branch only some devices take); the psums after the loop add them up
        rest = _vary_tree(rest, manual)
        model = _model(parts, rest, jax.tree.map(lambda a: a[0, 0], staged_local))
        layers_v = _vary_tree(jax.tree.map(lambda a: a[:, 0], staged_local), manual)  # (v, L/V, ...)
        return cls(parts, runner, manual, num_stages, train, device, rest, model, layers_v, data)

    def vary(self, tree: tp.Any) -> tp.Any:
        return _vary_tree(tree, self.manual)

    def zeros_like(self, tree: tp.Any) -> tp.Any:
        return self.vary(jax.tree.map(jnp.zeros_like, tree))

    def stage(self, layers_j: tp.Any, x_BTD: Array, i: Array, k: Array) -> Array:
        """Stage ``k``'s layers ``layers_j`` over microbatch ``i``'s activations ``x_BTD``."""
        mask_BT = None if self.data.mask_mBT is None else self.data.mask_mBT[i]
        positions_BT, mask_B1TS = self.model.positions(jnp.zeros(self.data.x_mBTD.shape[1:3], jnp.int32), mask_BT)
        r = self.runner
        out, _, _ = run_stack(r.layers_gd, layers_j, x_BTD, self.model.rope_tables(positions_BT), mask_B1TS,
                              kinds=r.kinds, kind_L=r.kind_VL[k], layer_L=r.layer_VL[k], scan=r.scan, remat=r.remat,
                              constrain=None)
        return out

    def head_loss(self, rest: nnx.State, y_BTD: Array, i: Array) -> Array:
        """The final norm, LM head and microbatch ``i``'s summed token losses over the batch's token count."""
        m_ = _model(self.parts, rest, jax.tree.map(lambda a: a[0], self.layers_v))
        logits = m_.head(m_.norm(y_BTD)).astype(m_.logits_dtype)
        return causal_lm_loss(logits, self.data.labels_mBT[i], num_items_in_batch=self.data.num_tokens)[0]

    def run(self, buffers: dict[str, Array], tables: np.ndarray):
        """The loop over ticks, then the results summed over the manual axes (one device holds each)."""
        carry = self.vary(buffers)
        if self.train:
            carry.update(loss=self.vary(jnp.zeros((), jnp.float32)),
                        g_rest=self.zeros_like(self.rest), g_layers=self.zeros_like(self.layers_v))
        carry, _ = jax.lax.scan(self.tick, carry, jnp.asarray(tables))
        # one device holds each of these; the sum over pp hands them to all
        out = jax.lax.psum(carry["out"][:-1], PP)
        if not self.train:
            return out
        data_axes = tuple(a for a in self.manual if a != PP)
        g_layers = jax.tree.map(lambda a: (jax.lax.psum(a, data_axes) if data_axes else a)[:, None],
                                carry["g_layers"])
        return jax.lax.psum(carry["loss"], self.manual), jax.lax.psum(carry["g_rest"], self.manual), g_layers, out

    def tick(self, carry: dict[str, tp.Any], table: Array) -> tuple[dict[str, tp.Any], None]:
        """One tick: this device's action (idle, a forward, the last stage's forward and loss, or a backward),
        then the exchange with its neighbours."""
        row = tuple(table[r, self.device] for r in range(8))
        action, i, j, k, fs, bs, _, _ = row
        layers_j = jax.tree.map(lambda a: a[j], self.layers_v)
        x_in = jnp.where(k == 0, self.data.x_mBTD[i], carry["fbuf"][fs])
        g_in = carry["bbuf"][bs] if self.train else None
        sent = jax.lax.switch(action, self.branches(layers_j, x_in, g_in, i, k))
        return self.exchange(carry, row, sent), None

    def branches(self, layers_j: tp.Any, x_in: Array, g_in: Array | None, i: Array, k: Array) -> list:
        """The switch's branches, one per executor action. Each returns (activation sent forward, gradient sent
        back, the last stage's output, its loss, d loss / d rest, d loss / d this stage's layers); the buffers
        are written after the switch, so each lives once in the loop's carry instead of once per branch."""
        none = self.vary(jnp.zeros(self.data.x_mBTD.shape[1:], self.data.x_mBTD.dtype))
        no_loss = self.vary(jnp.zeros((), jnp.float32))
        no_rest = self.zeros_like(self.rest) if self.train else None
        no_layer = self.zeros_like(layers_j) if self.train else None

        def idle():
            return none, none, none, no_loss, no_rest, no_layer

        def forward():
            return self.stage(layers_j, x_in, i, k), none, none, no_loss, no_rest, no_layer

        def forward_last():
            y = self.stage(layers_j, x_in, i, k)
            if not self.train:
                return none, none, y, no_loss, no_rest, no_layer
            loss, (g_rest, dy) = jax.value_and_grad(self.head_loss, argnums=(0, 1))(self.rest, y, i)
            return none, none, dy, loss, g_rest, no_layer

        def backward():
            _, vjp = jax.vjp(lambda lj, x: self.stage(lj, x, i, k), layers_j, x_in)
            g_layers_j, dx = vjp(g_in)
            return none, dx, none, no_loss, no_rest, g_layers_j

        return [idle, forward, forward_last, backward] if self.train else [idle, forward, forward_last]

    def exchange(self, carry: dict[str, tp.Any], row: tuple[Array, ...], sent: tuple) -> dict[str, tp.Any]:
        """Activations move one device forward and gradients one device back (``ppermute`` over pp, a ring), and
        the tick's results land in the carry's buffers and sums."""
        action, i, j, k, _, bs, recv_f, recv_b = row
        send_f, send_b, y_last, loss, g_rest, g_layers_j = sent
        p = self.num_stages
        ring = [(s, (s + 1) % p) for s in range(p)]
        # a write that should not happen goes to the buffer's spare last row (no read-modify-write, so
        # XLA updates the loop's buffers in place)
        put = lambda buf, slot, value, when: buf.at[jnp.where(when, slot, buf.shape[0] - 1)].set(value)
        got_f = jax.lax.ppermute(send_f, PP, ring)
        carry = dict(carry, fbuf=put(carry["fbuf"], jnp.maximum(recv_f, 0), got_f, recv_f >= 0))
        if not self.train:
            carry["out"] = put(carry["out"], i, y_last, action == _FWD_LAST)
            return carry
        got_b = jax.lax.ppermute(send_b, PP, [(b, a) for a, b in ring])
        bbuf = put(carry["bbuf"], bs, y_last, action == _FWD_LAST)  # the seed of this microbatch's backward
        carry["bbuf"] = put(bbuf, jnp.maximum(recv_b, 0), got_b, recv_b >= 0)
        carry["out"] = put(carry["out"], i, send_b, (action == _BWD) & (k == 0))  # stage 0: d loss / d x
        carry["loss"] = carry["loss"] + loss
        carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
        carry["g_layers"] = jax.tree.map(lambda g, gj: g.at[j].add(gj), carry["g_layers"], g_layers_j)
        return carry


def _vary_tree(tree: tp.Any, axes: tuple[str, ...]) -> tp.Any:
    """Every array of ``tree`` typed as varying over the manual ``axes`` (see :func:`_vary`)."""
    return jax.tree.map(lambda a: _vary(a, axes), tree)


def _vary(a: Array, axes: tuple[str, ...]) -> Array:
    """``a`` typed as varying over every manual axis in ``axes`` (a no-op for those it already varies over)."""
    missing = tuple(x for x in axes if x not in jax.typeof(a).manual_axis_type.varying)
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _drop_unit_axes(spec: P, mesh: jax.sharding.Mesh) -> P:
    """``spec`` without mesh axes of size 1 (they split nothing; XLA's partitioner trips on some of them
    inside a partly manual shard_map)."""
    def keep(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(n for n in names if mesh.shape[n] > 1)
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(keep(e) for e in spec))


def _pipeline_mesh(mesh: jax.sharding.Mesh | None, params: tp.Any, config: PipelineConfig) -> jax.sharding.Mesh:
    if mesh is None:
        mesh = mesh_of(params)
    if mesh is None or PP not in mesh.axis_names:
        raise ValueError("pipeline parallelism needs the model on a mesh with a 'pp' axis: "
                         "model.shard_model(make_mesh(pp=..., ...), pipeline_partition_axis())")
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        raise ValueError("the pipeline runs on Auto mesh axes (its stages' shardings are left to XLA); build the "
                         "mesh with make_mesh(..., axis_types=AxisType.Auto), the default")
    model_axes = [a for a in ("tp", "ep", "sp") if mesh.shape.get(a, 1) > 1]
    if mesh.shape.get("fsdp", 1) > 1 and model_axes:
        # XLA 0.10's SPMD partitioner aborts the process (a failed check on replica groups) on the pipeline's
        # loop when its microbatches are split over an automatic data axis and a model axis splits the layers
        raise ValueError(f"a pipeline with fsdp={mesh.shape['fsdp']} and {model_axes[0]}={mesh.shape[model_axes[0]]} "
                         f"together does not compile on this XLA (its partitioner aborts); put the data-parallel "
                         f"devices on dp instead (make_mesh(pp=..., dp=..., fsdp=1, {model_axes[0]}=...)), or drop "
                         f"{model_axes[0]}")
    if mesh.shape[PP] != config.num_stages:
        raise ValueError(f"PipelineConfig(num_stages={config.num_stages}) but the mesh's pp axis has "
                         f"{mesh.shape[PP]} devices; make them equal")
    return mesh


def _embed_all(graphdef, params, other, input_ids, attention_mask):
    """The embedding (and leading dense layers) of the whole batch: ``x (B, T, D)``."""
    model = nnx.merge(graphdef, params, other)
    positions_BT, mask_B1TS = model.positions(input_ids, attention_mask)
    x_BTD = model.embed(input_ids, positions_BT)
    c = model.config
    if c.first_dense_layers:
        kinds_L = [c.layer_kind(i) for i in range(c.first_dense_layers)]
        x_BTD, _, _ = run_layers(model.dense_layers, x_BTD, model.rope_tables(positions_BT), mask_B1TS,
                                 kinds_L=kinds_L, scan=model.scan_layers, remat=model.remat)
    return x_BTD


def pipeline_loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, other: nnx.State, batch: dict[str, Array],
                            config: PipelineConfig, mesh: jax.sharding.Mesh) -> tuple[Array, Array, nnx.State]:
    """Traceable: ``(loss, num_tokens, grads)`` of a causal-LM batch through the pipeline (grads shaped like
    ``params``)."""
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    labels = labels_from(input_ids, mask) if labels is None else labels
    m = config.num_microbatches
    num_tokens = jnp.sum(labels[:, 1:] != -100, dtype=jnp.int32)
    embed = functools.partial(_embed_all, graphdef, other=other, input_ids=input_ids, attention_mask=mask)
    x_BTD, embed_vjp = jax.vjp(embed, params)
    parts = _parts(graphdef, params, other)
    split = functools.partial(_split_microbatches, m=m)
    loss, g_rest, g_staged, dx_mBTD = _run_pipeline(
        parts, pipeline_schedule(config), mesh, split(x_BTD), None if mask is None else split(mask), split(labels),
        jnp.maximum(num_tokens, 1).astype(jnp.float32), train=True)
    dx_BTD = jnp.swapaxes(dx_mBTD, 0, 1).reshape(x_BTD.shape)
    (g_embed,) = embed_vjp(dx_BTD)
    # the pipeline's gradients in the parameters' own tree (its rest / layers parts are rebuilt States)
    g_pipe = dict(g_rest)
    g_pipe["layers"] = _unstage_layers(g_staged)
    leaves = [jax.tree.leaves(g_pipe[key]) for key in params]
    g_pipe = jax.tree.unflatten(jax.tree.structure(params), [x for part in leaves for x in part])
    grads = jax.tree.map(jnp.add, g_pipe, g_embed)
    return loss, num_tokens, grads


def pipeline_value_and_grad(model: nnx.Module, batch: dict[str, tp.Any], config: PipelineConfig, *,
                            mesh: jax.sharding.Mesh | None = None) -> tuple[Array, nnx.State]:
    """``(loss, grads)`` of next-token cross-entropy on ``batch`` through the pipeline, compiled; equal to
    ``jax.value_and_grad`` of the unpipelined loss. ``mesh`` defaults to the model's (``shard_model``)."""
    _check_model(model, config)
    model = with_mesh(model, None)  # no mesh: inside the pipeline's shard_map the automatic axes place everything
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    mesh = _pipeline_mesh(mesh, params, config)
    batch = prepare_batch(batch)
    _check_batch(batch["input_ids"], config, mesh)
    fn = jax.jit(lambda params, other, batch: pipeline_loss_and_grads(graphdef, params, other, batch, config, mesh))
    loss, _, grads = fn(params, other, batch)
    return loss, grads


def _check_batch(input_ids: Array, config: PipelineConfig, mesh: jax.sharding.Mesh) -> None:
    data_ways = mesh.shape.get("dp", 1) * mesh.shape.get("fsdp", 1)
    config.check_batch(input_ids.shape[0], data_ways)


def pipeline_forward(model: nnx.Module, input_ids: tp.Any, attention_mask: tp.Any = None, *,
                     config: PipelineConfig, mesh: jax.sharding.Mesh | None = None) -> Array:
    """Logits ``(B, T, V)`` of ``input_ids`` run through the pipeline's forward ticks (GPipe's fill and
    drain), compiled; equal to ``model(input_ids).logits``."""
    _check_model(model, config)
    model = with_mesh(model, None)  # no mesh: inside the pipeline's shard_map the automatic axes place everything
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    mesh = _pipeline_mesh(mesh, params, config)
    input_ids = jnp.asarray(input_ids, jnp.int32)
    _check_batch(input_ids, config, mesh)
    mask = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)

    run = jax.jit(lambda params, other, ids, mask: pipeline_logits(graphdef, params, other, ids, mask, config, mesh))
    return run(params, other, input_ids, mask)


def pipeline_logits(graphdef: nnx.GraphDef, params: nnx.State, other: nnx.State, input_ids: Array,
                    attention_mask: Array | None, config: PipelineConfig, mesh: jax.sharding.Mesh) -> Array:
    """Traceable: logits ``(B, T, V)`` through the pipeline's forward ticks (GPipe's fill and drain, or the
    interleaved forwards)."""
    forward_only = PipelineConfig(config.num_stages, config.num_microbatches,
                                  "interleaved" if config.virtual_stages > 1 else "gpipe", config.virtual_stages)
    x_BTD = _embed_all(graphdef, params, other, input_ids, attention_mask)
    split = functools.partial(_split_microbatches, m=config.num_microbatches)
    y_mBTD = _run_pipeline(_parts(graphdef, params, other), _forward_ticks(forward_only), mesh, split(x_BTD),
                           None if attention_mask is None else split(attention_mask), None, jnp.ones(()), train=False)
    model = nnx.merge(graphdef, params, other)
    y_BTD = jnp.swapaxes(y_mBTD, 0, 1).reshape(x_BTD.shape)
    return model.head(model.norm(y_BTD)).astype(model.logits_dtype)


def default_config(mesh: tp.Any, batch_size: int, schedule: str = "1f1b") -> PipelineConfig:
    """A pipeline over the mesh's pp axis with as many microbatches as divide the batch, up to ``2 p``."""
    sizes = dict(mesh.shape)
    p, data_ways = sizes.get(PP, 1), sizes.get(DP_AXIS, 1) * sizes.get("fsdp", 1)
    m = max((k for k in range(1, 2 * p + 1) if batch_size % (k * data_ways) == 0), default=1)
    return PipelineConfig(p, m, schedule)


def stage_padded(model: tp.Any, pipeline: PipelineConfig | None) -> tp.Any:
    """``model``, or where ``pipeline``'s stages are uneven an abstract copy of it with as many stacked layers as
    equal stages of the deepest one hold (:meth:`PipelineConfig.padded_layers`, the layer pattern carried on):
    the model whose memory a pipelined step holds on every device (the advisor's ledger and the explorer's).
    The copy keeps the model's dtypes and remat policy; it is built once per depth."""
    c = model.config
    layers = c.num_hidden_layers - c.first_dense_layers
    depth = layers if pipeline is None else pipeline.padded_layers(layers)
    if depth == layers:
        return model
    dtype = getattr(model, "dtype", None) or jnp.bfloat16
    return _deeper(c, depth + c.first_dense_layers, dtype, getattr(model, "param_dtype", None) or dtype,
                   getattr(model, "remat", "none"))


@functools.lru_cache(maxsize=16)
def _deeper(config: tp.Any, total: int, dtype: tp.Any, param_dtype: tp.Any, remat: str) -> CausalLM:
    kinds = config.layer_types
    deeper = config.replace(num_hidden_layers=total, layer_types=None if kinds is None else
                            tuple(kinds[i % len(kinds)] for i in range(total)))
    return CausalLM.lazy_init(deeper, dtype=dtype, param_dtype=param_dtype, remat=remat)


def _forward_ticks(config: PipelineConfig) -> PipelineSchedule:
    """The schedule's forward actions only (a forward pass, no backward)."""
    full = pipeline_schedule(config)
    keep = [a for a in full.actions if a.kind == "forward"]
    ticks = max(a.tick for a in keep) + 1
    grid = np.where(full.grid[:ticks] == FORWARD, FORWARD, IDLE).astype(np.int32)
    mb = np.where(grid == FORWARD, full.microbatch[:ticks], -1)
    stage = np.where(grid == FORWARD, full.stage[:ticks], -1)
    return PipelineSchedule(config, tuple(keep), grid, mb, stage)


def make_pipeline_train_step(config: PipelineConfig, optimizer: tp.Any = None, *,
                             partition_axis: PartitionAxis | None = None):
    """``train_step(state, batch) -> (state, metrics)`` like :func:`training.make_train_step`, with the loss and
    gradients from the pipeline. The state's model must sit on a mesh with ``pp = config.num_stages``; lay it
    with ``model.shard_model(mesh, pipeline_partition_axis())`` so each device stores only its stages."""
    partition_axis = pipeline_partition_axis(partition_axis)

    def step(state: TrainState, batch: dict[str, Array], mesh) -> tuple[TrainState, dict[str, Array]]:
        loss, num_tokens, grads = pipeline_loss_and_grads(state.graphdef, state.params, state.other, batch, config,
                                                          mesh)
        return advance(state, loss, num_tokens, grads)  # the update of training.make_train_step

    def train_step(state: TrainState, batch: dict[str, tp.Any]) -> tuple[TrainState, dict[str, Array]]:
        state = checked_state(state, optimizer)
        mesh = _pipeline_mesh(None, state.params, config)
        batch = place_batch(batch, state, partition_axis)
        _check_batch(batch["input_ids"], config, mesh)
        key = ("pipeline_train_step", config, signature((state, batch)))

        def compile_():  # the model is checked once per compiled program, not on every step
            _check_model(nnx.merge(state.graphdef, state.params, state.other), config)
            shardings = jax.tree.map(lambda x: x.sharding, (state, batch))
            return jax.jit(functools.partial(step, mesh=mesh), in_shardings=shardings,
                           out_shardings=(shardings[0], None), donate_argnums=0).lower(state, batch).compile()

        return PROGRAMS.get(key, compile_).value(state, batch)

    return train_step
