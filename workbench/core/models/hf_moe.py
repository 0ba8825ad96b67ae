"""Hugging Face's names and layouts of a mixture of experts' tensors, in one place: the per-expert names
each family writes to disk (:data:`EXPERTS_ON_DISK`), transformers' fused in-memory form
(:data:`FUSED_EXPERTS`), and the conversions to and from our :class:`.moe.MoE` parameters
``router_kernel (D, E)``, ``gate_proj (E, D, F)``, ``up_proj (E, D, F)``, ``down_proj (E, F, D)``: for one
block (:func:`from_hf_moe`, :func:`load_hf_moe` and inverses) and for a layer of a whole checkpoint
(:func:`read_experts`, :func:`moe_tensors`, used by :mod:`.hf_convert`).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workbench.core.models.config import ModelConfig
from workbench.core.models.hf_entry import Entry
from workbench.core.models.moe import MoE

MIXTRAL = ("w1", "w3", "w2")  # Mixtral's per-expert gate / up / down on disk
# Per-expert tensor names on disk: (module under the layer, names of gate / up / down)
EXPERTS_ON_DISK = {"mixtral": ("block_sparse_moe", MIXTRAL),
                   "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                   "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# transformers' in-memory experts under the block's `mlp` (GPT-OSS also on disk): (E, 2F, D) and (E, D, F)
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
EXPERT_KINDS = ("router", "gate", "up", "down")  # hf_convert.Entry kinds that this module reads and writes


# -- one layer of a whole checkpoint --------------------------------------------------------------------
def read_experts(config: ModelConfig, entry: Entry, read: tp.Callable[[str], np.ndarray],
                 has: tp.Callable[[str], bool]) -> np.ndarray:
    """A layer's router ``(D, E)`` or experts ``(E, in, out)`` (``entry.kind``) from a checkpoint, per-expert on
    disk or fused in memory; ``entry.name`` is the layer (``model.layers.3``)."""
    module, disk_names = EXPERTS_ON_DISK[config.model_type]
    legacy = f"{entry.name}.{module}"
    if entry.kind == "router":  # on disk under `module`; transformers 5's in-memory state dict under `mlp`
        key = f"{legacy}.gate.weight" if has(f"{legacy}.gate.weight") else f"{entry.name}.mlp.gate.weight"
        return read(key).T
    which = ("gate", "up", "down").index(entry.kind)
    w = disk_names[which]
    if has(f"{legacy}.experts.0.{w}.weight"):  # one (out, in) tensor per expert
        return np.stack([read(f"{legacy}.experts.{j}.{w}.weight").T for j in range(config.num_local_experts)])
    return from_hf_experts(*(read(f"{entry.name}.mlp.{name}") for name in FUSED_EXPERTS))[which]


def expected_expert_names(config: ModelConfig, entry: Entry) -> str:
    """The checkpoint names a router / experts entry reads, for error messages."""
    module, (gate, up, down) = EXPERTS_ON_DISK[config.model_type]
    w = {"router": "gate.weight", "gate": f"experts.*.{gate}.weight", "up": f"experts.*.{up}.weight",
         "down": f"experts.*.{down}.weight"}[entry.kind]
    return f"{entry.name}.{module}.{w}"


def moe_tensor_names(config: ModelConfig, entry: Entry) -> list[str]:
    """The on-disk names of one layer's router (one tensor) or experts (one per expert)."""
    module, disk_names = EXPERTS_ON_DISK[config.model_type]
    if entry.kind == "router":
        return [f"{entry.name}.{module}.gate.weight"]
    w = disk_names[("gate", "up", "down").index(entry.kind)]
    return [f"{entry.name}.{module}.experts.{j}.{w}.weight" for j in range(config.num_local_experts)]


# -- one MoE block ---------------------------------------------------------------------------------------
def _xp(a: tp.Any) -> tp.Any:
    return jnp if isinstance(a, jax.Array) else np


def from_hf_experts(gate_up_proj_EXD: tp.Any, down_proj_EDF: tp.Any) -> tuple[tp.Any, tp.Any, tp.Any]:
    """HF's fused ``experts.gate_up_proj (E, 2F, D)`` (gate rows first) and ``experts.down_proj (E, D, F)``
    -> ours ``(gate (E, D, F), up (E, D, F), down (E, F, D))``. NumPy in, NumPy out; jax in, jax out."""
    E, X, D = gate_up_proj_EXD.shape
    if X % 2 or down_proj_EDF.shape != (E, D, X // 2):
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj_EXD.shape)} and down_proj {tuple(down_proj_EDF.shape)} "
                         f"must be (E, 2F, D) and (E, D, F)")
    F = X // 2
    gate_up_EDX = gate_up_proj_EXD.swapaxes(1, 2)
    return gate_up_EDX[..., :F], gate_up_EDX[..., F:], down_proj_EDF.swapaxes(1, 2)


