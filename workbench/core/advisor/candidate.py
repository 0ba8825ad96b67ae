"""One layout the advisor weighed (:class:`Candidate`): its mesh, remat policy, pipeline and ZeRO stage, its ledger and
predicted step, its label, and the layout itself resolved on a model."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing as tp

from workbench.core.axes import MODE_DECODE, MODE_TRAIN, PartitionAxis
from workbench.core.hardware.cluster import cluster_mesh
from workbench.core.mesh import MESH_AXES
from workbench.core.plan import Plan
from workbench.core.sharding.plan import Layout
from workbench.core.units import format_bytes, format_seconds

gib = functools.partial(format_bytes, unit="GiB")  # the advisor's figures to compare, all in GiB


def layout_mesh(mesh_shape: tp.Mapping[str, int], cluster: tp.Any = None) -> tp.Any:
    """The mesh of ``mesh_shape`` over :data:`MESH_AXES`: on ``cluster``'s devices (``cluster_mesh``) with a
    cluster, else an ``AbstractMesh``."""
    from jax.sharding import AbstractMesh, AxisType

    shape = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    if cluster is not None:
        return cluster_mesh(cluster, shape, MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


def train_plan_text(remat: str, pipeline: tp.Any, grad_accumulation: int, zero_stage: int) -> str:
    """A train step's plan beyond its mesh, as a row's label says it: ", remat full, interleaved v=4 m=8, 2
    microbatches accumulated, ZeRO-1"."""
    pl = pipeline
    pipe = "" if pl is None else f", {pl.schedule}{f' v={pl.virtual_stages}' if pl.virtual_stages > 1 else ''} " \
        f"m={pl.num_microbatches}{' uneven stages' if pl.uneven else ''}"
    accumulate = f", {grad_accumulation} microbatches accumulated" if grad_accumulation > 1 else ""
    return f", remat {remat}{pipe}{accumulate}" + (", ZeRO-1" if zero_stage else "")


