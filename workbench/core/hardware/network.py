"""A collective's time on a cluster's network: the one model every view prices collectives with.

The model is the scaling book's ("How to Scale Your Model", Austin et al., https://jax-ml.github.io/scaling-book/),
with its ``(N - 1) / N`` factors and per-hop latency kept: :func:`collective_time` (:func:`transfer` with its
parts) places a collective over some mesh axes on the cluster's network the way JAX lays a mesh onto it (TPU:
``mesh_utils.create_device_mesh``'s assignment of mesh axes to whole torus axes or parts of them,
:func:`~workbench.core.hardware.cluster.torus_layout`; TPU slices: ``create_hybrid_device_mesh``, the slices over the
mesh
axes outermost first, :meth:`~workbench.core.hardware.cluster.Cluster.dcn_split`; GPU: devices in id order,
``gpus_per_node`` to a node).

The book's one-axis forms are its limit on one wraparound ring axis of N devices as N grows, latency dropped:
an all-gather or reduce-scatter of ``V`` bytes (:func:`array_bytes`) takes ``(N - 1) / N * V / W_ici -> V / W_ici``,
an all-reduce twice that, an all-to-all ``V / (4 W_ici)``; ``W_ici`` is the ring's two links
(:attr:`~workbench.core.hardware.chips.Hardware.ici_bandwidth`), and a line (no wraparound) has half of it.

>>> from workbench.core.hardware.cluster import Cluster
>>> v5e = Cluster.tpu("v5e:16x16")  # 16-chip axes wrap around: bidirectional rings of 4.5e10 B/s links
>>> round(collective_time("all-gather", 16 * 2**20, ("x",), {"x": 16, "y": 16}, v5e) * 1e6)  # 15/16 V / 9e10
175
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing as tp

import numpy as np

from workbench.core.hardware.cluster import DIE_TO_DIE, TPU_GENERATIONS, Cluster, TorusAxis, TorusPart, torus_layout
from workbench.core.hlo.text import COLLECTIVE_KINDS


# -- where a collective's devices sit -----------------------------------------------------------------------
def torus_assignment(mesh_shape: tp.Sequence[int], torus: tp.Sequence[int]) -> list[tuple[int, ...]]:
    """The torus axes each mesh axis spans (all of them or a part:
    :func:`~workbench.core.hardware.cluster.torus_layout`),
    as ``jax.experimental.mesh_utils.create_device_mesh`` lays a mesh on a TPU slice (splitting physical axes
    where it must)."""
    layout = torus_layout(mesh_shape, torus)
    return [tuple(p for p in range(len(torus)) if layout[p][i] > 1) for i in range(len(mesh_shape))]


@dataclasses.dataclass(frozen=True)
class Span:
    """The devices of one group of a collective: ``size`` of them, ``per_unit`` in each of ``units`` nodes
    (GPU) or slices (TPU), and (TPU) the parts of the torus axes (:class:`~workbench.core.hardware.cluster.TorusPart`)
    the group's part inside a slice runs along."""

    size: int
    per_unit: int
    units: int
    torus: tuple[TorusPart, ...] = ()


def span(axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int], cluster: Cluster) -> Span:
    """Where the group of devices that differ only along ``axes`` sits on ``cluster`` (every group alike).
    Remembered per (axes, mesh, cluster): a layout search asks the same few thousand times."""
    unknown = [a for a in axes if a not in mesh_shape]
    if unknown:
        raise ValueError(f"axes {unknown} are not in the mesh {dict(mesh_shape)}")
    return _span(tuple(axes), tuple(mesh_shape), tuple(int(s) for s in mesh_shape.values()), cluster)


