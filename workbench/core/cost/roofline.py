"""Roofline cost model after "How to Scale Your Model" (the scaling book, jax-ml.github.io/scaling-book).

A step takes at least the longest of three times: compute ``FLOPs / C``, memory ``bytes / W_hbm`` and
communication (one term per collective, from the book's "Sharded Matrices and How to Multiply Them"
chapter). Re-exported by :mod:`workbench.core.inspect`; import it from there.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax.numpy as jnp
import numpy as np

from workbench.core.cluster import Cluster
from workbench.core.cost.chips import H100, Hardware
from workbench.core.cost.network import comm_time

LOW_PRECISION = ("int8", "fp8")
_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "float16": "bf16", "fp16": "bf16", "f16": "bf16",
                "int8": "int8", "s8": "int8", "uint8": "int8", "u8": "int8", "fp8": "fp8"}


# -- compute and memory ----------------------------------------------------------------------------------
def rate_dtype(dtype: tp.Any) -> str:
    """The dtype whose peak a matmul runs at: its operands' (a pair: weights, activations). int8 / fp8 weights
    with bf16 activations run at the bf16 rate; only both int8 (or both fp8) run at the low-precision one."""
    if isinstance(dtype, tuple | list):
        names = {rate_dtype(d) for d in dtype}
        return names.pop() if len(names) == 1 else "bf16"
    name = str(getattr(dtype, "name", getattr(dtype, "__name__", dtype))).lower()
    name = "fp8" if name.startswith(("float8", "f8")) else _DTYPE_NAMES.get(name, name)
    if name not in ("bf16", *LOW_PRECISION):
        raise ValueError(f"no peak FLOP/s for {dtype!r}; chips publish bf16, int8 and fp8 rates (a float32 "
                         f"program compiled for a GPU cluster on CPU devices is costed at dtype='bf16')")
    return name


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Compute ``FLOPs / (C * mfu)`` against memory ``bytes / W_hbm``: the longer bounds the time."""

    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    critical_intensity: float  # C / W_hbm: FLOPs per byte above which compute bounds

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf


def roofline(flops: float, hbm_bytes: float, cluster: Cluster, dtype: tp.Any = "bf16", mfu: float = 1.0) -> Roofline:
    """One device doing ``flops`` on operands of ``dtype`` (see :func:`rate_dtype`) at ``mfu`` of its peak, and
    moving ``hbm_bytes`` to and from HBM."""
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no peak numbers (simulated CPU devices); use a TPU or GPU cluster")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is the fraction of peak FLOP/s reached, in (0, 1]; got {mfu!r}")
    peak = cluster.chip.peak_flops(rate_dtype(dtype)) / cluster.devices_per_chip
    bandwidth = cluster.chip.hbm_bandwidth / cluster.devices_per_chip
    return Roofline(flops, hbm_bytes, flops / (peak * mfu), hbm_bytes / bandwidth, peak / bandwidth)


def matmul_time(flops: float, hbm_bytes: float, cluster: Cluster, dtype: tp.Any = "bf16", mfu: float = 1.0) -> float:
    """Seconds for a matmul of ``flops`` moving ``hbm_bytes`` on one device: the roofline's longer side."""
    return roofline(flops, hbm_bytes, cluster, dtype, mfu).time_s





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

    ``collectives`` holds records from :func:`workbench.core.hlo.collectives.collectives` or ``(kind, V)`` pairs
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