@dataclasses.dataclass
class Candidate:
    """One layout: its :class:`~workbench.core.plan.Plan` (the mesh's axis sizes, the remat policy, pipeline, ZeRO
    stage and accumulation), how it resolves (partition axis, rules), its ledger and predicted step, whether it fits,
    the reason in words, and after :meth:`Advice.confirm` the compiled analysis."""

    plan: Plan  # how the step runs: mesh, remat, pipeline, ZeRO, accumulation, batch axes, experts over fsdp
    partition_axis: PartitionAxis
    rules: tuple[tuple[str, tp.Any], ...]
    ledger: tp.Any
    price: tp.Callable[[str], tp.Any]  # remat policy -> the predicted step (priced when first asked for)
    fits: bool
    # the reason in words: set, or written on first read by ``explain_reason`` (reasons.explain sets it: a search
    # ranks thousands of rows and shows ten)
    _reason: str | None = dataclasses.field(default=None, repr=False)
    explain_reason: tp.Callable[[], str] | None = dataclasses.field(default=None, repr=False)
    cluster: tp.Any = None  # the part of the cluster it runs on, when it leaves chips idle
    idle: int = 0  # devices of the cluster it leaves idle
    compiled: tp.Any = None  # virtual.CompiledAnalysis after confirm
    compiled_step: tp.Any = None  # cost.StepTime of the compiled program
    reconciled: list = dataclasses.field(default_factory=list)  # cost.reconcile rows: predicted vs compiled, why
    confirmation: tp.Any = None  # confirm.Confirmation: the compiled program in words, its rows and the step's
    confirm_note: str = ""
    # the same step's ledger under another program (keywords attention, vocab_tiles, offload): what confirm compiles
    reledger: tp.Callable[..., tp.Any] | None = None
    # regimes.Standing: the published runs that validate each part of the layout, or the range of one that rests on
    # a regime none validates (train steps ranked by evidence; None otherwise)
    standing: tp.Any = None

    # the plan's fields, as the rows, reasons and widgets read them
    mesh_shape = property(lambda self: dict(self.plan.mesh_shape))
    remat = property(lambda self: self.plan.remat)
    pipeline = property(lambda self: self.plan.pipeline)
    zero_stage = property(lambda self: self.plan.zero_stage)
    grad_accumulation = property(lambda self: self.plan.grad_accumulation)  # microbatches run one after another
    experts_fsdp = property(lambda self: self.plan.experts_fsdp)  # with ep and fsdp: experts split over fsdp too

    @property
    def reason(self) -> str:
        """Why this layout ranks where it does, or does not fit, in words (:func:`~.reasons.reason`)."""
        if self._reason is None:
            self._reason = self.explain_reason() if self.explain_reason is not None else ""
        return self._reason

    @reason.setter
    def reason(self, text: str) -> None:
        self._reason = text

    @functools.cached_property
    def step(self) -> tp.Any:
        """The predicted step (:func:`~workbench.core.cost.predicted.predict_step`): priced on first use, so a
        layout that does not fit costs the search its ledger only."""
        return self.price(self.remat)

    @functools.cached_property
    def recompute_s(self) -> float:
        """Compute seconds the remat policy adds to the step."""
        if self.remat == "none" or self.ledger.kind != "train":
            return 0.0
        return self.step.compute_s - self.price("none").compute_s

    @property
    def mesh_label(self) -> str:
        parts = [f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1]
        return (" × ".join(parts) or "one device") + ("" if self.experts_fsdp else " (experts whole over fsdp)")

    @property
    def label(self) -> str:
        used = f" on {math.prod(self.mesh_shape.values()):,} devices ({self.idle:,} idle)" if self.idle else ""
        if self.ledger.kind != "train":  # no backward: no remat, optimizer, ZeRO or accumulation to name
            return self.mesh_label + used
        return self.mesh_label + used + train_plan_text(self.remat, self.pipeline, self.grad_accumulation,
                                                         self.zero_stage)

    @property
    def time_s(self) -> float:
        """The predicted step (the point of a range)."""
        return self.step.time_s

    @property
    def ranked_s(self) -> float:
        """The step time the ranking reads: the slow end of the range where the layout rests on a regime no
        published run validates (:mod:`~workbench.core.advisor.regimes`), else the prediction."""
        return self.time_s if self.standing is None else self.standing.ranked_s

    @property
    def unvalidated(self) -> bool:
        """Whether the layout rests on a regime no published run validates (its step is a range)."""
        return self.standing is not None and bool(self.standing.unvalidated)

    def step_text(self) -> str:
        """"1.82 s", or a range "14.8 s to 21.6 s" where a regime is unvalidated."""
        return self.standing.range_text() if self.unvalidated else format_seconds(self.time_s)

    def tokens_text(self, tokens: int) -> str:
        """Tokens a second of a step of ``tokens``: a range (slow end first) where the step is one."""
        if self.unvalidated:
            return f"{tokens / self.standing.slow_s:,.0f} to {tokens / self.time_s:,.0f}"
        return f"{tokens / self.time_s:,.0f}"

    @property
    def split_axes(self) -> int:
        return sum(n > 1 for n in self.mesh_shape.values())

    def layout(self, model: tp.Any, cluster: tp.Any = None) -> tp.Any:
        """This layout resolved on ``model`` (on ``cluster_mesh(cluster, ...)`` with a cluster, else an
        ``AbstractMesh``), carrying its plan beyond the specs: remat policy, pipeline, ZeRO stage and accumulation
        (its batch axes and expert placement are in the partition axis and rules)."""
        if cluster is not None and self.cluster is not None:
            cluster = self.cluster
        mesh = layout_mesh(self.mesh_shape, cluster)
        mode = MODE_DECODE if self.ledger.kind == "decode" else MODE_TRAIN
        return Layout.of(model, mesh, self.partition_axis, self.rules, mode, remat=self.remat, pipeline=self.pipeline,
                         zero_stage=self.zero_stage, grad_accumulation=self.grad_accumulation)
