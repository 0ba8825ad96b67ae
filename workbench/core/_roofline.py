"""Roofline cost model after "How to Scale Your Model" (the scaling book, jax-ml.github.io/scaling-book).

A step takes at least the longest of three times: compute ``FLOPs / C``, memory ``bytes / W_hbm`` and
communication (one term per collective, from the book's "Sharded Matrices and How to Multiply Them"
chapter). Re-exported by :mod:`workbench.core.inspect`; import it from there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

RING, SWITCH = "ring", "switch"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-chip peak numbers the roofline uses.

    ``link_bandwidth`` is bytes/s in one direction: of one ICI link on a TPU (``topology="ring"``: a mesh
    axis is a bidirectional ring, so the book's ``W_ici`` is twice that), or of a GPU's whole NVLink egress
    (``topology="switch"``: every GPU reaches every other through NVSwitch). ``hbm_capacity`` is bytes of HBM
    per chip; ``peak_flops_by_dtype`` the dense peaks per operand dtype (``"bf16"``, ``"int8"``, ``"fp8"``)
    that :meth:`peak_flops` reads. A :class:`workbench.core.cluster.Cluster` is made of these chips.
    """

    name: str
    flops: float  # C: peak dense FLOP/s per chip (bf16 unless the name says otherwise)
    hbm_bandwidth: float  # W_hbm: bytes/s between HBM and the chip
    link_bandwidth: float
    topology: str = RING
    hbm_capacity: float = 0.0  # bytes per chip; 0: unknown
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s per chip for operands of ``dtype`` ("bf16", "int8", "fp8")."""
        peaks = dict(self.peak_flops_by_dtype) or {"bf16": self.flops}
        if dtype not in peaks:
            raise ValueError(f"{self.name} has no published peak for {dtype!r}; it has {sorted(peaks)}")
        return peaks[dtype]

    @property
    def ici_bandwidth(self) -> float:
        """The book's ``W_ici``: bytes/s a chip moves in a collective along one mesh axis."""
        return self.link_bandwidth * (2 if self.topology == RING else 1)

    @property
    def critical_intensity(self) -> float:
        """``C / W_hbm``: the FLOPs per HBM byte above which a kernel is compute-bound."""
        return self.flops / self.hbm_bandwidth


GB = 1e9
# NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 1979 TFLOP/s dense fp8 and int8 (the datasheet's 3958 /
# 3958 are with 2:4 sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s total = 450 GB/s per direction.
# H200 SXM datasheet: same compute and NVLink, 141 GB HBM3e at 4.8 TB/s.
_HOPPER = (("bf16", 989e12), ("fp8", 1979e12), ("int8", 1979e12))
H100 = Hardware("H100 SXM", 989e12, 3.35e12, 450e9, SWITCH, 80 * GB, _HOPPER)
H200 = Hardware("H200 SXM", 989e12, 4.8e12, 450e9, SWITCH, 141 * GB, _HOPPER)
# Measured on one H100 here (/work/shared/GPU.md): jnp.dot bf16 8192^3 668 TFLOP/s, HBM copy ~3.0 TB/s.
H100_MEASURED = Hardware("H100 SXM (measured)", 668e12, 3.0e12, 450e9, SWITCH, 80 * GB)
# Scaling book, "How to Think About TPUs", chip table (FLOP/s bf16 / int8, HBM bytes and B/s per chip) and
# ICI table (B/s per link, one way): v4p 2.75e14 / 2.75e14, 32 GB, 1.2e12, ICI 4.5e10; v5p 4.59e14 / 9.18e14,
# 96 GB, 2.8e12, 9e10; v5e 1.97e14 / 3.94e14, 16 GB, 8.1e11, 4.5e10; v6e 9.2e14 / 1.84e15, 32 GB, 1.6e12, 9e10.
TPU_V4 = Hardware("TPU v4", 2.75e14, 1.2e12, 4.5e10, RING, 32 * GB, (("bf16", 2.75e14), ("int8", 2.75e14)))
TPU_V5E = Hardware("TPU v5e", 1.97e14, 8.1e11, 4.5e10, RING, 16 * GB, (("bf16", 1.97e14), ("int8", 3.94e14)))
TPU_V5P = Hardware("TPU v5p", 4.59e14, 2.8e12, 9e10, RING, 96 * GB, (("bf16", 4.59e14), ("int8", 9.18e14)))
TPU_V6E = Hardware("TPU v6e", 9.2e14, 1.6e12, 9e10, RING, 32 * GB, (("bf16", 9.2e14), ("int8", 1.84e15)))


