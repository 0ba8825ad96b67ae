"""Each parallelism's collectives in a predicted step and what hides them, one module per parallelism (as
torchtitan keeps one file per parallelism): :mod:`.data` (data parallelism, FSDP and ZeRO-1), :mod:`.tensor`
(Megatron TP), :mod:`.sequence` (ring attention), :mod:`.expert` (EP's all-to-alls) and :mod:`.pipeline` (stage
sends and the bubble).

Each collective is ``cost.transfer(kind, bytes, axes, mesh, cluster)`` times its runs (the Training chapter of
"How to Scale Your Model"; the GPUs chapter for NVLink and the network between nodes), counted into a
:class:`~workbench.core.cost.step_counts.StepCounts` by :func:`~workbench.core.cost.predicted.predict_step` and
priced by :mod:`~workbench.core.cost.step_pricing`.
"""
