"""Decoder blocks stacked on a leading ``layers`` axis and run by ``jax.lax.scan`` (or unrolled).

:func:`stack_blocks` builds ONE block whose parameters carry a leading axis of ``num_layers``
(semantic axis ``LAYERS``) by vmapping the block's initialiser: under ``nnx.eval_shape`` that is
shape arithmetic on one traced block, whatever the depth. :func:`run_layers` runs the stack:

- ``scan=True``: ``lax.scan`` over the layer axis, so the block is compiled once and compile time
  stays flat in depth;
- ``scan=False``: a Python loop over static layer slices, every layer its own ops in the HLO
  (for inspecting one layer); the parameters are the same stacked arrays either way;
- inside :func:`presliced_layers`, a stack whose per-layer arrays are given (views of each layer's slice,
  :mod:`.layer_views`) runs unrolled over them, slicing nothing: a CPU decode loop reads each weight once.

Per-layer differences are data, not structure. A layer's kind (its sliding window or none, and
which rotary table it uses) indexes a ``lax.switch`` over one body per kind, so alternating
local/global layers compile two bodies at any depth. A KV cache rides in the scan carry; each layer
writes only its new tokens into it (see ``cache.py``). ``remat`` wraps the per-layer body in
``jax.checkpoint`` with a named policy, which a training step's backward pass follows.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.core.axes import LAYERS, DynamicShardingAxes
from workbench.core.checks import is_int

Array = jax.Array

REMAT_POLICIES: dict[str, tp.Any] = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def check_remat(policy: str) -> str:
    """``policy`` if it names a rematerialisation policy, else a ValueError listing them."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; use one of {tuple(REMAT_POLICIES)} ('none' keeps every "
                         f"activation, 'dots_saveable' keeps matmul outputs, 'full' recomputes the whole block)")
    return policy


def stacked_axes(axes: tp.Any) -> DynamicShardingAxes:
    """``axes`` with ``LAYERS`` in front (a stacked parameter's leading dimension)."""
    entries, mode = (axes.axes, axes.mode) if hasattr(axes, "axes") else axes
    return DynamicShardingAxes((LAYERS, *entries), mode)


def unstacked_axes(axes: tp.Any) -> DynamicShardingAxes:
    entries, mode = (axes.axes, axes.mode) if hasattr(axes, "axes") else axes
    if not entries or entries[0] != LAYERS:
        raise ValueError(f"axes {entries} have no leading LAYERS axis")
    return DynamicShardingAxes(tuple(entries[1:]), mode)


