"""The chips a cluster is made of: peak FLOP/s per operand dtype, HBM bandwidth and capacity, link bandwidth,
from the vendors' datasheets and the scaling book's tables; and this machine's CPU, measured once.
"""

from __future__ import annotations

import dataclasses
import functools
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
    per chip; ``peak_flops_by_dtype`` the dense peaks per operand dtype (``"bf16"``, ``"int8"``, ``"fp8"``, ``"fp4"``)
    that :meth:`peak_flops` reads. A :class:`workbench.core.hardware.cluster.Cluster` is made of these chips.
    """

    name: str
    flops: float  # C: peak dense FLOP/s per chip (bf16 unless the name says otherwise)
    hbm_bandwidth: float  # W_hbm: bytes/s between HBM and the chip
    link_bandwidth: float
    topology: str = RING
    hbm_capacity: float = 0.0  # bytes per chip; 0: unknown
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s per chip for operands of ``dtype`` ("bf16", "int8", "fp8", "fp4")."""
        peaks = dict(self.peak_flops_by_dtype) or {"bf16": self.flops}
        if dtype not in peaks:
            raise ValueError(f"{self.name} has no published peak for {dtype!r}; it has {sorted(peaks)}")
        return peaks[dtype]

    @property
    def ici_bandwidth(self) -> float:
        """The book's ``W_ici``: bytes/s a chip moves along one wraparound ring (both directions of its links) or
        through a switch, the bandwidth of the book's one-axis forms (:mod:`workbench.core.hardware.network`)."""
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
# Meta's Grand Teton H100 (torchtitan's benchmarks ran on it): the same SM as the SXM, 96 GB of HBM2e at 2.4 TB/s,
# power-limited to 500 W (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md).
H100_500W = Hardware("H100 96GB HBM2e 500 W", 989e12, 2.4e12, 450e9, SWITCH, 96 * GB, _HOPPER)
# Scaling book, "How to Think About TPUs", chip table (FLOP/s bf16 / int8, HBM bytes and B/s per chip) and
# ICI table (B/s per link, one way): v4p 2.75e14 / 2.75e14, 32 GB, 1.2e12, ICI 4.5e10; v5p 4.59e14 / 9.18e14,
# 96 GB, 2.8e12, 9e10; v5e 1.97e14 / 3.94e14, 16 GB, 8.1e11, 4.5e10; v6e 9.2e14 / 1.84e15, 32 GB, 1.6e12, 9e10.
TPU_V4 = Hardware("TPU v4", 2.75e14, 1.2e12, 4.5e10, RING, 32 * GB, (("bf16", 2.75e14), ("int8", 2.75e14)))
TPU_V5E = Hardware("TPU v5e", 1.97e14, 8.1e11, 4.5e10, RING, 16 * GB, (("bf16", 1.97e14), ("int8", 3.94e14)))
TPU_V5P = Hardware("TPU v5p", 4.59e14, 2.8e12, 9e10, RING, 96 * GB, (("bf16", 4.59e14), ("int8", 9.18e14)))
TPU_V6E = Hardware("TPU v6e", 9.2e14, 1.6e12, 9e10, RING, 32 * GB, (("bf16", 9.2e14), ("int8", 1.84e15)))
# Google Cloud TPU docs, "TPU7x (Ironwood)" (docs.cloud.google.com/tpu/docs/tpu7x), system architecture table: 2,307
# TFLOP/s bf16 and 4,614 fp8 per chip, 192 GiB of HBM per chip, two TensorCores per chip (two JAX devices: libtpu's
# "tpu7x:2x2x1" topology lists 8 devices for 4 chips), a 3D torus like v5p's; Google's Ironwood announcement (Cloud
# Next, April 2025) and Hot Chips 2025: 7.37 TB/s of HBM per chip, 1.2 TB/s of ICI per chip both ways. Six links
# (3D torus) at 1.2 TB/s both ways is 100 GB/s a link one way, the per-chip figure v5p's docs also give (1,200
# GBps); this takes the scaling book's v5p link, 9e10 B/s one way, for both.
TPU7X = Hardware("TPU7x (Ironwood)", 2.307e15, 7.37e12, 9e10, RING, 192 * 2**30,
                 (("bf16", 2.307e15), ("fp8", 4.614e15)))
# NVIDIA Blackwell. Dense peaks are half the datasheets' "with sparsity" figures. HGX / DGX B200 (1,000 W): 2.25
# PFLOP/s bf16, 4.5 fp8 and int8, 9 fp4 dense per GPU; DGX B200 datasheet: 8 GPUs, 1,440 GB of HBM3e (180 GB each)
# at 64 TB/s (8 TB/s each), NVLink 5 at 1.8 TB/s per GPU (900 GB/s per direction), 8 x 400 Gb/s ConnectX-7 per node.
# GB200 NVL72 datasheet (1,200 W GPUs): per rack 360 / 720 / 1,440 PFLOP/s bf16 / fp8 / fp4 with sparsity (dense per
# GPU: 2.5, 5, 10 PFLOP/s), up to 13.4 TB of HBM3e (186 GB per GPU) at 576 TB/s (8 TB/s per GPU), one NVLink 5
# domain of 72 GPUs at 1.8 TB/s each (130 TB/s), and one 400 Gb/s ConnectX-7 per GPU to the scale-out network.
TB = 1e12
B200 = Hardware("B200 (DGX / HGX)", 2.25e15, 8 * TB, 900e9, SWITCH, 180 * GB,
                (("bf16", 2.25e15), ("fp8", 4.5e15), ("int8", 4.5e15), ("fp4", 9e15)))
GB200 = Hardware("B200 in GB200 NVL72", 2.5e15, 8 * TB, 900e9, SWITCH, 186 * GB,
                 (("bf16", 2.5e15), ("fp8", 5e15), ("int8", 5e15), ("fp4", 10e15)))


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
