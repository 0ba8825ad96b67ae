"""Argument checks the core shares: the one rule of what a count is (an int, NumPy's too, never a bool).

>>> positive_int("batch_size", 4), is_positive_int(True), is_positive_int(2.0)
(4, False, False)
>>> positive_int("max_length", 0)
Traceback (most recent call last):
ValueError: max_length must be a positive int; got 0
"""

from __future__ import annotations

import numbers
import typing as tp


def is_int(value: tp.Any) -> bool:
    """An int or a NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_positive_int(value: tp.Any, least: int = 1) -> bool:
    """An int (see :func:`is_int`) of at least ``least``."""
    return is_int(value) and bool(value >= least)


def positive_int(name: str, value: tp.Any, *, least: int = 1, what: str = "a positive int") -> int:
    """``value`` as an int, or a ValueError ``"<name> must be <what>; got <value>"``."""
    if not is_positive_int(value, least):
        raise ValueError(f"{name} must be {what}; got {value!r}")
    return int(value)


def one_of(name: str, value: tp.Any, choices: tp.Sequence[tp.Any], *, what: str = "") -> tp.Any:
    """``value`` if it is one of ``choices``, or a ValueError ``"<name> must be one of <choices><what>; got <value>"``:
    the one check of a choice (a task, a remat policy, an optimizer ...).

    >>> one_of("remat", "full", ("none", "full"))
    'full'
    >>> one_of("task", "serve", ("train", "decode"))
    Traceback (most recent call last):
    ValueError: task must be one of ('train', 'decode'); got 'serve'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}{what}; got {value!r}")
    return value


def batch_shape(batch: tp.Any) -> tuple[int, int]:
    """``batch`` as ``(sequences, length)``, or a ValueError that says it is two positive ints."""
    if not isinstance(batch, tuple | list) or len(batch) != 2 or not all(is_positive_int(b) for b in batch):
        raise ValueError(f"batch is (sequences, length), two positive ints; got {batch!r}")
    return int(batch[0]), int(batch[1])
