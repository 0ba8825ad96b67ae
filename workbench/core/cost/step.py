"""A step's time on a cluster: its matmuls on the chips and its collectives on the network, as a
:class:`StepTime` of parts (each collective timed, the work split by kind). The predicted step
(:mod:`workbench.core.cost.predicted`) and a compiled one (:mod:`workbench.core.cost.compiled_step`) both return it.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.cost.flops import hfu, mfu
from workbench.core.cost.roofline import Roofline
from workbench.core.hardware.cluster import Cluster
from workbench.core.tables import html_table
from workbench.core.units import format_bytes, format_seconds


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
    role: str = ""  # what may hide it, where a prediction knows: "gather", "grad", "ring", "tp" or "critical"

    @property
    def total_s(self) -> float:
        return 0.0 if self.overlapped else self.seconds * self.runs


class Term(tp.NamedTuple):
    """One term of a measured-model step (:func:`~workbench.core.cost.predicted.predict_step`): its seconds on the
    critical path, which ``part`` of the step it is ("compute", "memory", "communication", "bubble") and how it
    was priced."""

    name: str
    seconds: float
    part: str
    note: str


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

    A prediction from structure (:func:`workbench.core.cost.predicted.predict_step`) also says how the work splits
    over layer kinds (``parts``, see :meth:`by_kind`) and adds a pipeline's idle time, ``bubble_s``, to the
    step: the schedule's ``bubble_fraction`` of its ticks run nothing, whatever overlaps inside a tick.

    ``efficiency`` is the fraction of peak FLOP/s its matmuls are assumed to reach; at 1 (no efficiency factor)
    the step is the roofline's ideal and its :attr:`mfu` and :attr:`hfu` are upper bounds (:attr:`ideal`).
    A prediction of the measured step model carries ``terms`` instead (:class:`Term`: matmuls and attention at
    the efficiencies their kernels reach, memory-bound work, the communication nothing hides, the bubble): the
    step is their sum, ``roofline`` keeps the ideal counts and ``efficiency`` the matmuls' achieved fraction.
    ``model_flops``: a device's share of the step's model FLOPs (:func:`~workbench.core.cost.flops.model_flops`
    over the devices), which a prediction knows; a compiled program's dots are hardware FLOPs, so without it a
    compiled step has an HFU and no MFU.
    """

    cluster: Cluster
    mesh: dict[str, int]
    roofline: Roofline
    collectives: tuple[CollectiveTime, ...]
    efficiency: float
    overlap: bool = True
    xla_seconds: float | None = None
    parts: tuple[WorkPart, ...] = ()
    bubble_fraction: float = 0.0
    bubble_s: float = 0.0
    model_flops: float | None = None
    terms: tuple[Term, ...] = ()

    def _part(self, part: str) -> float:
        return sum(t.seconds for t in self.terms if t.part == part)

    @property
    def compute_s(self) -> float:
        return self._part("compute") if self.terms else self.roofline.compute_s

    @property
    def memory_s(self) -> float:
        return self._part("memory") if self.terms else self.roofline.memory_s

    @property
    def comm_s(self) -> float:
        return sum(c.total_s for c in self.collectives)

    @property
    def time_s(self) -> float:
        if self.terms:
            return sum(t.seconds for t in self.terms)
        busy = max(self.roofline.time_s, self.comm_s) if self.overlap else self.roofline.time_s + self.comm_s
        return busy + self.bubble_s

    @property
    def measured_model(self) -> bool:
        """Priced by the measured step model (``terms``), not the ideal roofline."""
        return bool(self.terms)

    @property
    def bound(self) -> str:
        """"compute", "memory" or "communication": the longest part (a pipeline bubble aside)."""
        if self.terms:  # the book's sense: collectives outlast the work they could hide behind
            work = self.compute_s + self.memory_s
            return "communication" if self.comm_s > work else max(("compute", "memory"), key=self._part)
        return "communication" if self.comm_s > self.roofline.time_s else self.roofline.bound

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Seconds of compute, memory and communication per layer kind (``parts`` and each collective's
        ``part``): ``{"attention": {"compute_s": ..., "memory_s": ..., "comm_s": ...}, ...}``, e.g. for
        ``pandas.DataFrame(step.by_kind()).T``. Compute and memory are the roofline's, shared out by FLOPs and
        bytes; a step without parts (a compiled one) is one kind, "step"."""
        r = self.roofline
        parts = self.parts or (WorkPart("step", r.flops, r.hbm_bytes),)
        flops, nbytes = sum(p.flops for p in parts), sum(p.hbm_bytes for p in parts)
        out = {p.kind: {"compute_s": self.compute_s * p.flops / flops if flops else 0.0,
                        "memory_s": self.memory_s * p.hbm_bytes / nbytes if nbytes else 0.0,
                        "comm_s": 0.0} for p in parts}
        for c in self.collectives:
            kind = (c.part or "other") if self.parts else "step"
            out.setdefault(kind, {"compute_s": 0.0, "memory_s": 0.0, "comm_s": 0.0})["comm_s"] += c.total_s
        return out

    @property
    def peak_flops(self) -> float:
        """A device's peak FLOP/s, as the roofline priced the matmuls (before ``efficiency``)."""
        r = self.roofline
        if self.terms:
            return r.flops / r.compute_s if r.compute_s else 0.0
        return r.flops / (r.compute_s * self.efficiency) if r.compute_s else 0.0

    @property
    def ideal(self) -> bool:
        """No efficiency factor: matmuls at the chip's peak, so :attr:`mfu` and :attr:`hfu` are upper bounds."""
        return self.efficiency == 1.0 and not self.terms

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation (:func:`~workbench.core.cost.flops.hfu`): the matmul FLOPs a device runs,
        recompute included, over its peak and the step's time."""
        r = self.roofline
        return hfu(r.flops, self.time_s, self.peak_flops) if r.compute_s and self.time_s else 0.0

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation (:func:`~workbench.core.cost.flops.mfu`): ``model_flops`` (no recompute, no
        repeated work) over a device's peak and the step's time; None without ``model_flops``."""
        if self.model_flops is None or not self.roofline.compute_s or not self.time_s:
            return None
        return mfu(self.model_flops, self.time_s, self.peak_flops)

    def mfu_text(self) -> str:
        """:attr:`mfu` as a percentage, ``"≤ 42%"`` where it is an upper bound (:attr:`ideal`), ``"-"`` unknown."""
        return "-" if self.mfu is None else f"{'≤ ' if self.ideal else ''}{self.mfu:.0%}"

    def hfu_text(self) -> str:
        """:attr:`hfu` as :meth:`mfu_text` writes MFU."""
        return f"{'≤ ' if self.ideal else ''}{self.hfu:.0%}"

    def utilisation(self) -> str:
        """MFU and HFU in words, said to be upper bounds when :attr:`ideal`."""
        text = f"HFU {self.hfu_text()}"
        if self.mfu is None:
            text += " (no MFU: a compiled program's dots include any recompute; pass model_flops)"
        else:
            text = f"MFU {self.mfu_text()}, {text}"
        if self.terms:
            return text + (f" (predicted: matmuls at {self.efficiency:.0%} of peak, at the chip's calibrated kernel "
                           f"rates)")
        return text + (" (upper bounds: matmuls at peak)" if self.ideal else
                       f" (matmuls at {self.efficiency:.0%} of peak)")

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
        if self.terms:
            head = [("step", fs(self.time_s), f"{self.bound}-bound on {self.cluster.name}, {mesh}; the sum of the "
                     f"terms below; {self.utilisation()}")]
            head += [(t.name, fs(t.seconds), t.note) for t in self.terms if t.seconds]
            head.append(("all collectives", fs(self.comm_s), (levels or "no collectives") + "; hidden or not"))
            return head
        head = [("step", fs(self.time_s), f"{self.bound}-bound on {self.cluster.name}, {mesh}; parts "
                 + ("overlapped (the longest)" if self.overlap else "one after another") + f"; {self.utilisation()}"),
                ("compute", fs(r.compute_s), f"{r.flops:.3g} FLOP per device at {self.efficiency:.0%} of peak"),
                ("memory", fs(r.memory_s), f"{r.hbm_bytes:.3g} B per device (intensity {r.intensity:.0f} FLOP/B; "
                                           f"compute bounds above {r.critical_intensity:.0f} at these rates)"),
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
                             f"{format_bytes(nbytes):>14}{format_seconds(total):>11}")
        return "\n".join(lines)

    __str__ = summary

    def html(self, top: int | None = None) -> str:
        """:meth:`summary` as HTML tables: the parts, then the longest ``top`` collective groups (all by default)."""
        rows = [(k, ",".join(a) or "-", lv, b, runs, format_bytes(nb), format_seconds(t))
                for k, a, lv, b, runs, nb, t in self.rows()[:top]]
        header = ("collective", "axes", "level", "bound", "runs", "bytes/device", "time")
        return f"<div>{html_table(self._head())}{html_table(rows, header=header) if rows else ''}</div>"

    _repr_html_ = html
