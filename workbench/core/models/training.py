"""Next-token training for ``CausalLM``: a pytree train state, a jitted step, a small loop.

The state splits the model into its static ``graphdef`` and arrays, so one jitted step serves
every step. A step keeps the shardings it was given: on a mesh, params and optimizer state
stay where they are (``NamedSharding`` from ``shard_model`` or ``jax.device_put``) and the
batch is split over the data axes (``BATCH`` -> fsdp, dp by :class:`PartitionAxis`).

Example (``tiny`` from :mod:`.presets`, ``load_text`` from :mod:`workbench.data`)::

    model, losses = train(tiny("llama"), load_text("genesis"), steps=300, batch_size=32, seq_len=128)
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from workbench.core.axes import BATCH, LENGTH, PartitionAxis
from workbench.core.checks import positive_int
from workbench.core.mesh import mesh_of
from workbench.core.models.loss import causal_lm_loss, labels_from
from workbench.core.models.moe_losses import expert_counts
from workbench.core.models.tokenizer import ByteTokenizer
from workbench.core.programs import PROGRAMS, signature
from workbench.core.zero import check_zero_stage, state_sharding

Batch = dict[str, tp.Any]


class TrainState(struct.PyTreeNode):
    """Everything a step changes: params, optimizer state, step count (int32 array).

    ``graphdef`` (the model's structure) and ``tx`` (the optax optimizer) are static;
    ``other`` holds the model's non-parameter variables (carried, not trained).
    """

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    other: nnx.State


def make_optimizer(steps: int | None = None, *, lr: float = 3e-3, warmup_steps: int | None = None,
                   weight_decay: float = 0.1, clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95
                   ) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to ``lr / 10`` over ``steps``, global-norm clipping.

    ``steps=None`` keeps ``lr`` constant. Weight decay applies to matrices only (ndim >= 2),
    not to norms and biases. ``warmup_steps`` defaults to ``min(100, steps // 10)``.
    """
    if steps is None:
        schedule = lr
    else:
        steps = positive_int("steps", steps, what="a positive int (the length of the schedule) or None")
        warmup = min(100, steps // 10) if warmup_steps is None else warmup_steps
        if not 0 <= warmup < steps:
            raise ValueError(f"warmup_steps={warmup} must be >= 0 and smaller than steps={steps}")
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                                   mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))


def _copy(tree: tp.Any, mesh) -> tp.Any:
    """Fresh buffers with the same shardings (leaves off ``mesh`` are replicated onto it)."""
    def one(x):
        sharding = x.sharding
        if mesh is not None and not isinstance(sharding, NamedSharding):
            sharding = NamedSharding(mesh, P())
        return jax.device_put(x, sharding, may_alias=False)

    return jax.tree.map(one, tree)


def opt_state_shardings(tx: optax.GradientTransformation, opt_state: tp.Any, params: tp.Any, mesh: tp.Any,
                        zero_stage: int = 0) -> tp.Any:
    """Where each leaf of ``tx``'s ``opt_state`` lives (a tree of ``NamedSharding`` shaped like it): a leaf shaped
    like its parameter takes the parameter's sharding (``zero_stage=1``: split over ``dp`` as well, ZeRO-1,
    :func:`workbench.core.zero.state_sharding`); the rest (counts, Adafactor's factored statistics) is replicated
    on ``mesh``. ``opt_state`` and ``params`` are arrays or ``ShapeDtypeStruct`` s (the abstract step's); each
    parameter carries its ``NamedSharding``. The one placement of optimizer state: :func:`to_state` and
    :func:`workbench.core.compile.steps.layout_step` use it."""
    check_zero_stage(zero_stage)
    replicated = NamedSharding(mesh, P())

    def place(state_leaf: tp.Any, param: tp.Any = None) -> NamedSharding:
        if param is not None and tuple(state_leaf.shape) == tuple(param.shape):
            return state_sharding(param.sharding, param.shape, zero_stage)
        return replicated

    return optax.tree_map_params(tx, place, opt_state, params, transform_non_params=place)


