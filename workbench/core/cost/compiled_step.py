"""A compiled step's time on a cluster (:func:`step_time`): its dots on the chips, its HBM bytes and each of its
collectives on the network, as a :class:`~workbench.core.cost.step.StepTime`.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.cost.roofline import check_chip, roofline
from workbench.core.cost.step import CollectiveTime, StepTime
from workbench.core.hardware.calibration import calibration
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import transfer
from workbench.core.hlo.collectives import loop_collectives


def _pair_opposite_permutes(timed: list[CollectiveTime], records: tp.Sequence[tp.Any], hlo_text: str
                            ) -> list[CollectiveTime]:
    """Collective-permutes in one loop body that send the two ways round the same ring of a TPU torus (one's
    pairs are the other's reversed: XLA's bidirectional windowed einsums) use opposite links at once: per body
    and ring, the busier direction's permutes take time, the other's are marked ``overlapped``. (Through a
    switch both directions leave by the same egress: they add up.)"""
    body = {r.name: r.body for r in loop_collectives(hlo_text)}
    ways: dict[tuple, list[list[int]]] = {}
    for i, record in enumerate(records):
        pairs = frozenset(getattr(record, "source_target_pairs", None) or ())
        if record.kind != "collective-permute" or not pairs or record.name not in body or timed[i].level != "ici":
            continue
        reverse = frozenset((b, a) for a, b in pairs)
        ring = min(sorted(pairs), sorted(reverse))
        ways.setdefault((body[record.name], tuple(ring)), [[], []])[sorted(pairs) != ring].append(i)
    out = list(timed)
    for forward, backward in ways.values():
        if forward and backward:
            light = min((forward, backward), key=lambda side: sum(timed[i].total_s for i in side))
            for i in light:
                out[i] = dataclasses.replace(timed[i], overlapped=True)
    return out


def step_time(analysis: tp.Any = None, cluster: Cluster | None = None, mesh_shape: tp.Mapping[str, int] | None = None,
              *, efficiency: float | None = None, dtype: tp.Any = "bf16", overlap: bool = True,
              flops: float | None = None,
              hbm_bytes: float | None = None, collectives: tp.Iterable[tp.Any] | None = None,
              model_flops: float | None = None, network_efficiency: float | None = None) -> StepTime:
    """The predicted time of a compiled step (a :class:`~workbench.core.compile.virtual.CompiledAnalysis`) on
    ``cluster`` (default: the one it was compiled for) with its mesh (or ``mesh_shape``, name -> size).

    Compute is the program's dots (``analysis.matmul_flops``, each once per loop trip) at ``efficiency`` of the peak
    of ``dtype`` (default: the fraction large GEMMs reach on the chip, measured or fitted in
    :mod:`~workbench.core.hardware.calibration`; 1 gives the ideal roofline); memory its HBM bytes
    (``analysis.hbm_bytes``, at the bandwidth fusions reach unless ``efficiency`` is given); communication every
    collective (:func:`collective_time`) times its loop trips, its links at ``network_efficiency`` of their bandwidth
    (default: the fraction real collectives reach on the chip, as the predicted step prices them, unless
    ``efficiency`` is given; then 1). ``flops``, ``hbm_bytes`` and ``collectives`` (records
    or ``(kind, bytes, axes[, runs])`` tuples) replace the analysis's. The dots are hardware FLOPs (a recomputed
    forward included): they give the step's HFU; its MFU needs ``model_flops``, a device's share of the step's model
    FLOPs (:func:`~workbench.core.cost.flops.model_flops` over the devices). Collectives run one after another,
    except permutes in one loop body going opposite ways round a TPU ring (both directions of its links at once). A
    GPU cluster's program is compiled by XLA:CPU (bfloat16 math widened to float32, CPU fusion): its bytes are an
    overestimate.
    """
    cluster = cluster or getattr(analysis, "cluster", None)
    if cluster is None:
        raise ValueError("step_time needs a cluster: pass cluster=Cluster.tpu(...) / Cluster.h100(...)")
    if mesh_shape is None and analysis is None:
        raise ValueError("step_time needs the mesh: pass mesh_shape={'fsdp': 16, 'tp': 4, ...} or an analysis")
    mesh = dict(zip(analysis.axis_names, analysis.mesh_shape, strict=True)) if analysis is not None else {}
    if mesh_shape is not None:
        mesh = {**{name: 1 for name in mesh}, **{k: int(v) for k, v in mesh_shape.items()}}
    flops = analysis.matmul_flops if flops is None else flops
    hbm_bytes = analysis.hbm_bytes if hbm_bytes is None else hbm_bytes
    records = analysis.collectives if collectives is None else collectives
    timed = []
    for record in records:
        if isinstance(record, tuple):
            kind, nbytes, axes, runs = (*record, 1)[:4]
            name = ""
        else:
            if record.mesh_axes is None:
                raise ValueError(f"collective {record.name} has no mesh axes; compile with a mesh")
            kind, nbytes, axes, runs, name = record.kind, record.bytes, record.mesh_axes, record.trips, record.name
        timed.append((kind, tuple(axes), int(nbytes), int(runs), transfer(kind, nbytes, tuple(axes), mesh, cluster),
                      name))
    hbm_efficiency = 1.0
    if efficiency is None:
        check_chip(cluster)
        cal = calibration(cluster.chip)
        efficiency, hbm_efficiency = cal.gemm.value, cal.hbm.value
        network_efficiency = cal.network.value if network_efficiency is None else network_efficiency
    network = 1.0 if network_efficiency is None else network_efficiency
    timed = [CollectiveTime(kind, axes, nbytes, runs, t.attained(network), t.level, t.bound, name)
             for kind, axes, nbytes, runs, t, name in timed]
    if collectives is None and getattr(analysis, "hlo_text", ""):
        timed = _pair_opposite_permutes(timed, analysis.collectives, analysis.hlo_text)
    xla = getattr(analysis, "xla_seconds", None) if cluster == getattr(analysis, "cluster", None) else None
    line = roofline(flops, hbm_bytes, cluster, dtype, efficiency, hbm_efficiency)
    return StepTime(cluster, mesh, line, tuple(timed), efficiency, overlap, xla, model_flops=model_flops)
