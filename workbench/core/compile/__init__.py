"""Compiling a step without the cluster: the abstract step and the virtual cluster's compile (TPU ahead of time or
a worker process with N simulated CPU devices).
"""