def to_state(model: nnx.Module, optimizer: optax.GradientTransformation | None = None, *,
             zero_stage: int = 0) -> TrainState:
    """A :class:`TrainState` at step 0 holding copies of ``model``'s params (the model stays usable).

    ``optimizer`` defaults to ``make_optimizer()`` (constant lr). Optimizer moments take the
    sharding of their parameter (``zero_stage=1``: split over ``dp`` as well, ZeRO-1,
    :mod:`workbench.core.zero`); scalars (counts) are replicated. ``train_step`` keeps these shardings.
    """
    check_zero_stage(zero_stage)
    optimizer = make_optimizer() if optimizer is None else optimizer
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    mesh = mesh_of(params)
    params, other = _copy(params, mesh), _copy(other, mesh)
    opt_state = optimizer.init(params)
    step = jnp.zeros((), jnp.int32)
    if mesh is not None:
        opt_state = jax.device_put(opt_state, opt_state_shardings(optimizer, opt_state, params, mesh, zero_stage))
        step = jax.device_put(step, NamedSharding(mesh, P()))
    return TrainState(graphdef=graphdef, tx=optimizer, params=params, opt_state=opt_state, step=step, other=other)


def from_state(state: TrainState, *, copy: bool = True) -> nnx.Module:
    """The model with ``state``'s params. ``copy=False`` shares the arrays: then do not pass ``state``
    to a train step again (the step donates, deleting them)."""
    params, other = state.params, state.other
    if copy:
        mesh = mesh_of(params)
        params, other = _copy(params, mesh), _copy(other, mesh)
    return nnx.merge(state.graphdef, params, other)


def prepare_batch(batch: Batch | jax.Array | np.ndarray) -> Batch:
    if not isinstance(batch, dict):
        batch = {"input_ids": batch}
    unknown = set(batch) - {"input_ids", "attention_mask", "labels"}
    if "input_ids" not in batch or unknown:
        raise ValueError(f"a batch is a dict with input_ids and optionally attention_mask, labels; got keys "
                         f"{sorted(batch)}")
    out = {"input_ids": jnp.asarray(batch["input_ids"], jnp.int32)}
    mask = batch.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = jnp.asarray(mask, jnp.int32)
    labels = batch.get("labels")
    out["labels"] = labels_from(out["input_ids"], mask) if labels is None else jnp.asarray(labels, jnp.int32)
    return out


def train_loss(graphdef: nnx.GraphDef, params: nnx.State, other: nnx.State, batch: Batch,
               router: tuple[float, float] = (0.0, 0.0)) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """Traceable: the loss a train step differentiates and ``(num_tokens, extra metrics)``.

    The loss is the causal LM cross-entropy of ``batch`` (``input_ids``, ``labels``, optionally
    ``attention_mask``: :func:`prepare_batch`), plus a MoE model's router losses weighted by ``router = (aux, z)``
    (``(0, 0)``, what :func:`train` uses: none). ``extra`` holds a MoE model's tokens per expert per layer
    (``expert_load``). :func:`make_train_step` and the compiled abstract step
    (:func:`workbench.core.compile.steps.layout_step`) both differentiate it."""
    model = nnx.merge(graphdef, params, other)
    mask = batch.get("attention_mask")
    out = model(batch["input_ids"], mask)
    loss, num_tokens = causal_lm_loss(getattr(out, "logits", out), batch["labels"])
    extra = {}
    router_logits = getattr(out, "router_logits", None)
    if any(router):
        loss = loss + model._router_losses(router_logits, mask, *router)
    if router_logits is not None:
        extra["expert_load"] = expert_counts(jax.lax.stop_gradient(router_logits),
                                             model.config.num_experts_per_tok, mask)
    return loss, (num_tokens, extra)


