"""Device meshes: simulated CPU devices, the six-axis workbench mesh, multi-process start.

Axis order ``(pp, dp, fsdp, ep, tp, sp)``: outermost first. ``jax.make_mesh`` gives the last axes the
closest devices, so the axes that talk most (tp, sp) sit on the fastest links and pipeline stages (pp),
which pass only activations between neighbours, on the slowest.

Axis types: :func:`make_mesh` builds ``AxisType.Auto`` axes by default (``jax.make_mesh``
defaults to ``Explicit`` since JAX 0.7). With Auto axes, shardings are annotations and
XLA's GSPMD propagation chooses the rest and inserts the collectives: that is what the
workbench shows and teaches (``inspect.collectives``), and what parameter annotations
through ``PartitionAxis`` rely on. Pass ``axis_types=AxisType.Explicit`` to study
sharding-in-types, where JAX refuses ambiguous shardings instead of choosing.

The models are written for Auto axes (annotations, GSPMD chooses). On Explicit-typed arrays they run
through :func:`call_on_auto_axes`, JAX's ``auto_axes`` bridge: inputs keep their layout but lose the
sharding from their types, the body runs as on Auto axes, and the outputs get types back.
"""

from __future__ import annotations

import math
import os
import re
import typing as tp

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from workbench.core.checks import is_positive_int, positive_int

MESH_AXES = ("pp", "dp", "fsdp", "ep", "tp", "sp")


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether backends started

    return xla_bridge.backends_are_initialized()


def simulate_devices(n: int) -> None:
    """Make JAX's CPU backend expose ``n`` devices. Call before any JAX computation.

    Simulated devices shard arrays and run real collectives (not faster: they share the
    host's cores). If the backend already started with another count, raises
    ``RuntimeError``: restart the kernel and call this first.
    """
    n = positive_int("simulate_devices(n)", n)
    if _backends_started():
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"JAX already started with {have} CPU device(s), so it cannot switch to {n}. Restart the "
            f"kernel (or Python process) and call workbench.simulate_devices({n}) before any JAX "
            f"computation, or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting.")
    jax.config.update("jax_num_cpu_devices", n)
    # Child processes (notebook kernels started from here, subprocess tests) see the same count.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={n}".strip()


def _sizes(pp: int, dp: int, fsdp: int, ep: int, tp: int, sp: int, n: int) -> tuple[int, ...]:
    sizes = dict(pp=pp, dp=dp, fsdp=fsdp, ep=ep, tp=tp, sp=sp)
    for name, size in sizes.items():
        if not (is_positive_int(size) or size == -1):
            raise ValueError(f"make_mesh: {name}={size!r}; each axis size is a positive int, or -1 for "
                             f"'the rest of the devices' on one axis")
    inferred = [name for name, size in sizes.items() if size == -1]
    example = f"make_mesh(fsdp=-1, tp={2 if n % 2 == 0 else 1}) on {n} devices"
    if len(inferred) > 1:
        other = next(name for name in inferred if name != "fsdp")
        hint = (f"fsdp defaults to -1, so pass fsdp=1 with {other}=-1" if "fsdp" in inferred
                else f"e.g. {example}")
        raise ValueError(f"make_mesh: {' and '.join(inferred)} are both -1; at most one axis may be inferred "
                         f"({hint})")
    known = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if n % known:
            raise ValueError(f"make_mesh: the fixed axes multiply to {known}, which does not divide the "
                             f"{n} devices, so {inferred[0]}=-1 cannot be inferred (e.g. {example})")
        sizes[inferred[0]] = n // known
    elif known != n:
        raise ValueError(f"make_mesh: pp*dp*fsdp*ep*tp*sp = {known} but there are {n} devices; the product must "
                         f"equal the device count (e.g. {example}, or set one axis to -1)")
    return tuple(sizes.values())


def make_mesh(dp: int = 1, fsdp: int = -1, ep: int = 1, tp: int = 1, sp: int = 1, *, pp: int = 1,
              devices: tp.Sequence[jax.Device] | None = None,
              axis_types: AxisType = AxisType.Auto) -> Mesh:
    """A mesh with axes ``(pp, dp, fsdp, ep, tp, sp)`` over all devices; one size may be -1.

    >>> dict(make_mesh(dp=2, tp=4).shape)  # 8 devices: fsdp=-1 takes what is left
    {'pp': 1, 'dp': 2, 'fsdp': 1, 'ep': 1, 'tp': 4, 'sp': 1}

    ``pp`` is the pipeline-stage axis (see :mod:`workbench.core.pipeline`); keyword-only, so the
    positional order of the other five is unchanged.

    ``devices`` defaults to ``jax.devices()``, every device of every process, so under
    ``jax.distributed`` the mesh is global. ``jax.make_mesh`` orders devices to suit the
    physical topology on TPU and GPU.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = _sizes(pp, dp, fsdp, ep, tp, sp, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_types,) * len(MESH_AXES), devices=devices)


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           *, local_device_count: int | None = None) -> None:
    """Join a multi-process JAX job (``jax.distributed.initialize``), CPU-ready.

    On CPU, collectives across processes need an implementation: this selects gloo. With
    ``local_device_count``, each process simulates that many CPU devices. Afterwards
    ``make_mesh`` spans the devices of all processes.
    """
    if local_device_count is not None:
        simulate_devices(local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def describe_mesh(mesh: Mesh | jax.sharding.AbstractMesh) -> str:
    """One line: axis sizes, device count, platform and processes (an abstract mesh has only sizes)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
        return f"AbstractMesh({axes}): {mesh.size} devices, shapes only"
    devices = mesh.devices.flat
    platforms = sorted({d.platform for d in devices})
    processes = sorted({d.process_index for d in mesh.devices.flat})
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    types = "/".join(sorted({t.name for t in mesh.axis_types}))
    return (f"Mesh({axes}): {mesh.size} {'/'.join(platforms)} device(s), {len(processes)} process(es), "
            f"{types} axes")


