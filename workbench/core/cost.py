"""Step time on a cluster: collectives on its network, matmuls on its chips, and a compiled step's total.

The model is the scaling book's ("How to Scale Your Model", Austin et al., https://jax-ml.github.io/scaling-book/),
with its ``(N - 1) / N`` factors kept:

- :func:`collective_time`: a collective over some mesh axes, placed on the cluster's network the way JAX lays
  a mesh onto it (TPU: ``mesh_utils.create_device_mesh``'s assignment of mesh axes to torus axes; GPU: devices
  in id order, ``gpus_per_node`` to a node; TPU slices: the first mesh axis outermost);
- :func:`roofline` / :func:`matmul_time`: FLOPs against the chip's peak for the operands' dtype, bytes against
  its HBM bandwidth;
- :func:`step_time`: a :class:`~workbench.core.virtual.CompiledAnalysis` (its dots, HBM bytes and collectives,
  each once per loop trip) as a :class:`StepTime`.

>>> from workbench.core.cluster import Cluster
>>> v5e = Cluster.tpu("v5e:16x16")  # 16-chip axes wrap around: bidirectional rings of 4.5e10 B/s links
>>> round(collective_time("all-gather", 16 * 2**20, ("x",), {"x": 16, "y": 16}, v5e) * 1e6)  # 15/16 V / 9e10
175
"""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import math
import typing as tp

import numpy as np

from workbench.core.cluster import TPU_GENERATIONS, Cluster, TorusAxis

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
LOW_PRECISION = ("int8", "fp8")
_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "float16": "bf16", "fp16": "bf16", "f16": "bf16",
                "int8": "int8", "s8": "int8", "uint8": "int8", "u8": "int8", "fp8": "fp8"}


# -- where a collective's devices sit -----------------------------------------------------------------------
def torus_assignment(mesh_shape: tp.Sequence[int], torus: tp.Sequence[int]) -> list[tuple[int, ...]]:
    """The torus axes each mesh axis spans, as ``jax.experimental.mesh_utils.create_device_mesh`` lays a mesh
    on a TPU slice: from the last mesh axis (the most network-intensive) to the first, each takes the largest
    set of still-free torus axes whose sizes multiply to its size (ties: the first such set)."""
    free, out = list(torus), [()] * len(mesh_shape)
    for i in reversed(range(len(mesh_shape))):
        for k in range(len(free), 0, -1):
            found = next((c for c in itertools.combinations(range(len(free)), k)
                          if math.prod(free[j] for j in c) == mesh_shape[i]), None)
            if found is not None:
                out[i] = found
                free = [0 if j in found else size for j, size in enumerate(free)]
                break
        else:
            if mesh_shape[i] > 1:
                raise ValueError(f"mesh shape {tuple(mesh_shape)} does not map onto a torus {tuple(torus)}: each "
                                 f"mesh axis must be a product of whole torus axes")
    return out


@dataclasses.dataclass(frozen=True)
class Span:
    """The devices of one group of a collective: ``size`` of them, ``per_unit`` in each of ``units`` nodes
    (GPU) or slices (TPU), and (TPU) the torus axes the group's part inside a slice runs along."""

    size: int
    per_unit: int
    units: int
    torus: tuple[TorusAxis, ...] = ()


def span(axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int], cluster: Cluster) -> Span:
    """Where the group of devices that differ only along ``axes`` sits on ``cluster`` (every group alike).
    Remembered per (axes, mesh, cluster): a layout search asks the same few thousand times."""
    unknown = [a for a in axes if a not in mesh_shape]
    if unknown:
        raise ValueError(f"axes {unknown} are not in the mesh {dict(mesh_shape)}")
    return _span(tuple(axes), tuple(mesh_shape), tuple(int(s) for s in mesh_shape.values()), cluster)


