"""Operations with backend kernels, a registry of implementations, and their outputs.

An operation (attention, mostly) is a class with a portable ``forward_native`` and
optional kernels per backend. Calling it dispatches on where the inputs live::

    TPU        -> forward_tpu  -> forward_native
    NVIDIA GPU -> forward_cuda -> forward_gpu -> forward_native
    AMD GPU    -> forward_rocm -> forward_gpu -> forward_native
    CPU        -> forward_cpu  -> forward_native

Implementations register under a name (plus aliases) and declare :class:`Capabilities`,
so callers and widgets can list what each supports before running it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing as tp
from abc import ABC, abstractmethod

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from workbench.core import axes as ax

FORCE_NATIVE_ENV = "WORKBENCH_FORCE_NATIVE"
BACKENDS = ("cpu", "cuda", "rocm", "tpu")


# -- outputs ---------------------------------------------------------------------------
def _is_array(x: tp.Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _encode(value: tp.Any) -> tp.Any:
    if _is_array(value):
        arr = np.asarray(value)
        return {"__array__": True, "dtype": str(arr.dtype), "shape": list(arr.shape),
                "data": arr.astype(np.float64 if arr.dtype.kind == "f" else arr.dtype).tolist()}
    return value


def _decode(value: tp.Any) -> tp.Any:
    if isinstance(value, dict) and value.get("__array__"):
        return jnp.asarray(np.asarray(value["data"]).reshape(value["shape"]), dtype=value["dtype"])
    return value


def static_field(**kwargs: tp.Any) -> tp.Any:
    """A dataclass field of an :class:`OperationOutput` that is metadata, not a traced array."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


@dataclasses.dataclass(frozen=True)
class OperationOutput:
    """Result of an operation: a frozen dataclass and a JAX pytree (returnable from ``jit``).

    Subclasses are dataclasses too; fields made with :func:`static_field` are pytree
    metadata (strings, flags), the others are leaves.
    """

    def __init_subclass__(cls, **kwargs: tp.Any):
        super().__init_subclass__(**kwargs)
        cls._pytree_registered = False

    @classmethod
    def _register(cls) -> None:
        if cls.__dict__.get("_pytree_registered"):
            return
        fields = dataclasses.fields(cls)
        jax.tree_util.register_dataclass(
            cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
            meta_fields=[f.name for f in fields if f.metadata.get("static")])
        cls._pytree_registered = True

    def __post_init__(self):
        type(self)._register()

    def to_dict(self) -> dict[str, tp.Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: tp.Mapping[str, tp.Any]) -> tp.Self:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {unknown}; fields are {sorted(names)}")
        return cls(**data)

    def to_json(self) -> str:
        """JSON with arrays as nested lists plus dtype and shape (exact for float32 and below)."""
        return json.dumps({k: _encode(v) for k, v in self.to_dict().items()})

    @classmethod
    def from_json(cls, text: str) -> tp.Self:
        return cls.from_dict({k: _decode(v) for k, v in json.loads(text).items()})

    def replace(self, **changes: tp.Any) -> tp.Self:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class AttentionOutput(OperationOutput):
    """Attention result. ``attention_outputs`` is BTHD; ``attention_weights`` BHTS or None.

    ``kernel_path`` names the kernel that actually ran, e.g. ``"flash/native"``.
    """

    attention_outputs: jax.Array | None = None
    attention_weights: jax.Array | None = None
    kernel_path: str | None = static_field(default=None)


