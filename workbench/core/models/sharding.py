"""Model parameters -> PartitionSpecs, NamedShardings, placed or abstract models.

Every parameter carries ``semantic_axes``; a :class:`PartitionAxis` (semantic -> mesh axes),
the runtime ``mode`` and optional regex ``rules`` (first match wins, applied to the path
``"layers/self_attn/q_proj/kernel"``, giving semantic axes instead of the parameter's own)
resolve them on a mesh, with a reason per dimension (:func:`explain_params`). The decoder blocks'
parameters are stacked (``layers/self_attn/q_proj/kernel`` is ``(L, D, H*Dh)``, its first axis
``LAYERS``); a rule may give the axes of one layer's parameter and ``LAYERS`` is put in front.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import typing as tp

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.axes import LAYERS, MODE_TRAIN, DimDecision, DynamicShardingAxes, PartitionAxis
from workbench.core.models.block import AttentionContext
from workbench.core.models.moe import MoE

Rules = tp.Sequence[tuple[str, tp.Any]]


def path_str(path: tuple[tp.Any, ...]) -> str:
    return "/".join(map(str, path))


def _check_rules(rules: Rules | None) -> list[tuple[re.Pattern, tp.Any]]:
    compiled = []
    for item in rules or ():
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"a rule is (regex, semantic axes), e.g. ('mlp/.*/kernel', ColumnWise); got {item!r}")
        try:
            compiled.append((re.compile(item[0]), item[1]))
        except re.error as err:
            raise ValueError(f"rule regex {item[0]!r} does not compile: {err}") from None
    return compiled


def _per_layer_rule(rule_axes: tp.Any, own_axes: tp.Any, ndim: int) -> tp.Any:
    """A rule written for one layer's parameter, applied to the stacked one: ``LAYERS`` goes in front."""
    entries, mode = (rule_axes.axes, rule_axes.mode) if hasattr(rule_axes, "axes") else (rule_axes, None)
    own = getattr(own_axes, "axes", own_axes) or ()
    entries = tuple(entries) if isinstance(entries, list | tuple) else (entries,)
    if own and own[0] == LAYERS and LAYERS not in entries and len(entries) == ndim - 1:
        entries = (LAYERS, *entries)
        return entries if mode is None else DynamicShardingAxes(entries, mode)
    return rule_axes


_REMEMBERED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("remembered_params", default=None)


@contextlib.contextmanager
def remembered_params() -> tp.Iterator[None]:
    """Inside it, :func:`flat_params` flattens each model once: a layout search resolves the same (abstract,
    unchanging) model on thousands of meshes. Only for models nothing mutates while it is open."""
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def flat_params(model: nnx.Module) -> list[tuple[tp.Any, tp.Any]]:
    """``model``'s parameters as ``(path, variable)`` in tree order (``nnx.to_flat_state``), remembered inside
    :func:`remembered_params`."""
    memo = _REMEMBERED.get()
    if memo is None:
        return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    key = id(model)
    if key not in memo:
        memo[key] = (model, list(nnx.to_flat_state(nnx.state(model, nnx.Param))))  # the model kept: ids stay unique
    return memo[key][1]


def explain_params(model: nnx.Module, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
                   partition_axis: PartitionAxis | None = None, mode: str = MODE_TRAIN,
                   rules: Rules | None = None) -> dict[str, list[DimDecision]]:
    """Per parameter path, how each dimension resolves and why (a rule's pattern is named in the reason)."""
    pa = partition_axis or PartitionAxis()
    compiled = _check_rules(rules)
    out = {}
    for path, var in flat_params(model):
        name = path_str(path)
        axes, why = getattr(var, "semantic_axes", None), ""
        for pattern, rule_axes in compiled:
            if pattern.search(name):
                axes, why = rule_axes, f" (rule {pattern.pattern!r})"
                break
        if axes is None:
            raise ValueError(f"parameter {name} has no semantic_axes; add a rule for it")
        if why:
            axes = _per_layer_rule(axes, getattr(var, "semantic_axes", None), len(var.shape))
        try:
            decisions = pa.explain(axes, mode, shape=var.shape, mesh=mesh)
        except (ValueError, TypeError) as err:
            raise ValueError(f"parameter {name} {tuple(var.shape)}{why}: {err}") from None
        out[name] = [d.__class__(**{**d.__dict__, "reason": d.reason + why}) if why else d for d in decisions]
    return out


