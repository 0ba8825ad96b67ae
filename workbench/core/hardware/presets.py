"""The clusters a picker offers: :data:`CLUSTER_PRESETS`, label -> constructor, in the order a picker lists them.

TPU slices are named as Google names them (v5e and v6e by chips, v5p by TensorCores, two a chip), with their
topology and chips; a TPU7x (Ironwood) chip is two JAX devices. GPUs come as 8-GPU nodes (H100, H200, DGX B200)
or GB200 NVL72 racks.

>>> cluster_preset("TPU v5p-128 (4x4x4, 64 chips)").num_devices
64
>>> preset_label(Cluster.gb200_nvl72(racks=1))
'GB200 NVL72 1 rack (72 GPUs)'
"""

from __future__ import annotations

import functools
import typing as tp

from workbench.core.hardware.cluster import Cluster

__all__ = ["CLUSTER_PRESETS", "cluster_preset", "preset_label"]


def _tpu(topology: str) -> tp.Callable[[], Cluster]:
    return functools.partial(Cluster.tpu, topology)


CLUSTER_PRESETS: dict[str, tp.Callable[[], Cluster]] = {
    "TPU v5e-16 (4x4, 16 chips)": _tpu("v5e:4x4"),
    "TPU v5e-256 (16x16, 256 chips)": _tpu("v5e:16x16"),
    "TPU v5p-32 (2x2x4, 16 chips)": _tpu("v5p:2x2x4"),
    "TPU v5p-128 (4x4x4, 64 chips)": _tpu("v5p:4x4x4"),
    "TPU v5p-1024 (8x8x8, 512 chips)": _tpu("v5p:8x8x8"),
    "TPU v6e-16 Trillium (4x4, 16 chips)": _tpu("v6e:4x4"),
    "TPU v6e-256 Trillium (16x16, 256 chips)": _tpu("v6e:16x16"),
    "TPU7x Ironwood 2x2x2 (8 chips, 16 devices)": _tpu("tpu7x:2x2x2"),
    "TPU7x Ironwood 4x4x4 (64 chips, 128 devices)": _tpu("tpu7x:4x4x4"),
    "TPU7x Ironwood 4x4x8 (128 chips, 256 devices)": _tpu("tpu7x:4x4x8"),
    "H100 1 node (8 GPUs)": functools.partial(Cluster.h100, nodes=1),
    "H100 4 nodes (32 GPUs)": functools.partial(Cluster.h100, nodes=4),
    "H100 32 nodes (256 GPUs)": functools.partial(Cluster.h100, nodes=32),
    "H200 1 node (8 GPUs)": functools.partial(Cluster.h200, nodes=1),
    "H200 4 nodes (32 GPUs)": functools.partial(Cluster.h200, nodes=4),
    "H200 32 nodes (256 GPUs)": functools.partial(Cluster.h200, nodes=32),
    "DGX B200 1 node (8 GPUs)": functools.partial(Cluster.b200, nodes=1),
    "DGX B200 8 nodes (64 GPUs)": functools.partial(Cluster.b200, nodes=8),
    "GB200 NVL72 1 rack (72 GPUs)": functools.partial(Cluster.gb200_nvl72, racks=1),
    "GB200 NVL72 1 rack at 64 GPUs": functools.partial(Cluster.gb200_nvl72, racks=1, gpus_per_rack=64),
    "GB200 NVL72 2 racks (144 GPUs)": functools.partial(Cluster.gb200_nvl72, racks=2),
}


def cluster_preset(label: str) -> Cluster:
    """The cluster ``label`` names in :data:`CLUSTER_PRESETS`; a ValueError listing the labels otherwise."""
    make = CLUSTER_PRESETS.get(label) if isinstance(label, str) else None
    if make is None:
        raise ValueError(f"no cluster preset {label!r}; the presets are: {', '.join(CLUSTER_PRESETS)}")
    return make()


@functools.cache
def _labels() -> dict[Cluster, str]:
    return {make(): label for label, make in CLUSTER_PRESETS.items()}


def preset_label(cluster: Cluster) -> str | None:
    """The label of the preset equal to ``cluster`` (the same chip, devices, networks and topology: a
    :class:`Cluster` is compared as data), or None when it is none of them."""
    return _labels().get(cluster) if isinstance(cluster, Cluster) else None