def to_hf_experts(gate_EDF: tp.Any, up_EDF: tp.Any, down_EFD: tp.Any) -> tuple[tp.Any, tp.Any]:
    """Inverse of :func:`from_hf_experts`: ``(gate_up_proj (E, 2F, D), down_proj (E, D, F))``."""
    xp = _xp(gate_EDF)
    return xp.concatenate([gate_EDF, up_EDF], axis=2).swapaxes(1, 2), down_EFD.swapaxes(1, 2)


def from_legacy_experts(tensors: tp.Mapping[str, tp.Any], prefix: str = "", names: tuple[str, str, str] = MIXTRAL
                        ) -> tuple[tp.Any, tp.Any, tp.Any]:
    """Per-expert on-disk tensors ``{prefix}{j}.{name}.weight`` for ``names`` = (gate ``(F, D)``, up ``(F, D)``,
    down ``(D, F)``), Mixtral's ``w1``, ``w3``, ``w2`` by default -> ours ``(gate (E, D, F), up (E, D, F),
    down (E, F, D))``. ``prefix`` ends with ``experts.``."""
    E = 0
    while f"{prefix}{E}.{names[0]}.weight" in tensors:
        E += 1
    wanted = [f"{prefix}{j}.{w}.weight" for j in range(E) for w in names]
    missing = [n for n in wanted if n not in tensors]
    if not E or missing:
        raise ValueError(f"no complete per-expert weights under prefix {prefix!r}: missing "
                         f"{missing[:3] or [f'{prefix}0.{names[0]}.weight']}; pass the prefix ending in 'experts.'")
    stack = lambda w: _xp(tensors[f"{prefix}0.{w}.weight"]).stack(
        [tensors[f"{prefix}{j}.{w}.weight"] for j in range(E)]).swapaxes(1, 2)
    return tuple(stack(w) for w in names)


def to_legacy_experts(gate_EDF: tp.Any, up_EDF: tp.Any, down_EFD: tp.Any, prefix: str = "",
                      names: tuple[str, str, str] = MIXTRAL) -> dict[str, tp.Any]:
    """Inverse of :func:`from_legacy_experts`: ``{prefix}{j}.{name}.weight`` per expert ``j``."""
    out = {}
    for j in range(gate_EDF.shape[0]):
        for name, value in zip(names, (gate_EDF, up_EDF, down_EFD), strict=True):
            out[f"{prefix}{j}.{name}.weight"] = value[j].T
    return out


def from_hf_moe(tensors: tp.Mapping[str, tp.Any], prefix: str = "") -> dict[str, tp.Any]:
    """Our parameters (by name) from an HF MoE block's tensors under ``prefix`` (``model.layers.0.mlp.``
    in transformers 5, ``...block_sparse_moe.`` on disk): router ``gate.weight (E, D)`` and the experts,
    fused (``experts.gate_up_proj``, ``experts.down_proj``) or per expert (``experts.{j}.w1.weight`` ...)."""
    router = f"{prefix}gate.weight"
    if router not in tensors:
        raise ValueError(f"no router weight {router!r}; pass the prefix of the MoE block (ending in '.')")
    fused = [f"{prefix}{name}" for name in FUSED_EXPERTS]
    if fused[0] in tensors:
        experts = from_hf_experts(*(tensors[name] for name in fused))
    else:
        experts = from_legacy_experts(tensors, f"{prefix}experts.")
    return dict(zip(("router_kernel", "gate_proj", "up_proj", "down_proj"), (tensors[router].T, *experts),
                    strict=True))


def to_hf_moe(params: tp.Mapping[str, tp.Any], prefix: str = "", *, legacy: bool = False) -> dict[str, tp.Any]:
    """Inverse of :func:`from_hf_moe`: fused transformers-5 names, or the per-expert on-disk ones."""
    experts = params["gate_proj"], params["up_proj"], params["down_proj"]
    out = {f"{prefix}gate.weight": params["router_kernel"].T}
    if legacy:
        return out | to_legacy_experts(*experts, prefix=f"{prefix}experts.")
    return out | {f"{prefix}{name}": value for name, value in zip(FUSED_EXPERTS, to_hf_experts(*experts), strict=True)}


def load_hf_moe(module: MoE, tensors: tp.Mapping[str, tp.Any], prefix: str = "") -> MoE:
    """A copy of ``module`` holding the HF weights under ``prefix`` (cast to its param_dtype)."""
    new = nnx.merge(*nnx.split(module))
    for name, value in from_hf_moe(tensors, prefix).items():
        old = getattr(new, name)
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(f"{name}: HF weights give shape {tuple(value.shape)} but the module has "
                             f"{tuple(old.shape)}; build MoE with the checkpoint's sizes")
        setattr(new, name, nnx.Param(jnp.asarray(value, new.param_dtype), semantic_axes=old.semantic_axes))
    return new
