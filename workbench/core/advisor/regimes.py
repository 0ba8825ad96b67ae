"""Where the step model's predictions hold: each parallelism a layout uses, in the regime its accuracy depends on
(:class:`Regime`), the published runs that validate that regime (:func:`validated`), and for a layout that rests
on a regime no run validates a range whose slow end ranks it (:func:`standing`).

The step model was held against measured runs (``published_runs.json``); it was not held against layouts no one
published. A run whose prediction fell inside :data:`~workbench.core.interop.published.BAND` out of sample
(:mod:`workbench.core.interop.out_of_sample`) validates each of its layout's regimes:

- ``dp``, ``fsdp``: the network level its groups span (NVLink or the inter-node network on GPU, ICI or DCN on
  TPU): what hides its gathers and reductions does not depend on the group's size. A run with ``fsdp`` at a level
  validates ``dp`` there too (both reduce the gradients behind the backward).
- ``tp``, ``ep``: the level, and up to the run's size.
- ``sp`` (ring attention): the level, up to the run's size, and at chunks (tokens of a sequence a device holds,
  ``seq_len / sp``) at least as long as the run's: shorter chunks leave the ring's passes less attention to hide
  behind.
- ``pp``: the schedule, at least as many microbatches a stage as the run's (a smaller bubble than the model was
  checked at is a claim no run checks), up to its virtual stages.

A layout with a regime no run validates gets a range (:class:`Standing`): from its prediction to a slow end that
takes back what the model credits the unvalidated parts with (an interleaved pipeline's bubble priced as 1F1B's at
the same microbatches, ring attention's passes exposed, tensor parallelism's collectives unhidden) and then allows
the model's largest miss on published runs out of sample (divided by the lowest predicted / measured ratio).
The advisor ranks such a layout by its slow end and says which regime no run validates; a published run of
that kind, added with its source to ``published_runs.json``, validates it.

>>> from workbench.core.hardware.cluster import Cluster
>>> from workbench.core.plan import Plan
>>> [r.text() for r in regimes(Plan({"fsdp": 32, "tp": 8}), Cluster.h100(nodes=32), seq_len=8192)]
['fsdp=32 over inter-node', 'tp=8 over nvlink']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing as tp

from workbench.core.hardware.network import span
from workbench.core.interop.out_of_sample import out_of_sample
from workbench.core.interop.published import BAND, published_runs
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import Plan
from workbench.core.units import format_seconds

_SPLIT = ("dp", "fsdp", "ep", "tp", "sp")  # the mesh axes whose regime is their network level (and size)
_SIZED = ("ep", "tp", "sp")  # validated up to the run's size


@dataclasses.dataclass(frozen=True)
class Regime:
    """One parallelism of a layout as the step model's accuracy depends on it: ``term`` (a mesh axis), the
    ``platform``, the network ``level`` its groups span (not for ``pp``), its ``size``, and for ``sp`` the
    ``chunk`` (tokens of a sequence a device holds), for ``pp`` the ``schedule``, ``virtual`` stages and
    microbatches ``per_stage``."""

    term: str
    platform: str
    level: str = ""
    size: int = 1
    chunk: int = 0
    schedule: str = ""
    virtual: int = 1
    per_stage: float = 0.0

    def covered_by(self, other: Regime) -> bool:
        """Whether a run in ``other`` validates this regime (see the module's doc)."""
        # dp's gradient all-reduce hides behind the backward as fsdp's reduce-scatter does: a run of either
        # validates dp at its level
        same = self.term == other.term or (self.term == "dp" and other.term == "fsdp")
        if not same or self.platform != other.platform:
            return False
        if self.term == "pp":
            return (self.schedule == other.schedule and self.per_stage >= other.per_stage
                    and self.virtual <= other.virtual)
        if self.level != other.level:
            return False
        if self.term in _SIZED and self.size > other.size:
            return False
        return self.term != "sp" or self.chunk >= other.chunk

    def text(self) -> str:
        """"tp=8 over nvlink", "sp=4 over ici, 2,048-token chunks", "pp=2 interleaved v=4, m=8 (4 microbatches a
        stage)"."""
        if self.term == "pp":
            v = f" v={self.virtual}" if self.virtual > 1 else ""
            m = round(self.per_stage * self.size)
            return f"pp={self.size} {self.schedule}{v}, m={m} ({self.per_stage:g} microbatches a stage)"
        chunk = f", {self.chunk:,}-token chunks" if self.term == "sp" else ""
        return f"{self.term}={self.size} over {self.level}{chunk}"


def regimes(plan: Plan, cluster: tp.Any, seq_len: int) -> tuple[Regime, ...]:
    """The regimes of ``plan``'s layout on ``cluster`` for sequences of ``seq_len`` tokens: one per split axis."""
    shape = cluster.axis_sizes(plan.mesh_shape)
    out = []
    for axis in _SPLIT:
        if shape[axis] > 1:
            level = cluster.levels[0 if span((axis,), shape, cluster).units == 1 else -1].name
            out.append(Regime(axis, cluster.platform, level, shape[axis],
                              chunk=seq_len // shape[axis] if axis == "sp" else 0))
    pipe = plan.pipeline
    if pipe is not None:
        out.append(Regime("pp", cluster.platform, size=pipe.num_stages, schedule=pipe.schedule,
                          virtual=pipe.virtual_stages, per_stage=pipe.num_microbatches / pipe.num_stages))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """A published run that validates a regime: its name and predicted / measured ratio out of sample."""

    run: str
    ratio: float
    regime: Regime

    def text(self) -> str:
        return f"{self.run} ({self.regime.text()}, {self.ratio:.2f}x measured)"


@functools.cache
def validated() -> tuple[Evidence, ...]:
    """Every regime of every published run predicted within :data:`~workbench.core.interop.published.BAND` out
    of sample, with its run."""
    ratios = out_of_sample().ratios
    return tuple(Evidence(run.name, ratios[run.name], regime) for run in published_runs()
                 if BAND[0] <= ratios[run.name] <= BAND[1]
                 for regime in regimes(run.plan, run.cluster, run.batch[1]) if _as_priced(regime, run))


def _as_priced(regime: Regime, run: tp.Any) -> bool:
    """Whether ``run`` ran ``regime`` at the level the step model priced it at. Megatron, NeMo and torchtitan put
    ``tp`` innermost on GPU (inside a node) and context parallelism outside it; the workbench's mesh puts ``sp``
    innermost. Where ``tp x sp`` spans more than a node the model priced each at the other's level, so neither
    is validated by that run."""
    shape = run.cluster.axis_sizes(run.plan.mesh_shape)
    crossed = run.cluster.platform == "gpu" and shape["tp"] * shape["sp"] > run.cluster.gpus_per_node
    return not (crossed and regime.term in ("tp", "sp") and shape["tp"] > 1 and shape["sp"] > 1)


def lowest_ratio() -> float:
    """The lowest predicted / measured ratio on the published runs out of sample: the model's largest miss
    towards too fast, which the slow end of a range allows."""
    return out_of_sample().accuracy.low


@functools.cache  # a search asks for the same few dozen regimes thousands of times
def evidence(regime: Regime) -> Evidence | None:
    """The published run nearest ``regime`` that validates it (closest in size, then in ratio to 1), or None."""
    runs = [e for e in validated() if regime.covered_by(e.regime)]
    if not runs:
        return None
    return min(runs, key=lambda e: (abs(math.log(regime.size / e.regime.size)), abs(math.log(e.ratio))))


@dataclasses.dataclass(frozen=True)
class Standing:
    """What a layout's prediction rests on: each regime with the run that validates it (``validated``), the
    regimes no run validates (``unvalidated``), and for those the range's slow end (``slow_s``; None when every
    regime is validated)."""

    validated: tuple[Evidence, ...]
    unvalidated: tuple[Regime, ...]
    point_s: float
    slow_s: float | None = None

    @property
    def ranked_s(self) -> float:
        """The step time the layout is ranked by: the slow end where a regime is unvalidated, else the point."""
        return self.point_s if self.slow_s is None else self.slow_s

    def range_text(self) -> str:
        """"14.8 s" or "14.8 s to 21.6 s"."""
        if self.slow_s is None:
            return format_seconds(self.point_s)
        return f"{format_seconds(self.point_s)} to {format_seconds(self.slow_s)}"

    def text(self) -> str:
        """The clause a reason carries: which regime no run validates and the range it ranks by, or the runs that
        validate the layout."""
        if self.unvalidated:
            kinds = "; ".join(r.text() for r in self.unvalidated)
            return (f"no published run validates {kinds}: a range {self.range_text()}, ranked by its slow end (what "
                    f"the model credits it with taken back, and its largest miss on published runs allowed)")
        if not self.validated:
            return ""
        return "each part of the layout ran in a published run within the band: " + "; ".join(
            e.text() for e in self.validated)


def standing(plan: Plan, cluster: tp.Any, seq_len: int, point_s: float,
             reprice: tp.Callable[..., tp.Any]) -> Standing:
    """The :class:`Standing` of ``plan`` on ``cluster`` whose step is predicted at ``point_s``; ``reprice(plan,
    ring_overlap=...)`` prices a plan the way the point was priced (for the slow end)."""
    found = [(r, evidence(r)) for r in regimes(plan, cluster, seq_len)]
    unvalidated = tuple(r for r, e in found if e is None)
    validated_ = tuple(e for _, e in found if e is not None)
    if not unvalidated:
        return Standing(validated_, (), point_s)
    terms = {r.term for r in unvalidated}
    slow_plan = plan
    if "pp" in terms and plan.pipeline.virtual_stages > 1:  # the interleaved schedule's smaller bubble taken back
        p = plan.pipeline
        slow_plan = slow_plan.replace(pipeline=PipelineConfig(p.num_stages, p.num_microbatches, "1f1b",
                                                              uneven=p.uneven))
    if "tp" in terms:
        slow_plan = slow_plan.replace(tp_overlap=False)
    slow = reprice(slow_plan, ring_overlap="sp" not in terms).time_s
    return Standing(validated_, unvalidated, point_s, max(slow, point_s) / lowest_ratio())


__all__ = ["Evidence", "Regime", "Standing", "evidence", "lowest_ratio", "regimes", "standing", "validated"]
