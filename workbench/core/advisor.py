"""The layout advisor: every sensible way to lay a model on a cluster, ranked with reasons, confirmed by the compiler.

:func:`advise` enumerates mesh shapes of the cluster's devices over the workbench's axes ``(pp, dp, fsdp, ep, tp,
sp)`` (only those the cluster can hold: :meth:`Cluster.valid_mesh_shapes`), with the remat policies, for ``pp > 1``
the pipelines (1F1B and interleaved, ``m = p, 2p, 4p`` microbatches), and for a train step on ``dp > 1`` ZeRO-1
(the optimizer state split over ``dp``, :mod:`workbench.core.sharding.zero`), and drops what makes no sense for
this model and batch (a split that does not divide the heads, the experts, the layers or the batch; ``tp``
across GPU nodes unless allowed; more than ``max_split_axes`` split axes). Each remaining layout is resolved (the
parameters' PartitionSpecs, :class:`~workbench.core.sharding.plan.Layout`), held against the chip's HBM by the memory
ledger (:func:`~workbench.core.cost.ledger.ledger`), and timed by the analytic step model
(:func:`~workbench.core.cost.predicted.predict_step`): nothing is compiled. Layouts that fit are ranked by predicted
step time, each with the reason it wins or loses in words; :meth:`Advice.confirm` compiles the top few on the
virtual cluster (:func:`~workbench.core.compile.virtual.compile_step`) and puts the compiler's memory and collectives
beside the prediction, demoting a layout whose compiled memory does not fit.

ZeRO's stages: ``dp`` alone is stage 0, ``zero_stage=1`` on ``dp`` is stage 1 (and holds stage 2's split
gradients in a jitted step), ``fsdp`` is stage 3. Gradient accumulation is not enumerated.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import math
import time
import typing as tp

from workbench.core.axes import MODE_DECODE, MODE_TRAIN, PartitionAxis
from workbench.core.compile.steps import OPTIMIZERS
from workbench.core.compile.virtual import cluster_mesh, compile_step
from workbench.core.cost.ledger import REMATS, TASKS, ledger, libtpu_version, zero_parameter_copy_bytes
from workbench.core.cost.network import span
from workbench.core.cost.predicted import predict_step
from workbench.core.cost.published import accuracy_text
from workbench.core.cost.step_time import step_time
from workbench.core.mesh import MESH_AXES
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.pipeline import pipeline_partition_axis
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.sharding.plan import Layout
from workbench.core.tables import html_table
from workbench.core.units import format_bytes, format_seconds

_gib = functools.partial(format_bytes, unit="GiB")  # figures to compare, all in GiB


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What the advisor may choose. ``fixed``: axis sizes every layout keeps (``{"tp": 8}``);
    ``tp_across_nodes``: let ``tp`` (and ``sp``) groups span GPU nodes (their all-reduces then run on the
    inter-node network); ``max_split_axes``: mesh axes of size > 1 at most; ``pipeline``: consider ``pp > 1``
    (train steps); ``zero``: consider ZeRO-1 on ``dp > 1`` (train steps); ``headroom``: the fraction of HBM a
    layout must leave free to count as fitting."""

    fixed: tp.Mapping[str, int] = dataclasses.field(default_factory=dict)
    tp_across_nodes: bool = False
    max_split_axes: int = 3
    pipeline: bool = True
    zero: bool = True
    headroom: float = 0.10

    def __post_init__(self):
        unknown = sorted(set(self.fixed) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"Constraints.fixed names {unknown}; the mesh axes are {MESH_AXES}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"Constraints.headroom is a fraction of HBM in [0, 1); got {self.headroom!r}")
        if isinstance(self.max_split_axes, bool) or not isinstance(self.max_split_axes, int) \
                or not 1 <= self.max_split_axes <= len(MESH_AXES):
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
    step: tp.Any
    fits: bool
    zero_stage: int = 0
    reason: str = ""
    recompute_s: float = 0.0  # compute seconds the remat policy adds to the step
    compiled: tp.Any = None  # virtual.CompiledAnalysis after confirm
    compiled_step: tp.Any = None  # cost.StepTime of the compiled program
    confirm_note: str = ""

    @property
    def mesh_label(self) -> str:
        parts = [f"{a}={n}" for a, n in self.mesh_shape.items() if n > 1]
        return " × ".join(parts) or "one device"

    @property
    def label(self) -> str:
        pl = self.pipeline
        pipe = "" if pl is None else f", {pl.schedule}{f' v={pl.virtual_stages}' if pl.virtual_stages > 1 else ''} " \
            f"m={pl.num_microbatches}"
        return f"{self.mesh_label}, remat {self.remat}{pipe}" + (", ZeRO-1" if self.zero_stage else "")

    @property
    def time_s(self) -> float:
        return self.step.time_s

    @property
    def split_axes(self) -> int:
        return sum(n > 1 for n in self.mesh_shape.values())

    def layout(self, model: tp.Any, cluster: tp.Any = None) -> tp.Any:
        """This layout resolved on ``model`` (on ``cluster_mesh(cluster, ...)`` with a cluster, else an
        ``AbstractMesh``), carrying its remat policy and pipeline."""
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
                f"{_gib(smallest.ledger.total)} per device ({smallest.reason}). Fewer tokens per step (the "
                f"advisor does not model gradient accumulation) or more chips would.")

    def confirm(self, k: int = 3, *, progress: tp.Callable[[str], None] | None = None) -> list[Candidate]:
        """Compile the top ``k`` on the virtual cluster (:meth:`confirm_one` each)."""
        return [self.confirm_one(c, progress=progress) for c in list(self.ranked[:k])]

    def confirm_one(self, c: Candidate, *, progress: tp.Callable[[str], None] | None = None) -> Candidate:
        """Compile ``c`` on the virtual cluster: the compiled memory and step time go beside the prediction; on a
        TPU slice (XLA's TPU compiler), if its compiled memory exceeds the HBM it moves from ``ranked`` to
        ``rejected`` with that reason. A GPU cluster's program is XLA:CPU's (in the worker), whose memory is not
        a GPU's: it is shown, not held against the HBM."""
        if progress is not None:
            progress(f"compiling {c.label} for {self.cluster.name}")
        if c.pipeline is not None and self.cluster.platform != "tpu":
            c.confirm_note = ("not compiled: a pipelined step compiles for TPU clusters only (XLA:CPU aborts on the "
                              "exported pipeline the GPU worker receives)")
            return c
        model = self.model.with_options(remat=c.remat) if hasattr(self.model, "with_options") else self.model
        kind = "train" if self.task == "train" else "forward"
        batch = self.batch if self.task != "decode" else (self.batch[0], 1)
        c.compiled = compile_step(model, self.cluster, c.mesh_shape, kind=kind, batch=batch,
                                  optimizer=self.optimizer, partition_axis=c.partition_axis, rules=c.rules or None,
                                  pipeline=c.pipeline, zero_stage=c.zero_stage)
        # a decode step compiles as a one-token forward without a cache: not the predicted step's model FLOPs
        c.compiled_step = step_time(c.compiled, efficiency=c.step.efficiency,
                                    model_flops=None if self.task == "decode" else c.step.model_flops)
        total, hbm = c.compiled.memory.total, self.cluster.hbm_per_device
        here = self._ledger_total_compiled_here(c, model)
        c.confirm_note = (f"compiled: {_gib(total, decimals=2)} per device (ledger {here / total - 1:+.1%}"
                          + ("" if here == c.ledger.total else
                             f" for the libtpu {'.'.join(map(str, libtpu_version()))} that compiled it") + "), "
                          f"step {c.compiled_step.time_s * 1e3:.3g} ms from the compiled program"
                          + ("" if kind == "train" else " (compiled as a forward pass without a cache)"))
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
        out = []
        for i, c in enumerate(self.ranked[:top], 1):
            use = "-" if hbm is None else f"{c.ledger.total / hbm:.0%}"
            out.append((str(i), c.label, f"{_gib(c.ledger.total)}", use, _ms(c.time_s),
                        f"{tokens / c.time_s:,.0f}", c.step.mfu_text(), c.step.bound, c.reason))
        return out

    def table(self, top: int = 10) -> str:
        head = ("#", "layout", "memory/device", "of HBM", "step", "tokens/s", "MFU", "bound by", "why")
        rows = [head, *self.rows(top)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
        return "\n".join([self.summary(), *lines])

    def summary(self) -> str:
        pruned = ", ".join(f"{n} {why}" for why, n in self.pruned.items() if n)
        steps = [c.step for c in (self.ranked or self.rejected)[:1]]
        how = ""
        if steps and steps[0].measured_model:
            how = f". Step times and MFU are predictions: {accuracy_text()}"
        elif steps and steps[0].ideal:
            how = ". Step times are the ideal roofline (matmuls at peak): MFU marked ≤ is an upper bound"
        return (f"{self.task} of {self._model_name()} on {self.cluster.name}, batch {self.batch[0]} x {self.batch[1]}: "
                f"{self.considered} layouts predicted in {self.seconds:.2f} s, {len(self.ranked)} fit"
                + (f" (pruned before: {pruned})" if pruned else "") + how)

    def _model_name(self) -> str:
        return getattr(getattr(self.model, "config", None), "model_type", type(self.model).__name__)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, top: int = 10) -> str:
        """:meth:`table` as an HTML table: the summary line, then the top ``top`` layouts."""
        head = ("#", "layout", "memory/device", "of HBM", "step", "tokens/s", "MFU", "bound by", "why")
        return (f'<div class="wb-advice" style="font-size:12px"><div>{html.escape(self.summary())}</div>'
                f"{html_table(self.rows(top), header=head)}</div>")


