"""Attention implementations, one file each, registered in ``OperationRegistry`` on import."""

from workbench.core.operations.attention import (  # noqa: F401
    allgather_kv,
    flash,
    flex,
    paged,
    ring,
    sdpa,
    ulysses,
    vanilla,
)
