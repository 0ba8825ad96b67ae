"""Compile a program for a virtual cluster: what XLA says about it there, without the cluster.

- TPU clusters compile in this process with XLA's own TPU compiler, ahead of time: ``libtpu`` describes
  the slice (``jax.experimental.topologies``) and a program lowered from ``ShapeDtypeStruct``s on a mesh
  of those devices compiles to real TPU HLO (nothing runs; needs ``pip install "jax-workbench[tpu-aot]"``).
- GPU and CPU clusters compile in a worker process with as many simulated CPU devices (up to
  :data:`~workbench.core.hardware.cluster.MAX_SIMULATED_DEVICES`): this process traces and lowers the program on an
  ``AbstractMesh`` and exports it; the worker compiles it and returns the analysis. One worker per device
  count, reused; it exits with this process.

:func:`~workbench.core.hardware.cluster.cluster_mesh` (imported here too) gives the mesh to place abstract arguments
on; :func:`compile_on` returns a :class:`CompiledAnalysis` (memory, cost, collectives with mesh axes and loop
trips).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import typing as tp

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from workbench.core.compile import worker as worker_protocol
from workbench.core.compile.steps import abstract_step, full_mesh_shape
from workbench.core.hardware.cluster import Cluster, cluster_mesh
from workbench.core.hlo.collectives import Collective, summarize
from workbench.core.hlo.graph import hbm_bytes, matmul_flops
from workbench.core.mesh import MESH_AXES, mesh_of
from workbench.core.programs import CompileCache
from workbench.core.xla_log import xla_log_lines, xla_warnings

# XLA:TPU's memory-space assignment moves buffers into a TensorCore's VMEM (128 MiB on v5e) and adds prefetch
# copies: negligible beside a real model's HBM, but it reshapes a tiny model's HBM peak (a small Llama's grew by
# 9 MB per layer instead of its 24). With this option the peak is XLA's HBM buffer assignment alone, what the
# memory ledger counts; the ledger's tests compile tiny models with it. v5e reads the "vf" flag, v6e and TPU7x the
# "gf" one; a generation ignores the other's (measured with libtpu 0.0.42 on a 4-layer bf16 Llama, fsdp=4 x tp=2,
# 16 x 256: v5e:2x4 and v5p:2x2x2 peaks alike with one flag or both; v6e:2x4 130.5 MB with "vf" alone, 110.2 MB
# with both; tpu7x:2x2x1 78.3 MB with "vf" alone, 109.4 MB with both, 3 % below the ledger).
TPU_HBM_ONLY = {"xla_vf_vmem_memory_space_assignment": False, "xla_gf_vmem_memory_space_assignment": False}


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """Bytes per device from XLA's buffer assignment (``compiled.memory_analysis()``); ``peak`` is XLA's
    ``peak_memory_in_bytes`` where the backend reports one (TPU), else 0."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int = 0
    peak: int = 0

    @property
    def total(self) -> int:
        """What one device holds at most while the program runs: XLA's peak where reported (on TPU,
        ``temp`` leaves out buffers that the peak counts, such as a layer scan's saved activations), else
        arguments + outputs + temporaries, a donated argument that becomes an output counted once."""
        return self.peak or self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class CompiledAnalysis:
    """What XLA says about a program compiled for ``cluster`` on a mesh of ``mesh_shape`` (``axis_names``).

    ``cost`` is ``compiled.cost_analysis()`` (``flops``, ``bytes accessed``, and on TPU XLA's own time
    estimate ``optimal_seconds``); ``collectives`` every collective of the optimised HLO with its mesh axes and
    loop trips. ``compile_seconds`` is XLA's compile alone (``lowered.compile()``).

    ``seconds`` says where this call's time went: ``"trace_lower"`` (tracing and lowering here; for a worker
    cluster also exporting and serialising), ``"compile"`` (= ``compile_seconds``), ``"analysis"`` (memory, cost,
    HLO text, collectives), and for a worker cluster ``"worker_start"`` (0 once it runs), ``"worker_lower"``
    (deserialising and lowering there) and ``"transfer"`` (the rest of the round trip: pipe and pickles).
    ``cached``: the same program (same lowered module, cluster, device order and compile options) was compiled
    before in this process and its analysis is returned as it was; ``seconds`` then holds ``"trace_lower"``
    (needed to know the program) and ``"lookup"`` only, while ``compile_seconds`` stays that compile's.
    """

    cluster: Cluster
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    memory: MemoryAnalysis
    cost: dict[str, float]
    collectives: tuple[Collective, ...]
    compile_seconds: float
    warnings: tuple[str, ...] = ()
    hlo_text: str = dataclasses.field(default="", repr=False)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    cached: bool = dataclasses.field(default=False, compare=False)

    @property
    def flops(self) -> float:
        """XLA's ``cost_analysis()`` FLOPs: a while loop's body (a scanned layer) counted once."""
        return self.cost.get("flops", 0.0)

    @functools.cached_property
    def matmul_flops(self) -> float:
        """FLOPs of every dot of the program per device, each once per loop trip (``inspect.matmul_flops``)."""
        return matmul_flops(self.hlo_text)

    @property
    def bytes_accessed(self) -> float:
        """XLA's ``cost_analysis()`` bytes accessed: a while loop's body counted once."""
        return self.cost.get("bytes accessed", 0.0)

    @functools.cached_property
    def hbm_bytes(self) -> float:
        """Bytes each device moves between HBM and the chip, counted as XLA's ``bytes accessed`` is but each
        instruction once per loop trip (``_hlo_graph.hbm_bytes``)."""
        return hbm_bytes(self.hlo_text)

    @property
    def xla_seconds(self) -> float | None:
        """XLA's own estimate of the program's time (TPU only: ``cost_analysis()["optimal_seconds"]``), or None.
        Like the other ``cost_analysis()`` numbers it counts a while loop's body once. XLA:CPU (a worker
        cluster) makes no estimate: an ``optimal_seconds`` in its cost analysis is no time (negative for
        DeepSeek-V3's step); nor is XLA:TPU's -1, which it reports for a program it did not estimate (a small
        decode step's)."""
        seconds = self.cost.get("optimal_seconds") if self.cluster.platform == "tpu" else None
        return seconds if seconds is not None and seconds > 0 else None

    def collectives_summary(self) -> dict[str, dict[str, int]]:
        """Per kind: instructions, runs per execution (loop trips) and bytes per device."""
        return summarize(self.collectives, count_trips=True)