# -- Explicit axes ------------------------------------------------------------------------------------
def explicit_mesh_of(tree: tp.Any) -> Mesh | AbstractMesh | None:
    """The mesh of the first leaf of ``tree`` whose type carries Explicit axes (``jax.typeof(x)`` shows
    ``8@dp``), or None when no leaf has any (Auto meshes, unsharded values). A placed array gives its
    concrete Mesh, a tracer or a ``ShapeDtypeStruct`` the AbstractMesh of its type."""
    for leaf in jax.tree.leaves(tree):
        mesh = None
        if isinstance(leaf, jax.ShapeDtypeStruct | jax.Array) and not isinstance(leaf, jax.core.Tracer):
            sharding = getattr(leaf, "sharding", None)
            mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        else:
            try:
                mesh = jax.typeof(leaf).sharding.mesh
            except (TypeError, AttributeError):  # not an array (a Python scalar, ...)
                mesh = None
        if mesh is not None and not mesh.empty and mesh.explicit_axes:
            return mesh
    return None


def as_auto(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """``mesh`` (same devices, names and sizes) with its Explicit axes made Auto; Manual axes stay."""
    return mesh.update(axis_types=tuple(AxisType.Auto if t == AxisType.Explicit else t for t in mesh.axis_types))


def explicit_spec(spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> PartitionSpec:
    """``spec`` keeping only ``mesh``'s Explicit axes, as JAX keeps them in a type."""
    keep = set(mesh.explicit_axes)
    entries = []
    for entry in spec:
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in keep)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def call_on_auto_axes(fn: tp.Callable[..., tp.Any], args: tuple, mesh: Mesh | AbstractMesh,
                      out_specs: tp.Callable[[tp.Any], tp.Any]) -> tp.Any:
    """``fn(*args)`` run as on Auto axes, for code written for GSPMD called on Explicit-typed ``args``.

    What ``jax.sharding.auto_axes`` does, with the output specs computed from the outputs:
    ``out_specs(out)`` gives a PartitionSpec per output leaf (a pytree like ``out``), laid out on
    ``mesh``'s Explicit axes (other axes are dropped, as JAX drops them from types). ``mesh`` is the
    Explicit mesh (concrete or abstract); inside ``fn`` the context mesh is :func:`as_auto` of it, so
    ``fn`` must place and constrain on ``as_auto(mesh)``.
    """
    abstract = mesh.abstract_mesh
    auto = as_auto(abstract)
    unsharded = lambda x: PartitionSpec(*(None,) * jax.typeof(x).ndim)
    with jax.sharding.use_abstract_mesh(auto):
        args = jax.sharding.reshard(args, jax.tree.map(unsharded, args))
        out = fn(*args)
    specs = out_specs(out)
    return jax.tree.map(lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, explicit_spec(spec, mesh))),
                        out, specs)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_sizes(mesh_shape: tp.Mapping[str, int] | None, what: str = "mesh") -> dict[str, int]:
    """``{"fsdp": 16, "tp": 4}`` -> the size of each of :data:`MESH_AXES` (1 where not named), or a ValueError
    naming an unknown axis or a size that is no positive int."""
    mesh_shape = dict(mesh_shape or {})
    unknown = sorted(set(mesh_shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"{what} names axes {unknown}; the workbench's mesh axes are {MESH_AXES}")
    bad = {a: n for a, n in mesh_shape.items() if not is_positive_int(n)}
    if bad:
        raise ValueError(f"{what} sizes are positive ints; got {bad}")
    return {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}


def mesh_factorizations(n_devices: int, axis_names: tp.Sequence[str] = MESH_AXES) -> list[dict[str, int]]:
    """Every mesh shape over ``axis_names`` whose sizes multiply to ``n_devices``, in lexicographic order.

    >>> len(mesh_factorizations(8)), mesh_factorizations(4, ("dp", "tp"))
    (56, [{'dp': 1, 'tp': 4}, {'dp': 2, 'tp': 2}, {'dp': 4, 'tp': 1}])
    """
    n_devices = positive_int("n_devices", n_devices)
    names = tuple(axis_names)

    def rec(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(d, *rest) for d in divisors(n) for rest in rec(n // d, k - 1)]

    if not names:
        return [{}] if n_devices == 1 else []
    return [dict(zip(names, sizes, strict=True)) for sizes in rec(n_devices, len(names))]


def mesh_of(tree: tp.Any) -> Mesh | AbstractMesh | None:
    """The mesh of the first ``NamedSharding`` leaf of ``tree``, or None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None
