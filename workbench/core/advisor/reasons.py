"""The words: why each layout ranks where it does (:func:`reason`), each clause with the number that decides it, what
change of its mesh fits a layout that does not (:func:`rescue`), and :func:`explain` filling in every candidate's
reason once the ranking is known."""

from __future__ import annotations

import collections
import functools
import math
import typing as tp

from workbench.core.advisor.advice import Advice
from workbench.core.advisor.breakdown import step_sum
from workbench.core.advisor.candidate import Candidate, gib
from workbench.core.advisor.constraints import Constraints
from workbench.core.advisor.rank import TIE, tie_break
from workbench.core.hardware.cluster import prime_factors
from workbench.core.hardware.network import span
from workbench.core.units import format_seconds

_PART_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
               "activations": "activations", "kv_cache": "KV cache", "temporaries": "temporaries"}


def explain(advice: Advice, constraints: Constraints) -> None:
    """Give each candidate its reason (see :func:`reason`), written when first read."""
    fits_by_shape: dict[tuple, list[Candidate]] = {}
    for c in advice.ranked:
        fits_by_shape.setdefault(tuple(c.mesh_shape.values()), []).append(c)
    best = advice.ranked[0] if advice.ranked else None
    # rows predicted faster than the first that rank after it: they rest on regimes no published run validates
    faster = sum(c.time_s < best.time_s * (1 - TIE) for c in advice.ranked) if best is not None else 0
    for i, c in enumerate(advice.ranked):
        c.reason, c.explain_reason = None, functools.partial(
            reason, c, advice.cluster, best=best, batch=advice.batch, task=advice.task,
            previous=advice.ranked[i - 1] if i else None, config=getattr(advice.model, "config", None),
            faster=faster if i == 0 else 0)
    for c in advice.rejected:
        # the fastest fitting layout of the same mesh, with this schedule (and its virtual stages) if one fits,
        # else this remat policy; with ZeRO-1 where that fits
        rescued = sorted(fits_by_shape.get(tuple(c.mesh_shape.values()), []),
                         key=lambda f: (*_schedule_changes(c.pipeline, f.pipeline), f.remat != c.remat, -f.zero_stage))
        c.reason, c.explain_reason = None, functools.partial(
            reason, c, advice.cluster, rescued_by=rescued[0] if rescued else None, headroom=constraints.headroom)


def _schedule_changes(was: tp.Any, now: tp.Any) -> tuple[bool, bool]:
    """Whether a pipeline's schedule, and its virtual stages, change from ``was`` to ``now``."""
    if was is None or now is None:
        return (was is not now, was is not now)
    return was.schedule != now.schedule, was.virtual_stages != now.virtual_stages


def reason(c: Candidate, cluster: tp.Any, *, best: Candidate | None = None, rescued_by: Candidate | None = None,
           batch: tuple[int, int] | None = None, task: str = "train", headroom: float = 0.0,
           previous: Candidate | None = None, config: tp.Any = None, faster: int = 0) -> str:
    """Why ``c`` ranks where it does, in words, each with the number that decides it: what it does not fit by (and
    which change of its mesh would fit, named), or what its step is made of (:func:`~.breakdown.step_sum`: the
    parts named add up to the step) and what bounds it (collectives longer than the work, a tensor-parallel group
    across nodes, too few tokens per chip to hide FSDP's gathers, a pipeline bubble), the
    chips it leaves idle and why (with ``config``: which of the sequences, heads and layers the idle-making
    factors do not divide), how far it is from the best, and what broke a tie with the layout ranked before it
    (``previous``); the first row says how many rows (``faster``) are predicted faster but rank after it."""
    hbm = cluster.hbm_per_device
    if not c.fits:
        return _misfit(c, hbm * (1 - headroom), rescued_by)
    st = c.step
    words = [step_sum(st)]
    words += [w for w in (_collectives(st), _tp_across_nodes(c, cluster), _fsdp_exposed(c, batch, task),
                          _idle(c, cluster, batch, config), _accumulated(c, batch), _recomputed(c), _bubble(c)) if w]
    if c.standing is not None and c.standing.text():
        words.append(c.standing.text())
    words += _standing(c, best, previous, faster)
    if hbm is not None:
        words.append(f"uses {c.ledger.total / hbm:.0%} of HBM")
    return "; ".join(words)


