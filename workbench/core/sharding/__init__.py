"""A model's parameters on a mesh: placement with reasons, the layout plan and its export, spec text, the blocks
each device holds and their bytes, ZeRO's optimizer-state split, and what a matmul's output sharding is.

Semantic axes and their resolution stay in :mod:`workbench.core.axes` (the public contract).
"""