@functools.lru_cache(maxsize=8192)
def _span(axes: tuple[str, ...], names: tuple[str, ...], shape: tuple[int, ...], cluster: Cluster) -> Span:
    shape = cluster.check_mesh_shape(shape)
    ids = np.arange(cluster.num_devices).reshape(shape)
    group = ids[tuple(slice(None) if n in axes else 0 for n in names)].ravel()
    unit = cluster.gpus_per_node if cluster.platform == "gpu" else cluster.num_devices // cluster.slices
    units = len(np.unique(group // unit))
    torus: tuple[TorusAxis, ...] = ()
    if cluster.platform == "tpu":
        ici = (shape[0] // cluster.slices, *shape[1:])
        assignment = torus_assignment(ici, [a.size for a in cluster.torus])
        torus = tuple(cluster.torus[j] for i, n in enumerate(names) if n in axes for j in assignment[i])
    return Span(len(group), len(group) // units, units, torus)


# -- collectives --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Transfer:
    """A collective's predicted time: ``seconds = max(bandwidth_s, latency_s)`` (the book's
    ``max(T_min * hops, V / W)``), the network ``level`` that bounds it and whether ``bound`` by "bandwidth"
    or "latency" ("none": a group of one device)."""

    seconds: float
    bandwidth_s: float
    latency_s: float
    level: str
    bound: str


def _outer(cluster: Cluster) -> tuple[str, float, float] | None:
    """The network between nodes / slices: its name, bytes/s one way per device (the unit's NICs shared by its
    devices) and per-hop latency; None on one node / slice."""
    if cluster.platform == "gpu" and cluster.nodes > 1:
        level = cluster.level("inter-node")
        return level.name, level.bandwidth / cluster.gpus_per_node, level.latency_s
    if cluster.platform == "tpu" and cluster.slices > 1:
        level = cluster.level("dcn")
        per_host = TPU_GENERATIONS[cluster.topology.split(":")[0]].chips_per_host * cluster.devices_per_chip
        return level.name, level.bandwidth / per_host, level.latency_s
    return None


def transfer(kind: str, nbytes: float, axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
             cluster: Cluster) -> Transfer:
    """:func:`collective_time` with its parts: which network level bounds it, bandwidth or latency."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no network numbers (simulated CPU devices); cost a program on "
                         f"Cluster.tpu(...), Cluster.h100(...) or Cluster.h200(...)")
    s = span(tuple(axes), mesh_shape, cluster)
    n, g, m = s.size, s.per_unit, s.units
    if n == 1:
        return Transfer(0.0, 0.0, 0.0, "none", "none")
    inner = cluster.levels[0]  # "ici" (a torus) or "nvlink" (a switch)
    outer = _outer(cluster)
    if kind == "all-reduce":  # = reduce-scatter + all-gather of the same array: twice either
        one = transfer("all-gather", nbytes, axes, mesh_shape, cluster)
        return dataclasses.replace(one, seconds=2 * one.seconds, bandwidth_s=2 * one.bandwidth_s,
                                   latency_s=2 * one.latency_s)
    # Inside a node / slice. A torus axis of size k is a bidirectional ring with wraparound (2 links' worth of
    # bandwidth, floor(k / 2) hops across) and a line without (1 link, k - 1 hops): "not a full ring, half the
    # bandwidth". Several axes add their bandwidths (the book: V / (W_ici n_axes)). A GPU's NVLink egress
    # reaches every GPU of its node in one hop.
    if inner.kind == "torus":
        widths = [inner.bandwidth * (2 if a.wraparound else 1) for a in s.torus]
        hops_in = sum(a.size // 2 if a.wraparound else a.size - 1 for a in s.torus)
    else:
        widths, hops_in = [inner.bandwidth], g - 1
    hops_out = m - 1
    v = nbytes * (n if kind == "reduce-scatter" else 1)  # the book's V: the whole array gathered or scattered
    if kind in ("all-gather", "reduce-scatter"):
        # A ring over the group's g devices moves (g - 1) / g of V through each device's links; across units,
        # the book's GPU chapter: each level a ring of its own, overlapped, bytes * max_i (D_i - 1) / (D_i W_i),
        # a unit's outer network shared by all its devices, g of them in this group.
        parts = {inner.name: (g - 1) / g * v / sum(widths) if g > 1 else 0.0}
        if outer and m > 1:
            parts[outer[0]] = (m - 1) / m * v / (outer[1] * g)
    elif kind == "all-to-all":
        # Each device holds S = nbytes and sends S / n to every other. Ring of k (book footnote): k^2/4 shards of
        # S / k cross each link direction, k S / (4 W) with W the ring's two links; on a torus each axis's links
        # carry that axis's hops at once: the slowest axis bounds it. Through a switch: (g - 1) S / n leave
        # each GPU over NVLink; (n - g) S / n leave the unit, all its devices at once (book: B (M-1) / (M^2 W)).
        s_in = nbytes * g / n
        if inner.kind == "torus":
            parts = {inner.name: max((a.size * s_in / (4 * w) for a, w in zip(s.torus, widths, strict=True)),
                                     default=0.0)}
        else:
            parts = {inner.name: (g - 1) * nbytes / n / widths[0]}
        if outer and m > 1:
            parts[outer[0]] = (n - g) / n * nbytes / outer[1]
    else:  # collective-permute: each device sends nbytes to one peer, one link one way (across units if any)
        if outer and m > 1:
            parts, hops_in, hops_out = {outer[0]: nbytes / outer[1]}, 0, 1
        else:
            parts, hops_in = {inner.name: nbytes / inner.bandwidth}, 1
    latency = hops_in * inner.latency_s + (hops_out * outer[2] if outer and m > 1 else 0.0)
    level, bandwidth_s = max(parts.items(), key=lambda kv: kv[1])
    if latency > bandwidth_s:
        slow = outer[0] if outer and m > 1 and hops_out * outer[2] >= hops_in * inner.latency_s else inner.name
        return Transfer(latency, bandwidth_s, latency, slow, "latency")
    return Transfer(bandwidth_s, bandwidth_s, latency, level, "bandwidth")


def collective_time(kind: str, nbytes: float, axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
                    cluster: Cluster) -> float:
    """Seconds for one ``kind`` collective over mesh ``axes`` of ``mesh_shape`` (name -> size, the mesh's
    order) on ``cluster``.

    ``nbytes`` is what :class:`workbench.core.inspect.Collective` records: the result's bytes on each device
    (the gathered array of an all-gather, the reduced array of an all-reduce, one shard of a reduce-scatter,
    each device's data of an all-to-all, what each device sends in a collective-permute).
    """
    return transfer(kind, nbytes, axes, mesh_shape, cluster).seconds


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


# -- a step ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """One collective of a step: ``seconds`` per run, ``runs`` per step (loop trips)."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    runs: int
    seconds: float
    level: str
    bound: str
    name: str = ""
    overlapped: bool = False  # runs beside a permute the other way round the same ring: costs nothing more
    part: str = ""  # the layer kind it serves ("attention", "mlp", ...), where a prediction knows it

    @property
    def total_s(self) -> float:
        return 0.0 if self.overlapped else self.seconds * self.runs


class WorkPart(tp.NamedTuple):
    """One layer kind's share of a step's work on a device: its matmul FLOPs and HBM bytes."""

    kind: str
    flops: float
    hbm_bytes: float


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A step's predicted time on ``cluster``: compute, memory and communication, each collective with its
    network level. ``overlap``: the parts run at once (the step takes the longest, the book's assumption) or
    one after another (compute / memory, then every collective).

    A prediction from structure (:func:`workbench.core.layout_cost.predict_step`) also says how the work splits
    over layer kinds (``parts``, see :meth:`by_kind`) and adds a pipeline's idle time, ``bubble_s``, to the
    step: the schedule's ``bubble_fraction`` of its ticks run nothing, whatever overlaps inside a tick.
    """

    cluster: Cluster
    mesh: dict[str, int]
    roofline: Roofline
    collectives: tuple[CollectiveTime, ...]
    mfu_assumed: float
    overlap: bool = True
    xla_seconds: float | None = None
    parts: tuple[WorkPart, ...] = ()
    bubble_fraction: float = 0.0
    bubble_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.roofline.compute_s

    @property
    def memory_s(self) -> float:
        return self.roofline.memory_s

    @property
    def comm_s(self) -> float:
        return sum(c.total_s for c in self.collectives)

    @property
    def time_s(self) -> float:
        busy = max(self.roofline.time_s, self.comm_s) if self.overlap else self.roofline.time_s + self.comm_s
        return busy + self.bubble_s

    @property
    def bound(self) -> str:
        """"compute", "memory" or "communication": the longest part (a pipeline bubble aside)."""
        return "communication" if self.comm_s > self.roofline.time_s else self.roofline.bound

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Seconds of compute, memory and communication per layer kind (``parts`` and each collective's
        ``part``): ``{"attention": {"compute_s": ..., "memory_s": ..., "comm_s": ...}, ...}``, e.g. for
        ``pandas.DataFrame(step.by_kind()).T``. Compute and memory are the roofline's, shared out by FLOPs and
        bytes; a step without parts (a compiled one) is one kind, "step"."""
        r = self.roofline
        parts = self.parts or (WorkPart("step", r.flops, r.hbm_bytes),)
        out = {p.kind: {"compute_s": r.compute_s * p.flops / r.flops if r.flops else 0.0,
                        "memory_s": r.memory_s * p.hbm_bytes / r.hbm_bytes if r.hbm_bytes else 0.0,
                        "comm_s": 0.0} for p in parts}
        for c in self.collectives:
            kind = (c.part or "other") if self.parts else "step"
            out.setdefault(kind, {"compute_s": 0.0, "memory_s": 0.0, "comm_s": 0.0})["comm_s"] += c.total_s
        return out

    @property
    def mfu(self) -> float:
        """FLOPs per device over (peak x step time): the dots the program runs (a rematerialised forward
        counted again, so strictly the hardware FLOPs utilisation)."""
        peak_s = self.compute_s * self.mfu_assumed
        return peak_s / self.time_s if self.time_s else 0.0

    def by_level(self) -> dict[str, float]:
        """Communication seconds per network level."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.level] = out.get(c.level, 0.0) + c.total_s
        return out

    def rows(self) -> list[tuple[str, tuple[str, ...], str, str, int, float, float]]:
        """Collectives grouped by (kind, axes, level, bound): their runs and seconds, longest first."""
        groups: dict[tuple, list[CollectiveTime]] = {}
        for c in self.collectives:
            groups.setdefault((c.kind, c.axes, c.level, "overlapped" if c.overlapped else c.bound), []).append(c)
        rows = [(k[0], k[1], k[2], k[3], sum(c.runs for c in cs), sum(c.nbytes * c.runs for c in cs),
                 sum(c.total_s for c in cs)) for k, cs in groups.items()]
        return sorted(rows, key=lambda r: -r[-1])

    def _head(self) -> list[tuple[str, str, str]]:
        r = self.roofline
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
        levels = ", ".join(f"{k} {format_seconds(v)}" for k, v in self.by_level().items() if k != "none")
        fs = format_seconds
        head = [("step", fs(self.time_s), f"{self.bound}-bound on {self.cluster.name}, {mesh}; parts "
                 + ("overlapped (the longest)" if self.overlap else "one after another") + f"; MFU {self.mfu:.0%}"),
                ("compute", fs(r.compute_s), f"{r.flops:.3g} FLOP per device at {self.mfu_assumed:.0%} of peak"),
                ("memory", fs(r.memory_s), f"{r.hbm_bytes:.3g} B per device (intensity {r.intensity:.0f} FLOP/B, "
                                           f"critical {r.critical_intensity:.0f})"),
                ("communication", fs(self.comm_s), levels or "no collectives")]
        if self.bubble_s:
            head.append(("pipeline bubble", fs(self.bubble_s), f"{self.bubble_fraction:.0%} of the schedule's ticks "
                         f"idle, added to the step"))
        if self.xla_seconds is not None:
            head.append(("XLA's estimate", fs(self.xla_seconds), "cost_analysis()['optimal_seconds'] (XLA:TPU): "
                         "a loop body counted once, so about one layer of a scanned model"))
        return head

    def summary(self, top: int = 12) -> str:
        """The parts and the longest ``top`` collective groups as a text table."""
        lines = [f"{name:<15}{value:>10}  {note}" for name, value, note in self._head()]
        if self.collectives:
            lines.append(f"\n{'collective':<20}{'axes':<18}{'level':<12}{'bound':<11}{'runs':>6}"
                         f"{'bytes/device':>14}{'time':>11}")
            for kind, axes, level, bound, runs, nbytes, total in self.rows()[:top]:
                lines.append(f"{kind:<20}{','.join(axes) or '-':<18}{level:<12}{bound:<11}{runs:>6}"
                             f"{_b(nbytes):>14}{format_seconds(total):>11}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, top: int | None = None) -> str:
        """:meth:`summary` as HTML tables: the parts, then the longest ``top`` collective groups (all by default)."""
        esc = html.escape
        head = "".join(f"<tr><th style='text-align:left'>{esc(n)}</th><td>{esc(v)}</td><td style='text-align:left'>"
                       f"{esc(note)}</td></tr>" for n, v, note in self._head())
        body = "".join(f"<tr><td>{esc(k)}</td><td>{esc(','.join(a) or '-')}</td><td>{esc(lv)}</td><td>{esc(b)}</td>"
                       f"<td>{runs}</td><td>{esc(_b(nb))}</td><td>{esc(format_seconds(t))}</td></tr>"
                       for k, a, lv, b, runs, nb, t in self.rows()[:top])
        table = ("<table><tr><th>collective</th><th>axes</th><th>level</th><th>bound</th><th>runs</th>"
                 f"<th>bytes/device</th><th>time</th></tr>{body}</table>") if body else ""
        return f"<div><table>{head}</table>{table}</div>"


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"`` (three significant digits, s / ms / us / ns)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _b(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _pair_opposite_permutes(timed: list[CollectiveTime], records: tp.Sequence[tp.Any], hlo_text: str
                            ) -> list[CollectiveTime]:
    """Collective-permutes in one loop body that send the two ways round the same ring of a TPU torus (one's
    pairs are the other's reversed: XLA's bidirectional windowed einsums) use opposite links at once: per body
    and ring, the busier direction's permutes take time, the other's are marked ``overlapped``. (Through a
    switch both directions leave by the same egress: they add up.)"""
    from workbench.core.inspect import loop_collectives

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
              *, mfu: float = 1.0, dtype: tp.Any = "bf16", overlap: bool = True, flops: float | None = None,
              hbm_bytes: float | None = None, collectives: tp.Iterable[tp.Any] | None = None) -> StepTime:
    """The predicted time of a compiled step (a :class:`~workbench.core.virtual.CompiledAnalysis`) on
    ``cluster`` (default: the one it was compiled for) with its mesh (or ``mesh_shape``, name -> size).

    Compute is the program's dots (``analysis.matmul_flops``, each once per loop trip) at ``mfu`` of the peak of
    ``dtype``; memory its HBM bytes (``analysis.hbm_bytes``); communication every collective
    (:func:`collective_time`) times its loop trips. ``flops``, ``hbm_bytes`` and ``collectives`` (records or
    ``(kind, bytes, axes[, runs])`` tuples) replace the analysis's. Collectives run one after another, except
    permutes in one loop body going opposite ways round a TPU ring (both directions of its links at once). A
    GPU cluster's program is compiled by XLA:CPU (bfloat16 math widened to float32, CPU fusion): its bytes are
    an overestimate.
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
        t = transfer(kind, nbytes, tuple(axes), mesh, cluster)
        timed.append(CollectiveTime(kind, tuple(axes), int(nbytes), int(runs), t.seconds, t.level, t.bound, name))
    if collectives is None and getattr(analysis, "hlo_text", ""):
        timed = _pair_opposite_permutes(timed, analysis.collectives, analysis.hlo_text)
    xla = getattr(analysis, "xla_seconds", None) if cluster == getattr(analysis, "cluster", None) else None
    return StepTime(cluster, mesh, roofline(flops, hbm_bytes, cluster, dtype, mfu), tuple(timed), mfu, overlap, xla)


__all__ = ["KINDS", "CollectiveTime", "Roofline", "Span", "StepTime", "Transfer", "WorkPart", "collective_time",
           "format_seconds", "matmul_time",
           "rate_dtype", "roofline", "span", "step_time", "torus_assignment", "transfer"]
