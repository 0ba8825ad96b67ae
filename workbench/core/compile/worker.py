"""The compile worker: a process with N simulated CPU devices that compiles exported programs for a mesh.

The parent (:mod:`workbench.core.compile.virtual`) starts it with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
and talks over its stdin / stdout: each message is a pickled dict preceded by its length (8 bytes, big
endian). A request holds a serialized ``jax.export.Exported`` (traced and lowered by the parent, for a flat
list of arguments), the mesh's shape and axis names, each argument's PartitionSpec and the donated
arguments; the reply holds the analysis (memory, cost, collectives, HLO text), never arrays. The worker
exits when its stdin closes or its parent dies, so no worker outlives the notebook kernel that started it.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
import traceback
import typing as tp

from workbench.core.hlo.collectives import collectives_in
from workbench.core.xla_log import stderr_lines, xla_warnings

HEADER = struct.Struct(">Q")


def dumps(message: tp.Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(stream: tp.BinaryIO, message: tp.Any) -> None:
    data = dumps(message)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: tp.BinaryIO) -> tp.Any:
    """The next message, or None when the stream closed."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = stream.read(size)
    return None if len(data) < size else pickle.loads(data)


def _watch_parent(parent: int) -> None:
    """Exit as soon as the parent is gone (a killed kernel closes no pipe while we compile)."""
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def analyse(compiled: tp.Any, mesh: tp.Any, seconds: float, warnings: tuple[str, ...]) -> dict[str, tp.Any]:
    """What a compiled program says about itself, as plain data (memory, cost, collectives, HLO text), with
    ``seconds`` ``{"compile": seconds, "analysis": the time of this}``."""
    start = time.perf_counter()
    stats = compiled.memory_analysis()
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in
              ("argument", "output", "alias", "temp", "generated_code")} if stats is not None else {}
    if stats is not None:
        memory["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    text = compiled.as_text()
    collectives = tuple(collectives_in(text, mesh))
    return {"memory": memory, "cost": {k: float(v) for k, v in cost.items()}, "hlo_text": text,
            "collectives": collectives, "compile_seconds": seconds, "warnings": warnings,
            "seconds": {"compile": seconds, "analysis": time.perf_counter() - start}}


def _compile(request: dict[str, tp.Any]) -> dict[str, tp.Any]:
    import jax
    from jax.sharding import AxisType, NamedSharding

    start = time.perf_counter()
    exported = jax.export.deserialize(bytearray(request["exported"]))
    shape, names = request["mesh_shape"], request["axis_names"]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
            for a, spec in zip(exported.in_avals, request["in_specs"], strict=True)]
    lowered = jax.jit(exported.call, donate_argnums=tuple(request["donate_argnums"])).lower(*args)
    lowering = time.perf_counter() - start
    start = time.perf_counter()
    with stderr_lines() as log:
        compiled = lowered.compile(compiler_options=request.get("compiler_options"))
    reply = analyse(compiled, mesh, time.perf_counter() - start, tuple(xla_warnings(log)))
    reply["seconds"]["worker_lower"] = lowering
    return reply


def main() -> None:
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    import jax

    send(stdout, {"ready": len(jax.devices("cpu"))})
    while (request := receive(stdin)) is not None:
        try:
            reply = _compile(request)
        except Exception as err:  # the parent raises it with the worker's traceback
            reply = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        send(stdout, reply)


if __name__ == "__main__":
    main()
