"""The search behind :func:`advise`, as named steps: check the request, walk the mesh shapes the constraints leave
(:func:`_shapes`, each pruned one counted by reason), lay each shape out every way it can run (:func:`_layouts`:
pipelines x ZeRO stages x expert placements), hold each layout against the HBM over gradient accumulations and
remat policies (:func:`_held`), then rank (:mod:`~workbench.core.advisor.rank`), explain
(:mod:`~workbench.core.advisor.reasons`) and, if asked, confirm with the compiler
(:mod:`~workbench.core.advisor.confirm`)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import time
import typing as tp

from workbench.core.advisor.advice import Advice
from workbench.core.advisor.candidate import Candidate, layout_mesh
from workbench.core.advisor.constraints import (
    Constraints,
    batch_partition_axis,
    cluster_parts,
    mesh_shapes,
    pipeline_configs,
    pruned_why,
    tokens_over_ep,
)
from workbench.core.advisor.rank import pricer, ranked_and_rejected
from workbench.core.advisor.reasons import explain
from workbench.core.advisor.regimes import standing
from workbench.core.axes import EMPTY, EP, FSDP, MODE_DECODE, MODE_TRAIN, SP, DynamicShardingAxes, PartitionAxis
from workbench.core.checks import one_of, positive_int
from workbench.core.cost.ledger import ledger
from workbench.core.cost.price import price
from workbench.core.mesh import MESH_AXES
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.sharding import flat_params, path_str, remembered_params
from workbench.core.pipeline import pipeline_partition_axis, stage_padded
from workbench.core.plan import Plan
from workbench.core.sharding.plan import Layout
from workbench.core.vocab import OPTIMIZERS, REMATS, TASKS


def advise(model_or_config: tp.Any, cluster: tp.Any, *, batch_tokens: int, seq_len: int, task: str = "train",
           optimizer: str = "adamw", remat: str | tp.Sequence[str] | None = None,
           constraints: Constraints | None = None, partition_axis: PartitionAxis | None = None,
           rules: tp.Sequence[tuple[str, tp.Any]] | None = None, confirm: int = 0, efficiency: float | None = None,
           dtype: tp.Any = None) -> Advice:
    """Rank the layouts of ``model_or_config`` on ``cluster`` for a ``task`` step (see
    :mod:`workbench.core.advisor`).

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
    _check_choices(task, optimizer, cluster)
    batch, seq_len = _step_batch(task, batch_tokens, seq_len)
    rq = _Request(cluster=cluster, task=task, batch=batch, seq_len=seq_len, optimizer=optimizer,
                  remats=_remat_policies(task, remat), constraints=constraints or Constraints(),
                  model=_abstract_model(model_or_config, jnp.bfloat16 if dtype is None else dtype),
                  partition_axis=partition_axis or PartitionAxis(), rules=tuple(rules or ()), efficiency=efficiency)
    pruned: dict[str, int] = {}
    with remembered_params():  # the same abstract models resolved on every mesh: flattened once each
        candidates = [c for part, shape in _shapes(rq, pruned) for c in _layouts(rq, part, shape)]
    if rq.task == "train" and efficiency is None and rq.constraints.ranking == "evidence":
        _stand(rq, candidates)
    ranked, rejected = ranked_and_rejected(candidates)
    advice = Advice(rq.model, cluster, task, batch if task != "decode" else (batch[0], seq_len), optimizer, ranked,
                    rejected, len(candidates), pruned, 0.0)
    explain(advice, rq.constraints)
    advice.seconds = time.perf_counter() - start
    if confirm:
        advice.confirm(confirm)
    return advice


