"""What a step costs on a cluster, predicted or read from a compiled program.

- :mod:`.chips`: the chip table (peak FLOP/s per dtype, HBM, links) a :class:`~workbench.core.cluster.Cluster`
  is made of;
- :mod:`.network`: one collective's time on the cluster's network (torus axes, nodes, slices, latency);
- :mod:`.roofline`: FLOPs and bytes against a chip's peaks; :mod:`.sharded_matmul`: one sharded matmul as a step;
- :mod:`.step_time`: a compiled step's time on a cluster; :mod:`.predicted`: a layout's step time from shapes;
- :mod:`.flops`: a step's FLOPs by formula; MFU (model FLOPs) and HFU (with recompute), computed only there;
- :mod:`.ledger`: the bytes per device of a step, predicted from structure.
"""
