"""The hardware a step runs on: chips, their calibration evidence, clusters and their networks.

- :mod:`.chips`: the chip table (peak FLOP/s per dtype, HBM, links), each number with its source;
- :mod:`.calibration`: the efficiencies fitted to or measured on published runs, with their evidence;
- :mod:`.cluster`: a :class:`~workbench.core.hardware.cluster.Cluster` of chips (TPU slices and pods, GPU nodes) and
  its mesh;
- :mod:`.presets`: the clusters the widgets' pickers offer (``CLUSTER_PRESETS``, ``cluster_preset``, ``preset_label``);
- :mod:`.network`: one collective's time on the cluster's network (torus axes, nodes, slices, latency).
"""
