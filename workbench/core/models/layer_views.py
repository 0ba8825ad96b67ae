"""A decode step that reads each weight once: per-layer views of the stacked weights, chosen per backend.

The layers' parameters are stacked on a leading ``layers`` axis and run by ``lax.scan`` (:mod:`.stack`):
one compiled body whatever the depth, what training and prefill want. A decode step is different: it reads
every weight once to move one token, so the step takes as long as the weights take to read, and anything
that reads them twice doubles it. On XLA:CPU the scan does: the dot's operand is a whole buffer, so each
iteration copies its layer's slice of every stacked weight first (read, write, read again). Slicing the
stack inside the decode loop copies just the same, every step.

So ``generate(..., layer_loop="views")`` reads layer ``i`` from arrays that *are* layer ``i``:
:func:`layer_views` makes a zero-copy view of each layer's slice of each stacked parameter (``jax.device_put``
of a read-only NumPy view aliases the host buffer), and inside :func:`reading_views` a stack of layers runs
unrolled over those views (:func:`workbench.core.models.stack.run_stack`). Nothing is copied and no memory is
added. The unrolled loop costs compile time, about 0.12 s a layer on a 2-core CPU (SmolLM2-135M's 30 layers:
4.1 s against 0.6 s scanned), which a 64-token decode does not earn back (about 10 ms a step saved), so the
scan stays the default and the views are asked for where decodes are long or repeated. (An unrolled prefill
compiled as slowly and ran no faster: its matmuls are compute-bound, the copies a small part.)

Measured on this project's CPU machine (2 cores, SmolLM2-135M float32, batch 1, 64 new tokens, the same
process): the scanned decode step 42-49 ms, over views 32-35 ms, reading every weight once (``jnp.sum``)
21-23 ms. What is left is XLA:CPU's small matrix-vector products: a 576 x 576 or 576 x 192 dot runs on one
core at about half the two cores' read bandwidth. ``benchmarks/generate.py`` prints the same run's figures.

GPU and TPU refuse the views (:data:`LAYER_LOOP` records the choice per platform): XLA:GPU and XLA:TPU can read
a dot's operand through a dynamic slice, but no device was at hand to measure whether their decode copies.
"""

from __future__ import annotations

import contextlib
import typing as tp

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from workbench.core.models.stack import presliced_layers

LAYER_LOOP: dict[str, str] = {"cpu": "views", "gpu": "scan", "tpu": "scan"}
"""Which platforms' decode loops may run over per-layer views (``"views"``, measured on CPU) and which keep
``lax.scan`` (``"scan"``): ``generate(layer_loop="views")`` refuses a model on a ``"scan"`` platform."""

Views = dict[tuple, tuple[nnx.State, ...]]


def stack_paths(model: nnx.Module) -> list[tuple]:
    """Paths (in ``nnx.state(model)``) of the model's stacks of layers (modules with ``num_layers`` set)."""
    return [tuple(path) for path, module in nnx.iter_modules(model)
            if getattr(module, "num_layers", None) is not None and path]


def viewable(model: nnx.Module) -> bool:
    """Whether the model's arrays live on a platform whose :data:`LAYER_LOOP` is ``"views"`` and each stacked
    weight can be viewed layer by layer (one array on one device)."""
    state, paths = nnx.state(model), stack_paths(model)
    leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    platforms = {d.platform for x in leaves for d in x.sharding.device_set}
    if not paths or len(platforms) != 1 or LAYER_LOOP.get(platforms.pop(), "scan") != "views":
        return False
    return all(_viewable(x) for path in paths for x in jax.tree.leaves(_at(state, path)))


def layer_views(model: nnx.Module) -> Views:
    """Each stack's per-layer states, every array a zero-copy view of its layer's slice of the stacked one
    (call only where :func:`viewable`). A slice that does not start on the alignment XLA:CPU's buffers need
    (a layer of an odd size) is copied by ``device_put`` instead: the same values, in new memory."""
    state = nnx.state(model)
    views = {}
    for path in stack_paths(model):
        stacked = _at(state, path)
        leaves, treedef = jax.tree.flatten(stacked)
        n = leaves[0].shape[0]
        hosts = [_host(a) for a in leaves]
        # one batched device_put for every layer's views (one call each costs ~0.1 ms)
        flat = jax.device_put([h[i] for i in range(n) for h in hosts], [a.sharding for _ in range(n) for a in leaves])
        views[path] = tuple(jax.tree.unflatten(treedef, flat[i * len(leaves):(i + 1) * len(leaves)])
                            for i in range(n))
    return views


@contextlib.contextmanager
def reading_views(state: nnx.State, views: Views) -> tp.Iterator[None]:
    """While inside, a stack of ``state`` (traced) runs unrolled over ``views`` (traced alike), layer ``i``'s
    parameters read from ``views[path][i]`` rather than sliced from the stack."""
    found = {}
    for path, per_layer in views.items():
        stacked = jax.tree.leaves(_at(state, path))
        layers = [jax.tree.leaves(v) for v in per_layer]
        for j, a in enumerate(stacked):
            found[id(a)] = (a, tuple(layer[j] for layer in layers))
    with presliced_layers(found):
        yield


def _at(state: nnx.State, path: tuple) -> nnx.State:
    for key in path:
        state = state[key]
    return state


def _viewable(a: tp.Any) -> bool:
    """One array on one device (a model laid over a mesh of simulated devices scans: it is there to show the
    sharding, not to run fast, and a view would need each shard's sharding typed anew)."""
    return isinstance(a, jax.Array) and a.ndim >= 1 and isinstance(a.sharding, SingleDeviceSharding)


def _host(a: jax.Array) -> np.ndarray:
    """``a``'s NumPy view (``np.from_dlpack``: read-only, aliasing the device buffer on CPU, cached nowhere), whose
    slices ``device_put`` puts back without a copy (it aliases a read-only host array). While a view lives,
    donating ``a`` copies instead (JAX sees the reference)."""
    try:
        view = np.from_dlpack(a)
    except RuntimeError:  # a dtype DLPack cannot name (bfloat16, float8): JAX's own view, cached on the array
        return np.asarray(a)
    view.flags.writeable = False  # what makes device_put alias it rather than copy
    return view