def _misfit(c: Candidate, usable: float, rescued_by: Candidate | None) -> str:
    """By how much ``c`` overflows the ``usable`` HBM (its largest part named), and what change of the same mesh
    (``rescued_by``: remat, accumulation, pipeline microbatches, ZeRO, the experts' placement) fits."""
    parts = c.ledger.parts()
    big = max(parts, key=parts.get)
    # enough decimals that the two figures differ ("80.55 GiB > 80.47 GiB", never "80.5 GiB > 80.5 GiB")
    places = next((d for d in (1, 2, 3) if gib(c.ledger.total, decimals=d) != gib(usable, decimals=d)), 3)
    text = (f"does not fit: {gib(c.ledger.total, decimals=places)} > {gib(usable, decimals=places)} usable HBM "
            f"({_PART_NAMES.get(big, big)} {gib(parts[big])})")
    if rescued_by is None:
        return text
    return text + f"; with {rescue(c, rescued_by)} it fits ({gib(rescued_by.ledger.total)})"


def rescue(c: Candidate, fit: Candidate) -> str:
    """What ``fit`` (a layout of ``c``'s mesh) changes from ``c``, in words: "remat full, 8 microbatches accumulated
    and ZeRO-1", "interleaved v=2 m=16", "experts whole over fsdp"; its label if nothing names it."""
    change = [f"remat {fit.remat}"] if fit.remat != c.remat else []
    if fit.grad_accumulation != c.grad_accumulation:
        k = fit.grad_accumulation
        change.append(f"{k} microbatches accumulated" if k > 1 else "no accumulation")
    if fit.pipeline != c.pipeline:
        change.append(_pipeline_change(c.pipeline, fit.pipeline))
    if fit.zero_stage != c.zero_stage:
        change.append(f"ZeRO-{fit.zero_stage}" if fit.zero_stage else "no ZeRO")
    if fit.experts_fsdp != c.experts_fsdp:
        change.append("experts split over fsdp" if fit.experts_fsdp else "experts whole over fsdp")
    if not change:
        return fit.label
    return change[0] if len(change) == 1 else ", ".join(change[:-1]) + " and " + change[-1]


def _pipeline_change(was: tp.Any, now: tp.Any) -> str:
    """A pipeline's change in words: its microbatches where only they change, else the schedule as the label
    writes it."""
    if now is None:
        return "no pipeline"
    if was is not None and (was.schedule, was.virtual_stages, was.uneven) == (now.schedule, now.virtual_stages,
                                                                               now.uneven):
        return f"{now.num_microbatches} microbatches"
    v = f" v={now.virtual_stages}" if now.virtual_stages > 1 else ""
    return f"{now.schedule}{v} m={now.num_microbatches}{' uneven stages' if now.uneven else ''}"


def _collectives(st: tp.Any) -> str:
    """A communication-bound step: its collectives in all (longer than its work), the largest group on its network
    level, and how much of them the work does not hide (the step's sum names that part)."""
    groups = st.rows()
    if st.bound != "communication" or not groups:
        return ""
    kind, axes, level, _, _, _, seconds = groups[0]
    text = f"collectives {format_seconds(st.comm_s)} in all ({kind}s over {','.join(axes)} on {level} " \
           f"{format_seconds(seconds)})"
    if st.terms:
        exposed = sum(t.seconds for t in st.terms if t.part == "communication")
        text += f", {format_seconds(exposed)} of them exposed"
    return text


