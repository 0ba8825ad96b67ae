"""The cluster picker the LayoutAdvisor and the ShardingExplorer share: a ``Dropdown`` of the cluster presets
(:data:`~workbench.core.hardware.presets.CLUSTER_PRESETS`), with the given cluster's own name first when it is none
of them."""

from __future__ import annotations

import ipywidgets as widgets

from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.presets import CLUSTER_PRESETS, cluster_preset, preset_label

__all__ = ["cluster_label", "cluster_picker", "picked_cluster", "show_cluster"]


def cluster_label(cluster: Cluster) -> str:
    """``cluster``'s label in the picker: its preset's, else its name."""
    return preset_label(cluster) or cluster.name


def cluster_picker(cluster: Cluster, css_class: str, width: str = "370px") -> widgets.Dropdown:
    """A "cluster" Dropdown of the presets, showing ``cluster`` (its name first when it is not a preset)."""
    picker = widgets.Dropdown(options=list(CLUSTER_PRESETS), description="cluster",
                              layout=widgets.Layout(width=width), style={"description_width": "48px"})
    picker.add_class(css_class)
    show_cluster(picker, cluster)
    return picker


def show_cluster(picker: widgets.Dropdown, cluster: Cluster) -> None:
    """``picker`` showing ``cluster``; a cluster that is no preset joins the options first."""
    label = cluster_label(cluster)
    if label not in picker.options:
        picker.options = [label, *picker.options]
    picker.value = label


def picked_cluster(choice: Cluster | str, known: dict[str, Cluster]) -> Cluster:
    """The cluster ``choice`` names: a Cluster as it is (``known`` remembers it by its label), one of ``known`` by
    its label, else a preset (a ValueError listing the presets when it names none)."""
    if isinstance(choice, Cluster):
        known[cluster_label(choice)] = choice
        return choice
    if isinstance(choice, str) and choice in known:
        return known[choice]
    return cluster_preset(choice)