def _best_time(fn: tp.Callable[[], tp.Any], repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def cpu_measured() -> Hardware:
    """This machine's first CPU device, measured once: a float32 1024^3 matmul for ``C``, ``x + 1`` over
    64 MiB (read + write) for ``W_hbm``. Simulated devices share that memory, so it is the link too."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(np.ones((1024, 1024), np.float32), device)
    x = jax.device_put(np.ones(1 << 24, np.float32), device)
    matmul, add = jax.jit(jnp.dot), jax.jit(lambda x: x + 1)
    flops = 2 * 1024**3 / _best_time(lambda: matmul(a, a))
    bandwidth = 2 * x.nbytes / _best_time(lambda: add(x))
    return Hardware(f"CPU ({device.device_kind}, measured, float32)", flops, bandwidth, bandwidth, SWITCH)


COMM_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def comm_time(kind: str, array_bytes: float, hardware: Hardware, group_size: int | None = None) -> float:
    """Seconds for one collective over one mesh axis; ``array_bytes`` is the book's ``V``.

    ``V`` is the whole array: gathered (all-gather), before scattering (reduce-scatter), the array each
    device holds (all-reduce), all shards together (all-to-all); for collective-permute, the bytes each
    device sends. Latency is ignored: small collectives take longer than this.
    """
    w = hardware.ici_bandwidth
    # Scaling book, "Sharded Matrices and How to Multiply Them": on a bidirectional ring, AllGather and
    # ReduceScatter take ~V / W_ici whatever the ring size, AllReduce = ReduceScatter + AllGather = 2V / W_ici,
    # AllToAll ~V / (4 W_ici). Through a switch (the book's GPU chapter) AllGather is ~V / W_egress too, and an
    # AllToAll sends only a 1/N share of V from each GPU: ~V / (N W_egress).
    if kind in ("all-gather", "reduce-scatter"):
        return array_bytes / w
    if kind == "all-reduce":
        return 2 * array_bytes / w
    if kind == "all-to-all":
        if hardware.topology == RING:
            return array_bytes / (4 * w)
        if not group_size:
            raise ValueError(f"comm_time: an all-to-all on {hardware.name} (a switch) needs group_size")
        return array_bytes / (group_size * w)
    if kind == "collective-permute":
        return array_bytes / hardware.link_bandwidth  # one hop, one direction
    raise ValueError(f"comm_time: unknown collective kind {kind!r}; expected one of {COMM_KINDS}")


def array_bytes(record: tp.Any) -> float:
    """The book's ``V`` for a collective record (``kind``, per-device result ``bytes``, ``group_size``)."""
    scale = record.group_size if record.kind in ("reduce-scatter", "all-to-all") else 1
    return record.bytes * scale


@dataclasses.dataclass(frozen=True)
class Cost:
    """A roofline estimate for one device: compute, memory and per-collective seconds."""

    hardware: Hardware
    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    comm_s: dict[str, float]

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def time_s(self) -> float:
        """The roofline bound: the longest of the three, assuming they overlap perfectly."""
        return max(self.compute_s, self.memory_s, self.comm_total_s)

    @property
    def bound(self) -> str:
        times = {"compute-bound": self.compute_s, "memory-bound": self.memory_s, "comm-bound": self.comm_total_s}
        return max(times, key=times.get)

    def __str__(self) -> str:
        lines = [f"{self.hardware.name}: {self.bound}, {_seconds(self.time_s)} (intensity {self.intensity:.3g} "
                 f"FLOPs/B, critical {self.hardware.critical_intensity:.3g})",
                 f"  compute {_seconds(self.compute_s)} ({self.flops:.3g} FLOPs)",
                 f"  memory  {_seconds(self.memory_s)} ({self.hbm_bytes:.3g} B)"]
        lines += [f"  {label}: {_seconds(s)}" for label, s in self.comm_s.items()]
        return "\n".join(lines)


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def cost(flops: float, hbm_bytes: float, collectives: tp.Iterable[tp.Any] = (), hardware: Hardware = H100) -> Cost:
    """Roofline times for one device doing ``flops`` and moving ``hbm_bytes``, plus its collectives.

    ``collectives`` holds records from :func:`workbench.core.inspect.collectives` or ``(kind, V)`` pairs
    (``V`` as in :func:`comm_time`).
    """
    comm: dict[str, float] = {}
    for i, item in enumerate(collectives):
        if isinstance(item, tuple):
            kind, v = item
            seconds = comm_time(kind, v, hardware)
            label = f"{kind} #{i}"
        else:
            kind = item.kind
            seconds = comm_time(kind, array_bytes(item), hardware, item.group_size)
            label = f"{kind} #{i} over {'?' if item.mesh_axes is None else item.mesh_axes}"
        comm[label] = seconds
    return Cost(hardware, flops, hbm_bytes, flops / hardware.flops, hbm_bytes / hardware.hbm_bandwidth, comm)


def _pair(spec: tp.Sequence[tp.Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes of each of a 2-D spec's entries (a missing entry is unsplit)."""
    entries = (*spec, None, None)[:2]
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def matmul_cost(B: int, D: int, F: int, *, dtype: tp.Any = jnp.bfloat16, hardware: Hardware = H100,
                lhs: tp.Sequence[tp.Any] = (None, None), rhs: tp.Sequence[tp.Any] = (None, None),
                mesh_shape: tp.Mapping[str, int] | None = None) -> Cost:
    """Per-device roofline of ``x[B, D] @ w[D, F]`` with ``x`` split by ``lhs`` and ``w`` by ``rhs``.

    ``lhs``/``rhs`` are two-entry specs (a ``PartitionSpec`` works) over the axes of ``mesh_shape``. The
    collectives follow the book's cases ("Sharded Matrices"): contracting dimension D split alike on both
    -> local matmul then AllReduce of the output; split on one only -> AllGather it first; B and F split
    over the same axis -> AllGather ``w``.
    """
    mesh_shape = dict(mesh_shape or {})
    (b_ax, dl_ax), (dr_ax, f_ax) = _pair(lhs), _pair(rhs)
    missing = {a for a in (*b_ax, *dl_ax, *dr_ax, *f_ax) if a not in mesh_shape}
    if missing:
        raise ValueError(f"matmul_cost: axes {sorted(missing)} are not in mesh_shape={mesh_shape}; pass their sizes")
    size = lambda axes: math.prod(mesh_shape[a] for a in axes)
    item = np.dtype(dtype).itemsize
    comms: list[tuple[str, float]] = []
    d_ax: tuple[str, ...] = ()
    if dl_ax and dl_ax == dr_ax:
        d_ax = dl_ax
        comms.append(("all-reduce", B // size(b_ax) * F // size(f_ax) * item))
    else:
        if dl_ax:
            comms.append(("all-gather", B // size(b_ax) * D * item))
        if dr_ax:
            comms.append(("all-gather", D * F // size(f_ax) * item))
    if set(b_ax) & set(f_ax):
        comms.append(("all-gather", D // size(d_ax) * F * item))
        f_ax = ()
    b, d, f = B // size(b_ax), D // size(d_ax), F // size(f_ax)
    return cost(2 * b * d * f, (b * d + d * f + b * f) * item, comms, hardware)