def _tp_across_nodes(c: Candidate, cluster: tp.Any) -> str:
    """A tensor-parallel group spanning GPU nodes: its collectives' time on the inter-node network."""
    tp_size = c.mesh_shape.get("tp", 1)
    if not (tp_size > 1 and cluster.platform == "gpu" and span(("tp",), c.mesh_shape, cluster).units > 1):
        return ""
    st = c.step
    tp_comm = sum(x.total_s for x in st.collectives if "tp" in x.axes)
    return (f"tp={tp_size} crosses nodes: its collectives run on the inter-node network, "
            f"{format_seconds(tp_comm)} of {format_seconds(st.time_s)}")


def _fsdp_exposed(c: Candidate, batch: tuple[int, int] | None, task: str) -> str:
    """Too few tokens per chip for a train step's compute to hide FSDP's all-gathers: how many would."""
    st = c.step
    fsdp = c.mesh_shape.get("fsdp", 1)
    fsdp_comm = sum(x.total_s for x in st.collectives if "fsdp" in x.axes)
    if not (fsdp > 1 and batch is not None and task == "train" and st.compute_s and fsdp_comm > st.compute_s):
        return ""
    devices = math.prod(c.mesh_shape.values())
    per_chip = batch[0] * batch[1] / devices
    needed = per_chip * fsdp_comm / st.compute_s
    axes = [a for a in ("fsdp", "sp") if c.mesh_shape.get(a, 1) > 1]
    return (f"{per_chip:,.0f} tokens per chip < {needed:,.0f} needed to hide FSDP's all-gathers over "
            f"{' x '.join(f'{a}={c.mesh_shape[a]}' for a in axes)}")


def _idle(c: Candidate, cluster: tp.Any, batch: tuple[int, int] | None, config: tp.Any) -> str:
    """The chips ``c`` leaves idle, the cluster's device count factored, and which of the sequences, heads and
    layers (with ``config``) its prime factors of 5 or more divide none of."""
    if not c.idle:
        return ""
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
    return text


def _factorization(n: int) -> str:
    counts = collections.Counter(prime_factors(n))  # smallest prime first
    return " x ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in counts.items())


def _accumulated(c: Candidate, batch: tuple[int, int] | None) -> str:
    if c.grad_accumulation <= 1:
        return ""
    rows = f" of {c.plan.microbatch(batch)[0]} sequences" if batch else ""
    return f"{c.grad_accumulation} microbatches{rows} one after another, their gradients summed"


def _recomputed(c: Candidate) -> str:
    if not c.recompute_s > 0.01 * c.step.compute_s:
        return ""
    return f"remat {c.remat} recomputes the forward: {format_seconds(c.recompute_s)} of compute more"


def _bubble(c: Candidate) -> str:
    bubble = getattr(c.step, "bubble_fraction", 0.0) or 0.0
    if c.pipeline is None or not bubble:
        return ""
    return f"pipeline bubble {bubble:.0%} (p={c.pipeline.num_stages}, m={c.pipeline.num_microbatches})"


def _standing(c: Candidate, best: Candidate | None, previous: Candidate | None, faster: int = 0) -> list[str]:
    """How far ``c`` is from the best (by the step times the ranking reads: a range's slow end), and what broke a
    tie with the layout ranked before it."""
    if best is not None and c is not best:
        words = [f"{c.ranked_s / best.ranked_s:.2f}x the best" + (" at its slow end" if c.unvalidated else "")]
        why_after = tie_break(c, previous) if previous is not None else ""
        if why_after:
            words.append(f"ties with the row above (the same {TIE:.0%} band of step time), ranked after it for "
                         f"{why_after}")
        return words
    if best is c and faster:
        first = "first by its slow end" if c.unvalidated else \
            "first: the fastest whose every part published runs validate"
        return [f"{first} ({faster:,} layout{'s' if faster > 1 else ''} predicted faster rest on regimes no "
                f"published run validates, ranked by their slow ends)"]
    if best is c:
        return ["first by its slow end" if c.unvalidated else "the fastest that fits"]
    return []
