"""Pricing and ranking layouts: each layout's step priced by the analytic step model
(:func:`~workbench.core.cost.price.price`), those that fit ranked by step time, and ties (within
:data:`TIE`) broken by what a practitioner prefers next (:data:`_TIE_BREAKS`), which :func:`tie_break` names."""

from __future__ import annotations

import functools
import math
import typing as tp

from workbench.core.advisor.candidate import Candidate
from workbench.core.cost.price import price
from workbench.core.plan import Plan


def pricer(config: tp.Any, cluster: tp.Any, plan: Plan, batch: tuple[int, int], task: str, kv_length: int | None,
           efficiency: float | None) -> tp.Callable[[str], tp.Any]:
    """remat policy -> the predicted step of ``plan`` under that policy (:func:`~workbench.core.cost.price.price`),
    each policy priced once."""

    @functools.cache
    def price_at(remat: str) -> tp.Any:
        return price(plan.replace(remat=remat), config, cluster, batch, task, kv_length=kv_length,
                     efficiency=efficiency)

    return price_at


TIE = 0.01  # step times in one 1 % band (time_band) tie: the ranking then prefers what a practitioner would


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
    """The candidates that fit, best first (:func:`_preference`: by :attr:`Candidate.ranked_s`, the slow end of
    a range where one rests on a regime no published run validates), and those that do not, smallest first."""
    candidates = list(candidates)
    ranked = sorted((c for c in candidates if c.fits), key=_preference)
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: c.ledger.total)
    return ranked, rejected


def _preference(c: Candidate) -> tuple:
    """Rank by step time in bands of :data:`TIE` (the time rounded on a grid of powers of ``1 + TIE``: two steps under
    ``TIE`` apart may still fall in neighbouring bands), within a band by :data:`_TIE_BREAKS` (:func:`tie_break`
    says which decided)."""
    return (time_band(c), *(key(c) for key, _ in _TIE_BREAKS))


def time_band(c: Candidate) -> int:
    """The :data:`TIE` band of the step time ``c`` is ranked by (:attr:`Candidate.ranked_s`, rounded on a grid of
    powers of ``1 + TIE``): layouts in one band tie."""
    return round(math.log(c.ranked_s) / math.log1p(TIE))


def tie_break(c: Candidate, other: Candidate) -> str:
    """Why ``c`` ranks after ``other`` when their step times tie (the same :func:`time_band`, as the ranking reads
    it), in words; "" otherwise (the time decided)."""
    if time_band(c) != time_band(other):
        return ""
    for key, words in _TIE_BREAKS:
        if key(c) != key(other):
            return words if key(c) > key(other) else ""  # else the time decided, not this
    return ""
