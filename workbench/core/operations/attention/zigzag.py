"""The zig-zag (striped) layout of a sequence over ``sp`` devices: causal load balance for ``ring``.

Cut the sequence into ``2 sp`` chunks. Split contiguously, device ``i`` holds chunks ``2i`` and ``2i + 1``;
under a causal mask its queries see ``i + 1`` of the ``sp`` key blocks, so the last device does ``sp``
times the first one's work. Zig-zag, device ``i`` holds chunks ``i`` and ``2 sp - 1 - i``, one early and
one late: every device's queries see ``2 sp + 1`` of the ``(2 sp)^2`` chunk tiles (``i + 1`` for the
early chunk, ``2 sp - i`` for the late one).

:func:`zigzag_order` is the permutation of positions as a whole array; :func:`to_zigzag` and
:func:`from_zigzag` move one device's shard between the layouts inside ``shard_map``, with two
``ppermute`` of half a shard each (every chunk travels once, nothing is gathered).

>>> zigzag_chunks(4).tolist()
[[0, 7], [1, 6], [2, 5], [3, 4]]
>>> zigzag_order(8, 2).tolist()
[0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def zigzag_chunks(sp: int) -> np.ndarray:
    """``(sp, 2)``: the chunks (of ``2 sp``) device ``i`` holds in the zig-zag layout, ``[i, 2 sp - 1 - i]``."""
    i = np.arange(sp)
    return np.stack([i, 2 * sp - 1 - i], axis=1)


def zigzag_order(length: int, sp: int) -> np.ndarray:
    """The positions in zig-zag order: ``x[:, zigzag_order(T, sp)]`` split contiguously over ``sp`` gives
    device ``i`` chunks ``i`` and ``2 sp - 1 - i``. ``np.argsort`` of it undoes it."""
    if length % (2 * sp):
        raise ValueError(f"zigzag: length {length} must be divisible by 2 * sp = {2 * sp}")
    c = length // (2 * sp)
    return (zigzag_chunks(sp).reshape(-1, 1) * c + np.arange(c)).reshape(-1)


def _routes(sp: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], np.ndarray]:
    """The two permutations that carry a device's first (chunk ``2d``) and second (``2d + 1``) half to
    their zig-zag holders, and for each receiver the slot (0 early, 1 late) its first-half chunk fills."""
    holder = {}  # chunk -> (device, slot) in the zig-zag layout
    for d, (early, late) in enumerate(zigzag_chunks(sp).tolist()):
        holder[early], holder[late] = (d, 0), (d, 1)
    first = [(d, holder[2 * d][0]) for d in range(sp)]
    second = [(d, holder[2 * d + 1][0]) for d in range(sp)]
    first_slot = np.zeros(sp, np.int32)
    for d in range(sp):
        dest, slot = holder[2 * d]
        first_slot[dest] = slot
    return first, second, first_slot


def _inverse(perm: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(dst, src) for src, dst in perm]


def to_zigzag(x: Array, axis_name: str, sp: int, dim: int) -> Array:
    """Inside ``shard_map``: this device's contiguous shard of ``dim`` -> its zig-zag shard (early chunk first).

    A dimension of size 1 (broadcast, not split) is returned as it is.
    """
    if x.shape[dim] == 1 or sp == 1:
        return x
    first, second, first_slot = _routes(sp)
    a, b = jnp.split(x, 2, axis=dim)
    a, b = jax.lax.ppermute(a, axis_name, first), jax.lax.ppermute(b, axis_name, second)
    early = jnp.asarray(first_slot)[jax.lax.axis_index(axis_name)] == 0
    return jnp.concatenate([jnp.where(early, a, b), jnp.where(early, b, a)], axis=dim)


def from_zigzag(x: Array, axis_name: str, sp: int, dim: int) -> Array:
    """Inside ``shard_map``: the inverse of :func:`to_zigzag`."""
    if x.shape[dim] == 1 or sp == 1:
        return x
    first, second, first_slot = _routes(sp)
    early, late = jnp.split(x, 2, axis=dim)
    from_first = jnp.asarray(first_slot)[jax.lax.axis_index(axis_name)] == 0
    a = jnp.where(from_first, early, late)  # the chunk that came as someone's first half goes back there
    b = jnp.where(from_first, late, early)
    a, b = jax.lax.ppermute(a, axis_name, _inverse(first)), jax.lax.ppermute(b, axis_name, _inverse(second))
    return jnp.concatenate([a, b], axis=dim)
