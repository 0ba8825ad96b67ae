"""The layout advisor: every sensible way to lay a model on a cluster, ranked with reasons, confirmed by the compiler.

:func:`advise` enumerates mesh shapes of the cluster's devices over the workbench's axes ``(pp, dp, fsdp, ep, tp,
sp)`` (only those the cluster can hold: :meth:`Cluster.valid_mesh_shapes`), with the remat policies, for ``pp > 1``
the pipelines (1F1B and interleaved, ``m = p, 2p, 4p`` microbatches), and for a train step on ``dp > 1`` ZeRO-1
(the optimizer state split over ``dp``, :mod:`workbench.core.zero`), and drops what makes no sense for
this model and batch (a split that does not divide the heads, the experts, the layers or the batch; ``tp``
across GPU nodes unless allowed; more than ``max_split_axes`` split axes). Each remaining layout is resolved (the
parameters' PartitionSpecs, :class:`~workbench.core.sharding.plan.Layout`), held against the chip's HBM by the memory
ledger (:func:`~workbench.core.cost.ledger.ledger`), and timed by the analytic step model
(:func:`~workbench.core.cost.predicted.predict_step`): nothing is compiled. Layouts that fit are ranked by predicted
step time, each with the reason it wins or loses in words; :meth:`Advice.confirm` compiles the top few on the
virtual cluster (:func:`~workbench.core.compile.virtual.compile_step`) and puts the compiler's memory and collectives
beside the prediction, demoting a layout whose compiled memory does not fit.

What it chooses between, as practitioners do: mesh shapes along whole torus axes and, on TPU, splitting one (a
ring of 4 inside an axis of 16); part of a cluster whose device count nothing divides (the Llama-3 70B layout of
the scaling book uses 8,192 of a v5p pod's 8,960 chips), saying how many chips stay idle; FSDP over the batch and
the sequence together (``fsdp x sp``, both sharding the weights); gradient accumulation (microbatches per step,
tried where a layout does not fit without remat); pipelines with uneven stages (Llama 3 405B's 126 layers on 16);
expert parallelism whose ``ep`` groups are data parallel outside the experts (MaxText's and torchtitan's way),
with the experts split over ``fsdp`` too or kept whole over it (no gathers: what a decode step wants).
Ties (step times within 1 %) go to what a practitioner prefers next: no pipeline, no accumulation, no idle chips,
fewer split axes, more HBM left free; each reason says which decided.

ZeRO's stages: ``dp`` alone is stage 0, ``zero_stage=1`` on ``dp`` is stage 1 (and holds stage 2's split
gradients in a jitted step: ZeRO-2 is ZeRO-1 here), ``fsdp`` is stage 3.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import html
import itertools
import math
import re
import time
import typing as tp

from workbench.core.axes import EMPTY, EP, FSDP, MODE_DECODE, MODE_TRAIN, SP, DynamicShardingAxes, PartitionAxis
from workbench.core.checks import is_int, is_positive_int, positive_int
from workbench.core.compile.virtual import cluster_mesh, compile_step
from workbench.core.cost.ledger import ledger, libtpu_version, zero_parameter_copy_bytes
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.reconcile import reconcile
from workbench.core.cost.step_time import step_time
from workbench.core.hardware.cluster import prime_factors
from workbench.core.hardware.network import span
from workbench.core.interop.published import accuracy_text
from workbench.core.mesh import MESH_AXES, axis_sizes, mesh_factorizations
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.sharding import flat_params, path_str, remembered_params
from workbench.core.pipeline import pipeline_partition_axis
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.sharding.plan import Layout
from workbench.core.tables import html_table
from workbench.core.units import format_bytes, format_seconds
from workbench.core.vocab import OPTIMIZERS, REMATS, TASKS

_gib = functools.partial(format_bytes, unit="GiB")  # figures to compare, all in GiB
_ROW_HEADER = ("#", "layout", "memory/device", "of HBM", "step", "tokens/s", "MFU", "bound by", "why")  # Advice.rows


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What the advisor may choose. ``fixed``: axis sizes every layout keeps (``{"tp": 8}``);
    ``tp_across_nodes``: let ``tp`` (and ``sp``) groups span GPU nodes (their all-reduces then run on the
    inter-node network); ``max_split_axes``: mesh axes of size > 1 at most; ``pipeline``: consider ``pp > 1``
    (train steps); ``zero``: consider ZeRO-1 on ``dp > 1`` (train steps); ``headroom``: the fraction of HBM a
    layout must leave free to count as fitting; ``split_physical_axes``: on TPU, also mesh axes that split a torus
    axis (MaxText's ``allow_split_physical_axes``: a ring of 4 inside an axis of 16); ``idle_chips``: when the
    cluster's device count has a prime factor of 5 or more (which divides no batch, head or layer count of powers
    of two), also plan on part of it (:meth:`Cluster.part
    <workbench.core.hardware.cluster.Cluster.part>`), saying how many
    chips stay idle; ``grad_accumulation``: the microbatches per step to try (train, no pipeline) where a layout
    does not fit without remat at fewer."""

    fixed: tp.Mapping[str, int] = dataclasses.field(default_factory=dict)
    tp_across_nodes: bool = False
    max_split_axes: int = 3
    pipeline: bool = True
    zero: bool = True
    headroom: float = 0.10
    split_physical_axes: bool = True
    idle_chips: bool = True
    grad_accumulation: tuple[int, ...] = (1, 2, 4, 8, 16)

    def __post_init__(self):
        axis_sizes(self.fixed, "Constraints.fixed")
        if not self.grad_accumulation or not all(is_positive_int(k) for k in self.grad_accumulation):
            raise ValueError(f"Constraints.grad_accumulation is a tuple of positive ints (microbatches per step, 1 "
                             f"for none); got {self.grad_accumulation!r}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"Constraints.headroom is a fraction of HBM in [0, 1); got {self.headroom!r}")
        if not is_int(self.max_split_axes) or not 1 <= self.max_split_axes <= len(MESH_AXES):
            raise ValueError(f"Constraints.max_split_axes must be an int in 1..{len(MESH_AXES)}; "
                             f"got {self.max_split_axes!r}")


@dataclasses.dataclass
class Candidate:
    """One layout: the mesh's axis sizes, the remat policy, pipeline and ZeRO stage, its ledger and predicted step,
    whether it fits, the reason in words, and after :meth:`Advice.confirm` the compiled analysis."""

    mesh_shape: dict[str, int]
    remat: str
    pipeline: tp.Any
    partition_axis: PartitionAxis
    rules: tuple[tuple[str, tp.Any], ...]
    ledger: tp.Any
    price: tp.Callable[[str], tp.Any]  # remat policy -> the predicted step (priced when first asked for)
    fits: bool
    zero_stage: int = 0
    reason: str = ""
    grad_accumulation: int = 1  # microbatches per step, run one after another
    experts_fsdp: bool = True  # with ep and fsdp: the experts split over fsdp too (False: whole over it)
    cluster: tp.Any = None  # the part of the cluster it runs on, when it leaves chips idle
    idle: int = 0  # devices of the cluster it leaves idle
    compiled: tp.Any = None  # virtual.CompiledAnalysis after confirm
    compiled_step: tp.Any = None  # cost.StepTime of the compiled program
    reconciled: list = dataclasses.field(default_factory=list)  # cost.reconcile rows: predicted vs compiled, why
    confirm_note: str = ""

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
        pl = self.pipeline
        pipe = "" if pl is None else f", {pl.schedule}{f' v={pl.virtual_stages}' if pl.virtual_stages > 1 else ''} " \
            f"m={pl.num_microbatches}{' uneven stages' if pl.uneven else ''}"
        used = f" on {math.prod(self.mesh_shape.values()):,} devices ({self.idle:,} idle)" if self.idle else ""
        if self.ledger.kind != "train":  # no backward: no remat, optimizer, ZeRO or accumulation to name
            return self.mesh_label + used
        accumulate = f", {self.grad_accumulation} microbatches accumulated" if self.grad_accumulation > 1 else ""
        return (f"{self.mesh_label}{used}, remat {self.remat}{pipe}{accumulate}"
                + (", ZeRO-1" if self.zero_stage else ""))

    @property
    def time_s(self) -> float:
        return self.step.time_s

    @property
    def split_axes(self) -> int:
        return sum(n > 1 for n in self.mesh_shape.values())

    def layout(self, model: tp.Any, cluster: tp.Any = None) -> tp.Any:
        """This layout resolved on ``model`` (on ``cluster_mesh(cluster, ...)`` with a cluster, else an
        ``AbstractMesh``), carrying its remat policy and pipeline."""
        if cluster is not None and self.cluster is not None:
            cluster = self.cluster
        mesh = _mesh(self.mesh_shape, cluster)
        mode = MODE_DECODE if self.ledger.kind == "decode" else MODE_TRAIN
        return Layout.of(model, mesh, self.partition_axis, self.rules, mode, remat=self.remat, pipeline=self.pipeline,
                         zero_stage=self.zero_stage)


@dataclasses.dataclass
class Advice:
    """The ranked layouts (``ranked``: they fit, fastest first) and those that do not fit (``rejected``, each with
    why), for one model, cluster, task and batch. ``considered``: layouts the ledger and step model saw;
    ``pruned``: mesh shapes dropped before that, by reason; ``seconds``: enumeration and ranking time."""

    model: tp.Any
    cluster: tp.Any
    task: str
    batch: tuple[int, int]
    optimizer: str
    ranked: list[Candidate]
    rejected: list[Candidate]
    considered: int
    pruned: dict[str, int]
    seconds: float

    @property
    def best(self) -> Candidate:
        """The fastest layout that fits; a ValueError saying why when none does."""
        if not self.ranked:
            raise ValueError(self.why_none())
        return self.ranked[0]

    def why_none(self) -> str:
        """Why no layout fits, and what would help."""
        if not self.considered:
            pruned = ", ".join(f"{n} {why}" for why, n in self.pruned.items() if n)
            return (f"every mesh shape of {self.cluster.name} was pruned before the ledger ({pruned}): allow more "
                    f"(Constraints), or change the batch so it divides over the data axes")
        smallest = self.rejected[0]
        return (f"no layout fits {self.cluster.name}: the smallest, {smallest.label}, needs "
                f"{_gib(smallest.ledger.total)} per device ({smallest.reason}). "
                + ("Fewer sequences, a shorter KV cache or more chips would." if self.task == "decode" else
                   "More microbatches (Constraints.grad_accumulation), fewer tokens per step or more chips would."))

    def confirm(self, k: int = 3, *, progress: tp.Callable[[str], None] | None = None) -> list[Candidate]:
        """Compile the top ``k`` on the virtual cluster (:meth:`confirm_one` each)."""
        return [self.confirm_one(c, progress=progress) for c in list(self.ranked[:k])]

    def confirm_one(self, c: Candidate, *, progress: tp.Callable[[str], None] | None = None) -> Candidate:
        """Compile ``c`` on the virtual cluster: the compiled memory and step time go beside the prediction; on a
        TPU slice (XLA's TPU compiler), if its compiled memory exceeds the HBM it moves from ``ranked`` to
        ``rejected`` with that reason. A GPU cluster's program is XLA:CPU's (in the worker), whose memory is not
        a GPU's: it is shown, not held against the HBM."""
        cluster = c.cluster or self.cluster  # the part of the cluster it plans on, when it leaves chips idle
        if progress is not None:
            progress(f"compiling {c.label} for {cluster.name}")
        if c.pipeline is not None and cluster.platform != "tpu":
            c.confirm_note = ("not compiled: a pipelined step compiles for TPU clusters only (XLA:CPU aborts on the "
                              "exported pipeline the GPU worker receives)")
            return c
        if cluster.platform == "tpu" and cluster.topology is None:
            c.confirm_note = (f"not compiled: {cluster.name} is no TPU slice shape, so XLA's TPU compiler has no "
                              f"topology to compile it for")
            return c
        if c.pipeline is not None and c.pipeline.uneven:
            c.confirm_note = "not compiled: the compiled pipeline runs equal stages only (uneven stages are priced)"
            return c
        model = self.model.with_options(remat=c.remat) if hasattr(self.model, "with_options") else self.model
        kind = "train" if self.task == "train" else "forward"
        batch = self.batch if self.task != "decode" else (self.batch[0], 1)
        batch = (batch[0] // c.grad_accumulation, batch[1])  # one microbatch of an accumulation: its memory
        c.compiled = compile_step(model, cluster, c.mesh_shape, kind=kind, batch=batch,
                                  optimizer=self.optimizer, partition_axis=c.partition_axis, rules=c.rules or None,
                                  pipeline=c.pipeline, zero_stage=c.zero_stage)
        # a decode step compiles as a one-token forward without a cache: not the predicted step's model FLOPs
        model_flops = None if self.task == "decode" else c.step.model_flops / c.grad_accumulation
        c.compiled_step = step_time(c.compiled, efficiency=c.step.efficiency, model_flops=model_flops)
        c.reconciled = reconcile(c.step, c.compiled_step, c.ledger, c.compiled, seq_len=batch[1])
        total, hbm = c.compiled.memory.total, self.cluster.hbm_per_device
        here = self._ledger_total_compiled_here(c, model)
        c.confirm_note = (f"compiled: {_gib(total, decimals=2)} per device (ledger {here / total - 1:+.1%}"
                          + ("" if here == c.ledger.total else
                             f" for the libtpu {'.'.join(map(str, libtpu_version()))} that compiled it") + "), "
                          f"step {c.compiled_step.time_s * 1e3:.3g} ms from the compiled program"
                          + ("" if kind == "train" else " (compiled as a forward pass without a cache)")
                          + (f" (one of its {c.grad_accumulation} microbatches; the ledger adds the gradient sum)"
                             if c.grad_accumulation > 1 else ""))
        if c.compiled_step.xla_seconds is not None:
            c.confirm_note += (f"; XLA's own estimate {format_seconds(c.compiled_step.xla_seconds)} (libtpu's "
                               f"optimal_seconds, a scanned layer counted once) beside the model's "
                               f"{format_seconds(c.step.time_s)}")
        if self.cluster.platform != "tpu":  # XLA:CPU in the worker: bfloat16 math widened, CPU fusion
            c.confirm_note += "; XLA:CPU's buffer assignment (bfloat16 widened), not held against the GPU's HBM"
        elif hbm is not None and total > hbm and c in self.ranked:
            c.fits = False
            c.reason = (f"demoted by the compiler: the compiled step needs {_gib(total)} per device > "
                        f"{_gib(hbm)} HBM (the ledger said {_gib(c.ledger.total)})")
            self.ranked.remove(c)
            self.rejected.insert(0, c)
        return c

    def _ledger_total_compiled_here(self, c: Candidate, model: tp.Any) -> int:
        """``c``'s ledger total for the compiler that compiles here: the cluster's libtpu release may differ from
        the installed one, and the ledger's ZeRO-1 parameter copy depends on it (``ledger`` module doc)."""
        here = libtpu_version()
        if self.cluster.platform != "tpu" or self.task != "train" or not c.zero_stage or here is None:
            return c.ledger.total
        layout = c.layout(model)
        return (c.ledger.total - zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", self.cluster.libtpu)
                + zero_parameter_copy_bytes(layout, c.zero_stage, "tpu", here))

    # -- display ------------------------------------------------------------------------------------------------
    def rows(self, top: int = 10) -> list[tuple[str, ...]]:
        """``(rank, layout, memory/device, HBM use, step, tokens/s, MFU, bound, reason)`` of the top ``top``; MFU
        (:attr:`StepTime.mfu <workbench.core.cost.step_time.StepTime.mfu>`) is marked ``≤`` where it is an upper
        bound (no efficiency factor)."""
        hbm = self.cluster.hbm_per_device
        tokens = self.batch[0] * (1 if self.task == "decode" else self.batch[1])
        return [(str(i), c.label, f"{_gib(c.ledger.total)}", "-" if hbm is None else f"{c.ledger.total / hbm:.0%}",
                 format_seconds(c.time_s), f"{tokens / c.time_s:,.0f}", c.step.mfu_text(), c.step.bound, c.reason)
                for i, c in enumerate(self.ranked[:top], 1)]

    def table(self, top: int = 10) -> str:
        rows = [_ROW_HEADER, *self.rows(top)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_ROW_HEADER) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
        return "\n".join([self.summary(), *lines])

    __str__ = table

    def summary(self) -> str:
        pruned = ", ".join(f"{n} {why}" for why, n in self.pruned.items() if n)
        steps = [c.step for c in (self.ranked or self.rejected)[:1]]
        how = ""
        if steps and steps[0].measured_model:
            how = f". Step times and MFU are predictions: {accuracy_text()}"
        elif steps and steps[0].ideal:
            how = ". Step times are the ideal roofline (matmuls at peak): MFU marked ≤ is an upper bound"
        batch = f"{self.batch[0]} sequences, KV cache {self.batch[1]}" if self.task == "decode" else \
            f"batch {self.batch[0]} x {self.batch[1]}"
        return (f"{self.task} of {self._model_name()} on {self.cluster.name}, {batch}: "
                f"{self.considered} layouts predicted in {self.seconds:.2f} s, {len(self.ranked)} fit"
                + (f" (pruned before: {pruned})" if pruned else "") + how)

    def _model_name(self) -> str:
        return getattr(getattr(self.model, "config", None), "model_type", type(self.model).__name__)

    def html(self, top: int = 10) -> str:
        """:meth:`table` as an HTML table: the summary line, then the top ``top`` layouts."""
        return (f'<div class="wb-advice" style="font-size:12px"><div>{html.escape(self.summary())}</div>'
                f"{html_table(self.rows(top), header=_ROW_HEADER)}</div>")

    _repr_html_ = html


# -- enumeration ------------------------------------------------------------------------------------------------
def _mesh(mesh_shape: tp.Mapping[str, int], cluster: tp.Any = None) -> tp.Any:
    from jax.sharding import AbstractMesh, AxisType

    shape = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    if cluster is not None:
        return cluster_mesh(cluster, shape, MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


MICROBATCHES_PER_STAGE = (1, 2, 4)  # m = p, 2p, 4p: the bubble (p - 1) / (v m + p - 1) at 50 %, 33 %, 20 % (v = 1)


def _pipeline_configs(p: int, rows_per_shard: int, num_layers: int) -> list[tp.Any]:
    """The pipelines a ``pp = p`` layout may run: 1F1B and interleaved (two or four stages per device, at least two
    layers each) with ``m = p, 2p, 4p`` microbatches where ``m`` divides a data shard's rows. Stages that do not
    divide the layers are uneven, offered where no schedule divides them
    (the deepest ``ceil(L / stages)`` deep, as Llama 3 405B's 126 layers on 16 stages). GPipe is left out: the
    same bubble as 1F1B with ``m`` microbatches stashed instead of ``p``."""
    even, uneven = [], []
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        if num_layers < 2 * p * v:
            continue  # a virtual stage of one layer: nothing left to overlap its sends with
        split = num_layers % (p * v) != 0
        (uneven if split else even).extend(PipelineConfig(p, k * p, schedule, v, uneven=split)
                                           for k in MICROBATCHES_PER_STAGE if rows_per_shard % (k * p) == 0)
    return even or uneven  # uneven stages only where no schedule splits the layers evenly


SHORT_SHARD = 512  # tokens: a sequence shard shorter than this leaves attention's kernels too little to overlap


def _shape_filter(shape: dict[str, int], config: tp.Any, cluster: tp.Any, task: str, batch: tuple[int, int],
                  constraints: Constraints) -> str | None:
    """Why a mesh shape makes no sense for this model and batch (a key of ``Advice.pruned``, naming the number that
    decides it), ``""`` for a shape not worth counting (an axis the model or task does not have), or None."""
    b, t = batch
    ep, tp_, sp, pp = shape["ep"], shape["tp"], shape["sp"], shape["pp"]
    experts = config.num_local_experts
    layers = config.num_hidden_layers - config.first_dense_layers
    if (ep > 1 and not experts) or (pp > 1 and (task != "train" or not constraints.pipeline)):
        return ""  # no experts to split, no backward to pipeline: not a choice to report
    if sum(n > 1 for n in shape.values()) > constraints.max_split_axes:
        return f"with more than {constraints.max_split_axes} split axes"
    if any(shape[a] != n for a, n in constraints.fixed.items()):
        return "not of the fixed sizes"
    if ep > 1 and experts % ep:
        return f"with ep not dividing the {experts} experts"
    if tp_ > 1 and (config.num_attention_heads % tp_ or config.intermediate_size % tp_):
        return f"with tp not dividing the {config.num_attention_heads} heads"
    if sp > 1 and task == "decode":
        return "with sp on a decode step"
    if sp > 1 and (t % sp or t // sp < SHORT_SHARD):
        return f"with sp leaving under {SHORT_SHARD} of the {t} positions per shard"
    data = shape["dp"] * shape["fsdp"] * (ep if _tokens_over_ep(shape) else 1)
    if b % data:
        return f"with the {b} sequences not dividing over the data axes"
    if pp > 1 and not _pipeline_configs(pp, b // data, layers):
        return "with pp and too few sequences per data shard to microbatch"
    # tp and sp are the mesh's innermost axes: consecutive GPUs
    if cluster.platform == "gpu" and not constraints.tp_across_nodes and cluster.gpus_per_node % (tp_ * sp):
        return f"with tp x sp across the {cluster.gpus_per_node}-GPU nodes"
    return None


def _tokens_over_ep(shape: tp.Mapping[str, int]) -> bool:
    """Whether the token batch splits over ``ep`` as well as the data axes: always with ``ep > 1``, as MaxText (its
    ``activation_batch`` rule names ``expert``) and torchtitan (EP borrows its devices from data parallelism) run
    experts: outside the expert layers an ``ep`` group is data parallel, not a copy of the same work."""
    return shape.get("ep", 1) > 1


def _batch_partition_axis(pa: PartitionAxis, shape: tp.Mapping[str, int]) -> PartitionAxis:
    """``pa`` with the batch over ``ep`` too where :func:`_tokens_over_ep` says so."""
    if not _tokens_over_ep(shape):
        return pa
    over = lambda axes: tuple(dict.fromkeys((*(axes if isinstance(axes, tuple) else (axes,)), EP)))
    return pa.replace(batch_axis=over(pa.batch_axis), decode_batch_axis=over(pa.decode_batch_axis))


@functools.lru_cache(maxsize=64)
def _mesh_shapes(cluster: tp.Any, split: bool, max_split_axes: int) -> tuple[tuple[int, ...], ...]:
    """The mesh shapes over :data:`MESH_AXES` a search tries on ``cluster``: those along whole physical axes, and
    with ``split`` (TPU) those that split a torus axis (:func:`~workbench.core.hardware.cluster.torus_layout`),
    of at most
    ``max_split_axes`` axes of size > 1."""
    whole = set(cluster.valid_mesh_shapes(len(MESH_AXES)))
    if cluster.platform != "tpu" or not split:
        return tuple(sorted(whole))
    shapes = set(whole)
    for s in mesh_factorizations(cluster.num_devices):
        sizes = tuple(s.values())
        if sizes in shapes or sum(n > 1 for n in sizes) > max_split_axes:
            continue
        try:
            cluster.check_mesh_shape(sizes)
        except ValueError:
            continue
        shapes.add(sizes)
    return tuple(sorted(shapes))


def _cluster_parts(cluster: tp.Any, constraints: Constraints) -> list[tp.Any]:
    """The cluster, and where its device count has a prime factor of 5 or more, the parts of it of the largest
    ``2^a`` and ``3 x 2^a`` devices (:meth:`Cluster.part`), biggest first."""
    n = cluster.num_devices
    if not constraints.idle_chips or not any(p >= 5 for p in prime_factors(n)):
        return [cluster]
    unit = cluster.gpus_per_node if cluster.platform == "gpu" else cluster.slices * cluster.devices_per_chip
    counts = {1 << (n.bit_length() - 1), 3 << max(0, (n // 3).bit_length() - 1)}
    return [cluster] + [cluster.part(k) for k in sorted(counts, reverse=True) if k < n and k % unit == 0 and k >= unit]


def _factorization(n: int) -> str:
    counts = collections.Counter(prime_factors(n))  # smallest prime first
    return " x ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in counts.items())


def _experts_whole_rules(model: tp.Any) -> tuple[tuple[str, tp.Any], ...]:
    """Rules that keep each expert weight (a parameter split over ``EP``) whole over ``fsdp`` and ``sp``: its FSDP
    entries dropped, its expert and tensor-parallel splits kept (MaxText's expert rules without ``fsdp``)."""
    def keep(entry: tp.Any) -> tp.Any:
        kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in (FSDP, SP))
        return EMPTY if not kept else kept[0] if len(kept) == 1 else kept

    out = []
    for path, var in flat_params(model):
        axes = getattr(var, "semantic_axes", None)
        entries = tuple(getattr(axes, "axes", ()) or ())
        if EP in entries:
            out.append((f"^{re.escape(path_str(path))}$",
                        DynamicShardingAxes(tuple(keep(e) for e in entries), axes.mode)))
    return tuple(out)


def _whole_experts_overflow(split: tp.Any, whole_rules: tp.Sequence[tuple[str, tp.Any]], shape: dict[str, int],
                            usable: float) -> bool:
    """Whether the parameters alone overflow ``usable`` bytes once the expert weights of the ``split`` layout (split
    over fsdp and sp too) stay whole over fsdp and sp."""
    patterns = [re.compile(pattern) for pattern, _ in whole_rules]
    ways = shape["fsdp"] * shape["sp"]
    grown = sum(p.bytes_per_device * (ways - 1) for p in split.params if any(r.search(p.path) for r in patterns))
    return split.param_bytes + grown > usable


def _pricer(config: tp.Any, cluster: tp.Any, shape: dict[str, int], batch: tuple[int, int], task: str,
            pipeline: tp.Any, kv_length: int | None, efficiency: float | None, zero: int, accumulation: int,
            batch_axes: tuple[str, ...], experts_fsdp: bool = True) -> tp.Callable[[str], tp.Any]:
    """remat policy -> :func:`predict_step` of one layout, each policy priced once."""

    @functools.cache
    def price(remat: str) -> tp.Any:
        return predict_step(config, cluster, shape, batch=batch, task=task, remat=remat, pipeline=pipeline,
                            kv_length=kv_length, efficiency=efficiency, zero_stage=zero,
                            grad_accumulation=accumulation, batch_axes=batch_axes, experts_fsdp=experts_fsdp)

    return price


def _microbatch_ledger(model: tp.Any, layout: Layout, task: str, batch: tuple[int, int], k: int, remat: str,
                       **options: tp.Any) -> tp.Any:
    """The ledger of one of ``k`` microbatches of ``batch``, with the running sum of their gradients beside its own."""
    led = ledger(model, layout, kind=task, batch=(batch[0] // k, batch[1]), remat=remat, **options)
    return dataclasses.replace(led, temporaries=led.temporaries + led.grads) if k > 1 else led


TIE = 0.01  # step times within 1 % are a tie: the ranking then prefers what a practitioner would


# What a practitioner prefers between layouts whose step times tie, in order: (the criterion, lower first; why a
# layout ranks after another that beats it on it)
_TIE_BREAKS: tuple[tuple[tp.Callable[[Candidate], float], str], ...] = (
    (lambda c: c.pipeline is not None, "a pipeline that buys nothing"),
    (lambda c: c.grad_accumulation, "gradient accumulation"),
    (lambda c: c.idle, "idle chips"),
    (lambda c: c.split_axes, "more split axes"),
    (lambda c: c.ledger.total, "less HBM left free"),
)


def _preference(c: Candidate) -> tuple:
    """Rank by step time; within :data:`TIE` of each other by :data:`_TIE_BREAKS` (:func:`tie_break` says which
    decided)."""
    return (round(math.log(c.time_s) / math.log1p(TIE)), *(key(c) for key, _ in _TIE_BREAKS))


def tie_break(c: Candidate, other: Candidate) -> str:
    """Why ``c`` ranks after ``other`` when their step times tie (within :data:`TIE`), in words; "" otherwise."""
    if abs(c.time_s / other.time_s - 1) > TIE:
        return ""
    for key, words in _TIE_BREAKS:
        if key(c) != key(other):
            return words if key(c) > key(other) else ""  # else the time decided, not this
    return ""


def _abstract_model(model_or_config: tp.Any, dtype: tp.Any) -> tp.Any:
    if isinstance(model_or_config, ModelConfig):
        return CausalLM.lazy_init(model_or_config, dtype=dtype, param_dtype=dtype)
    if not hasattr(model_or_config, "config"):
        raise TypeError(f"advise takes a model (CausalLM, live or lazy_init) or a ModelConfig; got "
                        f"{type(model_or_config).__name__}")
    return model_or_config


def advise(model_or_config: tp.Any, cluster: tp.Any, *, batch_tokens: int, seq_len: int, task: str = "train",
           optimizer: str = "adamw", remat: str | tp.Sequence[str] | None = None,
           constraints: Constraints | None = None, partition_axis: PartitionAxis | None = None,
           rules: tp.Sequence[tuple[str, tp.Any]] | None = None, confirm: int = 0, efficiency: float | None = None,
           dtype: tp.Any = None) -> Advice:
    """Rank the layouts of ``model_or_config`` on ``cluster`` for a ``task`` step (see the module doc).

    ``batch_tokens`` tokens per step in sequences of ``seq_len`` (train, prefill); for ``"decode"``,
    ``batch_tokens`` sequences each decode one token against a KV cache of ``seq_len``. ``remat``: one policy,
    several, or None (train: all three; prefill and decode have no backward). ``confirm``: compile the top
    ``confirm`` layouts (:meth:`Advice.confirm`). Each step is priced by the measured step model
    (:func:`~workbench.core.cost.predicted.predict_step`: kernels at the efficiencies real ones reach, only the
    communication nothing hides; its MFU is a prediction, with the model's spread on published runs in
    :meth:`Advice.summary`); ``efficiency`` (a float) prices with the ideal roofline at that fraction of peak instead
    (1: each MFU an upper bound). ``dtype``: of an abstract model built from a config (default bfloat16).
    """
    import jax.numpy as jnp

    start = time.perf_counter()
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}; got {task!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no chip numbers (simulated CPU devices): advise on Cluster.tpu(...), "
                         f"Cluster.h100(...) or Cluster.h200(...)")
    batch_tokens, seq_len = positive_int("batch_tokens", batch_tokens), positive_int("seq_len", seq_len)
    if task == "decode":
        batch = (batch_tokens, 1)
    elif batch_tokens % seq_len:
        raise ValueError(f"batch_tokens={batch_tokens} is not a whole number of sequences of seq_len={seq_len}")
    else:
        batch = (batch_tokens // seq_len, seq_len)
    remats = (REMATS if task == "train" else ("none",)) if remat is None else \
        (remat,) if isinstance(remat, str) else tuple(remat)
    bad = [r for r in remats if r not in REMATS]
    if bad:
        raise ValueError(f"remat policies {bad} unknown; use {REMATS}")
    constraints = constraints or Constraints()
    model = _abstract_model(model_or_config, jnp.bfloat16 if dtype is None else dtype)
    config = model.config
    pa = partition_axis or PartitionAxis()
    rules = tuple(rules or ())
    mode = MODE_DECODE if task == "decode" else MODE_TRAIN

    pruned: dict[str, int] = {}
    ranked: list[Candidate] = []
    rejected: list[Candidate] = []
    considered = 0
    kv_length = seq_len if task == "decode" else None
    remats = tuple(sorted(remats, key=REMATS.index))  # least recompute first: a search stops at the first that fits
    usable = cluster.hbm_per_device * (1 - constraints.headroom)
    layers = config.num_hidden_layers - config.first_dense_layers
    padded_models: dict[int, tp.Any] = {layers: model}
    with remembered_params():  # the same abstract models resolved on every mesh: flattened once each
        for part in _cluster_parts(cluster, constraints):
            idle = cluster.num_devices - part.num_devices
            for sizes in _mesh_shapes(part, constraints.split_physical_axes, constraints.max_split_axes):
                shape = dict(zip(MESH_AXES, sizes, strict=True))
                why = _shape_filter(shape, config, part, task, batch, constraints)
                if why is not None:
                    if why:
                        pruned[why] = pruned.get(why, 0) + 1
                    continue
                batch_axes = ("fsdp", "dp", "ep") if _tokens_over_ep(shape) else ("fsdp", "dp")
                data = math.prod(shape[a] for a in batch_axes)
                pipelines = _pipeline_configs(shape["pp"], batch[0] // data, layers) if shape["pp"] > 1 else [None]
                shape_pa = _batch_partition_axis(pipeline_partition_axis(pa) if shape["pp"] > 1 else pa, shape)
                layouts: dict[tuple, tp.Any] = {}  # (stacked depth, experts FSDP-sharded) -> the layout held to HBM
                # with ep and fsdp, the experts either split over fsdp too (gathered like every weight) or stay whole
                whole = _experts_whole_rules(model) if shape["ep"] > 1 and shape["fsdp"] * shape["sp"] > 1 else ()
                expert_choices = ((True, rules), (False, rules + whole)) if whole else ((True, rules),)
                zeros = (0, 1) if constraints.zero and task == "train" and shape["dp"] > 1 else (0,)
                for pipeline, zero, (experts_fsdp, shape_rules) in itertools.product(pipelines, zeros, expert_choices):
                    # uneven stages are held against HBM as the deepest stage, times pp
                    depth = layers if pipeline is None or not pipeline.uneven else \
                        pipeline.stage_layers(layers) * pipeline.total_stages
                    if depth not in padded_models:
                        total = depth + config.first_dense_layers
                        kinds = config.layer_types  # the layer pattern carried on over the padded layers
                        padded = config.replace(num_hidden_layers=total, layer_types=None if kinds is None else
                                                tuple(kinds[i % len(kinds)] for i in range(total)))
                        padded_models[depth] = _abstract_model(padded, getattr(model, "dtype", None) or jnp.bfloat16)
                    if not experts_fsdp and _whole_experts_overflow(layouts[depth, True], whole, shape, usable):
                        continue  # the experts' weights alone, whole over fsdp, overflow HBM: no need to resolve it
                    if (depth, experts_fsdp) not in layouts:
                        layouts[depth, experts_fsdp] = Layout.of(padded_models[depth], _mesh(shape), shape_pa,
                                                                 shape_rules, mode)
                    layout = layouts[depth, experts_fsdp]
                    accumulations = [k for k in constraints.grad_accumulation if (batch[0] // data) % k == 0] \
                        if task == "train" and pipeline is None else [1]
                    held = functools.partial(_microbatch_ledger, padded_models[depth], layout, task, batch,
                                             optimizer=optimizer, cluster=part, pipeline=pipeline,
                                             kv_length=kv_length, zero_stage=zero)
                    candidate = functools.partial(Candidate, shape, pipeline=pipeline, partition_axis=shape_pa,
                                                  rules=shape_rules, zero_stage=zero, cluster=part if idle else None,
                                                  idle=idle, experts_fsdp=experts_fsdp)
                    price_at = functools.partial(_pricer, config, part, shape, batch, task, pipeline, kv_length,
                                                 efficiency, zero, batch_axes=batch_axes, experts_fsdp=experts_fsdp)
                    k_most, frugal = max(accumulations), remats[-1]  # the least memory this layout can take
                    if k_most > 1 or len(remats) > 1:
                        led = held(k_most, frugal)
                        if led.total > usable:  # not even so: that one, rejected, says by how much
                            considered += 1
                            rejected.append(candidate(remat=frugal, ledger=led, price=price_at(k_most), fits=False,
                                                      grad_accumulation=k_most))
                            continue
                    fitted_at = None  # the first accumulation that fits; one more is tried if only remat did
                    for k in sorted(accumulations):
                        if fitted_at is not None and (fitted_at[1] == "none" or k > 2 * fitted_at[0]):
                            break  # fits without recompute, or one doubling past the first fit: more only slows it
                        price = price_at(k)
                        for r in remats:
                            considered += 1
                            led = held(k, r)
                            fits = led.total <= usable
                            (ranked if fits else rejected).append(candidate(remat=r, ledger=led, price=price, fits=fits,
                                                                             grad_accumulation=k))
                            if led.params + led.grads + led.optimizer + led.kv_cache > usable:
                                fitted_at = (0, "none")  # the state alone overflows: no remat or microbatching helps
                                break
                            if fits:
                                fitted_at = fitted_at or (k, r)
                                if r == "none":
                                    fitted_at = (k, r)
                                break  # more recompute only slows a layout that fits
    ranked.sort(key=_preference)
    rejected.sort(key=lambda c: c.ledger.total)
    advice = Advice(model, cluster, task, batch if task != "decode" else (batch[0], seq_len), optimizer, ranked,
                    rejected, considered, pruned, 0.0)
    _explain(advice, constraints)
    advice.seconds = time.perf_counter() - start
    if confirm:
        advice.confirm(confirm)
    return advice


# -- reasons ------------------------------------------------------------------------------------------------------
_PART_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
               "activations": "activations", "kv_cache": "KV cache", "temporaries": "temporaries"}


def _explain(advice: Advice, constraints: Constraints) -> None:
    """Fill in each candidate's reason (see :func:`reason`)."""
    fits_by_shape: dict[tuple, list[Candidate]] = {}
    for c in advice.ranked:
        fits_by_shape.setdefault(tuple(c.mesh_shape.values()), []).append(c)
    best = advice.ranked[0] if advice.ranked else None
    for i, c in enumerate(advice.ranked):
        c.reason = reason(c, advice.cluster, best=best, batch=advice.batch, task=advice.task,
                          previous=advice.ranked[i - 1] if i else None,
                          config=getattr(advice.model, "config", None))
    for c in advice.rejected:
        # the fastest fitting layout of the same mesh, with this schedule if one fits, else this remat policy
        rescued = sorted(fits_by_shape.get(tuple(c.mesh_shape.values()), []),
                         key=lambda f: (f.pipeline is None or c.pipeline is None
                                        or f.pipeline.schedule != c.pipeline.schedule, f.remat != c.remat,
                                        f.zero_stage == c.zero_stage))
        c.reason = reason(c, advice.cluster, rescued_by=rescued[0] if rescued else None,
                          headroom=constraints.headroom)


def reason(c: Candidate, cluster: tp.Any, *, best: Candidate | None = None, rescued_by: Candidate | None = None,
           batch: tuple[int, int] | None = None, task: str = "train", headroom: float = 0.0,
           previous: Candidate | None = None, config: tp.Any = None) -> str:
    """Why ``c`` ranks where it does, in words, each with the number that decides it: what it does not fit by (and
    which remat would fit), or what bounds its step (the largest collective on its network level, a
    tensor-parallel group across nodes, too few tokens per chip to hide FSDP's gathers, a pipeline bubble), the
    chips it leaves idle and why (with ``config``: which of the sequences, heads and layers the idle-making
    factors do not divide), how far it is from the best, and what broke a tie with the layout ranked before it
    (``previous``)."""
    hbm = cluster.hbm_per_device
    if not c.fits:
        parts = c.ledger.parts()
        big = max(parts, key=parts.get)
        text = (f"does not fit: {_gib(c.ledger.total)} > {_gib(hbm * (1 - headroom))} usable HBM "
                f"({_PART_NAMES.get(big, big)} {_gib(parts[big])})")
        if rescued_by is not None:
            change = [f"remat {rescued_by.remat}"] if rescued_by.remat != c.remat else []
            if rescued_by.pipeline != c.pipeline and rescued_by.pipeline is not None:
                pl = rescued_by.pipeline
                same_schedule = c.pipeline is not None and pl.schedule == c.pipeline.schedule
                change.append(f"{pl.num_microbatches} microbatches" if same_schedule else
                              f"{pl.schedule} m={pl.num_microbatches}")
            if rescued_by.zero_stage != c.zero_stage:
                change.append(f"ZeRO-{rescued_by.zero_stage}" if rescued_by.zero_stage else "no ZeRO")
            text += f"; with {' and '.join(change)} it fits ({_gib(rescued_by.ledger.total)})"
        return text
    st = c.step
    words: list[str] = []
    groups = st.rows()
    if st.bound == "communication" and groups:
        kind, axes, level, _, _, _, seconds = groups[0]
        words.append(f"{kind}s over {','.join(axes)} on {level}: {format_seconds(seconds)} of "
                     f"{format_seconds(st.time_s)}")
    else:
        words.append(f"{st.bound}-bound ({format_seconds(max(st.compute_s, st.memory_s))} of "
                     f"{format_seconds(st.time_s)})")

    tp_size = c.mesh_shape.get("tp", 1)
    if tp_size > 1 and cluster.platform == "gpu" and span(("tp",), c.mesh_shape, cluster).units > 1:
        tp_comm = sum(x.total_s for x in st.collectives if "tp" in x.axes)
        words.append(f"tp={tp_size} crosses nodes: its collectives run on the inter-node network, "
                     f"{format_seconds(tp_comm)} of {format_seconds(st.time_s)}")
    fsdp = c.mesh_shape.get("fsdp", 1)
    fsdp_comm = sum(x.total_s for x in st.collectives if "fsdp" in x.axes)
    if fsdp > 1 and batch is not None and task == "train" and st.compute_s and fsdp_comm > st.compute_s:
        devices = math.prod(c.mesh_shape.values())
        per_chip = batch[0] * batch[1] / devices
        needed = per_chip * fsdp_comm / st.compute_s
        axes = [a for a in ("fsdp", "sp") if c.mesh_shape.get(a, 1) > 1]
        words.append(f"{per_chip:,.0f} tokens per chip < {needed:,.0f} needed to hide FSDP's all-gathers over "
                     f"{' x '.join(f'{a}={c.mesh_shape[a]}' for a in axes)}")
    if c.idle:
        n = cluster.num_devices
        odd = sorted({p for p in prime_factors(n) if p >= 5})
        text = f"runs on {n - c.idle:,} of the {n:,} devices ({c.idle:,} idle): {n:,} = {_factorization(n)}"
        counts = [(f"{batch[0]:,} sequences", batch[0])] if batch is not None else []
        if config is not None:
            counts += [(f"{config.num_attention_heads} heads", config.num_attention_heads),
                       (f"{config.num_hidden_layers} layers", config.num_hidden_layers)]
        undivided = [name for name, count in counts if all(count % p for p in odd)]
        if undivided:
            text += (f", and {' and '.join(map(str, odd))} divide{'s' if len(odd) == 1 else ''} neither "
                     + " nor ".join(undivided))
        words.append(text)
    if c.grad_accumulation > 1:
        rows = f" of {batch[0] // c.grad_accumulation} sequences" if batch else ""
        words.append(f"{c.grad_accumulation} microbatches{rows} one after another, their gradients summed")
    if c.recompute_s > 0.01 * st.compute_s:
        words.append(f"remat {c.remat} recomputes the forward: {format_seconds(c.recompute_s)} of compute more")
    bubble = getattr(st, "bubble_fraction", 0.0) or 0.0
    if c.pipeline is not None and bubble:
        words.append(f"pipeline bubble {bubble:.0%} (p={c.pipeline.num_stages}, m={c.pipeline.num_microbatches})")
    if best is not None and c is not best:
        words.append(f"{c.time_s / best.time_s:.2f}x the best")
        why_after = tie_break(c, previous) if previous is not None else ""
        if why_after:
            words.append(f"ties with the row above (within {TIE:.0%}), ranked after it for {why_after}")
    elif best is c:
        words.append("the fastest that fits")
    if hbm is not None:
        words.append(f"uses {c.ledger.total / hbm:.0%} of HBM")
    return "; ".join(words)


__all__ = ["Advice", "Candidate", "Constraints", "advise", "reason"]