def stack_blocks(make_block: tp.Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """One block of ``make_block`` with every parameter stacked ``num_layers`` times (each layer its own key)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_block(nnx.Rngs(0))))
    key = rngs.params()
    keys = jax.random.split(key, num_layers)
    init = lambda k: nnx.state(make_block(nnx.Rngs(k)))
    if isinstance(key, jax.core.Tracer):  # abstract (lazy_init, eval_shape): ONE traced block, vmapped
        state = jax.vmap(init)(keys)
    else:  # concrete: layer by layer (per-op programs are cached across layers), stacked on the host;
        # a vmapped init would compile op by op per depth, a jitted one takes seconds to compile
        layers = [init(k) for k in keys]
        state = jax.tree.map(lambda *xs: jnp.asarray(np.stack([np.asarray(x) for x in xs])), *layers)
    return _with_layers(nnx.merge(graphdef, state), stacked_axes, num_layers)


def _with_layers(module: nnx.Module, map_axes: tp.Callable[[tp.Any], DynamicShardingAxes],
                 num_layers: int | None) -> nnx.Module:
    """``module`` with every variable's semantic axes mapped (LAYERS added or removed) and ``num_layers`` set."""
    for _, var in nnx.to_flat_state(nnx.state(module)):
        axes = var.get_metadata().get("semantic_axes")
        if axes is not None:
            var.set_metadata(semantic_axes=map_axes(axes))
    module.num_layers = num_layers
    return module


def num_stacked(stack: nnx.Module) -> int:
    n = getattr(stack, "num_layers", None)
    if n is None:
        raise TypeError(f"this {type(stack).__name__} is one layer, not a stack of layers")
    return n


def layer_view(stack: nnx.Module, index: int) -> nnx.Module:
    """Layer ``index`` of a stack as a one-layer block (a copy of that slice of every parameter)."""
    n = num_stacked(stack)
    if not is_int(index):
        raise TypeError(f"a layer index is an int; got {index!r}")
    if not -n <= index < n:
        raise IndexError(f"layer {index} out of range: the model has {n} layers")
    index = int(index) % n
    graphdef, state = nnx.split(stack)
    return _with_layers(nnx.merge(graphdef, jax.tree.map(lambda a: _slice(a, index), state)), unstacked_axes, None)


def _slice(a: tp.Any, index: int) -> tp.Any:
    if isinstance(a, jax.ShapeDtypeStruct):  # an abstract model (lazy_init): the slice's shape
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[index]


def layer_kinds(kinds_L: tp.Sequence[tp.Hashable]) -> tuple[tuple[tp.Any, ...], np.ndarray]:
    """The distinct per-layer kinds (in order of first use) and each layer's index into them."""
    kinds: list[tp.Any] = []
    for k in kinds_L:
        if k not in kinds:
            kinds.append(k)
    return tuple(kinds), np.asarray([kinds.index(k) for k in kinds_L], np.int32)


_PRESLICED: contextvars.ContextVar[dict[int, tuple[Array, tuple[Array, ...]]] | None] = contextvars.ContextVar(
    "presliced_layers", default=None)


@contextlib.contextmanager
def presliced_layers(found: dict[int, tuple[Array, tuple[Array, ...]]]) -> tp.Iterator[None]:
    """While inside, :func:`run_stack` runs a stack whose every parameter ``a`` has ``found[id(a)] == (a,
    layers)`` unrolled, layer ``i`` reading ``layers[i]`` (no slice of ``a``). See :mod:`.layer_views`."""
    token = _PRESLICED.set({**(_PRESLICED.get() or {}), **found})
    try:
        yield
    finally:
        _PRESLICED.reset(token)


def _presliced(state: tp.Any) -> list[tuple[Array, ...]] | None:
    """Each leaf's per-layer arrays where every leaf of ``state`` has them (:func:`presliced_layers`), else None."""
    found, leaves = _PRESLICED.get(), jax.tree.leaves(state)
    if not found:
        return None
    layers = [found.get(id(a)) for a in leaves]
    if any(entry is None or entry[0] is not a for entry, a in zip(layers, leaves, strict=True)):
        return None
    return [entry[1] for entry in layers]


class LayerCache(tp.NamedTuple):
    """What one layer's attention needs of a cache: the call's step, the stacked arrays, the layer index."""

    step: tp.Any
    kv: tp.Any
    layer: tp.Any


def run_layers(stack: nnx.Module, x_BTD: Array, ropes: tp.Mapping[str, tuple[Array, Array]] | None,
               mask_B1TS: Array | None, *, kinds_L: tp.Sequence[tuple[int | None, str]], step: tp.Any = None,
               kv: tp.Any = None, scan: bool = True, remat: str = "none",
               constrain: tp.Callable[[Array], Array] | None = None,
               first_layer: int = 0) -> tuple[Array, tp.Any, Array | None]:
    """Run every layer of ``stack``: hidden states, the cache arrays after the last layer, and the
    stacked per-layer router logits ``(L, N, E)`` of a MoE (else None). ``kinds_L[i]`` is layer i's
    ``(sliding window or None, rotary table name)`` (``ModelConfig.layer_kind``); ``ropes`` maps a table
    name to its ``(cos, sin)`` (None without rotary positions). ``constrain`` pins each layer's output
    hidden states to a sharding (the scan carry's layout is XLA's choice otherwise). ``first_layer``: the
    model's index of the stack's first layer (where its layers sit in a cache of all layers)."""
    n = num_stacked(stack)
    if len(kinds_L) != n:
        raise ValueError(f"internal: {len(kinds_L)} layer kinds for {n} layers")
    kinds, kind_L = layer_kinds(kinds_L)
    graphdef, state = nnx.split(stack)
    return run_stack(graphdef, state, x_BTD, ropes, mask_B1TS, kinds=kinds, kind_L=kind_L,
                     layer_L=first_layer + np.arange(n, dtype=np.int32), step=step, kv=kv, scan=scan,
                     remat=remat, constrain=constrain)


def run_stack(graphdef: nnx.GraphDef, state: nnx.State, x_BTD: Array,
              ropes: tp.Mapping[str, tuple[Array, Array]] | None, mask_B1TS: Array | None, *,
              kinds: tp.Sequence[tuple[int | None, str]], kind_L: Array | np.ndarray, layer_L: Array | np.ndarray,
              step: tp.Any = None,
              kv: tp.Any = None, scan: bool = True, remat: str = "none",
              constrain: tp.Callable[[Array], Array] | None = None) -> tuple[Array, tp.Any, Array | None]:
    """:func:`run_layers` on a stack given as its graphdef and stacked state (any number of layers, e.g. one
    pipeline stage's slice): ``kinds`` the distinct layer kinds, ``kind_L`` each layer's index into them and
    ``layer_L`` its index in the model (both may be traced: a pipeline stage picks them at run time)."""
    constrain = constrain or (lambda x: x)
    n = jax.tree.leaves(state)[0].shape[0]
    policy = REMAT_POLICIES[check_remat(remat)]

    def layer(kind, x_BTD, kv, state_l, index):
        window, rope = kind
        cos_BTD, sin_BTD = (None, None) if ropes is None else ropes[rope]
        block = nnx.merge(graphdef, state_l)
        cache = None if step is None else LayerCache(step, kv, index)
        x_BTD, kv, router = block(x_BTD, cos_BTD, sin_BTD, mask_B1TS, sliding_window=window, cache=cache)
        return constrain(x_BTD), kv, router

    def remat_(fn):
        return fn if remat == "none" else jax.checkpoint(fn, policy=policy, prevent_cse=not scan)

    presliced = _presliced(state)
    if scan and presliced is None:
        def by_kind(x_BTD, kv, state_l, index, kind):
            if len(kinds) == 1:
                return layer(kinds[0], x_BTD, kv, state_l, index)
            branches = [functools.partial(layer, w) for w in kinds]
            return jax.lax.switch(kind, branches, x_BTD, kv, state_l, index)

        run = remat_(by_kind)

        def body(carry, xs):
            x_BTD, kv = carry
            x_BTD, kv, router = run(x_BTD, kv, *xs)
            return (x_BTD, kv), router

        (x_BTD, kv), routers = jax.lax.scan(body, (x_BTD, kv), (state, jnp.asarray(layer_L), jnp.asarray(kind_L)))
        return x_BTD, kv, routers
    routers = []
    treedef = jax.tree.structure(state)
    for i in range(n):
        state_l = (jax.tree.map(lambda a, i=i: a[i], state) if presliced is None else
                   jax.tree.unflatten(treedef, [layers[i] for layers in presliced]))
        if isinstance(kind_L, np.ndarray):
            run = remat_(functools.partial(layer, kinds[int(kind_L[i])]))
        else:  # chosen at run time (a pipeline stage's kinds): switch, as the scan does
            run = remat_(lambda *a, i=i: jax.lax.switch(kind_L[i], [functools.partial(layer, w) for w in kinds], *a))
        index = int(layer_L[i]) if isinstance(layer_L, np.ndarray) else layer_L[i]
        x_BTD, kv, router = run(x_BTD, kv, state_l, index)
        routers.append(router)
    return x_BTD, kv, None if routers[0] is None else jnp.stack(routers)
