"""The bytes each device holds for a tree of arrays and their shardings, counted without allocating anything.

Not the memory ledger's quantity (:class:`workbench.core.cost.ledger.Ledger`): the ledger predicts, from a layout's
specs, the bytes of a step by part (parameters, gradients, optimizer, activations, ...), one number that every
device holds. :func:`memory_per_device` counts one given tree of concrete placements exactly, device by device
(``NamedSharding.devices_indices_map``: replication and uneven splits show per device id), with no parts and no
step. That is why the tests hold the ledger against it: an independent count, not the ledger's own arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import numpy as np
from jax.sharding import Sharding


# -- memory ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes each device holds of one tree of arrays (by device id), and their unsharded size (``logical``)."""

    per_device: dict[int, int]
    logical: int

    @property
    def total(self) -> int:
        """Bytes over all devices: ``logical`` times the average replication."""
        return sum(self.per_device.values())

    @property
    def max(self) -> int:
        return max(self.per_device.values(), default=0)


def _shard_bytes(leaf: tp.Any, sharding: Sharding | None, out: dict[int, int]) -> int:
    sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
    if not isinstance(sharding, Sharding):
        raise TypeError(f"memory_per_device: no sharding for {leaf!r}; pass shardings=... or give each "
                        f"ShapeDtypeStruct a sharding")
    shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
    for device, index in sharding.devices_indices_map(shape).items():
        lengths = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
        out[device.id] = out.get(device.id, 0) + math.prod(lengths) * itemsize
    return math.prod(shape) * itemsize


def memory_per_device(abstract_tree: tp.Any, shardings: tp.Any = None) -> DeviceMemory:
    """Bytes each device holds for a tree of arrays or ``ShapeDtypeStruct``s, computed, not allocated.

    ``shardings`` is one sharding for every leaf, a tree matching ``abstract_tree`` (or a prefix of it),
    or ``None`` to use each leaf's own ``.sharding``.
    """
    out: dict[int, int] = {}
    if shardings is None or isinstance(shardings, Sharding):
        logical = sum(_shard_bytes(x, shardings, out) for x in jax.tree.leaves(abstract_tree))
    else:
        is_sharding = lambda s: s is None or isinstance(s, Sharding)
        sizes = jax.tree.map(lambda s, sub: sum(_shard_bytes(x, s, out) for x in jax.tree.leaves(sub)),
                             shardings, abstract_tree, is_leaf=is_sharding)
        logical = sum(jax.tree.leaves(sizes))
    return DeviceMemory(dict(sorted(out.items())), logical)
