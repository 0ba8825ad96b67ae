"""Pricing and ranking layouts: each layout's step priced by the analytic step model
(:func:`~workbench.core.cost.predicted.predict_step`), those that fit ranked by step time, and ties (within
:data:`TIE`) broken by what a practitioner prefers next (:data:`_TIE_BREAKS`), which :func:`tie_break` names."""

from __future__ import annotations

import functools
import math
import typing as tp

from workbench.core.advisor.candidate import Candidate
from workbench.core.cost.predicted import predict_step


def pricer(config: tp.Any, cluster: tp.Any, shape: dict[str, int], batch: tuple[int, int], task: str,
           pipeline: tp.Any, kv_length: int | None, efficiency: float | None, zero: int, accumulation: int,
           batch_axes: tuple[str, ...], experts_fsdp: bool = True) -> tp.Callable[[str], tp.Any]:
    """remat policy -> :func:`predict_step` of one layout, each policy priced once."""

    @functools.cache
    def price(remat: str) -> tp.Any:
        return predict_step(config, cluster, shape, batch=batch, task=task, remat=remat, pipeline=pipeline,
                            kv_length=kv_length, efficiency=efficiency, zero_stage=zero,
                            grad_accumulation=accumulation, batch_axes=batch_axes, experts_fsdp=experts_fsdp)

    return price


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


def ranked_and_rejected(candidates: tp.Iterable[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """The candidates that fit, best first (:func:`_preference`), and those that do not, smallest first."""
    candidates = list(candidates)
    ranked = sorted((c for c in candidates if c.fits), key=_preference)
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: c.ledger.total)
    return ranked, rejected


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