@functools.lru_cache(maxsize=8192)
def _span(axes: tuple[str, ...], names: tuple[str, ...], shape: tuple[int, ...], cluster: Cluster) -> Span:
    shape = cluster.check_mesh_shape(shape)
    mine = [i for i, n in enumerate(names) if n in axes]
    size = math.prod(shape[i] for i in mine)
    if cluster.platform != "tpu":  # devices in id order, gpus_per_node to a node
        ids = np.arange(cluster.num_devices).reshape(shape)
        group = ids[tuple(slice(None) if n in axes else 0 for n in names)].ravel()
        units = len(np.unique(group // cluster.gpus_per_node)) if cluster.platform == "gpu" else 1
        return Span(size, size // units, units)
    # create_hybrid_device_mesh: each mesh axis is its dcn part (which slice, major) times its ici part (where
    # in the slice); a group crosses the slices of its axes' dcn parts, the same ici part in each
    dcn, ici = cluster.dcn_split(shape)
    units = math.prod(dcn[i] for i in mine)
    layout = torus_layout(ici, cluster.physical_axes)
    parts = torus_parts(layout, cluster.torus, mine)
    if cluster.devices_per_chip > 1:  # the chip's cores: the last physical axis, one mesh axis owns it (size 2)
        cores = math.prod(layout[-1][i] for i in mine)
        if cores > 1:
            parts += (TorusPart(cores, False, 1, die_to_die=True),)
    return Span(size, size // units, units, parts)


def torus_parts(layout: tp.Sequence[tp.Sequence[int]], torus: tp.Sequence[TorusAxis], mesh_axes: tp.Sequence[int]
                ) -> tuple[TorusPart, ...]:
    """What a group over ``mesh_axes`` runs along on each physical axis of ``torus``, given a slice's
    :func:`~workbench.core.hardware.cluster.torus_layout`.

    Along physical axis ``p`` of ``P`` chips the mesh axes that own a part of it nest, the earlier one major
    (``_generate_logical_mesh``): with parts ``n_0, n_1, ...`` (mesh order) a chip's coordinate is
    ``i_0 n_1 n_2 ... + i_1 n_2 ... + ...``, so mesh axis ``j``'s neighbours are ``stride = n_{j+1} n_{j+2} ...``
    links apart, its ``n_j`` chips span ``n_j * stride`` of the axis, and it closes a ring only when that is
    all of it (no earlier mesh axis owns a part) and the axis wraps around. Parts of the group's own axes that
    nest next to each other are one part (their sizes multiplied, the inner stride): two mesh axes that split a
    physical axis between them gather along all of it. Parts of the group's axes with another mesh axis's part
    between them stay separate (an approximation: they share links)."""
    parts = []
    for p, axis in enumerate(torus):
        run: list[tuple[int, int]] = []  # (size, stride) of the group's parts nested next to each other
        runs = [run]
        owners = [i for i in range(len(layout[p])) if layout[p][i] > 1]
        for i in owners:
            stride = math.prod(layout[p][j] for j in owners if j > i)
            if i in mesh_axes:
                run.append((layout[p][i], stride))
            elif run:
                run = []
                runs.append(run)
        for r in runs:
            if r:
                size, stride = math.prod(n for n, _ in r), r[-1][1]
                parts.append(TorusPart(size, axis.wraparound and size * stride == axis.size, stride))
    return tuple(parts)


# -- collectives --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Transfer:
    """A collective's predicted time: ``seconds = max(bandwidth_s, latency_s)`` (the book's
    ``max(T_min * hops, V / W)``), the network ``level`` that bounds it and whether ``bound`` by "bandwidth"
    or "latency" ("none": a group of one device)."""

    seconds: float
    bandwidth_s: float
    latency_s: float
    level: str
    bound: str

    def attained(self, network_efficiency: float) -> float:
        """Seconds when the links run at ``network_efficiency`` of their bandwidth, as real collectives do (the
        chip's :attr:`~workbench.core.hardware.calibration.ChipCalibration.network`); the latency as it is. The
        predicted and the compiled step both price a collective so."""
        return max(self.bandwidth_s / network_efficiency, self.latency_s)


def _outer(cluster: Cluster) -> tuple[str, float, float] | None:
    """The network between nodes / slices: its name, bytes/s one way per device (the unit's NICs shared by its
    devices) and per-hop latency; None on one node / slice."""
    if cluster.platform == "gpu" and cluster.nodes > 1:
        level = cluster.level("inter-node")
        return level.name, level.bandwidth / cluster.gpus_per_node, level.latency_s
    if cluster.platform == "tpu" and cluster.slices > 1:
        level = cluster.level("dcn")
        per_host = TPU_GENERATIONS[cluster.topology.split(":")[0]].chips_per_host * cluster.devices_per_chip
        return level.name, level.bandwidth / per_host, level.latency_s
    return None


def array_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """The book's ``V`` from what a :class:`~workbench.core.hlo.collectives.Collective` records (``nbytes``, the
    result on each device, over ``group_size`` devices): the whole array gathered (all-gather), before scattering
    (reduce-scatter), reduced (all-reduce), all shards together (all-to-all), sent (collective-permute)."""
    return nbytes * (group_size if kind in ("reduce-scatter", "all-to-all") else 1)


def transfer(kind: str, nbytes: float, axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
             cluster: Cluster) -> Transfer:
    """:func:`collective_time` with its parts: which network level bounds it, bandwidth or latency."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no network numbers (simulated CPU devices); cost a program on "
                         f"Cluster.tpu(...), Cluster.h100(...) or Cluster.h200(...)")
    s = span(tuple(axes), mesh_shape, cluster)
    n, g, m = s.size, s.per_unit, s.units
    if n == 1:
        return Transfer(0.0, 0.0, 0.0, "none", "none")
    inner = cluster.levels[0]  # "ici" (a torus) or "nvlink" (a switch)
    outer = _outer(cluster)
    if kind == "all-reduce":  # = reduce-scatter + all-gather of the same array: twice either
        one = transfer("all-gather", nbytes, axes, mesh_shape, cluster)
        return dataclasses.replace(one, seconds=2 * one.seconds, bandwidth_s=2 * one.bandwidth_s,
                                   latency_s=2 * one.latency_s)
    # Inside a node / slice. A torus axis of size k is a bidirectional ring with wraparound (2 links' worth of
    # bandwidth, floor(k / 2) hops across) and a line without (1 link, k - 1 hops): "not a full ring, half the
    # bandwidth". Several axes add their bandwidths (the book: V / (W_ici n_axes)). A GPU's NVLink egress
    # reaches every GPU of its node in one hop.
    #
    # A part of a physical axis (a TorusPart: k chips, `stride` s links between logical neighbours; see
    # torus_parts). The s groups of that mesh axis along one physical line interleave (group c holds chips
    # c, c + s, c + 2s, ...), so each logical hop crosses s physical links, and a physical link lies on one
    # logical hop of each of the s groups (every link of a ring; on a line, all but the few at its ends).
    # All s groups run their collective at once (every group alike): a link carries s groups' traffic. A
    # ring algorithm moves (k - 1) / k V per device over its logical links, split between the two directions
    # on a ring; a physical link direction carries that for s groups, (k - 1) / k V s / 2 on a ring,
    # (k - 1) / k V s on a line. So one group's bandwidth is (2 if it wraps else 1) W_link / s: W_link (one
    # link, a line) for a contiguous part (s = 1) of a larger axis. A strided part wraps only when it spans
    # the whole physical axis (k s = P) and that axis wraps. The farthest logical neighbour is floor(k / 2)
    # (ring) or k - 1 (line) logical hops away, s links each. A whole axis is s = 1, k = P: the forms above.
    if inner.kind == "torus":  # a chip's TensorCores (TPU7x) talk over its die-to-die link, not ICI
        link = {False: inner.bandwidth, True: DIE_TO_DIE.bandwidth}
        widths = [link[a.die_to_die] * (2 if a.wraparound else 1) / a.stride for a in s.torus]
        hops_in = sum((a.size // 2 if a.wraparound else a.size - 1) * a.stride for a in s.torus)
    else:
        widths, hops_in = [inner.bandwidth], g - 1
    hops_out = m - 1
    v = array_bytes(kind, nbytes, n)
    inner_name = DIE_TO_DIE.name if s.torus and all(a.die_to_die for a in s.torus) else inner.name
    if kind in ("all-gather", "reduce-scatter"):
        # A ring over the group's g devices moves (g - 1) / g of V through each device's links; across units,
        # the book's GPU chapter: each level a ring of its own, overlapped, bytes * max_i (D_i - 1) / (D_i W_i),
        # a unit's outer network shared by all its devices, g of them in this group.
        parts = {inner_name: (g - 1) / g * v / sum(widths) if g > 1 else 0.0}
        if outer and m > 1:
            parts[outer[0]] = (m - 1) / m * v / (outer[1] * g)
    elif kind == "all-to-all":
        # Each device holds S = nbytes and sends S / n to every other. Ring of k (book footnote): k^2/4 shards of
        # S / k cross each link direction, k S / (4 W) with W the ring's two links (a line: k^2 / 4 shards cross
        # its middle link, W one link); on a torus each axis's links carry that axis's hops at once: the slowest
        # axis bounds it (a part: W / stride, its links shared by its stride interleaved groups). Through a
        # switch: (g - 1) S / n leave each GPU over NVLink; (n - g) S / n leave the unit, all its devices at once
        # (book: B (M-1) / (M^2 W)).
        s_in = nbytes * g / n
        if inner.kind == "torus":
            parts = {inner_name: max((a.size * s_in / (4 * w) for a, w in zip(s.torus, widths, strict=True)),
                                     default=0.0)}
        else:
            parts = {inner.name: (g - 1) * nbytes / n / widths[0]}
        if outer and m > 1:
            parts[outer[0]] = (n - g) / n * nbytes / outer[1]
    else:  # collective-permute: each device sends nbytes to one peer, one link one way (across units if any)
        if outer and m > 1:
            parts, hops_in, hops_out = {outer[0]: nbytes / outer[1]}, 0, 1
        else:
            link = DIE_TO_DIE.bandwidth if inner_name == DIE_TO_DIE.name else inner.bandwidth
            parts, hops_in = {inner_name: nbytes / link}, 1
    latency = hops_in * inner.latency_s + (hops_out * outer[2] if outer and m > 1 else 0.0)
    level, bandwidth_s = max(parts.items(), key=lambda kv: kv[1])
    if latency > bandwidth_s:
        slow = outer[0] if outer and m > 1 and hops_out * outer[2] >= hops_in * inner.latency_s else inner_name
        return Transfer(latency, bandwidth_s, latency, slow, "latency")
    return Transfer(bandwidth_s, bandwidth_s, latency, level, "bandwidth")


def collective_time(kind: str, nbytes: float, axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
                    cluster: Cluster) -> float:
    """Seconds for one ``kind`` collective over mesh ``axes`` of ``mesh_shape`` (name -> size, the mesh's
    order) on ``cluster``.

    ``nbytes`` is what :class:`workbench.core.hlo.collectives.Collective` records: the result's bytes on each device
    (the gathered array of an all-gather, the reduced array of an all-reduce, one shard of a reduce-scatter,
    each device's data of an all-to-all, what each device sends in a collective-permute).
    """
    return transfer(kind, nbytes, axes, mesh_shape, cluster).seconds