def param_specs(model: nnx.Module, mesh=None, partition_axis: PartitionAxis | None = None, mode: str = MODE_TRAIN,
                rules: Rules | None = None) -> dict[str, PartitionSpec]:
    """Per parameter path, its PartitionSpec."""
    return {name: PartitionSpec(*(d.spec_entry for d in ds))
            for name, ds in explain_params(model, mesh, partition_axis, mode, rules).items()}


def params_sharding(model: nnx.Module, mesh: jax.sharding.Mesh, partition_axis: PartitionAxis | None = None,
                    mode: str = MODE_TRAIN, rules: Rules | None = None) -> nnx.State:
    """An ``nnx.State`` shaped like the parameters holding each one's ``NamedSharding``."""
    specs = param_specs(model, mesh, partition_axis, mode, rules)
    state = nnx.state(model, nnx.Param)
    return nnx.map_state(lambda path, var: var.replace(NamedSharding(mesh, specs[path_str(path)])), state)


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, partition_axis: PartitionAxis | None = None,
                mode: str = MODE_TRAIN, rules: Rules | None = None) -> nnx.Module:
    """A copy of ``model`` with every parameter placed by its resolved spec, knowing its mesh (see
    :func:`with_mesh`); ``model`` is unchanged."""
    shardings = params_sharding(model, mesh, partition_axis, mode, rules)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    placed = jax.tree.map(_place, params, shardings)
    return with_mesh(nnx.merge(graphdef, placed, rest), mesh, partition_axis)


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` placed with ``sharding``. From CPU memory, each shard is cut on the host: XLA:CPU's reshard of a
    one-device array onto a mesh is ~20x slower (2.5 s for a 106 MB stacked kernel onto 8 devices)."""
    if isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices()) and x.sharding != sharding:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.device_put(x, sharding)


def with_mesh(model: nnx.Module, mesh: jax.sharding.Mesh | None, partition_axis: PartitionAxis | None = None
              ) -> nnx.Module:
    """A model (sharing ``model``'s arrays) that constrains its hidden states to the layout
    ``partition_axis`` gives ``ACTIVATION_AXES`` on ``mesh`` at every layer (None: no constraint).

    Inside the layer scan XLA would otherwise choose the loop carry's sharding on its own, and for
    small batches it replicates the batch and splits the weights' contraction instead of gathering
    FSDP weights; pinning the batch (and sequence) split keeps data/FSDP/sequence parallelism what
    they are meant to be.
    """
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    pa = None if mesh is None else (partition_axis or PartitionAxis())
    if hasattr(new, "mesh"):
        new.mesh, new.partition_axis = mesh, pa

    for _, module in nnx.iter_modules(new):
        # the alltoall MoE strategy and sequence-parallel attention run shard_maps over this mesh
        if isinstance(module, MoE | AttentionContext):
            module.mesh, module.partition_axis = mesh, pa
    return new


def gather_model(model: nnx.Module, device: jax.Device | None = None) -> nnx.Module:
    """A copy of ``model`` with every array whole on one device (default: the first)."""
    device = device or jax.devices()[0]
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), state))


def lazy_init(build: tp.Callable[[], nnx.Module], mesh: jax.sharding.Mesh | None = None,
              partition_axis: PartitionAxis | None = None, mode: str = MODE_TRAIN,
              rules: Rules | None = None) -> nnx.Module:
    """The abstract model ``build()`` would make: parameters are ``ShapeDtypeStruct``s (with their
    ``NamedSharding`` when a mesh is given); no memory is allocated."""
    abstract = nnx.eval_shape(build)
    if mesh is None:
        return abstract
    abstract = with_mesh(abstract, mesh, partition_axis)
    specs = param_specs(abstract, mesh, partition_axis, mode, rules)
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                           sharding=NamedSharding(mesh, specs[path_str(path)])))
    return abstract