def apply_update(tx: optax.GradientTransformation, grads: tp.Any, params: tp.Any, opt_state: tp.Any
                 ) -> tuple[tp.Any, tp.Any]:
    """Traceable: the optimizer update of a train step, ``grads -> (new params, new opt_state)`` by ``tx``.

    The one update: :func:`make_train_step` (through :func:`advance`), the pipeline's train step
    (:func:`workbench.core.pipeline.make_pipeline_train_step`) and the compiled abstract train step
    (:func:`workbench.core.compile.steps.layout_step`) all call it."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def advance(state: TrainState, loss: jax.Array, num_tokens: jax.Array, grads: nnx.State,
            extra: tp.Mapping[str, jax.Array] | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """Traceable: ``state`` one step on (``grads`` applied by :func:`apply_update` with ``state.tx``) and the
    step's metrics: loss, num_tokens, grad_norm (before clipping) and ``extra``."""
    params, opt_state = apply_update(state.tx, grads, state.params, state.opt_state)
    new = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    return new, {"loss": loss, "num_tokens": num_tokens, "grad_norm": optax.tree.norm(grads), **(extra or {})}


def checked_state(state: tp.Any, optimizer: optax.GradientTransformation | None) -> TrainState:
    """A train step's ``state`` checked to be a :class:`TrainState`, with ``optimizer`` (when given) as its ``tx``."""
    if not isinstance(state, TrainState):
        raise TypeError(f"train_step takes a TrainState (to_state(model, optimizer)); got {type(state).__name__}")
    return state if optimizer is None or state.tx is optimizer else state.replace(tx=optimizer)


def _step(state: TrainState, batch: Batch, router: tuple[float, float] = (0.0, 0.0)
          ) -> tuple[TrainState, dict[str, jax.Array]]:
    loss_of = lambda params: train_loss(state.graphdef, params, state.other, batch, router)
    (loss, (num_tokens, extra)), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    return advance(state, loss, num_tokens, grads, extra)


def make_train_step(optimizer: optax.GradientTransformation | None = None, *,
                    partition_axis: PartitionAxis | None = None, router_aux_loss_coef: float = 0.0,
                    router_z_loss_coef: float = 0.0
                    ) -> tp.Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """``train_step(state, batch) -> (state, metrics)``, jitted, donating ``state``.

    The update uses ``state.tx`` (the optimizer given to ``to_state``); an ``optimizer``
    given here replaces it, and must have the same state structure (e.g. another schedule).

    ``batch`` is a dict with ``input_ids (B, T)`` and optionally ``attention_mask`` and
    ``labels`` (default: ``labels_from(input_ids, attention_mask)``). The output state has the
    input state's shardings; on a mesh the batch is placed by ``partition_axis`` (default
    ``PartitionAxis()``) resolving ``(BATCH, LENGTH)``. Metrics: loss, num_tokens, grad_norm, and for a
    MoE model ``expert_load`` (tokens per expert per layer, ``(L, E)``). A MoE model's loss adds
    ``router_aux_loss_coef`` x the Switch load-balancing loss and ``router_z_loss_coef`` x the router
    z-loss (:mod:`.moe_losses`; ``compute_loss`` takes the same coefficients).
    """
    partition_axis = PartitionAxis() if partition_axis is None else partition_axis
    router = (router_aux_loss_coef, router_z_loss_coef)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        state = checked_state(state, optimizer)
        batch = place_batch(batch, state, partition_axis)
        key = ("train_step", router, signature((state, batch)))
        return PROGRAMS.get(key, lambda: _compile_step(state, batch, router)).value(state, batch)

    return train_step


def _compile_step(state: TrainState, batch: Batch, router: tuple[float, float]):
    """The step compiled for these avals and shardings; the output state keeps the input's shardings."""
    state_sh, batch_sh = jax.tree.map(lambda x: x.sharding, (state, batch))
    step = functools.partial(_step, router=router)
    return jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=0).lower(state, batch).compile()


