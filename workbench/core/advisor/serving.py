"""The advisor's serving answer: the point of a model's latency-throughput front
(:func:`~workbench.core.cost.serving.serving_frontier`) that meets a latency target or a throughput target, and
why, with how far the serving model was from measured decode steps beside it.

A latency target (``max_ms_per_token``) picks the front's point that gives the most output tokens a second a chip
at or under it; a throughput target (``min_tokens_per_s_per_chip``) the fastest point that gives at least it; both,
the most tokens a second a chip among the points meeting both. The targets are held against predictions, so the
answer also says where the measured spread would carry the pick past its target: the lowest predicted / measured,
out of sample, of the engine's own published decode steps on that chip (of all of them where it has none).
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.cost.serving import FrontierPoint, serving_frontier
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.published_serving import (
    ENGINE_FITS,
    out_of_sample,
    published_points,
    serving_accuracy_text,
)
from workbench.core.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class ServingAdvice:
    """Every point swept (``points``; :attr:`front` the Pareto front among them, fastest first), the point picked
    for the targets (``pick``, None where no point meets them) and why (``why``)."""

    points: tuple[FrontierPoint, ...]
    pick: FrontierPoint | None
    why: str
    max_ms_per_token: float | None
    min_tokens_per_s_per_chip: float | None

    @property
    def front(self) -> tuple[FrontierPoint, ...]:
        return tuple(sorted((p for p in self.points if p.on_front), key=lambda p: p.ms_per_token))

    def summary(self) -> str:
        spread = serving_accuracy_text("decode")
        return f"{self.why}. {spread[0].upper()}{spread[1:]}."


def lowest_decode_ratio(engine: str | None = None, chip: tp.Any = None) -> tuple[float, str]:
    """The lowest predicted / measured, out of sample, of the published decode steps of ``engine`` on ``chip``'s
    fitted group (TensorRT-LLM's on H100 and H200 together), or of all of them where there are none: the model's
    most optimistic miss there, and which steps it is of."""
    ratios, _ = out_of_sample()
    group = next((chips for e, chips in ENGINE_FITS if e == engine and chip in chips), ())
    mine = [p for p in published_points() if p.kind == "decode" and p.engine == engine and p.cluster.chip in group]
    if mine:
        chips = " and ".join(c.name for c in group)
        return min(ratios[p.name] for p in mine), f"{engine}'s {len(mine)} published decode steps on {chips}"
    everything = [p for p in published_points() if p.kind == "decode"]
    return min(ratios[p.name] for p in everything), f"all {len(everything)} published decode steps"


def _point_text(p: FrontierPoint) -> str:
    return f"{p.label}: {p.ms_per_token:.1f} ms a token, {p.tokens_per_s_per_chip:,.0f} tokens/s a chip"


def _meets(p: FrontierPoint, max_ms: float | None, min_tps: float | None, ratio: float = 1.0) -> bool:
    """Whether ``p`` meets the targets with its prediction taken as ``ratio`` x the measurement (measured =
    predicted / ratio: a step 1 / ratio as long, ``ratio`` x the tokens)."""
    return ((max_ms is None or p.ms_per_token / ratio <= max_ms)
            and (min_tps is None or p.tokens_per_s_per_chip * ratio >= min_tps))


def _best(points: tp.Sequence[FrontierPoint], max_ms: float | None) -> FrontierPoint:
    """A latency target's pick: the most tokens a second a chip; a throughput target's alone: the fastest."""
    if max_ms is not None:
        return max(points, key=lambda p: p.tokens_per_s_per_chip)
    return min(points, key=lambda p: p.ms_per_token)


def _held_to_evidence(pick: FrontierPoint, front: tp.Sequence[FrontierPoint], max_ms: float | None,
                      min_tps: float | None, spread: tuple[float, str]) -> str:
    """``pick`` at the most optimistic miss of the evidence, against each target given; where it would miss, the
    point the targets pick with every prediction taken at that miss (or that none would meet them)."""
    low, of = spread
    worst = []
    if max_ms is not None:
        ms = pick.ms_per_token / low
        worst.append(f"{ms:.1f} ms a token, " + ("over" if ms > max_ms else "within") + f" the {max_ms:g} ms target")
    if min_tps is not None:
        tps = pick.tokens_per_s_per_chip * low
        worst.append(f"{tps:,.0f} tokens/s a chip, " + ("under" if tps < min_tps else "meeting")
                     + f" the {min_tps:,.0f} target")
    text = (f"at the lowest predicted / measured, out of sample, of {of} ({low:.3g}x) it would give "
            + " and ".join(worst))
    if _meets(pick, max_ms, min_tps, low):
        return text
    targets = "targets" if max_ms is not None and min_tps is not None else "target"
    backed = [p for p in front if _meets(p, max_ms, min_tps, low)]
    if not backed:
        return text + f"; no point of the front meets the {targets} at that miss"
    safe = _best(backed, max_ms)
    return (text + f"; the point that meets the {targets} even at that miss is {_point_text(safe)} "
                   f"({safe.ms_per_token / low:.1f} ms a token and {safe.tokens_per_s_per_chip * low:,.0f} tokens/s "
                   f"a chip at that miss)")


def _check_targets(max_ms_per_token: float | None, min_tokens_per_s_per_chip: float | None) -> None:
    if max_ms_per_token is None and min_tokens_per_s_per_chip is None:
        raise ValueError("give a latency target (max_ms_per_token=, ms a token) or a throughput target "
                         "(min_tokens_per_s_per_chip=, output tokens a second a chip), or both")
    for name, value in (("max_ms_per_token", max_ms_per_token),
                        ("min_tokens_per_s_per_chip", min_tokens_per_s_per_chip)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} is a positive target; got {value!r}")


def pick_from_front(points: tp.Sequence[FrontierPoint], *, max_ms_per_token: float | None = None,
                    min_tokens_per_s_per_chip: float | None = None, spread: tuple[float, str] | None = None,
                    ) -> tuple[FrontierPoint | None, str]:
    """The front's point for the targets (the module doc says how) and why in words; None and why where none
    meets them. ``spread``: the lowest predicted / measured that applies and what it is of
    (:func:`lowest_decode_ratio`; all published decode steps' by default). Raises ``ValueError`` without a target
    or with one that is not positive."""
    _check_targets(max_ms_per_token, min_tokens_per_s_per_chip)
    front = sorted((p for p in points if p.on_front), key=lambda p: p.ms_per_token)
    if not front:
        raise ValueError("no point is on the front: no layout's weights fit the cluster")
    fast = [p for p in front if _meets(p, max_ms_per_token, None)]
    both = [p for p in front if _meets(p, max_ms_per_token, min_tokens_per_s_per_chip)]
    if not both:
        if not fast:
            return None, (f"no layout reaches {max_ms_per_token:g} ms a token: the fastest point is "
                          f"{_point_text(front[0])}")
        best = max(front, key=lambda p: p.tokens_per_s_per_chip)
        within = max(fast, key=lambda p: p.tokens_per_s_per_chip)
        if max_ms_per_token is None:
            return None, (f"no layout gives {min_tokens_per_s_per_chip:,.0f} tokens/s a chip: the most is "
                          f"{_point_text(best)}")
        return None, (f"no layout gives {min_tokens_per_s_per_chip:,.0f} tokens/s a chip within "
                      f"{max_ms_per_token:g} ms a token: the most within it is {_point_text(within)}")
    pick = _best(both, max_ms_per_token)
    if max_ms_per_token is not None:
        why = f"the most tokens a second a chip at or under {max_ms_per_token:g} ms a token"
        if min_tokens_per_s_per_chip is not None:
            why += f" (and at least {min_tokens_per_s_per_chip:,.0f})"
        after = front.index(pick) + 1
        if after < len(front):  # the next front point gives more throughput but misses the latency target
            why += f"; the next point on the front, {_point_text(front[after])}, misses the latency target"
    else:
        why = f"the fastest point giving at least {min_tokens_per_s_per_chip:,.0f} tokens/s a chip"
        if front.index(pick) > 0:
            why += f"; the next faster, {_point_text(front[front.index(pick) - 1])}, gives fewer"
    held = _held_to_evidence(pick, front, max_ms_per_token, min_tokens_per_s_per_chip,
                             spread or lowest_decode_ratio())
    return pick, f"{_point_text(pick)}: {why}. Held to the evidence: {held}"


def advise_serving(model_or_config: tp.Any, cluster: Cluster, *, input_len: int, output_len: int,
                   max_ms_per_token: float | None = None, min_tokens_per_s_per_chip: float | None = None,
                   dtype: tp.Any = "bf16", weight_dtype: str | None = None, kv_dtype: str | None = None,
                   engine: str | None = None, memory_fraction: float = 0.9) -> ServingAdvice:
    """The serving layout and requests in flight for a latency target (``max_ms_per_token``), a throughput target
    (``min_tokens_per_s_per_chip``) or both: the point of ``serving_frontier`` (the same keywords) that meets them,
    and why (:func:`pick_from_front`)."""
    config = model_or_config if isinstance(model_or_config, ModelConfig) else getattr(model_or_config, "config",
                                                                                          None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"advise_serving takes a ModelConfig or a model with a .config; got "
                        f"{type(model_or_config).__name__}")
    _check_targets(max_ms_per_token, min_tokens_per_s_per_chip)  # before the sweep, which takes seconds
    points = serving_frontier(config, cluster, input_len=input_len, output_len=output_len, dtype=dtype,
                              weight_dtype=weight_dtype, kv_dtype=kv_dtype, engine=engine,
                              memory_fraction=memory_fraction)
    pick, why = pick_from_front(points, max_ms_per_token=max_ms_per_token,
                                min_tokens_per_s_per_chip=min_tokens_per_s_per_chip,
                                spread=lowest_decode_ratio(engine, cluster.chip))
    return ServingAdvice(points, pick, why, max_ms_per_token, min_tokens_per_s_per_chip)


__all__ = ["ServingAdvice", "advise_serving", "lowest_decode_ratio", "pick_from_front"]
