"""Optimised HLO read back: the module's computations and how often each runs, its collectives, its dots
and HBM traffic, and a profile of where its time went.

- :mod:`.text`: the one parser: computations, instructions, shapes, element types, collective kinds;
- :mod:`.collectives`: each collective of a compiled program, its bytes, replica groups and mesh axes;
- :mod:`.graph`: the call graph with loop trip counts, matmul FLOPs, HBM bytes, async windows;
- :mod:`.op_profile`: a ``jax.profiler`` trace's XLA operations, counted and timed.
"""