def make_eval_step(*, partition_axis: PartitionAxis | None = None
                   ) -> tp.Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """``eval_step(state, batch) -> {"loss", "num_tokens"}``, jitted; the state is not donated."""
    partition_axis = PartitionAxis() if partition_axis is None else partition_axis
    def loss_and_tokens(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
        loss, (num_tokens, _) = train_loss(state.graphdef, state.params, state.other, batch)
        return {"loss": loss, "num_tokens": num_tokens}

    evaluate = jax.jit(loss_and_tokens)

    def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
        return evaluate(state, place_batch(batch, state, partition_axis))

    return eval_step


def place_batch(batch: Batch, state: TrainState, partition_axis: PartitionAxis) -> Batch:
    """``batch`` normalised, and split over the data axes when ``state`` lives on a mesh."""
    batch = prepare_batch(batch)
    mesh = mesh_of(state.params)
    if mesh is None:
        return batch
    spec = partition_axis.resolve((BATCH, LENGTH), shape=batch["input_ids"].shape, mesh=mesh)
    return jax.device_put(batch, NamedSharding(mesh, spec))


def batches(token_ids: tp.Sequence[int] | np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0
            ) -> tp.Iterator[Batch]:
    """Endless batches ``{"input_ids": int32 (batch_size, seq_len)}`` of random windows of ``token_ids``."""
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be one flat sequence; got shape {ids.shape}")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"batch_size must be >= 1 and seq_len >= 2; got {batch_size}, {seq_len}")
    if len(ids) < seq_len:
        raise ValueError(f"{len(ids)} tokens are fewer than seq_len={seq_len}; use a longer text or a shorter seq_len")
    rng = np.random.default_rng(seed)
    offsets_L = np.arange(seq_len)
    while True:
        starts_B = rng.integers(0, len(ids) - seq_len + 1, batch_size)
        yield {"input_ids": ids[starts_B[:, None] + offsets_L]}


def train(model: nnx.Module, text_or_ids: str | tp.Sequence[int] | np.ndarray, *, steps: int, batch_size: int = 16,
          seq_len: int = 64, tokenizer: tp.Any = None, optimizer: optax.GradientTransformation | None = None,
          lr: float = 3e-3, seed: int = 0, progress: bool = True, partition_axis: PartitionAxis | None = None
          ) -> tuple[nnx.Module, list[float]]:
    """Train a copy of ``model`` for ``steps`` steps on random windows; returns ``(trained, losses)``.

    A string is encoded with ``tokenizer`` (default :class:`ByteTokenizer`); ``optimizer``
    defaults to ``make_optimizer(steps, lr=lr)``. A model placed on a mesh trains sharded.
    ``model`` itself is not changed.
    """
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            tokenizer = ByteTokenizer()
        ids = np.asarray(tokenizer.encode(text_or_ids), np.int32)
    else:
        ids = np.asarray(text_or_ids, np.int32)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids span [{ids.min()}, {ids.max()}] but the model's vocab_size is {vocab}; "
                         f"build the model with vocab_size >= tokenizer.vocab_size")
    optimizer = make_optimizer(steps, lr=lr) if optimizer is None else optimizer
    state = to_state(model, optimizer)
    train_step = make_train_step(optimizer, partition_axis=partition_axis)
    data = batches(ids, batch_size, seq_len, seed=seed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="train", unit="step")
    losses = []
    for i in range(steps):
        state, metrics = train_step(state, next(data))
        losses.append(metrics["loss"])
        if bar is not None:
            bar.update(1)
            if i % 10 == 0 or i == steps - 1:
                bar.set_postfix(loss=f"{float(metrics['loss']):.3f}")
    if bar is not None:
        bar.close()
    return from_state(state, copy=False), [float(x) for x in losses]