# -- compiling ----------------------------------------------------------------------------------------
def compile_on(cluster: Cluster, fn: tp.Callable, *args: tp.Any, donate_argnums: tp.Sequence[int] = (),
               out_shardings: tp.Any = None, compiler_options: tp.Mapping[str, tp.Any] | None = None
               ) -> CompiledAnalysis:
    """Compile ``fn(*args)`` for ``cluster`` and analyse it; ``args`` are ``ShapeDtypeStruct`` trees placed
    on :func:`cluster_mesh` (every leaf with a ``NamedSharding``). ``fn`` is jitted here with
    ``donate_argnums`` and ``out_shardings``; ``compiler_options`` (XLA flags, e.g. ``TPU_HBM_ONLY``) go to
    the compiler. Nothing is allocated or run. The same program compiled again (same lowered module, cluster,
    device order and options) returns the first analysis (:data:`ANALYSES`)."""
    mesh = mesh_of(args)
    if mesh is None:
        raise ValueError("compile_on needs abstract arguments placed on the cluster's mesh: "
                         "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(cluster_mesh(...), spec))")
    jit_kwargs: dict[str, tp.Any] = {"donate_argnums": tuple(donate_argnums)}
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = out_shardings
    if cluster.platform == "tpu":
        if not isinstance(mesh, Mesh) or mesh.devices.flat[0].platform != "tpu":
            raise ValueError(f"{cluster.name}: place the arguments on cluster_mesh(cluster, ...) (TPU devices)")
        start = time.perf_counter()
        lowered = jax.jit(fn, **jit_kwargs).lower(*args)
        traced = time.perf_counter() - start
        key = ("tpu", cluster, tuple(mesh.axis_names), mesh.devices.shape, tuple(d.id for d in mesh.devices.flat),
               _digest(lowered.as_text(debug_info=True).encode()), tuple(sorted((compiler_options or {}).items())))

        def build() -> dict[str, tp.Any]:
            start = time.perf_counter()
            with xla_log_lines() as log:  # XLA's log kept; other threads' stderr goes on meanwhile
                compiled = lowered.compile(dict(compiler_options or {}) or None)
            return worker_protocol.analyse(compiled, mesh, time.perf_counter() - start, tuple(xla_warnings(log)))

        return _analysis(cluster, mesh, ANALYSES.get(key, build), {"trace_lower": traced})
    if not isinstance(mesh, AbstractMesh) or mesh.size != cluster.num_devices:
        raise ValueError(f"{cluster.name}: place the arguments on cluster_mesh(cluster, ...) (an AbstractMesh of "
                         f"{cluster.num_devices} devices)")
    if cluster.num_devices not in workers():  # the worker starts (a process importing JAX) while we trace
        threading.Thread(target=_start_worker, args=(cluster.num_devices,), daemon=True).start()
    start = time.perf_counter()
    request = _export(fn, args, mesh, jit_kwargs, compiler_options)
    traced = time.perf_counter() - start
    key = ("worker", cluster, _digest(worker_protocol.dumps(request)))

    def build() -> dict[str, tp.Any]:
        start = time.perf_counter()
        worker = _worker(cluster.num_devices)
        started = time.perf_counter()
        reply = worker.compile(request)
        trip = time.perf_counter() - started
        reply["seconds"] = dict(reply["seconds"], worker_start=started - start,
                                transfer=max(0.0, trip - sum(reply["seconds"].values())))
        return reply

    return _analysis(cluster, mesh, ANALYSES.get(key, build), {"trace_lower": traced})


