"""LoRA adapters on a model's :class:`ParallelLinear` layers: ``y = base(x) + (x @ a @ b) * alpha / rank``.

:func:`apply_lora_to_layers` returns a new model whose matching projections are wrapped in
:class:`LoRALinear`; the adapter weights are :class:`LoRAParam` (an ``nnx.Param`` subclass), so
``nnx.state(model, LoRAParam)`` or ``nnx.DiffState(0, LoRAParam)`` select them alone. ``a (in, rank)``
starts random, ``b (rank, out)`` at zero, so a fresh adapter leaves the output unchanged.
:func:`unwrap_lora_to_layers` folds ``a @ b * scale`` back into plain kernels. Only
``ParallelLinear`` layers are adapted; anything else (embeddings, norms, 3-D MoE expert weights)
is left as it is. Every function returns a new model and leaves its input untouched.

The module-surgery helpers :func:`find_layers` and :func:`map_layers` serve
:mod:`workbench.core.models.quantize` too.
"""

from __future__ import annotations

import re
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import NamedSharding

from workbench.core.axes import EMPTY, DynamicShardingAxes
from workbench.core.checks import positive_int
from workbench.core.linear import ParallelLinear, TensorParallelConfig

__all__ = [
    "LoRALinear",
    "LoRAParam",
    "apply_lora_to_layers",
    "find_layers",
    "map_layers",
    "merge_lora_params",
    "split_lora_params",
    "unwrap_lora_to_layers",
]

Array = jax.Array
PathParts = tuple[tp.Any, ...]


class LoRAParam(nnx.Param):
    """A LoRA adapter weight; ``nnx.state(model, LoRAParam)`` selects the adapters alone."""


# -- module surgery ---------------------------------------------------------------------------
def _path_str(path: PathParts) -> str:
    return "/".join(str(p) for p in path)


def _child(node: tp.Any, key: tp.Any) -> tp.Any:
    return node[key] if isinstance(node, nnx.List | nnx.Dict | list | dict) else getattr(node, key)


def _set_child(node: tp.Any, key: tp.Any, value: tp.Any) -> None:
    if isinstance(node, nnx.List | nnx.Dict | list | dict):
        node[key] = value
    elif isinstance(node, nnx.Module):
        setattr(node, key, value)
    else:
        raise ValueError(f"cannot replace {key!r} inside a {type(node).__name__}; keep layers in modules, "
                         f"nnx.List or nnx.Dict")


def find_layers(model: nnx.Module, kinds: type | tuple[type, ...]) -> list[tuple[str, PathParts, nnx.Module]]:
    """``(path, path_parts, layer)`` for each ``kinds`` module, path joined with "/" (``layers/mlp/up_proj``)."""
    return [(_path_str(path), path, node) for path, node in nnx.iter_graph(model)
            if path and isinstance(node, kinds)]


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression ({e}); it is matched with "
                         f"re.search against paths like 'layers/self_attn/q_proj'") from None


def map_layers(model: nnx.Module, pattern: str, kinds: type | tuple[type, ...],
               fn: tp.Callable[[str, nnx.Module], nnx.Module], *, what: str = "layer") -> nnx.Module:
    """A copy of ``model`` where each ``kinds`` layer whose path matches ``re.search(pattern, path)``
    is replaced by ``fn(path, layer_copy)``. No match raises ValueError listing available paths."""
    regex = _compile(pattern)
    new = nnx.clone(model)  # new Variables (arrays shared, they are immutable): ``model`` stays intact
    found = find_layers(new, kinds)
    matched = [f for f in found if regex.search(f[0])]
    if not matched:
        names = kinds.__name__ if isinstance(kinds, type) else " / ".join(k.__name__ for k in kinds)
        if not found:
            raise ValueError(f"{what}: the model has no {names} layers")
        paths = [f[0] for f in found]
        shown = ", ".join(paths[:6]) + (f", ... ({len(paths)} in all)" if len(paths) > 6 else "")
        raise ValueError(f"{what}: pattern {pattern!r} matches no {names} path; available paths: {shown}")
    for path, parts, layer in matched:
        parent = new
        for key in parts[:-1]:
            parent = _child(parent, key)
        _set_child(parent, parts[-1], fn(path, layer))
    return new


