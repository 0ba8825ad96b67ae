"""Virtual clusters: the chips a cluster is made of, how many, and the networks between them.

A :class:`Cluster` is data: its chip (a :class:`~workbench.core.hardware.chips.Hardware`: peak FLOP/s per dtype,
HBM capacity and bandwidth), its device count and its network levels (:class:`NetworkLevel`): a TPU
slice's ICI torus (axes with or without wraparound) and the DCN between slices; a GPU cluster's NVLink
inside a node (a GB200 NVL72 rack: 72 GPUs) and the inter-node network beside it. Build one with
:meth:`Cluster.tpu` (v4, v5e, v5p, v6e, TPU7x), :meth:`Cluster.h100`, :meth:`Cluster.h200`, :meth:`Cluster.b200`,
:meth:`Cluster.gb200_nvl72` or :meth:`Cluster.cpu`:

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

import collections
import dataclasses
import functools
import itertools
import math
import os
import re
import typing as tp

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from workbench.core.checks import is_positive_int, positive_int
from workbench.core.hardware.chips import (
    B200,
    GB200,
    H100,
    H200,
    RING,
    SWITCH,
    TPU7X,
    TPU_V4,
    TPU_V5E,
    TPU_V5P,
    TPU_V6E,
    Hardware,
)
from workbench.core.mesh import axis_sizes, mesh_factorizations
from workbench.core.units import format_bytes
from workbench.core.xla_log import xla_log_lines

TPU_AOT_HINT = 'pip install "jax-workbench[tpu-aot]"'
MAX_SIMULATED_DEVICES = 1024


@dataclasses.dataclass(frozen=True)
class TorusAxis:
    """One physical axis of an ICI torus: its chips, and whether its ends are linked (a ring) or not (a line)."""

    size: int
    wraparound: bool


@dataclasses.dataclass(frozen=True)
class TorusPart:
    """What one group of a collective runs along on one physical torus axis (a :class:`TorusAxis` of ``P``
    chips): ``size`` chips, ``stride`` physical links between logical neighbours, and whether its ends are
    linked (``wraparound``: the part spans the whole axis, ``size * stride == P``, and the axis is a ring).
    A whole axis is ``TorusPart(P, axis.wraparound, 1)``; a mesh axis that owns only a part of a physical axis
    (``mesh_utils.create_device_mesh(..., allow_split_physical_axes=True)``, :func:`torus_layout`) has a part
    of fewer chips: contiguous (``stride`` 1) when it is the innermost mesh axis on that physical axis, else
    strided (see :func:`workbench.core.hardware.network.transfer` for what each costs). ``die_to_die``: the part
    is a chip's TensorCores (TPU7x: two devices a chip), joined by the chip's own link (:data:`DIE_TO_DIE`), not ICI."""

    size: int
    wraparound: bool
    stride: int = 1
    die_to_die: bool = False


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
    devices_per_chip: int  # JAX devices per chip: 1 (v4 and v5p run their two TensorCores as one "megacore"), 2 (TPU7x)
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
    # TPU7x docs: 3D slices like v5p's (4 chips to a host VM, "AxBxC", cubes of 4x4x4 with full tori), 9,216 chips
    # a pod (here at most 16x24x24, which is 9,216); each chip two JAX devices. DCN per host assumed 2 x 200 Gb/s
    # (GKE's Ironwood page: two NICs per 4-chip VM; their speed is not given there).
    "tpu7x": _TpuGeneration(TPU7X, 3, (16, 24, 24), 4, 2, 2 * 200e9 / 8),
}
DCN_LATENCY_S = 1e-5
# The two TensorCores of a TPU7x chip sit on two dies joined by a die-to-die link whose bandwidth is not published;
# jax's mesh_utils gives that "core axis" its mesh axis first "due to its higher bandwidth" (than ICI). Priced here
# at the chip's six ICI links together, one way (6 x 9e10 B/s): an assumption, and a lower bound by that comment.
DIE_TO_DIE = NetworkLevel("die-to-die", "torus", 6 * TPU7X.link_bandwidth, "chip", ICI_HOP_S)
# NVIDIA DGX H100 / H200 datasheets: 8 GPUs per node on NVSwitch (NVLink 4: 450 GB/s per GPU per direction,
# in the chip's Hardware), 8 x 400 Gb/s ConnectX-7 InfiniBand per node = 400 GB/s per node per direction
# (the scaling book's GPU chapter uses the same). Latencies assumed: ~1 us NVLink hop, ~5 us across nodes.
GPUS_PER_NODE = 8
INTER_NODE_PER_NODE = 8 * 400e9 / 8
NVLINK_HOP_S, INTER_NODE_HOP_S = 1e-6, 5e-6
# DGX B200 datasheet: 8 GPUs on NVLink 5 (900 GB/s per GPU per direction, in the chip), 8 x 400 Gb/s ConnectX-7 per
# node, as DGX H100. GB200 NVL72 datasheet: one NVLink domain of 72 GPUs (a rack; jobs often run on 64 of them and keep
# the rest as spares), each GPU with its own 400 Gb/s ConnectX-7 to the scale-out network: 50 GB/s per GPU one way.
NVL72_GPUS = 72
SCALE_OUT_PER_GB200 = 400e9 / 8


def _topology_examples() -> str:
    return "; ".join(f"{g}: " + (", ".join(f"'{g}:{s}'" for s in gen.shapes) if gen.shapes else
                                 f"'{g}:AxBxC' (each 1, 2 or a multiple of 4, e.g. '{g}:2x2x1', '{g}:4x4x4', "
                                 f"'{g}:4x4x8'; at most {'x'.join(map(str, gen.pod))})")
                     for g, gen in TPU_GENERATIONS.items())


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """``"v5p:4x4x4"`` -> ``("v5p", (4, 4, 4))``; a ValueError listing the valid strings otherwise."""
    match = re.fullmatch(r"(v\w+|tpu\w+):(\d+(?:x\d+)*)", topology.strip()) if isinstance(topology, str) else None
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
        return (all(d % 4 == 0 for d in dims),) * len(dims)
    return tuple(d == 16 for d in dims)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster to explore on: its chip, how many devices, and the networks between them (see module doc).

    ``torus`` (TPU) holds the ICI axes of one slice; ``slices`` TPU slices are joined by DCN (any mesh axes may
    span them, outermost first: :meth:`dcn_split`). ``nodes`` x ``gpus_per_node`` GPUs sit on NVLink inside a
    node, the inter-node network between nodes. ``chip`` is None for simulated CPU devices (no peak numbers).
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
        ``"v4:2x2x2"``, ``"tpu7x:4x4x4"``), or ``slices`` of them joined by the data-center network; ``libtpu``: its
        compiler's release (see the class doc). A TPU7x (Ironwood) chip is two devices (its two TensorCores),
        joined by the chip's die-to-die link (:data:`DIE_TO_DIE`)."""
        generation, dims = parse_topology(topology)
        slices = positive_int("slices", slices)
        if libtpu is not None and not (isinstance(libtpu, tuple) and libtpu and all(
                isinstance(n, int) and n >= 0 for n in libtpu)):
            raise ValueError(f"libtpu is a release as a tuple of integers, such as (0, 0, 50); got {libtpu!r}")
        gen = TPU_GENERATIONS[generation]
        torus = tuple(TorusAxis(d, w) for d, w in zip(dims, _wraparound(generation, dims), strict=True))
        levels = [NetworkLevel("ici", "torus", gen.chip.link_bandwidth, "link", ICI_HOP_S)]
        if gen.devices_per_chip > 1:
            levels.append(DIE_TO_DIE)
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
        nodes, gpus_per_node = positive_int("nodes", nodes), positive_int("gpus_per_node", gpus_per_node)
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
    def b200(cls, nodes: int = 1, *, gpus_per_node: int = GPUS_PER_NODE) -> Cluster:
        """``nodes`` DGX / HGX B200 nodes: 8 Blackwell GPUs each on NVLink 5, InfiniBand between nodes."""
        return cls.gpu(B200, nodes=nodes, gpus_per_node=gpus_per_node)

    @classmethod
    def gb200_nvl72(cls, racks: int = 1, *, gpus_per_rack: int = NVL72_GPUS) -> Cluster:
        """``racks`` GB200 NVL72 racks: each one NVLink domain of 72 GPUs (``gpus_per_rack=64``: the GPUs a job
        uses where the rest are spares), racks joined by the scale-out network (400 Gb/s per GPU). A rack is what
        the network model calls a node: tensor and expert parallelism stay on NVLink up to ``gpus_per_rack``."""
        gpus_per_rack = positive_int("gpus_per_rack", gpus_per_rack)
        if gpus_per_rack > NVL72_GPUS:
            raise ValueError(f"a GB200 NVL72 rack has {NVL72_GPUS} GPUs; gpus_per_rack={gpus_per_rack}")
        cluster = cls.gpu(GB200, nodes=racks, gpus_per_node=gpus_per_rack,
                          inter_node_bandwidth=gpus_per_rack * SCALE_OUT_PER_GB200)
        used = f" ({gpus_per_rack} GPUs a rack)" if gpus_per_rack != NVL72_GPUS else ""
        return dataclasses.replace(cluster, name=f"{racks} x GB200 NVL72{used}")

    @classmethod
    def cpu(cls, num_devices: int) -> Cluster:
        """``num_devices`` simulated CPU devices (what a laptop can show; no peak numbers)."""
        num_devices = positive_int("num_devices", num_devices)
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

    def dcn_split(self, mesh_shape: tp.Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``mesh_shape`` as ``(dcn_shape, ici_shape)``, their product axis by axis: how many slices each mesh axis
        spans, and its size inside one slice (``mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape)``
        lays it out so: along an axis, the slice index is the major part, the position in a slice the minor).

        The slices go to the mesh axes outermost first (MaxText's ``dcn_*`` axes): walking the axes in mesh
        order, each takes ``gcd(its size, slices still to place)``. One slice, GPU, CPU: all ones, the shape.

        >>> Cluster.tpu("v6e:16x16", slices=4).dcn_split((1, 2, 512, 1))
        ((1, 2, 2, 1), (1, 1, 256, 1))
        """
        shape = tuple(int(s) for s in mesh_shape)
        left, dcn = (self.slices if self.platform == "tpu" else 1), []
        for size in shape:
            dcn.append(math.gcd(size, left))
            left //= dcn[-1]
        if left > 1:
            raise ValueError(f"mesh shape {shape} cannot hold the {self.slices} slices of {self.name}: its sizes "
                             f"multiply to {math.prod(shape)}, the cluster has {self.num_devices} devices")
        return tuple(dcn), tuple(s // d for s, d in zip(shape, dcn, strict=True))

    def valid_mesh_shapes(self, ndim: int) -> tuple[tuple[int, ...], ...]:
        """Every ``ndim``-axis logical mesh shape of all devices that maps onto this cluster along whole physical
        axes (what a layout search enumerates; :meth:`check_mesh_shape` also takes the shapes that split one).

        TPU: inside a slice each axis size must be the product of some of the physical axes, each used once
        (JAX's rule for ``mesh_utils.create_device_mesh`` without ``allow_split_physical_axes``); with
        ``slices`` > 1, any axes may span the slices as :meth:`dcn_split` gives them out. GPU, CPU: any
        factorisation.
        """
        positive_int("ndim", ndim)
        names = tuple(f"a{i}" for i in range(ndim))
        if self.platform != "tpu":
            return tuple(tuple(s.values()) for s in mesh_factorizations(self.num_devices, names))
        dcns = [tuple(s.values()) for s in mesh_factorizations(self.slices, names)]
        shapes = set()
        for groups in itertools.product(range(ndim), repeat=len(self.physical_axes)):
            ici = [1] * ndim
            for axis, size in zip(groups, self.physical_axes, strict=True):
                ici[axis] *= size
            for dcn in dcns:
                shape = tuple(i * d for i, d in zip(ici, dcn, strict=True))
                if self.dcn_split(shape) == (dcn, tuple(ici)):
                    shapes.add(shape)
        return tuple(sorted(shapes))

    def axis_sizes(self, mesh_shape: tp.Mapping[str, int]) -> dict[str, int]:
        """Each workbench mesh axis's size (:func:`~workbench.core.mesh.axis_sizes`); they must multiply to this
        cluster's devices."""
        sizes = axis_sizes(mesh_shape)
        if math.prod(sizes.values()) != self.num_devices:
            raise ValueError(f"mesh {dict(mesh_shape)} has {math.prod(sizes.values())} devices; {self.name} has "
                             f"{self.num_devices}")
        return sizes

    def check_mesh_shape(self, mesh_shape: tp.Sequence[int]) -> tuple[int, ...]:
        """``mesh_shape`` as a tuple if it maps onto this cluster, else a ValueError listing those that do.

        TPU: any shape of all the devices JAX can lay out: the slices spread over the axes by
        :meth:`dcn_split`, and the part inside a slice on its torus, along whole physical axes or splitting
        some (:func:`torus_layout`)."""
        shape = tuple(mesh_shape)
        if not shape or not all(is_positive_int(s) for s in shape):
            raise ValueError(f"a mesh shape is a tuple of positive ints; got {mesh_shape!r}")
        shape = tuple(map(int, shape))
        if math.prod(shape) == self.num_devices:
            if self.platform != "tpu":
                return shape  # any factorisation maps onto one axis of every device
            dcn, ici = self.dcn_split(shape)
            try:
                torus_layout(ici, self.physical_axes)
                return shape
            except ValueError as err:
                why = (f"the slices go {dcn} over its axes (Cluster.dcn_split), leaving {ici} on each slice, "
                       f"which JAX cannot lay on the physical axes {self.physical_axes} ({err})")
        else:
            why = f"it has {math.prod(shape)} devices, the cluster {self.num_devices}"
        valid = _valid_mesh_shapes(self, len(shape))
        raise ValueError(f"mesh shape {shape} does not map onto {self.name}: {why}. Valid {len(shape)}-axis "
                         f"shapes along whole physical axes: {sorted(valid)}")

    def part(self, num_devices: int) -> Cluster:
        """``num_devices`` of this cluster's devices as a cluster of their own: a run that leaves the rest idle.

        GPU: whole nodes (``num_devices`` a multiple of ``gpus_per_node``), on the same networks. TPU: the same
        count from each slice, as a box of the slice's torus when one holds them (an axis that keeps its full
        length keeps its wraparound); else on the most balanced box of that many chips, with no wraparound: the
        part is not a box of the torus, so no axis of it closes a ring, and its collectives are priced as on that
        box's lines (the name says which)."""
        num_devices = positive_int("num_devices", num_devices)
        if num_devices == self.num_devices:
            return self
        if num_devices > self.num_devices:
            raise ValueError(f"{self.name} has {self.num_devices} devices; a part of it cannot have {num_devices}")
        if self.platform == "gpu":
            if num_devices % self.gpus_per_node:
                raise ValueError(f"a part of {self.name} is whole nodes: a multiple of {self.gpus_per_node} GPUs; "
                                 f"got {num_devices}")
            nodes = num_devices // self.gpus_per_node
            bandwidth = self.level("inter-node").bandwidth if self.nodes > 1 else INTER_NODE_PER_NODE
            part = Cluster.gpu(self.chip, nodes=nodes, gpus_per_node=self.gpus_per_node,
                               inter_node_bandwidth=bandwidth)
            return dataclasses.replace(part, name=f"{num_devices:,} GPUs of {self.name}")
        if self.platform != "tpu":
            return Cluster.cpu(num_devices)
        unit = self.slices * self.devices_per_chip
        if num_devices % unit:
            raise ValueError(f"a part of {self.name} takes as many chips from each of its {self.slices} slice(s): a "
                             f"multiple of {unit} devices; got {num_devices}")
        chips = num_devices // unit
        dims = tuple(a.size for a in self.torus)
        every = [tuple(f.values()) for f in mesh_factorizations(chips, [f"d{i}" for i in range(len(dims))])]
        boxes = [box for box in every if all(b <= d for b, d in zip(box, dims, strict=True))]
        if boxes:
            box = max(boxes, key=lambda b: (sum(x == d for x, d in zip(b, dims, strict=True)), -max(b)))
            torus = tuple(TorusAxis(b, a.wraparound and b == a.size) for b, a in zip(box, self.torus, strict=True))
            how = "a box of its torus"
        else:
            box = min(every, key=lambda b: (max(b), -min(b), b))
            torus = tuple(TorusAxis(b, False) for b in box)
            how = "not a box of its torus: priced on these lines, no wraparound"
        generation = self.topology.split(":")[0]
        shape = "x".join(map(str, box))
        return dataclasses.replace(
            self, name=f"{chips * self.slices:,} chips of {self.name} ({shape}, {how})", num_devices=num_devices,
            topology=f"{generation}:{shape}" if boxes else None, torus=torus)

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


# -- how JAX lays a mesh on one slice's torus ---------------------------------------------------------------
def torus_layout(mesh_shape: tp.Sequence[int], torus: tp.Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """How ``jax.experimental.mesh_utils.create_device_mesh(mesh_shape, devices,
    allow_split_physical_axes=True)`` lays a mesh on a slice's physical axes of sizes ``torus``: the matrix
    ``layout[p][i]``, the part of physical axis ``p`` that mesh axis ``i`` owns (rows multiply to ``torus``,
    columns to ``mesh_shape``; JAX's "assignment" of ``_create_device_mesh_for_nd_torus``).

    JAX first tries whole axes: from the last mesh axis (the most network-intensive) to the first, each takes
    the largest set of still-free physical axes whose sizes multiply to its size (ties: the first such set).
    If one finds none, it starts again splitting axes (``_create_device_mesh_for_nd_torus_splitting_axes``):
    again from the last mesh axis, each takes, among every way of giving its prime factors to physical axes
    with that factor still free, the one with (in order) the largest product of whole physical axes taken,
    the most whole axes, the largest product on physical axes that the mesh axes placed before it (later in
    the mesh) already use (what JAX's code does; its comment says the opposite), the largest tuple. Along a
    split physical axis the earlier mesh axis is the major part (``_generate_logical_mesh``).
    A ValueError when the sizes cannot be laid out (they do not multiply to the torus's).

    Not mirrored: JAX's per-chip handlers for a few small slices (v5e / v6e of 4, 8 or 16 chips; v5p 2x2x2; TPU7x
    of at most 32 devices with x and y at most 2)
    that order devices along a ring; and jax 0.10.2's ``_get_prime_factors``, which drops the small factors
    of a few sizes (28 -> [7]; fixed in newer jax): this mirrors the correct factorisation.
    """
    return _torus_layout(tuple(int(s) for s in mesh_shape), tuple(int(t) for t in torus))[0]


def needs_split(mesh_shape: tp.Sequence[int], torus: tp.Sequence[int]) -> bool:
    """Whether JAX lays ``mesh_shape`` on ``torus`` only by splitting a physical axis
    (``allow_split_physical_axes=True``; see :func:`torus_layout`)."""
    return _torus_layout(tuple(int(s) for s in mesh_shape), tuple(int(t) for t in torus))[1]


@functools.lru_cache(maxsize=4096)
def _torus_layout(shape: tuple[int, ...], torus: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], ...], bool]:
    if math.prod(shape) != math.prod(torus):
        raise ValueError(f"mesh shape {shape} has {math.prod(shape)} devices, the torus {torus} "
                         f"{math.prod(torus)}")
    layout = np.ones((len(torus), len(shape)), dtype=np.int64)
    whole = _whole_axes(shape, torus)
    if whole is not None:
        for i, axes in enumerate(whole):
            for p in axes:
                layout[p, i] = torus[p]
    else:
        for i in reversed(range(len(shape))):
            free = np.array(torus) // np.prod(layout, axis=1)
            used = np.prod(layout, axis=1)
            best = max(_feasible_parts(free, shape[i]), default=None, key=lambda x: (
                math.prod(int(s) for p, s in enumerate(x) if s == torus[p]),
                sum(1 for p, s in enumerate(x) if s == torus[p] and s > 1),
                math.prod(int(s) for p, s in enumerate(x) if used[p] > 1),
                tuple(int(s) for s in x)))
            if best is None:
                raise ValueError(f"mesh axis {i} of size {shape[i]} fits no free part of the torus "
                                 f"{tuple(int(f) for f in free)}")
            layout[:, i] = best
    return tuple(tuple(int(s) for s in row) for row in layout), whole is None


def _whole_axes(shape: tuple[int, ...], torus: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """JAX's whole-axis pass (see :func:`torus_layout`): the physical axes of each mesh axis, or None."""
    free, out = list(torus), [()] * len(shape)
    for i in reversed(range(len(shape))):
        for k in range(len(free), 0, -1):
            found = next((c for c in itertools.combinations(range(len(free)), k)
                          if math.prod(free[j] for j in c) == shape[i]), None)
            if found is not None:
                out[i] = found
                free = [0 if j in found else size for j, size in enumerate(free)]
                break
        else:
            if shape[i] > 1:
                return None
    return out


def prime_factors(n: int) -> list[int]:
    """``n``'s prime factors, smallest first, with repeats (``prime_factors(12) == [2, 2, 3]``)."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def _feasible_parts(free: np.ndarray, size: int) -> tp.Iterator[tuple[int, ...]]:
    """JAX's ``_enumerate_feasible_logical_axis_assignments``: every way to give the prime factors of ``size``
    to physical axes whose free part has them (a factor ``p`` of multiplicity ``m`` to ``m`` of the free
    factors ``p``), as each physical axis's part."""
    wanted = collections.Counter(prime_factors(size))
    holders = {f: [p for p, n in enumerate(free) for g in prime_factors(int(n)) if g == f] for f in wanted}
    choices = [set(itertools.combinations(holders[f], m)) for f, m in wanted.items()]
    for pick in itertools.product(*choices):
        part = [1] * len(free)
        for f, axes in zip(wanted, pick, strict=True):
            for p in axes:
                part[p] *= f
        yield tuple(part)


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
    # libtpu lists each TensorCore of a v4 chip; JAX runs v4 as one device per chip (megacore), and so do we. A
    # TPU7x chip is two devices to JAX (each TensorCore its own HBM half): both stay.
    cores = TPU_GENERATIONS[topology.split(":")[0]].devices_per_chip
    return tuple(d for d in topology_desc.devices if getattr(d, "core_on_chip", 0) < cores)


def cluster_mesh(cluster: Cluster, mesh_shape: tp.Sequence[int], axis_names: tp.Sequence[str]
                 ) -> Mesh | AbstractMesh:
    """The mesh to place a program's abstract arguments on: a TPU cluster's compile-only devices laid on its
    torus as JAX lays them (a ``Mesh``: ``mesh_utils.create_hybrid_device_mesh(ici, dcn)`` over slices,
    :meth:`Cluster.dcn_split`; ``allow_split_physical_axes`` where the shape splits a physical axis), else an
    ``AbstractMesh`` that the worker makes concrete. Auto axes, as ``make_mesh``.
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
    dcn, ici = cluster.dcn_split(shape)
    # the same keyword in jax 0.10.2 and 0.12: create_device_mesh and create_hybrid_device_mesh both take it
    split = {"allow_split_physical_axes": True} if needs_split(ici, cluster.physical_axes) else {}
    try:
        if cluster.slices > 1:
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, **split)
        else:
            grid = mesh_utils.create_device_mesh(shape, devices, **split)
    except (NotImplementedError, ValueError, AssertionError, TypeError) as err:
        raise ValueError(f"mesh shape {shape} does not map onto {cluster.name} ({err}); valid {len(shape)}-axis "
                         f"shapes: {list(cluster.valid_mesh_shapes(len(shape)))}") from None
    return Mesh(grid, names, axis_types=types)


__all__ = ["DIE_TO_DIE", "MAX_SIMULATED_DEVICES", "NVL72_GPUS", "RING", "SCALE_OUT_PER_GB200", "SWITCH", "TPU_AOT_HINT",
           "TPU_GENERATIONS", "Cluster", "NetworkLevel", "TorusAxis", "TorusPart", "cluster_mesh", "needs_split",
           "parse_topology", "torus_layout", "tpu_devices"]