ANALYSES = CompileCache(maxsize=16)
"""The analyses of the programs :func:`compile_on` compiled in this process, by program (the lowered module,
its cluster, device order and compile options), so compiling the same step again (a re-run cell, the explorer
switching back) costs its tracing only. ``ANALYSES.clear()`` forgets them."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _analysis(cluster: Cluster, mesh: tp.Any, found: tp.Any, seconds: dict[str, float]) -> CompiledAnalysis:
    reply = found.value
    if found.compiled:
        seconds.update(reply["seconds"])
    else:
        seconds["lookup"] = found.seconds
    memory = dict(reply["memory"])
    if cluster.platform != "tpu":  # XLA:CPU's peak_memory_in_bytes is about the arguments only: not a peak
        memory["peak"] = 0
    return CompiledAnalysis(cluster, tuple(mesh.axis_sizes), tuple(mesh.axis_names), MemoryAnalysis(**memory),
                            dict(reply["cost"]), reply["collectives"], reply["compile_seconds"], reply["warnings"],
                            reply["hlo_text"], seconds, not found.compiled)


# -- the worker -----------------------------------------------------------------------------------------
class Worker:
    """A process with ``num_devices`` simulated CPU devices that compiles exported programs (see
    :mod:`workbench.core.compile.worker`). Requests are served one at a time."""

    def __init__(self, num_devices: int):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                         if not f.startswith("--xla_force_host_platform_device_count"))
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}".strip(),
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.num_devices = num_devices
        self.log = tempfile.TemporaryFile()  # the worker's stderr, read when it fails
        self.lock = threading.Lock()
        self.process = subprocess.Popen([sys.executable, "-m", "workbench.core.compile.worker"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        ready = worker_protocol.receive(self.process.stdout)
        if not ready or ready.get("ready") != num_devices:
            raise RuntimeError(f"the compile worker for {num_devices} devices did not start:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def compile(self, request: dict[str, tp.Any]) -> dict[str, tp.Any]:
        """Send a request (:func:`_export`) and return the worker's reply."""
        with self.lock:
            if self.process.poll() is not None:
                raise RuntimeError(f"the compile worker for {self.num_devices} devices exited:\n{self._log_tail()}")
            worker_protocol.send(self.process.stdin, request)
            reply = worker_protocol.receive(self.process.stdout)
        if reply is None:
            raise RuntimeError(f"the compile worker for {self.num_devices} devices died:\n{self._log_tail()}")
        if "error" in reply:
            raise RuntimeError(f"compiling for {self.num_devices} simulated devices failed: {reply['error']}\n"
                               f"{reply['traceback']}")
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _export(fn: tp.Callable, args: tp.Sequence[tp.Any], mesh: AbstractMesh, jit_kwargs: dict[str, tp.Any],
            compiler_options: tp.Mapping[str, tp.Any] | None = None) -> dict[str, tp.Any]:
    """A worker's request: ``fn`` traced, lowered and exported here for flat arguments, serialised."""
    jit_kwargs = dict(jit_kwargs)
    leaves, treedef = jax.tree.flatten(args)
    specs = [leaf.sharding.spec if isinstance(leaf.sharding, NamedSharding) else PartitionSpec()
             for leaf in leaves]
    donated = set(jit_kwargs.pop("donate_argnums", ()))
    arg_of = [i for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]  # each flat leaf's positional argument
    donate = [j for j, i in enumerate(arg_of) if i in donated]

    def flat(*leaves):  # flat in, flat out: the exported program names no pytree types of ours
        return jax.tree.leaves(fn(*jax.tree.unflatten(treedef, leaves)))

    if "out_shardings" in jit_kwargs:
        jit_kwargs["out_shardings"] = jax.tree.leaves(
            jit_kwargs["out_shardings"], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))

    with xla_log_lines():
        exported = jax.export.export(jax.jit(flat, **jit_kwargs), platforms=["cpu"])(*leaves)
    return {"exported": exported.serialize(), "mesh_shape": tuple(mesh.axis_sizes),
            "axis_names": tuple(mesh.axis_names), "in_specs": specs, "donate_argnums": donate,
            # never run, only read: on CPU, LLVM's -O0 compiles 3-4x faster after the same HLO passes
            "compiler_options": {"xla_backend_optimization_level": 0, **(compiler_options or {})}}