def placed_param(cls: type[nnx.Param], value: Array, axes: tp.Any, config: TensorParallelConfig | None,
                 **metadata: tp.Any) -> nnx.Param:
    """A ``cls`` variable with ``semantic_axes=axes``; with ``config``, put on its mesh like ParallelLinear does."""
    if config is None:
        return cls(value, semantic_axes=axes, **metadata)
    spec = config.partition_axis.resolve(axes, shape=value.shape, mesh=config.mesh)
    value = jax.device_put(value, NamedSharding(config.mesh, spec))
    return cls(value, semantic_axes=axes, out_sharding=tuple(spec), eager_sharding=False, **metadata)


# -- the adapter layer --------------------------------------------------------------------------
def _lora_axes(kernel: nnx.Variable) -> tuple[DynamicShardingAxes, DynamicShardingAxes]:
    """Semantic axes of ``a``: (kernel input axis, EMPTY); of ``b``: (EMPTY, kernel output axis); a stacked
    kernel's leading axes (``LAYERS``) lead both."""
    axes = getattr(kernel, "semantic_axes", None)
    if axes is None:
        empty = (EMPTY,) * len(kernel.shape)
        return DynamicShardingAxes(empty, "__train__"), DynamicShardingAxes(empty, "__train__")
    entries, mode = axes if not hasattr(axes, "axes") else (axes.axes, axes.mode)
    lead, (d_in, d_out) = tuple(entries[:-2]), entries[-2:]
    return DynamicShardingAxes((*lead, d_in, EMPTY), mode), DynamicShardingAxes((*lead, EMPTY, d_out), mode)


class LoRALinear(nnx.Module):
    """``base(x) + (x @ lora_a @ lora_b) * alpha / rank`` around a linear layer ``base``.

    ``lora_a (in, rank)`` is drawn like Hugging Face PEFT's ``init_lora_weights="gaussian"``
    (normal, std ``1 / rank``); ``lora_b (rank, out)`` starts at zero, so the output is unchanged.
    ``alpha`` defaults to ``rank`` (scale 1). The base layer's attributes (``in_features``,
    ``direction``, ``parallel_config`` ...) read through. A stacked base (kernel ``(L, in, out)``,
    the model's scanned layers) gets stacked adapters ``(L, in, rank)`` and ``(L, rank, out)``:
    every layer its own adapter.
    """

    def __init__(self, base: nnx.Module, rank: int, *, alpha: float | None = None, dtype=None,
                 rngs: nnx.Rngs):
        rank = positive_int("LoRA rank", rank, what="an int >= 1 (e.g. 8)")
        kernel = base.kernel
        *lead, in_f, out_f = kernel.shape
        param_dtype = dtype or getattr(base, "param_dtype", None) or jnp.float32
        a_axes, b_axes = _lora_axes(kernel)
        config = getattr(base, "parallel_config", None)
        a = jax.random.normal(rngs.params(), (*lead, in_f, rank), jnp.float32) / rank
        self.base = base
        self.lora_a = placed_param(LoRAParam, a.astype(param_dtype), a_axes, config)
        self.lora_b = placed_param(LoRAParam, jnp.zeros((*lead, rank, out_f), param_dtype), b_axes, config)
        self.rank = rank
        self.alpha = float(rank if alpha is None else alpha)

    scale = property(lambda self: self.alpha / self.rank, doc="``alpha / rank``: the adapter's output scale.")
    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)
    use_bias = property(lambda self: self.base.use_bias)
    dtype = property(lambda self: self.base.dtype)
    param_dtype = property(lambda self: self.base.param_dtype)
    precision = property(lambda self: self.base.precision)
    direction = property(lambda self: self.base.direction)
    parallel_config = property(lambda self: self.base.parallel_config)

    def delta_kernel(self) -> Array:
        """``lora_a @ lora_b * scale`` in float32, shape ``([L,] in, out)``: what unwrapping adds to the kernel."""
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST) * self.scale

    def __call__(self, x: Array) -> Array:
        y = self.base(x)
        x, a, b = dtypes.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.base.dtype)
        delta = jnp.matmul(jnp.matmul(x, a, precision=self.precision), b, precision=self.precision)
        return y + (delta * jnp.asarray(self.scale, delta.dtype)).astype(y.dtype)


