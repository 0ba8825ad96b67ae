"""A collective's time on a cluster's network: the one model every view prices collectives with.

The model is the scaling book's ("How to Scale Your Model", Austin et al., https://jax-ml.github.io/scaling-book/),
with its ``(N - 1) / N`` factors and per-hop latency kept: :func:`collective_time` (:func:`transfer` with its
parts) places a collective over some mesh axes on the cluster's network the way JAX lays a mesh onto it (TPU:
``mesh_utils.create_device_mesh``'s assignment of mesh axes to torus axes; GPU: devices in id order,
``gpus_per_node`` to a node; TPU slices: the first mesh axis outermost).

The book's one-axis forms are its limit on one wraparound ring axis of N devices as N grows, latency dropped:
an all-gather or reduce-scatter of ``V`` bytes (:func:`array_bytes`) takes ``(N - 1) / N * V / W_ici -> V / W_ici``,
an all-reduce twice that, an all-to-all ``V / (4 W_ici)``; ``W_ici`` is the ring's two links
(:attr:`~workbench.core.cost.chips.Hardware.ici_bandwidth`), and a line (no wraparound) has half of it.

>>> from workbench.core.cluster import Cluster
>>> v5e = Cluster.tpu("v5e:16x16")  # 16-chip axes wrap around: bidirectional rings of 4.5e10 B/s links
>>> round(collective_time("all-gather", 16 * 2**20, ("x",), {"x": 16, "y": 16}, v5e) * 1e6)  # 15/16 V / 9e10
175
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing as tp

import numpy as np

from workbench.core.cluster import TPU_GENERATIONS, Cluster, TorusAxis
from workbench.core.hlo.text import COLLECTIVE_KINDS


# -- where a collective's devices sit -----------------------------------------------------------------------
def torus_assignment(mesh_shape: tp.Sequence[int], torus: tp.Sequence[int]) -> list[tuple[int, ...]]:
    """The torus axes each mesh axis spans, as ``jax.experimental.mesh_utils.create_device_mesh`` lays a mesh
    on a TPU slice: from the last mesh axis (the most network-intensive) to the first, each takes the largest
    set of still-free torus axes whose sizes multiply to its size (ties: the first such set)."""
    free, out = list(torus), [()] * len(mesh_shape)
    for i in reversed(range(len(mesh_shape))):
        for k in range(len(free), 0, -1):
            found = next((c for c in itertools.combinations(range(len(free)), k)
                          if math.prod(free[j] for j in c) == mesh_shape[i]), None)
            if found is not None:
                out[i] = found
                free = [0 if j in found else size for j, size in enumerate(free)]
                break
        else:
            if mesh_shape[i] > 1:
                raise ValueError(f"mesh shape {tuple(mesh_shape)} does not map onto a torus {tuple(torus)}: each "
                                 f"mesh axis must be a product of whole torus axes")
    return out


@dataclasses.dataclass(frozen=True)
class Span:
    """The devices of one group of a collective: ``size`` of them, ``per_unit`` in each of ``units`` nodes
    (GPU) or slices (TPU), and (TPU) the torus axes the group's part inside a slice runs along."""

    size: int
    per_unit: int
    units: int
    torus: tuple[TorusAxis, ...] = ()


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
    ids = np.arange(cluster.num_devices).reshape(shape)
    group = ids[tuple(slice(None) if n in axes else 0 for n in names)].ravel()
    unit = cluster.gpus_per_node if cluster.platform == "gpu" else cluster.num_devices // cluster.slices
    units = len(np.unique(group // unit))
    torus: tuple[TorusAxis, ...] = ()
    if cluster.platform == "tpu":
        ici = (shape[0] // cluster.slices, *shape[1:])
        assignment = torus_assignment(ici, [a.size for a in cluster.torus])
        torus = tuple(cluster.torus[j] for i, n in enumerate(names) if n in axes for j in assignment[i])
    return Span(len(group), len(group) // units, units, torus)


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
    if inner.kind == "torus":
        widths = [inner.bandwidth * (2 if a.wraparound else 1) for a in s.torus]
        hops_in = sum(a.size // 2 if a.wraparound else a.size - 1 for a in s.torus)
    else:
        widths, hops_in = [inner.bandwidth], g - 1
    hops_out = m - 1
    v = array_bytes(kind, nbytes, n)
    if kind in ("all-gather", "reduce-scatter"):
        # A ring over the group's g devices moves (g - 1) / g of V through each device's links; across units,
        # the book's GPU chapter: each level a ring of its own, overlapped, bytes * max_i (D_i - 1) / (D_i W_i),
        # a unit's outer network shared by all its devices, g of them in this group.
        parts = {inner.name: (g - 1) / g * v / sum(widths) if g > 1 else 0.0}
        if outer and m > 1:
            parts[outer[0]] = (m - 1) / m * v / (outer[1] * g)
    elif kind == "all-to-all":
        # Each device holds S = nbytes and sends S / n to every other. Ring of k (book footnote): k^2/4 shards of
        # S / k cross each link direction, k S / (4 W) with W the ring's two links; on a torus each axis's links
        # carry that axis's hops at once: the slowest axis bounds it. Through a switch: (g - 1) S / n leave
        # each GPU over NVLink; (n - g) S / n leave the unit, all its devices at once (book: B (M-1) / (M^2 W)).
        s_in = nbytes * g / n
        if inner.kind == "torus":
            parts = {inner.name: max((a.size * s_in / (4 * w) for a, w in zip(s.torus, widths, strict=True)),
                                     default=0.0)}
        else:
            parts = {inner.name: (g - 1) * nbytes / n / widths[0]}
        if outer and m > 1:
            parts[outer[0]] = (n - g) / n * nbytes / outer[1]
    else:  # collective-permute: each device sends nbytes to one peer, one link one way (across units if any)
        if outer and m > 1:
            parts, hops_in, hops_out = {outer[0]: nbytes / outer[1]}, 0, 1
        else:
            parts, hops_in = {inner.name: nbytes / inner.bandwidth}, 1
    latency = hops_in * inner.latency_s + (hops_out * outer[2] if outer and m > 1 else 0.0)
    level, bandwidth_s = max(parts.items(), key=lambda kv: kv[1])
    if latency > bandwidth_s:
        slow = outer[0] if outer and m > 1 and hops_out * outer[2] >= hops_in * inner.latency_s else inner.name
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