_WORKERS: dict[int, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(num_devices: int) -> Worker:
    """The worker for ``num_devices`` (started on first use, then reused)."""
    with _WORKERS_LOCK:
        worker = _WORKERS.get(num_devices)
        if worker is None or worker.process.poll() is not None:
            worker = _WORKERS[num_devices] = Worker(num_devices)
        return worker


def _start_worker(num_devices: int) -> None:
    try:
        _worker(num_devices)
    except Exception:  # the compile that needs it starts it again, and raises
        pass


def workers() -> dict[int, int]:
    """Running workers: device count -> process id."""
    return {n: w.process.pid for n, w in list(_WORKERS.items()) if w.process.poll() is None}


@atexit.register
def close_workers() -> None:
    """Stop every worker (they also exit on their own when this process dies)."""
    with _WORKERS_LOCK:
        for worker in _WORKERS.values():
            worker.close()
        _WORKERS.clear()


def compile_step(model: tp.Any, cluster: Cluster, mesh_shape: tp.Mapping[str, int], *, kind: str = "train",
                 batch: tuple[int, int] = (8, 128), optimizer: str = "adamw", partition_axis: tp.Any = None,
                 rules: tp.Any = None, pipeline: tp.Any = None, zero_stage: int = 0, kv_length: int | None = None,
                 compiler_options: tp.Mapping[str, tp.Any] | None = None) -> CompiledAnalysis:
    """Compile one ``kind`` step (``"train"``: loss, gradient and the optimizer update with the state donated;
    ``"forward"``; ``"decode"``: ``batch``'s tokens written into a KV cache of ``kv_length`` positions, the cache
    donated) of ``model`` for ``cluster`` on a mesh of ``mesh_shape`` (workbench axes, e.g.
    ``{"fsdp": 16, "tp": 4}``), from abstract arguments (see :mod:`workbench.core.compile.steps`). With ``pp > 1`` a
    train step is the pipeline's (``pipeline``, default 1F1B): TPU clusters only. ``zero_stage=1`` splits the
    optimizer state over ``dp`` too (ZeRO-1). ``compiler_options`` as :func:`compile_on` takes them."""
    if kind == "train" and int(mesh_shape.get("pp", 1)) > 1 and cluster.platform != "tpu":
        raise ValueError(f"a pipelined train step compiles for TPU clusters only: the worker that compiles for "
                         f"{cluster.name} receives an exported program, and XLA:CPU 0.10 aborts on an exported "
                         f"pipeline ('Invalid binary instruction opcode copy'); choose pp=1, or a TPU cluster")
    mesh = cluster_mesh(cluster, full_mesh_shape(mesh_shape, cluster), MESH_AXES)
    step = abstract_step(model, mesh, kind=kind, batch=batch, optimizer_name=optimizer,
                         partition_axis=partition_axis, rules=rules, pipeline=pipeline, zero_stage=zero_stage,
                         kv_length=kv_length)
    return compile_on(cluster, step.fn, *step.args, donate_argnums=step.donate_argnums,
                      out_shardings=step.out_shardings, compiler_options=compiler_options)