# -- metadata and capabilities ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OperationMetadata:
    """Configuration shared by the implementations of an operation.

    ``backend`` overrides where a call dispatches ("cpu", "cuda", "rocm", "tpu");
    ``force_native`` runs ``forward_native`` whatever the backend (also set by the
    environment variable ``WORKBENCH_FORCE_NATIVE=1``), for debugging a kernel.
    ``options`` holds implementation-specific settings such as block sizes.
    """

    runtime_dtype: tp.Any = None
    runtime_softmax_dtype: tp.Any = jnp.float32
    softmax_scale: float | None = None
    dropout_prob: float = 0.0
    mesh: jax.sharding.Mesh | None = None
    partition_axis: ax.PartitionAxis = dataclasses.field(default_factory=ax.PartitionAxis)
    sequence_axis_name: str = "sp"
    backend: str | None = None
    force_native: bool = False
    options: tp.Mapping[str, tp.Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"OperationMetadata.backend={self.backend!r}; use one of {BACKENDS} or None "
                             f"(dispatch on where the inputs live)")

    def replace(self, **changes: tp.Any) -> OperationMetadata:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an implementation supports, declared up front and checked when called.

    ``features``: optional inputs/behaviours it honours (e.g. "causal", "gqa").
    ``dtypes``: input dtypes. ``backends``: where it has a kernel of its own (every
    implementation also runs ``forward_native`` anywhere). ``mesh_axes``: mesh axes it
    needs (ring attention needs "sp").
    """

    features: frozenset[str] = frozenset()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    backends: tuple[str, ...] = BACKENDS
    mesh_axes: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "features", frozenset(self.features))

    def supports(self, feature: str) -> bool:
        return feature in self.features


# -- operations -----------------------------------------------------------------------------
def platform_of(device: jax.Device) -> str:
    """"cpu", "tpu", "cuda" or "rocm" for a device (JAX calls both GPUs "gpu")."""
    if device.platform != "gpu":
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def _input_platform(args: tp.Any) -> str:
    for leaf in jax.tree_util.tree_leaves(args):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            devices = leaf.devices()
            if devices:
                return platform_of(next(iter(devices)))
    return platform_of(jax.devices()[0])  # traced inputs: the default backend


class BaseOperation(ABC):
    """An operation with a portable kernel and optional per-backend ones."""

    metadata: OperationMetadata

    def __init__(self, metadata: OperationMetadata | None = None):
        self.metadata = metadata if metadata is not None else OperationMetadata()

    @abstractmethod
    def forward_native(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        """The portable implementation, valid on every backend."""

    def forward_tpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_tt(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_gpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_gpu(*args, **kwargs)

    def forward_rocm(self, *args, **kwargs):
        return self.forward_gpu(*args, **kwargs)

    def dispatch_target(self, *args: tp.Any, **kwargs: tp.Any) -> str:
        """The name of the ``forward_*`` method a call with these inputs runs."""
        if self.metadata.force_native or os.environ.get(FORCE_NATIVE_ENV, "") not in ("", "0", "false"):
            return "forward_native"
        platform = self.metadata.backend or _input_platform((args, kwargs))
        return f"forward_{platform}" if hasattr(self, f"forward_{platform}") else "forward_native"

    def __call__(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        return getattr(self, self.dispatch_target(*args, **kwargs))(*args, **kwargs)


class OperationImpl(BaseOperation):
    """A registrable implementation: a name, aliases, capabilities and helpers."""

    capabilities: tp.ClassVar[Capabilities] = Capabilities()

    @classmethod
    @abstractmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        """The registry name; a tuple gives the canonical name first, then aliases."""

    def get_impl_metadata(self) -> OperationMetadata:
        return self.metadata

    @staticmethod
    def get_mode(query: jax.Array, BTHD: bool = True) -> str:
        """``MODE_DECODE`` when the query holds one position, else ``MODE_TRAIN``."""
        return ax.MODE_DECODE if query.shape[1 if BTHD else 2] == 1 else ax.MODE_TRAIN

    @staticmethod
    def repeat_kv_heads(key: jax.Array, value: jax.Array, num_reps: int) -> tuple[jax.Array, jax.Array]:
        """Repeat BTHD key/value heads ``num_reps`` times (GQA/MQA to full heads)."""
        return jnp.repeat(key, num_reps, axis=2), jnp.repeat(value, num_reps, axis=2)

    def create_stable_sharding(self, state_ps: PartitionSpec | None = None,
                               preserved_indices: tp.Sequence[int] | None = None,
                               clone_ps: PartitionSpec | None = None, dep: tp.Any = True,
                               tensor: jax.Array | None = None) -> PartitionSpec | None:
        """A spec keeping only ``preserved_indices`` of ``state_ps`` (or ``clone_ps``).

        With ``tensor`` and a mesh in the metadata, mesh axes that do not divide the
        tensor's dimensions are dropped, as :meth:`PartitionAxis.resolve` does.
        """
        if dep is None or state_ps is None:
            return None
        if preserved_indices is None:
            spec = state_ps
        else:
            source = state_ps if clone_ps is None else clone_ps
            spec = PartitionSpec(*(source[i] if i in preserved_indices else None
                                   for i in range(len(state_ps))))
        if tensor is None or self.metadata.mesh is None:
            return spec
        return ax.fit_spec(spec, tensor.shape, self.metadata.mesh)


# -- registry -----------------------------------------------------------------------------------
_I = tp.TypeVar("_I", bound=type[OperationImpl])


class OperationRegistry:
    """Implementations by name. Register with ``@OperationRegistry.register``."""

    _registry: tp.ClassVar[dict[str, type[OperationImpl]]] = {}
    _canonical: tp.ClassVar[dict[str, str]] = {}  # every name -> canonical name

    @classmethod
    def register(cls, impl_cls: _I | None = None, *, override: bool = False) -> tp.Any:
        """Register an implementation under its ``get_impl_name()`` names.

        Use bare (``@OperationRegistry.register``) or with ``override=True`` to replace a
        registered name, e.g. when re-running a notebook cell.
        """
        def add(impl: _I) -> _I:
            if not (isinstance(impl, type) and issubclass(impl, OperationImpl)):
                raise TypeError(f"OperationRegistry.register takes an OperationImpl subclass; got {impl!r}")
            raw = impl.get_impl_name()
            names = (raw,) if isinstance(raw, str) else tuple(raw)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"{impl.__name__}.get_impl_name() must return a non-empty name or tuple "
                                 f"of names; got {raw!r}")
            taken = [n for n in names if n in cls._registry and cls._registry[n] is not impl]
            if taken and not override:
                owners = ", ".join(f"{n!r} by {cls._registry[n].__name__}" for n in taken)
                raise ValueError(f"cannot register {impl.__name__}: {owners} already registered. Pass "
                                 f"override=True to replace it (e.g. when re-running a notebook cell), "
                                 f"or choose another name")
            for owner in {cls._registry[n] for n in taken}:  # replacing: drop each old owner's other names too
                cls._unregister(owner)
            for n in names:
                cls._registry[n] = impl
                cls._canonical[n] = names[0]
            return impl

        return add if impl_cls is None else add(impl_cls)

    @classmethod
    def _unregister(cls, impl: type[OperationImpl]) -> None:
        for n in [n for n, owner in cls._registry.items() if owner is impl]:
            del cls._registry[n], cls._canonical[n]

    @classmethod
    def unregister(cls, name: str) -> None:
        """Remove an implementation and all of its aliases."""
        cls._unregister(cls.get(name))

    @classmethod
    def get(cls, name: str) -> type[OperationImpl]:
        if name not in cls._registry:
            names = cls.list_implementations(include_aliases=True)
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"no operation implementation named {name!r}.{hint} Registered: {names}")
        return cls._registry[name]

    @classmethod
    def create(cls, name: str, metadata: OperationMetadata | None = None) -> OperationImpl:
        return cls.get(name)(metadata)

    @classmethod
    def canonical_name(cls, name: str) -> str:
        cls.get(name)
        return cls._canonical[name]

    @classmethod
    def list_implementations(cls, include_aliases: bool = False) -> list[str]:
        names = cls._registry if include_aliases else set(cls._canonical.values())
        return sorted(names)

    @classmethod
    def capabilities(cls, name: str) -> Capabilities:
        return cls.get(name).capabilities

    @classmethod
    def supporting(cls, feature: str) -> list[str]:
        """Canonical names of the implementations whose capabilities include ``feature``."""
        return [n for n in cls.list_implementations() if cls._registry[n].capabilities.supports(feature)]
