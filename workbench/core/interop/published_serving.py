"""Serving steps others measured and published, priced by the serving model: how true its decode, prefill and
throughput predictions are.

``published_serving.json`` (beside this module; built by ``benchmarks/data/build_published_serving.py`` from the raw
records in ``benchmarks/data/published_serving_*.json``, every quote and derivation) holds each measured point with
what pricing it needs: the model, the chips and their tensor parallelism, the weights', activations' and KV cache's
dtypes, the requests in flight (or the prompts sent at once), the lengths, the engine and the measurement:

- **decode**: the time per output token (TPOT, or the mean inter-token latency) at a steady concurrency, priced as
  a continuous-batching step (:func:`~workbench.core.cost.serving.serving_step`);
- **prefill**: the time to the first token of one prompt (or of the prompts a fixed concurrency sends together),
  priced by :func:`~workbench.core.cost.serving.time_to_first_token`, in steps of the engine's prefill budget
  where it chunks prefill (``prefill_chunk``: sglang-jax's and vLLM's TPU runs);
- **throughput**: output tokens a second at a running batch the engine published (a static batch, or its cap on
  running sequences), priced as ``concurrency`` over the step at that batch.

Each engine's own cost a step (:data:`~workbench.core.hardware.calibration.ENGINE_LAYER`, a cost a layer) is fitted
to the decode points of that engine on that chip (:data:`ENGINE_FITS`, :func:`fit_engine_layer`); prefill and
throughput points are out of sample for it. :func:`leave_one_out` refits each without every decode point in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import statistics
import typing as tp

from workbench.core.cost.flops import model_shapes
from workbench.core.cost.serving import serving_step, time_to_first_token
from workbench.core.hardware.calibration import engine_layer
from workbench.core.hardware.chips import H100, H200, TPU7X, TPU_V6E, Hardware
from workbench.core.hardware.cluster import Cluster
from workbench.core.interop.published import BAND, Accuracy
from workbench.core.models.config import ModelConfig
from workbench.core.models.presets import full_config

POINTS_FILE = pathlib.Path(__file__).with_name("published_serving.json")
KINDS = ("decode", "prefill", "throughput")
# the engines and chips whose cost a layer is fitted, each to its decode points (Hopper's two chips share one)
ENGINE_FITS: tuple[tuple[str, tuple[Hardware, ...]], ...] = (
    ("TensorRT-LLM", (H100, H200)), ("vLLM", (TPU_V6E,)), ("sglang-jax", (TPU_V6E,)), ("sglang-jax", (TPU7X,)))


@dataclasses.dataclass(frozen=True)
class ServingPoint:
    """One measured serving point and everything needed to price it (the module doc lists the kinds)."""

    name: str
    kind: str
    engine: str
    config: ModelConfig
    cluster: Cluster
    mesh: dict[str, int]
    input_len: int
    output_len: int
    concurrency: int | None  # requests in flight (decode, throughput)
    prompts: int | None  # prompts sent at once (prefill)
    dtype: str
    weight_dtype: str | None
    kv_dtype: str | None
    measured: float  # seconds (decode: TPOT; prefill: TTFT) or output tokens a second (throughput)
    model_name: str
    source: dict[str, str]
    choices: str
    note: str
    prefill_chunk: int | None = None  # the engine's prompt tokens a step where it chunks prefill (prefill points)

    @property
    def layers(self) -> int:
        return model_shapes(self.config).layers

    @functools.cached_property
    def _kernels(self) -> tuple[float, int]:
        """The step's seconds without any engine cost, and the engine steps it takes (computed once)."""
        if self.kind == "prefill":
            first = time_to_first_token(self.config, self.cluster, self.mesh, input_len=self.input_len,
                                        prompts=self.prompts, prefill_chunk=self.prefill_chunk, **self._served())
            return first.time_s, first.steps
        return serving_step(self.config, self.cluster, self.mesh, concurrency=self.concurrency,
                            input_len=self.input_len, output_len=self.output_len, **self._served()).time_s, 1

    def _served(self) -> dict[str, tp.Any]:
        return {"dtype": self.dtype, "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype}

    @property
    def kernels_s(self) -> float:
        """The step's seconds without any engine cost: the kernels and collectives alone."""
        return self._kernels[0]

    @property
    def engine_steps(self) -> int:
        """The engine steps the measurement spans: one, or a chunked prefill's steps."""
        return self._kernels[1]

    def predicted(self, per_layer_s: float | None = None) -> float:
        """The prediction in the measurement's unit, with the engine's shipped cost a layer (or ``per_layer_s``)."""
        if per_layer_s is None:
            shipped = engine_layer(self.engine, self.cluster.chip)
            per_layer_s = shipped.value if shipped is not None else 0.0
        seconds = self.kernels_s + self.engine_steps * per_layer_s * self.layers
        return self.concurrency / seconds if self.kind == "throughput" else seconds

    def ratio(self, per_layer_s: float | None = None) -> float:
        """Predicted over measured: above 1, the model is slower (or, for throughput, faster) than measured."""
        return self.predicted(per_layer_s) / self.measured


def _config(spec: dict[str, tp.Any]) -> ModelConfig:
    return full_config(spec["full"]) if "full" in spec else ModelConfig.from_hf(dict(spec["hf"]))


def _cluster(spec: dict[str, tp.Any]) -> Cluster:
    if "tpu" in spec:
        return Cluster.tpu(spec["tpu"])
    chip = {"h100": H100, "h200": H200}[spec["gpu"]]
    return Cluster.gpu(chip, nodes=1, gpus_per_node=spec["gpus"])


def _point(raw: dict[str, tp.Any]) -> ServingPoint:
    measured = raw["measured_tokens_per_s"] if raw["kind"] == "throughput" else raw["measured_s"]
    return ServingPoint(raw["name"], raw["kind"], raw["engine"], _config(raw["model"]), _cluster(raw["cluster"]),
                        dict(raw["mesh"]), raw["input_len"], raw["output_len"], raw["concurrency"], raw["prompts"],
                        raw["dtype"], raw["weight_dtype"], raw["kv_dtype"], measured, raw["model_name"],
                        raw["source"], raw["choices"], raw["note"], raw["prefill_chunk"])


@functools.cache
def published_points() -> tuple[ServingPoint, ...]:
    """Every priced point of ``published_serving.json``, in its order."""
    return tuple(_point(raw) for raw in json.loads(POINTS_FILE.read_text())["points"])


@functools.cache
def not_held_points() -> tuple[dict[str, str], ...]:
    """The measured points set aside, each with why (``name``, ``why``, ``source``)."""
    return tuple(json.loads(POINTS_FILE.read_text())["not_held"])


def fit_engine_layer(points: tp.Sequence[ServingPoint]) -> float:
    """The cost a layer at which ``points``' predicted / measured have a geometric mean of 1 (bisection: the mean
    log ratio rises with it); 0 where the kernels alone are already slower than measured."""
    if not points:
        raise ValueError("fitting an engine's cost a layer needs at least one measured decode step")

    def mean_log_ratio(x: float) -> float:
        return statistics.fmean(math.log(p.ratio(x)) for p in points)

    if mean_log_ratio(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1e-3  # a millisecond a layer is far beyond any engine measured
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_log_ratio(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_group(engine: str, chips: tuple[Hardware, ...],
              points: tp.Sequence[ServingPoint] | None = None) -> tuple[ServingPoint, ...]:
    """The decode points of ``engine`` on ``chips``: what its cost a layer is fitted to."""
    return tuple(p for p in (published_points() if points is None else points)
                 if p.kind == "decode" and p.engine == engine and p.cluster.chip in chips)


@dataclasses.dataclass(frozen=True)
class EngineRefit:
    """One engine's cost a layer on its chips: shipped, fitted on all its decode points, and refitted without each."""

    engine: str
    chips: tuple[Hardware, ...]
    shipped: float
    in_sample: float
    left_out: dict[str, float]


def leave_one_out(points: tp.Sequence[ServingPoint] | None = None
                  ) -> tuple[dict[str, float], tuple[EngineRefit, ...]]:
    """Each point's predicted / measured with its engine's cost a layer refitted without it where that cost was
    fitted to it (a decode point of a fitted engine and chip); every other point as shipped, out of sample already.
    Also each fitted engine's refits."""
    points = tuple(published_points() if points is None else points)
    ratios = {p.name: p.ratio() for p in points}
    refits = []
    for engine, chips in ENGINE_FITS:
        group = fit_group(engine, chips, points)
        if not group:
            continue
        left_out = {}
        for p in group:
            others = [q for q in group if q is not p]
            left_out[p.name] = fit_engine_layer(others) if others else 0.0
            ratios[p.name] = p.ratio(left_out[p.name])
        shipped = engine_layer(engine, chips[0])
        refits.append(EngineRefit(engine, chips, shipped.value if shipped else 0.0, fit_engine_layer(group),
                                  left_out))
    return ratios, tuple(refits)


@functools.cache
def out_of_sample() -> tuple[dict[str, float], tuple[EngineRefit, ...]]:
    """:func:`leave_one_out` of the published points (computed once)."""
    return leave_one_out()


def serving_accuracy_text(kind: str) -> str:
    """How far the serving model was from the published points of ``kind`` ("decode", "prefill"), out of sample:
    what a view prints beside a serving prediction."""
    ratios, _ = out_of_sample()
    mine = [p for p in published_points() if p.kind == kind]
    if not mine:
        raise ValueError(f"no published serving points of kind {kind!r}; kinds: {KINDS}")
    engines = ", ".join(sorted({p.engine for p in mine}))
    chips = ", ".join(sorted({" ".join(p.cluster.chip.name.split()[:2 if p.cluster.platform == "tpu" else 1])
                              for p in mine}))
    what = {"decode": "decode steps", "prefill": "times to the first token",
            "throughput": "throughputs at a published batch"}[kind]
    out = [ratios[p.name] for p in mine]
    return (f"with each engine's own cost, on {len(mine)} published {what} ({engines}; {chips}) the serving model "
            f"was {min(out):.2f}x to {max(out):.2f}x the measured out of sample, typically within "
            f"{statistics.median(max(r, 1 / r) for r in out) - 1:.0%} (benchmarks/published_serving.py)")


def accuracy(kind: str, points: tp.Sequence[ServingPoint] | None = None) -> Accuracy:
    """Predicted / measured of every point of ``kind`` as shipped (in sample for the decode points)."""
    return Accuracy({p.name: p.ratio() for p in (published_points() if points is None else points)
                     if p.kind == kind})


__all__ = ["BAND", "ENGINE_FITS", "KINDS", "EngineRefit", "ServingPoint", "accuracy", "fit_engine_layer",
           "fit_group", "leave_one_out", "not_held_points", "out_of_sample", "published_points",
           "serving_accuracy_text"]
