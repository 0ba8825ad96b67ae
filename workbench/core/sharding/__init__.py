"""A model's parameters on a mesh: placement with reasons, the layout plan and its export, spec text and the blocks
each device holds and their bytes.

Semantic axes and their resolution stay in :mod:`workbench.core.axes` (the public contract); ZeRO's optimizer-state
split is :mod:`workbench.core.zero`, a matmul's output sharding :mod:`workbench.core.matmul_sharding`.
"""
