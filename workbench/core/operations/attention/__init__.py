"""Attention implementations, one file each, registered in ``OperationRegistry`` on import."""

from workbench.core.operations.attention import allgather_kv, flash, paged, ring, sdpa, ulysses, vanilla  # noqa: F401
