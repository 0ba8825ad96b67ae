"""The step model on runs no constant was fitted to: leave-one-out over the published runs.

Most constants of :mod:`workbench.core.hardware.calibration` were measured on a chip (the H100's GEMM, attention
and HBM rates: ``benchmarks/gpu_constants.py``) or derived from one (the 500 W H100, the H200), so no published
run set them, and every run they price is out of sample already. Two kinds were fitted to the published runs
themselves (:data:`FITTED`):

- each TPU chip's GEMM efficiency (``gemm``), to MaxText's runs on that chip;
- the H100 family's fp8 GEMM efficiency (``gemm_fp8``), to the fp8 runs on H100 and H200 (torchtitan,
  Megatron-Bridge, NeMo);
- the rate of the 2022 Triton flash-attention kernel on H100 (``attention_kernels.flash_triton``), to
  llm-foundry's MPT runs at 8,192-65,536 tokens a sequence, the only runs that used it (shipped at the value two of
  them give alone: the other fifteen are out of sample for it as shipped).

The fit is written down (:func:`fit`): the value at which its runs' predicted / measured ratios have a geometric
mean of 1. Leave-one-out (:func:`leave_one_out`) refits every constant that prices a run without that run, and
prices the run with the refitted values: the ratio it would have had had it not been published when the constants
were set. The shipped values were chosen by hand near the fit; both are printed (``benchmarks/published_runs.py``).

Not refitted: the TPU constants all four chips share (attention 0.55, HBM 0.85, fusion 1.0, network 0.80), set
once for the 18 TPU runs together; in these compute-bound steps the per-chip GEMM rate carries most of the time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import typing as tp

from workbench.core.hardware.calibration import CALIBRATIONS, calibration, overridden
from workbench.core.hardware.chips import H100, H100_500W, H200, TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E, Hardware
from workbench.core.interop.published import (
    FINE_GRAINED_EXPERTS,
    Accuracy,
    PublishedRun,
    accuracy,
    not_held_runs,
    price,
    published_runs,
)

# the range a refitted efficiency is searched in (a fraction of the chip's peak)
LOWEST, HIGHEST = 0.02, 1.0


@dataclasses.dataclass(frozen=True)
class FittedConstant:
    """One calibration field fitted to published runs: ``field`` of ``chips`` (an efficiency, or
    ``"attention_kernels.<kernel>"``), fitted to their runs (of ``dtype`` only, or running the ``attention``
    kernel only, where given)."""

    field: str
    chips: tuple[Hardware, ...]
    dtype: str | None = None
    attention: str | None = None

    @property
    def label(self) -> str:
        names = " / ".join(dict.fromkeys(" ".join(c.name.split()[:2]) for c in self.chips))
        return f"{names} {self.field}"

    def covers(self, run: PublishedRun) -> bool:
        """Whether this constant prices ``run`` (and so was fitted to it)."""
        return (run.cluster.chip in self.chips and (self.dtype is None or run.plan.dtype == self.dtype)
                and (self.attention is None or run.plan.attention == self.attention))

    def shipped(self) -> float:
        name, _, kernel = self.field.partition(".")
        value = getattr(calibration(self.chips[0]), name)
        return (value[kernel] if kernel else value).value

    def at(self, value: float) -> contextlib.AbstractContextManager[None]:
        """Within the block, this constant is ``value`` on every chip it belongs to."""
        return overridden(self.chips, self.field, value, f"refitted {self.label} (leave-one-out)")


FITTED: tuple[FittedConstant, ...] = (
    *(FittedConstant("gemm", (chip,)) for chip in (TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E)),
    FittedConstant("gemm_fp8", (H100, H100_500W, H200), dtype="fp8"),
    FittedConstant("attention_kernels.flash_triton", (H100, H100_500W, H200), attention="flash_triton"),
)

Pricer = tp.Callable[[PublishedRun], float]


def _seconds(run: PublishedRun) -> float:
    return price(run).time_s


def fit(constant: FittedConstant, runs: tp.Sequence[PublishedRun], seconds: Pricer = _seconds) -> float:
    """The value of ``constant`` at which ``runs``' predicted / measured ratios have a geometric mean of 1
    (a root of the mean log ratio, which falls as the efficiency rises); :data:`LOWEST` or :data:`HIGHEST`
    where no value in between centres them. ``seconds`` prices a run (the step model by default)."""
    if not runs:
        raise ValueError(f"fitting {constant.label} needs at least one run")

    def mean_log_ratio(value: float) -> float:
        with constant.at(value):
            return statistics.fmean(math.log(seconds(r) / r.measured_s) for r in runs)

    # regula falsi (Illinois) on the log of the value: the mean log ratio is close to linear in it
    a, b = math.log(LOWEST), math.log(HIGHEST)
    fa, fb = mean_log_ratio(math.exp(a)), mean_log_ratio(math.exp(b))
    if fb >= 0:
        return HIGHEST
    if fa <= 0:
        return LOWEST
    for _ in range(100):
        c = b - fb * (b - a) / (fb - fa)
        fc = mean_log_ratio(math.exp(c))
        if abs(fc) < 1e-7 or abs(b - a) < 1e-7:
            return math.exp(c)
        if fc * fb < 0:
            a, fa = b, fb
        else:
            fa /= 2
        b, fb = c, fc
    raise RuntimeError(f"fitting {constant.label} did not converge: the step model is not monotone in it")


@dataclasses.dataclass(frozen=True)
class Refit:
    """One fitted constant: its shipped value, its fit on all its runs, and its refits with one run left out."""

    constant: FittedConstant
    runs: tuple[str, ...]
    shipped: float
    in_sample: float
    left_out: dict[str, float]


@dataclasses.dataclass(frozen=True)
class OutOfSample:
    """Each run priced with every constant fitted to it refitted without it (``ratios``), the refits, and which
    runs no constant was fitted to."""

    ratios: dict[str, float]
    refits: tuple[Refit, ...]

    @property
    def accuracy(self) -> Accuracy:
        return Accuracy(self.ratios)

    def unfitted(self) -> tuple[str, ...]:
        """The runs no fitted constant prices: out of sample as shipped."""
        fitted = {name for r in self.refits for name in r.runs}
        return tuple(name for name in self.ratios if name not in fitted)

    def text(self) -> str:
        acc = self.accuracy
        return (f"out of sample (the constants fitted to these runs refitted without the run each prices) "
                f"{acc.low:.2f}x to {acc.high:.2f}x, typically within {acc.median_abs - 1:.0%}")


def leave_one_out(runs: tp.Sequence[PublishedRun] | None = None, seconds: Pricer = _seconds,
                  constants: tp.Sequence[FittedConstant] = FITTED) -> OutOfSample:
    """For each run, every constant of ``constants`` that prices it refitted (:func:`fit`) on its other runs, and
    the run priced with those values (see the module doc). A constant with a single run keeps its shipped value
    when that run is left out: nothing is left to fit it to, which the ratio then says."""
    runs = tuple(published_runs() if runs is None else runs)
    groups = {c: tuple(r for r in runs if c.covers(r)) for c in constants}
    left_out: dict[FittedConstant, dict[str, float]] = {c: {} for c in constants}
    ratios = {}
    for run in runs:
        with contextlib.ExitStack() as stack:
            for c, mine in groups.items():
                if run in mine:
                    others = [r for r in mine if r is not run]
                    value = fit(c, others, seconds) if others else c.shipped()
                    left_out[c][run.name] = value
                    stack.enter_context(c.at(value))
            ratios[run.name] = seconds(run) / run.measured_s
    refits = tuple(Refit(c, tuple(r.name for r in mine), c.shipped(), fit(c, mine, seconds), left_out[c])
                   for c, mine in groups.items() if mine)
    return OutOfSample(ratios, refits)


@functools.cache
def out_of_sample() -> OutOfSample:
    """:func:`leave_one_out` of the published runs with the step model (computed once)."""
    return leave_one_out()


def chip_text(chip: Hardware) -> str:
    """How far the step model was from the published runs on ``chip`` itself; where none ran on it, that its
    constants were carried over from another chip, so the spread over all runs says nothing measured about it."""
    ratios = {r.name: accuracy().ratios[r.name] for r in published_runs() if r.cluster.chip == chip}
    if ratios:
        held = Accuracy(ratios)
        return (f"on the {len(ratios)} run(s) on {chip.name} itself: {held.low:.2f}x to {held.high:.2f}x, typically "
                f"within {held.median_abs - 1:.0%}")
    gemm = calibration(chip).gemm
    carried = gemm.source.split(";")[0].removeprefix("not sourced: ") if not gemm.sourced else "measured"
    return (f"no published run on {chip.name} is held against the model: its kernel efficiencies are not its own "
            f"({carried}), so the spread above was measured on other chips, not on this one")


@functools.cache
def not_held_text() -> str:
    """The spread of the runs of a kind the model misses (:func:`~workbench.core.interop.published.not_held_runs`:
    fine-grained MoE, every platform), and why; empty where there are none. Priced once: every advisor summary and
    explorer step of such a model prints it."""
    runs = not_held_runs()
    if not runs:
        return ""
    ratios = [price(r).time_s / r.measured_s for r in runs]
    chips = ", ".join(sorted({r.chip for r in runs}))
    return (f"Fine-grained MoE steps (more than {FINE_GRAINED_EXPERTS} experts) are NOT held: on {len(runs)} published "
            f"training steps of such models ({chips}) the model was {min(ratios):.2f}x to {max(ratios):.2f}x the "
            f"measured step ({runs[0].not_held})")


def accuracy_text(chip: Hardware | None = None, *, moe: bool = False) -> str:
    """How far the step model was from the published runs, in sample and out of it, for a view to print beside a
    prediction; with ``chip``, also how far on that chip's own runs (:func:`chip_text`); with ``moe`` (a
    fine-grained mixture of experts: :func:`~workbench.core.interop.published.fine_grained_moe`), the spread of the
    runs of such models it is not held to (:func:`not_held_text`)."""
    text = f"{accuracy().text()}; {out_of_sample().text()}"
    if chip is not None and chip in CALIBRATIONS:
        text = f"{text}; {chip_text(chip)}"
    caveat = not_held_text() if moe else ""
    return f"{text}. {caveat}" if caveat else text


__all__ = ["FITTED", "FittedConstant", "OutOfSample", "Refit", "accuracy_text", "chip_text", "fit", "leave_one_out",
           "not_held_text", "out_of_sample"]
