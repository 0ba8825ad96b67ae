"""Virtual clusters: the chips a cluster is made of, how many, and the networks between them.

A :class:`Cluster` is data: its chip (a :class:`~workbench.core.cost.chips.Hardware`: peak FLOP/s per dtype,
HBM capacity and bandwidth), its device count and its network levels (:class:`NetworkLevel`): a TPU
slice's ICI torus (axes with or without wraparound) and the DCN between slices; a GPU cluster's NVLink
inside a node and the inter-node network beside it. Build one with :meth:`Cluster.tpu`,
:meth:`Cluster.h100`, :meth:`Cluster.h200` or :meth:`Cluster.cpu`:

>>> c = Cluster.tpu("v5p:4x4x4")
>>> c.num_devices, c.torus
(64, (TorusAxis(size=4, wraparound=True), TorusAxis(size=4, wraparound=True), TorusAxis(size=4, wraparound=True)))
>>> c.valid_mesh_shapes(2)
((1, 64), (4, 16), (16, 4), (64, 1))
>>> Cluster.h100(nodes=8).num_devices
64

:func:`cluster_mesh` (or :meth:`Cluster.mesh`) gives the mesh to place a program's abstract arguments on
(a TPU slice's compile-only devices, :func:`tpu_devices`), and :func:`workbench.core.compile.virtual.compile_on`
compiles the program for the cluster (TPU: XLA's TPU compiler, ahead of time; else a worker process with as
many simulated CPU devices).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import re
import typing as tp

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from workbench.core.compile.xla_log import xla_log_lines
from workbench.core.cost.chips import H100, H200, RING, SWITCH, TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E, Hardware
from workbench.core.mesh import mesh_factorizations
from workbench.core.units import format_bytes

TPU_AOT_HINT = 'pip install "jax-workbench[tpu-aot]"'
MAX_SIMULATED_DEVICES = 1024


@dataclasses.dataclass(frozen=True)
class TorusAxis:
    """One physical axis of an ICI torus: its chips, and whether its ends are linked (a ring) or not (a line)."""

    size: int
    wraparound: bool


@dataclasses.dataclass(frozen=True)
class NetworkLevel:
    """One network a collective can cross.

    ``bandwidth`` is bytes/s in one direction ``per`` "link" (one ICI link), "chip" (a GPU's NVLink egress),
    "node" (a GPU node's inter-node NICs together) or "host" (a TPU host's DCN NICs); ``latency_s`` is per
    hop. ``kind``: "torus" (nearest-neighbour links along ``Cluster.torus``) or "switch" (any to any).
    """

    name: str
    kind: str
    bandwidth: float
    per: str
    latency_s: float


@dataclasses.dataclass(frozen=True)
class _TpuGeneration:
    chip: Hardware
    ndim: int  # torus dimensions of a slice's topology string
    pod: tuple[int, ...]  # the largest slice
    chips_per_host: int
    devices_per_chip: int  # JAX devices per chip: 1 (v4 and v5p run their two TensorCores as one "megacore")
    dcn_per_host: float  # bytes/s one way
    shapes: tuple[str, ...] | None = None  # every allowed shape, where the docs list them all


# ICI per-hop latency: the scaling book ("How to Think About TPUs" and "All About Rooflines"): ~1 us per hop.
ICI_HOP_S = 1e-6
# Google Cloud TPU docs, v5e and v6e pages ("Supported configurations"): the 2D slice shapes; per-host NICs
# 2 x 100 Gbps (v5e, 8 chips per host) and 4 x 200 Gbps (v6e, 8 chips per host). v4 / v5p pages: 3D slices
# of 4 chips per host, pods of 16x16x16 (v4) and 16x20x28 (v5p), topologies AxBxC. v4 / v5p DCN per host:
# assumed 2.5e10 B/s (the scaling book's ~6.25e9 B/s per chip, 4 chips per host). DCN latency assumed 10 us.
_2D_SHAPES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
TPU_GENERATIONS: dict[str, _TpuGeneration] = {
    "v4": _TpuGeneration(TPU_V4, 3, (16, 16, 16), 4, 1, 2.5e10),
    "v5p": _TpuGeneration(TPU_V5P, 3, (16, 20, 28), 4, 1, 2.5e10),
    "v5e": _TpuGeneration(TPU_V5E, 2, (16, 16), 8, 1, 2 * 100e9 / 8, _2D_SHAPES),
    "v6e": _TpuGeneration(TPU_V6E, 2, (16, 16), 8, 1, 4 * 200e9 / 8, _2D_SHAPES),
}
DCN_LATENCY_S = 1e-5
# NVIDIA DGX H100 / H200 datasheets: 8 GPUs per node on NVSwitch (NVLink 4: 450 GB/s per GPU per direction,
# in the chip's Hardware), 8 x 400 Gb/s ConnectX-7 InfiniBand per node = 400 GB/s per node per direction
# (the scaling book's GPU chapter uses the same). Latencies assumed: ~1 us NVLink hop, ~5 us across nodes.
GPUS_PER_NODE = 8
INTER_NODE_PER_NODE = 8 * 400e9 / 8
NVLINK_HOP_S, INTER_NODE_HOP_S = 1e-6, 5e-6


def _topology_examples() -> str:
    return "; ".join(f"{g}: " + (", ".join(f"'{g}:{s}'" for s in gen.shapes) if gen.shapes else
                                 f"'{g}:AxBxC' (each 1, 2 or a multiple of 4, e.g. '{g}:2x2x1', '{g}:4x4x4', "
                                 f"'{g}:4x4x8'; at most {'x'.join(map(str, gen.pod))})")
                     for g, gen in TPU_GENERATIONS.items())


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """``"v5p:4x4x4"`` -> ``("v5p", (4, 4, 4))``; a ValueError listing the valid strings otherwise."""
    match = re.fullmatch(r"(v\w+):(\d+(?:x\d+)*)", topology.strip()) if isinstance(topology, str) else None
    gen = TPU_GENERATIONS.get(match.group(1)) if match else None
    dims = tuple(int(d) for d in match.group(2).split("x")) if match else ()
    ok = gen is not None and len(dims) == gen.ndim and all(d >= 1 for d in dims)
    if ok and gen.shapes is not None:
        ok = "x".join(map(str, dims)) in gen.shapes
    elif ok:
        ok = all(d in (1, 2) or d % 4 == 0 for d in dims) and all(
            d <= p for d, p in zip(sorted(dims), sorted(gen.pod), strict=True))
    if not ok:
        raise ValueError(f"unknown TPU topology {topology!r}; a topology is 'generation:shape'. Valid: "
                         f"{_topology_examples()}")
    return match.group(1), dims


def _wraparound(generation: str, dims: tuple[int, ...]) -> tuple[bool, ...]:
    """Which torus axes are rings. Google Cloud TPU docs (v4 / v5p "Topology" sections and the scaling book's
    TPU chapter): v4 / v5p slices made of whole 4x4x4 cubes (every axis a multiple of 4) are tori, their
    wraparound closed by optical circuit switches; smaller ones are meshes. v5e / v6e: only a full 16-chip
    axis of the pod wraps around."""
    if TPU_GENERATIONS[generation].ndim == 3:
        cubes = all(d % 4 == 0 for d in dims)
        return tuple(cubes for _ in dims)
    return tuple(d == 16 for d in dims)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster to explore on: its chip, how many devices, and the networks between them (see module doc).

    ``torus`` (TPU) holds the ICI axes of one slice; ``slices`` TPU slices are joined by DCN (a mesh's first
    axis spans them). ``nodes`` x ``gpus_per_node`` GPUs sit on NVLink inside a node, the inter-node network
    between nodes. ``chip`` is None for simulated CPU devices (no peak numbers).
    """

    name: str
    platform: str
    chip: Hardware | None
    num_devices: int
    levels: tuple[NetworkLevel, ...] = ()
    topology: str | None = None
    torus: tuple[TorusAxis, ...] = ()
    devices_per_chip: int = 1
    slices: int = 1
    nodes: int = 1
    gpus_per_node: int = 1
    libtpu: tuple[int, ...] | None = None

    # -- constructors ----------------------------------------------------------------------------------
    @classmethod
    def tpu(cls, topology: str, *, slices: int = 1, libtpu: tuple[int, ...] | None = None) -> Cluster:
        """A TPU slice by its topology string (``"v5p:4x4x4"``, ``"v5e:8x8"``, ``"v6e:16x16"``,
        ``"v4:2x2x2"``), or ``slices`` of them joined by the data-center network; ``libtpu``: its compiler's
        release (see the class doc)."""
        generation, dims = parse_topology(topology)
        _positive("slices", slices)
        if libtpu is not None and not (isinstance(libtpu, tuple) and libtpu and all(
                isinstance(n, int) and n >= 0 for n in libtpu)):
            raise ValueError(f"libtpu is a release as a tuple of integers, such as (0, 0, 50); got {libtpu!r}")
        gen = TPU_GENERATIONS[generation]
        torus = tuple(TorusAxis(d, w) for d, w in zip(dims, _wraparound(generation, dims), strict=True))
        levels = [NetworkLevel("ici", "torus", gen.chip.link_bandwidth, "link", ICI_HOP_S)]
        if slices > 1:
            levels.append(NetworkLevel("dcn", "switch", gen.dcn_per_host, "host", DCN_LATENCY_S))
        n = math.prod(dims) * gen.devices_per_chip * slices
        name = f"{generation}:{'x'.join(map(str, dims))}" + (f" x {slices} slices" if slices > 1 else "")
        return cls(name, "tpu", gen.chip, n, tuple(levels), f"{generation}:{'x'.join(map(str, dims))}", torus,
                   gen.devices_per_chip, slices, libtpu=libtpu)

    @classmethod
    def gpu(cls, chip: Hardware, *, nodes: int = 1, gpus_per_node: int = GPUS_PER_NODE,
            inter_node_bandwidth: float = INTER_NODE_PER_NODE) -> Cluster:
        """``nodes`` x ``gpus_per_node`` GPUs of ``chip``: NVLink inside a node, ``inter_node_bandwidth``
        (bytes/s per node, one way) between nodes."""
        _positive("nodes", nodes)
        _positive("gpus_per_node", gpus_per_node)
        if chip.topology != SWITCH:
            raise ValueError(f"{chip.name} is not a GPU (its links form a {chip.topology}); use Cluster.tpu")
        levels = [NetworkLevel("nvlink", "switch", chip.link_bandwidth, "chip", NVLINK_HOP_S)]
        if nodes > 1:
            levels.append(NetworkLevel("inter-node", "switch", inter_node_bandwidth, "node", INTER_NODE_HOP_S))
        name = f"{nodes} x {gpus_per_node} {chip.name}"
        return cls(name, "gpu", chip, nodes * gpus_per_node, tuple(levels), nodes=nodes, gpus_per_node=gpus_per_node)

    @classmethod
    def h100(cls, nodes: int = 1, *, gpus_per_node: int = GPUS_PER_NODE) -> Cluster:
        """``nodes`` DGX-style H100 SXM nodes (8 GPUs each by default)."""
        return cls.gpu(H100, nodes=nodes, gpus_per_node=gpus_per_node)

    @classmethod
    def h200(cls, nodes: int = 1, *, gpus_per_node: int = GPUS_PER_NODE) -> Cluster:
        """``nodes`` DGX-style H200 SXM nodes (8 GPUs each by default)."""
        return cls.gpu(H200, nodes=nodes, gpus_per_node=gpus_per_node)

    @classmethod
    def cpu(cls, num_devices: int) -> Cluster:
        """``num_devices`` simulated CPU devices (what a laptop can show; no peak numbers)."""
        _positive("num_devices", num_devices)
        return cls(f"{num_devices} simulated CPU devices", "cpu", None, num_devices)

    # -- what a cluster offers -------------------------------------------------------------------------
    @property
    def hbm_per_device(self) -> float | None:
        """Bytes of HBM one JAX device has (v4: a TensorCore, half a chip); None for CPU devices."""
        return None if self.chip is None or not self.chip.hbm_capacity else \
            self.chip.hbm_capacity / self.devices_per_chip

    def level(self, name: str) -> NetworkLevel:
        for level in self.levels:
            if level.name == name:
                return level
        raise ValueError(f"{self.name} has no network level {name!r}; it has {[lv.name for lv in self.levels]}")

    @property
    def physical_axes(self) -> tuple[int, ...]:
        """The axes a logical mesh must be built from without splitting one (TPU: DCN slices, the torus, the
        TensorCores of a chip); GPU and CPU: one axis of every device (any factorisation maps onto it)."""
        if self.platform != "tpu":
            return (self.num_devices,)
        cores = (self.devices_per_chip,) if self.devices_per_chip > 1 else ()
        return tuple(a.size for a in self.torus) + cores

    def valid_mesh_shapes(self, ndim: int) -> tuple[tuple[int, ...], ...]:
        """Every ``ndim``-axis logical mesh shape of all devices that maps onto this cluster.

        TPU: with ``slices`` > 1 the first axis holds the slices (times a part of one slice); inside a slice,
        each axis size must be the product of some of the physical axes, each used once (JAX's rule for
        ``mesh_utils.create_device_mesh`` without ``allow_split_physical_axes``). GPU, CPU: any factorisation.
        """
        _positive("ndim", ndim)
        if self.platform != "tpu":
            names = tuple(f"a{i}" for i in range(ndim))
            return tuple(tuple(s.values()) for s in mesh_factorizations(self.num_devices, names))
        shapes = set()
        for groups in itertools.product(range(ndim), repeat=len(self.physical_axes)):
            shape = [1] * ndim
            for axis, size in zip(groups, self.physical_axes, strict=True):
                shape[axis] *= size
            shape[0] *= self.slices
            shapes.add(tuple(shape))
        return tuple(sorted(shapes))

    def check_mesh_shape(self, mesh_shape: tp.Sequence[int]) -> tuple[int, ...]:
        """``mesh_shape`` as a tuple if it maps onto this cluster, else a ValueError listing those that do."""
        shape = tuple(mesh_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"a mesh shape is a tuple of positive ints; got {mesh_shape!r}")
        if self.platform != "tpu" and math.prod(shape) == self.num_devices:
            return shape  # any factorisation maps onto one axis of every device
        valid = _valid_mesh_shapes(self, len(shape))
        if shape not in valid:
            why = (f"it has {math.prod(shape)} devices, the cluster {self.num_devices}"
                   if math.prod(shape) != self.num_devices else
                   f"each axis must be a product of whole physical axes {self.physical_axes}"
                   + (f" (the first also times the {self.slices} slices)" if self.slices > 1 else ""))
            raise ValueError(f"mesh shape {shape} does not map onto {self.name}: {why}. Valid {len(shape)}-axis "
                             f"shapes: {sorted(valid)}")
        return shape

    def mesh(self, mesh_shape: tp.Sequence[int], axis_names: tp.Sequence[str]) -> Mesh | AbstractMesh:
        """The mesh to place abstract arguments on: :func:`cluster_mesh`."""
        return cluster_mesh(self, mesh_shape, axis_names)

    def __str__(self) -> str:
        parts = [f"{self.name}: {self.num_devices} devices"]
        if self.chip is not None and self.chip.hbm_capacity:
            parts.append(f"{format_bytes(self.hbm_per_device, 'GiB')} HBM each, {self.chip.peak_flops() / 1e12:.0f} "
                         f"TFLOP/s bf16 per chip")
        if self.torus:
            parts.append("torus " + "x".join(f"{a.size}{'(wrap)' if a.wraparound else ''}" for a in self.torus))
        parts += [f"{lv.name} {lv.bandwidth / 1e9:.3g} GB/s per {lv.per}" for lv in self.levels]
        return ", ".join(parts)


@functools.lru_cache(maxsize=256)
def _valid_mesh_shapes(cluster: Cluster, ndim: int) -> frozenset[tuple[int, ...]]:
    """:meth:`Cluster.valid_mesh_shapes` as a set, remembered (a layout search checks many shapes)."""
    return frozenset(cluster.valid_mesh_shapes(ndim))


def _positive(name: str, value: tp.Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


# -- the mesh a cluster's programs are placed on ----------------------------------------------------------
@functools.cache
def tpu_devices(topology: str, slices: int = 1) -> tuple[jax.Device, ...]:
    """The compile-only devices of a TPU topology (``libtpu`` describes the slice; nothing is allocated)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ImportError(f"compiling for a TPU cluster ({topology}) needs libtpu, XLA's TPU compiler: "
                          f"{TPU_AOT_HINT}") from None
    from jax.experimental import topologies

    # Compiling touches no chip, so several processes (a notebook and a test worker, pytest -n 2) may load
    # libtpu at once; without this the second fails on libtpu's /tmp/libtpu_lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with xla_log_lines():  # libtpu complains that this host is not a TPU VM: true, and fine (kept, not shown)
        kwargs = {"num_slices": slices} if slices > 1 else {}
        topology_desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
    # libtpu lists each TensorCore of a v4 chip; JAX runs v4 as one device per chip (megacore), and so do we
    return tuple(d for d in topology_desc.devices if getattr(d, "core_on_chip", 0) == 0)


def cluster_mesh(cluster: Cluster, mesh_shape: tp.Sequence[int], axis_names: tp.Sequence[str]
                 ) -> Mesh | AbstractMesh:
    """The mesh to place a program's abstract arguments on: a TPU cluster's compile-only devices laid on its
    torus (a ``Mesh``), else an ``AbstractMesh`` that the worker makes concrete. Auto axes, as ``make_mesh``.
    :func:`workbench.core.compile.virtual.compile_on` compiles a program placed on it."""
    shape, names = cluster.check_mesh_shape(mesh_shape), tuple(axis_names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"give one distinct axis name per mesh axis; got {names} for shape {shape}")
    types = (AxisType.Auto,) * len(shape)
    if cluster.platform != "tpu":
        if cluster.num_devices > MAX_SIMULATED_DEVICES:
            raise ValueError(f"{cluster.name} has {cluster.num_devices} devices; a worker simulates at most "
                             f"{MAX_SIMULATED_DEVICES}")
        return AbstractMesh(shape, names, axis_types=types)
    from jax.experimental import mesh_utils

    devices = tpu_devices(cluster.topology, cluster.slices)
    try:
        if cluster.slices > 1:
            ici = (shape[0] // cluster.slices, *shape[1:])
            grid = mesh_utils.create_hybrid_device_mesh(ici, (cluster.slices,) + (1,) * (len(shape) - 1), devices)
        else:
            grid = mesh_utils.create_device_mesh(shape, devices)
    except (NotImplementedError, ValueError, AssertionError) as err:
        raise ValueError(f"mesh shape {shape} does not map onto {cluster.name} ({err}); valid {len(shape)}-axis "
                         f"shapes: {list(cluster.valid_mesh_shapes(len(shape)))}") from None
    return Mesh(grid, names, axis_types=types)


__all__ = ["MAX_SIMULATED_DEVICES", "RING", "SWITCH", "TPU_AOT_HINT", "TPU_GENERATIONS", "Cluster",
           "NetworkLevel", "TorusAxis", "cluster_mesh", "parse_topology", "tpu_devices"]