# -- enumeration ------------------------------------------------------------------------------------------------
def _mesh(mesh_shape: tp.Mapping[str, int], cluster: tp.Any = None) -> tp.Any:
    from jax.sharding import AbstractMesh, AxisType

    shape = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    if cluster is not None:
        return cluster_mesh(cluster, shape, MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape))


MICROBATCHES_PER_STAGE = (1, 2, 4)  # m = p, 2p, 4p: the bubble (p - 1) / (v m + p - 1) at 50 %, 33 %, 20 % (v = 1)


def _pipeline_configs(p: int, rows_per_shard: int, num_layers: int) -> list[tp.Any]:
    """The pipelines a ``pp = p`` layout may run: 1F1B and interleaved (two stages per device) with ``m = p, 2p,
    4p`` microbatches where ``m`` divides a data shard's rows (and ``2 p`` the layers, for interleaved). GPipe is
    left out: the same bubble as 1F1B with ``m`` microbatches stashed instead of ``p``."""
    configs = []
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        if num_layers % (p * v):
            continue
        configs += [PipelineConfig(p, k * p, schedule, v) for k in MICROBATCHES_PER_STAGE
                    if rows_per_shard % (k * p) == 0]
    return configs


def _shape_filter(shape: dict[str, int], config: tp.Any, cluster: tp.Any, task: str, batch: tuple[int, int],
                  constraints: Constraints) -> str | None:
    """Why a mesh shape makes no sense for this model and batch (a key of ``Advice.pruned``), or None."""
    if sum(n > 1 for n in shape.values()) > constraints.max_split_axes:
        return "with too many split axes"
    if any(shape[a] != n for a, n in constraints.fixed.items()):
        return "not of the fixed sizes"
    b, t = batch
    ep, tp_, sp, pp = shape["ep"], shape["tp"], shape["sp"], shape["pp"]
    experts = config.num_local_experts
    if ep > 1 and (not experts or experts % ep):
        return "with ep not dividing the experts"
    if tp_ > 1 and (config.num_attention_heads % tp_ or config.intermediate_size % tp_):
        return "with tp not dividing the heads"
    if sp > 1 and (task == "decode" or t % sp or t // sp < 512):
        return "with sp where the sequence is short"
    if pp > 1:
        layers = config.num_hidden_layers - config.first_dense_layers
        if task != "train" or not constraints.pipeline or layers % pp:
            return "with pp not fitting the layers or task"
    data = shape["dp"] * shape["fsdp"]
    if b % data:
        return "with the batch not dividing over dp x fsdp"
    if pp > 1 and not _pipeline_configs(pp, b // data, config.num_hidden_layers - config.first_dense_layers):
        return "with pp not fitting the layers or task"
    if cluster.platform == "gpu" and not constraints.tp_across_nodes and tp_ * sp > 1:
        inner = tp_ * sp  # tp and sp are the mesh's innermost axes: consecutive GPUs
        if cluster.gpus_per_node % inner:
            return "with tp across nodes"
    return None


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
    for name, value in (("batch_tokens", batch_tokens), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
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
    step_batch = (batch[0], batch[1]) if task != "decode" else (batch[0], 1)

    pruned: dict[str, int] = {}
    ranked: list[Candidate] = []
    rejected: list[Candidate] = []
    considered = 0
    for sizes in cluster.valid_mesh_shapes(len(MESH_AXES)):
        shape = dict(zip(MESH_AXES, sizes, strict=True))
        why = _shape_filter(shape, config, cluster, task, step_batch, constraints)
        if why is not None:
            pruned[why] = pruned.get(why, 0) + 1
            continue
        data = shape["dp"] * shape["fsdp"]
        pipelines = _pipeline_configs(shape["pp"], step_batch[0] // data, config.num_hidden_layers
                                      - config.first_dense_layers) if shape["pp"] > 1 else [None]
        shape_pa = pipeline_partition_axis(pa) if shape["pp"] > 1 else pa
        layout = Layout.of(model, _mesh(shape), shape_pa, rules, mode)
        kv_length = seq_len if task == "decode" else None
        zeros = (0, 1) if constraints.zero and task == "train" and shape["dp"] > 1 else (0,)
        no_remat: dict[tuple, tp.Any] = {}  # (pipeline, zero) -> the step without recompute
        for pipeline, r, zero in sorted(itertools.product(pipelines, remats, zeros), key=lambda k: k[1] != "none"):
            considered += 1
            led = ledger(model, layout, kind=task, batch=step_batch, optimizer=optimizer, remat=r, cluster=cluster,
                         pipeline=pipeline, kv_length=kv_length, zero_stage=zero)
            step = predict_step(config, cluster, shape, batch=step_batch, task=task, remat=r, pipeline=pipeline,
                                kv_length=kv_length, efficiency=efficiency, zero_stage=zero)
            fits = led.total <= cluster.hbm_per_device * (1 - constraints.headroom)
            c = Candidate(shape, r, pipeline, shape_pa, rules, led, step, fits, zero)
            if r == "none" or task != "train":
                no_remat[pipeline, zero] = step
            elif (pipeline, zero) not in no_remat:
                no_remat[pipeline, zero] = predict_step(config, cluster, shape, batch=step_batch, task=task,
                                                        remat="none", pipeline=pipeline, kv_length=kv_length,
                                                        efficiency=efficiency, zero_stage=zero)
            c.recompute_s = step.compute_s - no_remat[pipeline, zero].compute_s
            (ranked if fits else rejected).append(c)
    # equal times (compute-bound layouts often tie): fewer split axes, then less memory
    ranked.sort(key=lambda c: (float(f"{c.time_s:.4g}"), c.split_axes, c.ledger.total))
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


def _ms(seconds: float) -> str:
    return format_seconds(seconds)


def _explain(advice: Advice, constraints: Constraints) -> None:
    """Fill in each candidate's reason (see :func:`reason`)."""
    fits_by_shape: dict[tuple, list[Candidate]] = {}
    for c in advice.ranked:
        fits_by_shape.setdefault(tuple(c.mesh_shape.values()), []).append(c)
    best = advice.ranked[0] if advice.ranked else None
    for c in advice.ranked:
        c.reason = reason(c, advice.cluster, best=best, batch=advice.batch, task=advice.task)
    for c in advice.rejected:
        # the fastest fitting layout of the same mesh, with this schedule if one fits, else this remat policy
        rescued = sorted(fits_by_shape.get(tuple(c.mesh_shape.values()), []),
                         key=lambda f: (f.pipeline is None or c.pipeline is None
                                        or f.pipeline.schedule != c.pipeline.schedule, f.remat != c.remat,
                                        f.zero_stage == c.zero_stage))
        c.reason = reason(c, advice.cluster, rescued_by=rescued[0] if rescued else None,
                          headroom=constraints.headroom)


def reason(c: Candidate, cluster: tp.Any, *, best: Candidate | None = None, rescued_by: Candidate | None = None,
           batch: tuple[int, int] | None = None, task: str = "train", headroom: float = 0.0) -> str:
    """Why ``c`` ranks where it does, in words: what it does not fit by (and which remat would fit), or what
    bounds its step (the largest collective on its network level, a tensor-parallel group across nodes, too
    few tokens per chip to hide FSDP's gathers, a pipeline bubble) and how far it is from the best."""
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
        words.append(f"{kind}s over {','.join(axes)} on {level}: {_ms(seconds)} of {_ms(st.time_s)}")
    else:
        words.append(f"{st.bound}-bound ({_ms(max(st.compute_s, st.memory_s))} of {_ms(st.time_s)})")

    tp_size = c.mesh_shape.get("tp", 1)
    if tp_size > 1 and cluster.platform == "gpu" and span(("tp",), c.mesh_shape, cluster).units > 1:
        tp_comm = sum(x.total_s for x in st.collectives if "tp" in x.axes)
        words.append(f"tp={tp_size} crosses nodes: its collectives run on the inter-node network, "
                     f"{_ms(tp_comm)} of {_ms(st.time_s)}")
    fsdp = c.mesh_shape.get("fsdp", 1)
    fsdp_comm = sum(x.total_s for x in st.collectives if "fsdp" in x.axes)
    if fsdp > 1 and batch is not None and task == "train" and st.compute_s and fsdp_comm > st.compute_s:
        devices = math.prod(c.mesh_shape.values())
        per_chip = batch[0] * batch[1] / devices
        needed = per_chip * fsdp_comm / st.compute_s
        words.append(f"{per_chip:,.0f} tokens per chip is below the {needed:,.0f} needed to hide FSDP's "
                     f"all-gathers")
    if c.recompute_s > 0.01 * st.compute_s:
        words.append(f"remat {c.remat} recomputes the forward: {_ms(c.recompute_s)} of compute more")
    bubble = getattr(st, "bubble_fraction", 0.0) or 0.0
    if c.pipeline is not None and bubble:
        words.append(f"pipeline bubble {bubble:.0%} (p={c.pipeline.num_stages}, m={c.pipeline.num_microbatches})")
    if best is not None and c is not best:
        words.append(f"{c.time_s / best.time_s:.2f}x the best")
    elif best is c:
        words.append("the fastest that fits")
    if hbm is not None:
        words.append(f"uses {c.ledger.total / hbm:.0%} of HBM")
    return "; ".join(words)


__all__ = ["Advice", "Candidate", "Constraints", "advise", "reason"]
