"""One bounded, thread-safe cache of compiled programs, shared by generation, the attention lab and training.

Compiling is slow and a compiled program is reused for as long as its key (structure, config, input
avals and shardings) matches. The widgets run ``generate`` on a background thread while the main thread
may compile too, so the cache is locked; a key asked for by two threads at once is compiled once (the
second waits for the first, without holding the lock, so other keys compile meanwhile). The least
recently used entry goes when the cache is full; what a program needs at run time (a streamer slot)
lives in its entry and goes with it.

>>> cache = CompileCache(maxsize=2)
>>> cache.get(("demo", 1), lambda: "program").compiled, cache.get(("demo", 1), lambda: "other").value
(True, 'program')
"""

from __future__ import annotations

import collections
import threading
import time
import typing as tp

import jax

from workbench.core.checks import positive_int


class Lookup(tp.NamedTuple):
    """What :meth:`CompileCache.get` found: the ``value``, whether this call built it (``compiled``), and the
    ``seconds`` it spent building or waiting for another thread building the same key (0 on a hit)."""

    value: tp.Any
    compiled: bool
    seconds: float


class CompileCache:
    """An LRU map ``key -> compiled program`` of at most ``maxsize`` entries, safe to use from many threads.

    Keys are tuples whose first item names the user (``"generate"``, ``"attention_lab"``, ``"train_step"``),
    so :meth:`clear` can forget one user's programs.
    """

    def __init__(self, maxsize: int):
        self.maxsize = positive_int("maxsize", maxsize)
        self._entries: collections.OrderedDict[tp.Hashable, tp.Any] = collections.OrderedDict()
        self._building: dict[tp.Hashable, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple, build: tp.Callable[[], tp.Any]) -> Lookup:
        """The value cached under ``key``, or ``build()``'s, cached (evicting the least recently used).

        ``build`` runs at most once at a time per key: a concurrent caller waits for it. When it raises,
        the error goes to its caller and a waiting caller builds for itself.
        """
        start, waited = time.perf_counter(), False
        while True:
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    return Lookup(self._entries[key], False, time.perf_counter() - start if waited else 0.0)
                pending = self._building.get(key)
                if pending is None:
                    done = self._building[key] = threading.Event()
                    break
            pending.wait()
            waited = True
        try:
            value = build()
            with self._lock:
                self._entries[key] = value
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
        finally:
            with self._lock:
                del self._building[key]
            done.set()
        return Lookup(value, True, time.perf_counter() - start)

    def __contains__(self, key: tp.Hashable) -> bool:
        """Whether ``key`` is compiled and cached (does not count as a use)."""
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[tp.Hashable]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def items(self) -> list[tuple[tp.Hashable, tp.Any]]:
        """The cached ``(key, value)`` pairs, least recently used first (does not count as a use)."""
        with self._lock:
            return list(self._entries.items())

    def clear(self, user: str | None = None) -> None:
        """Forget every program, or only those whose key starts with ``user``."""
        with self._lock:
            for key in [k for k in self._entries if user is None or k[0] == user]:
                del self._entries[key]


def signature(args: tp.Any) -> tuple:
    """What a compiled program's inputs must match: the pytree structure, each leaf's aval and sharding."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)


PROGRAMS = CompileCache(maxsize=128)
"""The cache generation, the attention lab and the training step share."""
