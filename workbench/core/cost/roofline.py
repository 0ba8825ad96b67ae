"""The roofline of one device (the scaling book, "All About Rooflines", jax-ml.github.io/scaling-book/roofline/):
compute ``FLOPs / C`` against memory ``bytes / W_hbm``, the longer bounding the time. A step adds its
collectives on the network (:mod:`workbench.core.hardware.network`) in :class:`~workbench.core.cost.step.StepTime`.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

from workbench.core.hardware.cluster import Cluster

LOW_PRECISION = ("int8", "fp8", "fp4")
_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "float16": "bf16", "fp16": "bf16", "f16": "bf16",
                "int8": "int8", "s8": "int8", "uint8": "int8", "u8": "int8", "fp8": "fp8", "fp4": "fp4", "nvfp4": "fp4"}


def rate_dtype(dtype: tp.Any) -> str:
    """The dtype whose peak a matmul runs at: its operands' (a pair: weights, activations). int8 / fp8 weights
    with bf16 activations run at the bf16 rate; only both int8 (or both fp8, both fp4) run at the low-precision
    one."""
    if isinstance(dtype, tuple | list):
        names = {rate_dtype(d) for d in dtype}
        return names.pop() if len(names) == 1 else "bf16"
    name = str(getattr(dtype, "name", getattr(dtype, "__name__", dtype))).lower()
    name = "fp8" if name.startswith(("float8", "f8")) else _DTYPE_NAMES.get(name, name)
    if name not in ("bf16", *LOW_PRECISION):
        raise ValueError(f"no peak FLOP/s for {dtype!r}; chips publish bf16, int8, fp8 and fp4 rates (a float32 "
                         f"program compiled for a GPU cluster on CPU devices is costed at dtype='bf16')")
    return name


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One device's compute ``FLOPs / (C * efficiency)`` against its memory ``bytes / W_hbm``: the longer bounds
    the time (``bound``: "compute" or "memory")."""

    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    critical_intensity: float  # (C * efficiency) / W_hbm at the rates priced: FLOPs per byte above which compute bounds

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes if self.hbm_bytes else math.inf


def check_chip(cluster: Cluster) -> None:
    """A ValueError when ``cluster`` has no chip numbers to price a step with (simulated CPU devices)."""
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no peak numbers (simulated CPU devices); use a TPU or GPU cluster")


def roofline(flops: float, hbm_bytes: float, cluster: Cluster, dtype: tp.Any = "bf16",
             efficiency: float = 1.0, hbm_efficiency: float = 1.0) -> Roofline:
    """One device of ``cluster`` doing ``flops`` on operands of ``dtype`` (see :func:`rate_dtype`) at ``efficiency``
    of its peak FLOP/s, and moving ``hbm_bytes`` to and from HBM at ``hbm_efficiency`` of its bandwidth."""
    check_chip(cluster)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency is the fraction of peak FLOP/s reached, in (0, 1]; got {efficiency!r}")
    peak = cluster.chip.peak_flops(rate_dtype(dtype)) / cluster.devices_per_chip
    bandwidth = cluster.chip.hbm_bandwidth / cluster.devices_per_chip * hbm_efficiency
    return Roofline(flops, hbm_bytes, flops / (peak * efficiency), hbm_bytes / bandwidth, peak * efficiency / bandwidth)