# -- model-level functions ----------------------------------------------------------------------
def apply_lora_to_layers(model: nnx.Module, rank: int, pattern: str = ".*", *, alpha: float | None = None,
                         rngs: nnx.Rngs | None = None, dtype=None) -> nnx.Module:
    """A new model with each ``ParallelLinear`` whose path matches ``pattern`` (``re.search`` on
    paths like ``layers/self_attn/q_proj``) wrapped in a :class:`LoRALinear`; ``model`` is untouched.
    The decoder layers are stacked, so a ``layers/...`` path covers every layer (each gets its own adapter).

    ``rngs`` draws the ``lora_a`` weights (default ``nnx.Rngs(0)``: reproducible); ``dtype`` is
    their param dtype (default the base layer's).
    """
    rank = positive_int("LoRA rank", rank, what="an int >= 1 (e.g. 8)")
    rngs = nnx.Rngs(0) if rngs is None else rngs
    wrapped = {id(layer.base) for _, _, layer in find_layers(model, LoRALinear)}
    for path, _, layer in find_layers(model, ParallelLinear):
        if id(layer) in wrapped and _compile(pattern).search(path):
            raise ValueError(f"{path} already sits inside a LoRALinear; call unwrap_lora_to_layers first, or "
                             f"pick a pattern that does not match '/base' paths")
    return map_layers(model, pattern, ParallelLinear,
                      lambda _, layer: LoRALinear(layer, rank, alpha=alpha, dtype=dtype, rngs=rngs),
                      what="apply_lora_to_layers")


def _lora_state(model: nnx.Module) -> nnx.State:
    state = nnx.state(model, LoRAParam)
    if not nnx.to_flat_state(state):
        raise ValueError("the model has no LoRA parameters; call apply_lora_to_layers(model, rank) first")
    return state


def split_lora_params(model: nnx.Module) -> tuple[nnx.State, nnx.State]:
    """``(lora_state, other_state)``: the :class:`LoRAParam` variables, and every other variable.

    Both hold copies of the model's variables, so editing them leaves ``model`` as it is.
    """
    _lora_state(model)
    _, lora, other = nnx.split(nnx.clone(model), LoRAParam, ...)
    return lora, other


def _value(v: tp.Any) -> tp.Any:
    return v[...] if isinstance(v, nnx.Variable) else v


def merge_lora_params(model: nnx.Module, lora_state: nnx.State | tp.Mapping) -> nnx.Module:
    """A new model with the LoRA values of ``lora_state`` (as :func:`split_lora_params` gives it, or
    the same nested dict of arrays). Each value is placed like the variable it replaces."""
    have = dict(nnx.to_flat_state(_lora_state(model)))
    state = lora_state if isinstance(lora_state, nnx.State) else nnx.State(lora_state)
    got = {path: _value(v) for path, v in nnx.to_flat_state(state)}
    missing, extra = sorted(set(have) - set(got), key=str), sorted(set(got) - set(have), key=str)
    if missing or extra:
        show = lambda ps: ", ".join(_path_str(p) for p in ps[:4]) + (" ..." if len(ps) > 4 else "")
        raise ValueError(f"lora_state does not match the model's LoRA parameters: missing [{show(missing)}], "
                         f"unexpected [{show(extra)}]; pass the lora_state of split_lora_params on a model "
                         f"with the same adapters")
    bad = [f"{_path_str(p)}: {tuple(jnp.shape(got[p]))} (expected {var.shape})" for p, var in have.items()
           if tuple(jnp.shape(got[p])) != tuple(var.shape)]
    if bad:
        raise ValueError(f"lora_state has mis-shaped values: {'; '.join(bad[:4])}")
    new = nnx.clone(model)
    for path, var in nnx.to_flat_state(nnx.state(new, LoRAParam)):
        old, value = var[...], jnp.asarray(got[path], var.dtype)
        if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer) and \
                isinstance(old.sharding, NamedSharding):
            value = jax.device_put(value, old.sharding)
        var.set_value(value)  # ``new`` is a copy: the model passed in keeps its values
    return new


def _unwrap(path: str, layer: LoRALinear) -> nnx.Module:
    base = layer.base
    if not isinstance(base, ParallelLinear):
        raise ValueError(f"{path}: the base layer is a {type(base).__name__}, whose kernel cannot absorb the "
                         f"adapter exactly; unwrap_lora_to_layers before quantizing")
    kernel = base.kernel
    w = kernel[...]
    merged = (w.astype(jnp.float32) + layer.delta_kernel()).astype(w.dtype)
    if isinstance(w, jax.Array) and not isinstance(w, jax.core.Tracer):
        merged = jax.device_put(merged, w.sharding)
    kernel.set_value(merged)  # ``base`` belongs to the copy map_layers made
    return base


def unwrap_lora_to_layers(model: nnx.Module) -> nnx.Module:
    """A new model with each :class:`LoRALinear` replaced by its base layer, kernel ``W + a @ b * scale``."""
    return map_layers(model, ".*", LoRALinear, _unwrap, what="unwrap_lora_to_layers")
