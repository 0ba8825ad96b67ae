"""Compiling a step without the cluster: the abstract step, the virtual cluster's compile (TPU ahead of time or a
worker process with N simulated CPU devices), the compile cache, and XLA's log while compiling.
"""
