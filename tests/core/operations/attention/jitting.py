"""One ``jit`` around an attention call, for tests that check what it computes, not how it runs eagerly."""

import jax
import numpy as np


def jitted(op, q, k, v, **kw):
    """``op(q, k, v, **kw)`` under one ``jit``: one compile per call instead of one per eager op (the array
    arguments are traced; mods, flags and other Python values are closed over, as static)."""
    arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array | np.ndarray)}
    rest = {n: x for n, x in kw.items() if n not in arrays}
    return jax.jit(lambda q, k, v, arrays: op(q, k, v, **arrays, **rest))(q, k, v, arrays)
