"""What a step costs on a cluster, predicted from shapes or read from a compiled program: arithmetic only (no flax,
no optax); the chips and the network model are in :mod:`workbench.core.hardware`.

- :mod:`.roofline`: FLOPs and bytes against a chip's peaks; :mod:`.sharded_matmul`: one sharded matmul as a step;
- :mod:`.step`: the StepTime record; :mod:`.compiled_step`: a compiled step's time on a cluster;
  :mod:`.predicted`: a layout's step time from shapes,
  counted in :mod:`.step_counts` and :mod:`.work`, each parallelism's collectives in :mod:`.parallel`, priced in
  :mod:`.step_pricing`; :mod:`.price`: a :class:`~workbench.core.plan.Plan` priced (the one entry callers use);
- :mod:`.flops`: a step's FLOPs by formula; MFU (model FLOPs) and HFU (with recompute), computed only there;
- :mod:`.kernels`: a kernel's rate on a chip; :mod:`.reconcile`: the step model's terms against a compiled program;
- :mod:`.ledger`: the bytes per device of a step, predicted from structure; :mod:`.activations` what the forward
  keeps for the backward.
"""
