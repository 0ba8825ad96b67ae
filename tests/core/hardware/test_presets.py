"""The cluster presets the pickers offer (issue 50): each builds the cluster its label names, counted by hand, and
reads back to its label."""

import re

import pytest

from workbench.core.hardware.chips import B200, GB200, H100, H200, TPU7X, TPU_V5E, TPU_V5P, TPU_V6E
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.presets import CLUSTER_PRESETS, cluster_preset, preset_label

# label -> JAX devices, counted by hand: a TPU slice's chips (x 2 on TPU7x, two TensorCores a chip), a GPU cluster's
# nodes x 8 or racks x GPUs a rack
HAND_COUNTS = {
    "TPU v5e-16 (4x4, 16 chips)": 4 * 4,
    "TPU v5e-256 (16x16, 256 chips)": 16 * 16,
    "TPU v5p-32 (2x2x4, 16 chips)": 2 * 2 * 4,
    "TPU v5p-128 (4x4x4, 64 chips)": 4 * 4 * 4,
    "TPU v5p-1024 (8x8x8, 512 chips)": 8 * 8 * 8,
    "TPU v6e-16 Trillium (4x4, 16 chips)": 4 * 4,
    "TPU v6e-256 Trillium (16x16, 256 chips)": 16 * 16,
    "TPU7x Ironwood 2x2x2 (8 chips, 16 devices)": 2 * 2 * 2 * 2,
    "TPU7x Ironwood 4x4x4 (64 chips, 128 devices)": 4 * 4 * 4 * 2,
    "TPU7x Ironwood 4x4x8 (128 chips, 256 devices)": 4 * 4 * 8 * 2,
    "H100 1 node (8 GPUs)": 8,
    "H100 4 nodes (32 GPUs)": 4 * 8,
    "H100 32 nodes (256 GPUs)": 32 * 8,
    "H200 1 node (8 GPUs)": 8,
    "H200 4 nodes (32 GPUs)": 4 * 8,
    "H200 32 nodes (256 GPUs)": 32 * 8,
    "DGX B200 1 node (8 GPUs)": 8,
    "DGX B200 8 nodes (64 GPUs)": 8 * 8,
    "GB200 NVL72 1 rack (72 GPUs)": 72,
    "GB200 NVL72 1 rack at 64 GPUs": 64,
    "GB200 NVL72 2 racks (144 GPUs)": 2 * 72,
}


def test_every_preset_builds_its_hand_counted_devices():
    assert list(CLUSTER_PRESETS) == list(HAND_COUNTS)
    for label, devices in HAND_COUNTS.items():
        cluster = cluster_preset(label)
        assert isinstance(cluster, Cluster) and cluster.num_devices == devices, label
        # what the label says: chips (devices over devices a chip), devices or GPUs
        chips = re.search(r"([\d,]+) chips", label)
        if chips:
            assert int(chips.group(1).replace(",", "")) * cluster.devices_per_chip == devices, label
        for said in re.findall(r"([\d,]+) (?:devices|GPUs)", label):
            assert int(said.replace(",", "")) == devices, label


def test_the_presets_are_the_clusters_their_constructors_give():
    assert cluster_preset("TPU v5p-128 (4x4x4, 64 chips)") == Cluster.tpu("v5p:4x4x4")
    assert cluster_preset("TPU v6e-256 Trillium (16x16, 256 chips)") == Cluster.tpu("v6e:16x16")
    assert cluster_preset("TPU7x Ironwood 4x4x4 (64 chips, 128 devices)") == Cluster.tpu("tpu7x:4x4x4")
    assert cluster_preset("H200 4 nodes (32 GPUs)") == Cluster.h200(nodes=4)
    assert cluster_preset("DGX B200 8 nodes (64 GPUs)") == Cluster.b200(nodes=8)
    assert cluster_preset("GB200 NVL72 1 rack at 64 GPUs") == Cluster.gb200_nvl72(racks=1, gpus_per_rack=64)
    chips = {cluster_preset(label).chip for label in CLUSTER_PRESETS}
    assert chips == {TPU_V5E, TPU_V5P, TPU_V6E, TPU7X, H100, H200, B200, GB200}  # no CPU: it has no chip to price


def test_every_label_reads_back_and_other_clusters_are_no_preset():
    for label in CLUSTER_PRESETS:
        assert preset_label(cluster_preset(label)) == label
    assert len({cluster_preset(label) for label in CLUSTER_PRESETS}) == len(CLUSTER_PRESETS)
    assert preset_label(Cluster.h100(nodes=2)) is None
    assert preset_label(Cluster.cpu(8)) is None
    assert preset_label(Cluster.tpu("v5p:4x4x4", libtpu=(0, 0, 50))) is None  # another compiler: another cluster
    assert preset_label("H100 1 node (8 GPUs)") is None  # a label is not a cluster


@pytest.mark.parametrize("label", ["", "H100", "v5p:4x4x4", None])
def test_an_unknown_label_lists_the_presets(label):
    with pytest.raises(ValueError, match="no cluster preset") as e:
        cluster_preset(label)
    assert all(known in str(e.value) for known in CLUSTER_PRESETS)