# -- the request ------------------------------------------------------------------------------------------------
def _check_choices(task: str, optimizer: str, cluster: tp.Any) -> None:
    """A ValueError naming the choices where the task or optimizer is unknown or the cluster has no chip numbers."""
    one_of("task", task, TASKS)
    one_of("optimizer", optimizer, OPTIMIZERS)
    if cluster.chip is None:
        raise ValueError(f"{cluster.name} has no chip numbers (simulated CPU devices): advise on Cluster.tpu(...), "
                         f"Cluster.h100(...) or Cluster.h200(...)")


def _step_batch(task: str, batch_tokens: int, seq_len: int) -> tuple[tuple[int, int], int]:
    """The ``(sequences, tokens each)`` one step holds (a decode step's: one token each), and ``seq_len`` checked."""
    batch_tokens, seq_len = positive_int("batch_tokens", batch_tokens), positive_int("seq_len", seq_len)
    if task == "decode":
        return (batch_tokens, 1), seq_len
    if batch_tokens % seq_len:
        raise ValueError(f"batch_tokens={batch_tokens} is not a whole number of sequences of seq_len={seq_len}")
    return (batch_tokens // seq_len, seq_len), seq_len


def _remat_policies(task: str, remat: str | tp.Sequence[str] | None) -> tuple[str, ...]:
    """The remat policies to try, least recompute first: a search stops at the first that fits."""
    remats = (REMATS if task == "train" else ("none",)) if remat is None else \
        (remat,) if isinstance(remat, str) else tuple(remat)
    bad = [r for r in remats if r not in REMATS]
    if bad:
        raise ValueError(f"remat policies {bad} unknown; use {REMATS}")
    return tuple(sorted(remats, key=REMATS.index))


def _abstract_model(model_or_config: tp.Any, dtype: tp.Any) -> tp.Any:
    if isinstance(model_or_config, ModelConfig):
        return CausalLM.lazy_init(model_or_config, dtype=dtype, param_dtype=dtype)
    if not hasattr(model_or_config, "config"):
        raise TypeError(f"advise takes a model (CausalLM, live or lazy_init) or a ModelConfig; got "
                        f"{type(model_or_config).__name__}")
    return model_or_config


@dataclasses.dataclass
class _Request:
    """One :func:`advise` call, checked: what every layout of its search shares."""

    cluster: tp.Any
    task: str
    batch: tuple[int, int]  # (sequences, tokens each) of one step: a decode step's are (sequences, 1)
    seq_len: int  # a decode step's KV cache
    optimizer: str
    remats: tuple[str, ...]  # least recompute first
    constraints: Constraints
    model: tp.Any  # abstract, or the model given
    partition_axis: PartitionAxis
    rules: tuple[tuple[str, tp.Any], ...]
    efficiency: float | None
    config: tp.Any = dataclasses.field(init=False)
    layers: int = dataclasses.field(init=False)  # the stacked layers (those a pipeline splits)
    mode: str = dataclasses.field(init=False)
    kv_length: int | None = dataclasses.field(init=False)
    usable: float = dataclasses.field(init=False)  # bytes of HBM a layout may take
    program: dict[str, tp.Any] = dataclasses.field(init=False)  # attention kernel, vocab tiles, offload

    def __post_init__(self):
        self.config = self.model.config
        self.layers = self.config.num_hidden_layers - self.config.first_dense_layers
        self.mode = MODE_DECODE if self.task == "decode" else MODE_TRAIN
        self.kv_length = self.seq_len if self.task == "decode" else None
        self.usable = self.cluster.hbm_per_device * (1 - self.constraints.headroom)
        # offload moves a train step's saved activations; prefill and decode save none
        self.program = {**self.constraints.program(), **({} if self.task == "train" else {"offload": False})}


# -- enumerate and hold to HBM ----------------------------------------------------------------------------------
def _shapes(rq: _Request, pruned: dict[str, int]) -> tp.Iterator[tuple[tp.Any, dict[str, int]]]:
    """The mesh shapes worth a ledger, each with the part of the cluster it runs on: on each part
    (:func:`cluster_parts`) its mesh shapes (:func:`mesh_shapes`), less those :func:`pruned_why` drops, each of those
    counted in ``pruned`` under its reason."""
    c = rq.constraints
    for part in cluster_parts(rq.cluster, c):
        for sizes in mesh_shapes(part, c.split_physical_axes, c.max_split_axes):
            shape = dict(zip(MESH_AXES, sizes, strict=True))
            why = pruned_why(shape, rq.config, part, rq.task, rq.batch, c)
            if why is None:
                yield part, shape
            elif why:
                pruned[why] = pruned.get(why, 0) + 1


def _layouts(rq: _Request, part: tp.Any, shape: dict[str, int]) -> tp.Iterator[Candidate]:
    """Every way to run one mesh shape on ``part``: its pipelines x ZeRO stages x the experts split over fsdp or
    whole over it, each held against the HBM over accumulations and remat policies (:func:`_held`)."""
    idle = rq.cluster.num_devices - part.num_devices
    batch_axes = ("fsdp", "dp", "ep") if tokens_over_ep(shape) else ("fsdp", "dp")
    rows = rq.batch[0] // math.prod(shape[a] for a in batch_axes)  # sequences per data shard
    pipelines = _pipelines(rq, shape["pp"], rows) if shape["pp"] > 1 else [None]
    shape_pa = batch_partition_axis(pipeline_partition_axis(rq.partition_axis) if shape["pp"] > 1 else
                                    rq.partition_axis, shape)
    # with ep and fsdp, the experts either split over fsdp too (gathered like every weight) or stay whole
    whole = _experts_whole_rules(rq.model) if shape["ep"] > 1 and shape["fsdp"] * shape["sp"] > 1 else ()
    expert_choices = ((True, rq.rules), (False, rq.rules + whole)) if whole else ((True, rq.rules),)
    zeros = (0, 1) if rq.constraints.zero and rq.task == "train" and shape["dp"] > 1 else (0,)
    layouts: dict[tuple, tp.Any] = {}  # (stacked depth, experts FSDP-sharded) -> the layout held to HBM
    for pipeline, zero, (experts_fsdp, shape_rules) in itertools.product(pipelines, zeros, expert_choices):
        # uneven stages are held against HBM as the deepest stage, times pp
        model = stage_padded(rq.model, pipeline)
        depth = model.config.num_hidden_layers
        if not experts_fsdp and _whole_experts_overflow(layouts[depth, True], whole, shape, rq.usable):
            continue  # the experts' weights alone, whole over fsdp, overflow HBM: no need to resolve it
        if (depth, experts_fsdp) not in layouts:
            layouts[depth, experts_fsdp] = Layout.of(model, layout_mesh(shape), shape_pa, shape_rules, rq.mode)
        accumulations = rq.constraints.accumulations(rows) \
            if rq.task == "train" and pipeline is None else [1]
        program = rq.program
        ledger_at = functools.partial(_ledger_at, model, layouts[depth, experts_fsdp], kind=rq.task, batch=rq.batch,
                                      optimizer=rq.optimizer, cluster=part, pipeline=pipeline,
                                      kv_length=rq.kv_length, zero_stage=zero, **program)
        plan = Plan(shape, pipeline=pipeline, zero_stage=zero, batch_axes=batch_axes, experts_fsdp=experts_fsdp,
                    **program)
        candidate = functools.partial(_candidate, plan, partition_axis=shape_pa, rules=shape_rules,
                                      cluster=part if idle else None, idle=idle)
        price_at = functools.partial(_price_at, rq, part, plan)
        yield from _held(ledger_at, candidate, price_at, accumulations, rq.remats, rq.usable)


def _pipelines(rq: _Request, pp: int, rows: int) -> list[tp.Any]:
    """The pipelines a ``pp``-stage layout with ``rows`` sequences a data shard may run: those the constraints
    give (of ``pp`` stages, microbatches dividing the rows), else the advisor's own (:func:`pipeline_configs`)."""
    given = rq.constraints.pipelines
    if given:
        return [p for p in given if p.num_stages == pp and rows % p.num_microbatches == 0]
    return pipeline_configs(pp, rows, rq.layers)


def _stand(rq: _Request, candidates: tp.Sequence[Candidate]) -> None:
    """Each fitting candidate's :class:`~workbench.core.advisor.regimes.Standing`: the published runs that
    validate its layout's regimes, or its range."""
    for c in candidates:
        if c.fits:
            part = c.cluster or rq.cluster
            reprice = functools.partial(_reprice, rq, part)
            c.standing = standing(c.plan, part, rq.seq_len, c.time_s, reprice)


def _reprice(rq: _Request, part: tp.Any, plan: Plan, **options: tp.Any) -> tp.Any:
    return price(plan, rq.config, part, rq.batch, rq.task, kv_length=rq.kv_length, **options)


def _candidate(plan: Plan, *, remat: str, grad_accumulation: int, **fields: tp.Any) -> Candidate:
    return Candidate(plan.replace(remat=remat, grad_accumulation=grad_accumulation), **fields)


def _price_at(rq: _Request, part: tp.Any, plan: Plan, accumulation: int) -> tp.Callable[[str], tp.Any]:
    """remat policy -> the step of ``plan`` with ``accumulation`` microbatches on the cluster ``part``."""
    return pricer(rq.config, part, plan.replace(grad_accumulation=accumulation), rq.batch, rq.task, rq.kv_length,
                  rq.efficiency)


def _held(ledger_at: tp.Callable[[int, str], tp.Any], candidate: tp.Callable[..., Candidate],
          price_at: tp.Callable[[int], tp.Any], accumulations: list[int], remats: tuple[str, ...],
          usable: float) -> tp.Iterator[Candidate]:
    """One layout at the gradient accumulations (``k`` microbatches) and remat policies worth holding to ``usable``
    HBM: where even the most microbatches with the most recompute overflow, that one alone (rejected, saying by how
    much); else from the fewest microbatches up, the remat policies until one fits (more recompute only slows a
    layout that fits), stopping at a fit without recompute, one doubling past the first fit, or a state (parameters,
    gradients, optimizer, KV cache) that overflows alone."""
    k_most, frugal = max(accumulations), remats[-1]  # the least memory this layout can take
    if k_most > 1 or len(remats) > 1:
        led = ledger_at(k_most, frugal)
        if led.total > usable:  # not even so: that one, rejected, says by how much
            yield candidate(remat=frugal, ledger=led, price=price_at(k_most), fits=False, grad_accumulation=k_most,
                            reledger=functools.partial(ledger_at, k_most, frugal))
            return
    fitted_at = None  # the first accumulation that fits; one more is tried if only remat did
    for k in sorted(accumulations):
        if fitted_at is not None and (fitted_at[1] == "none" or k > 2 * fitted_at[0]):
            break  # fits without recompute, or one doubling past the first fit: more only slows it
        price = price_at(k)
        for r in remats:
            led = ledger_at(k, r)
            fits = led.total <= usable
            yield candidate(remat=r, ledger=led, price=price, fits=fits, grad_accumulation=k,
                            reledger=functools.partial(ledger_at, k, r))
            if led.params + led.grads + led.optimizer + led.kv_cache > usable:
                fitted_at = (0, "none")  # the state alone overflows: no remat or microbatching helps
                break
            if fits:
                fitted_at = fitted_at or (k, r)
                if r == "none":
                    fitted_at = (k, r)
                break  # more recompute only slows a layout that fits


def _ledger_at(model: tp.Any, layout: Layout, k: int, remat: str, **options: tp.Any) -> tp.Any:
    """The ledger of a step of ``k`` accumulated microbatches under ``remat`` (:func:`ledger`)."""
    return ledger(model, layout, grad_accumulation=k, remat=remat, **options)


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
