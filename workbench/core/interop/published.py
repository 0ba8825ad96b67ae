"""Training steps others measured and published, priced by the step model: how true its predictions are.

``published_runs.json`` (beside this module) holds each run with a complete configuration (MaxText's recipes and
README tables on TPU v4, v5e, v5p and v6e; torchtitan, Megatron-Bridge and NeMo on H100 and H200): the model, the
cluster, the layout, the batch, the recompute, the dtype, the measured step time, and where each was published
(the raw records, every quote and derivation, are in ``benchmarks/data/published_runs_*.json``).
:func:`price` predicts one with :func:`~workbench.core.cost.predicted.predict_step`; :func:`accuracy` says how
far the predictions were from the measurements, which every view prints beside a prediction.

>>> runs = published_runs()
>>> len(runs) >= 12, sorted({r.cluster.platform for r in runs})
(True, ['gpu', 'tpu'])
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import statistics
import typing as tp

from workbench.core.cost.predicted import BATCH_AXES, predict_step
from workbench.core.cost.step_time import StepTime
from workbench.core.hardware.chips import H100, H100_500W, H200
from workbench.core.hardware.cluster import Cluster
from workbench.core.models.config import ModelConfig
from workbench.core.pipeline_schedule import PipelineConfig

RUNS_FILE = pathlib.Path(__file__).with_name("published_runs.json")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One measured training step and everything needed to price it."""

    name: str
    framework: str
    config: ModelConfig
    cluster: Cluster
    mesh: dict[str, int]
    batch: tuple[int, int]
    measured_s: float
    recompute: float
    dtype: str
    source: dict[str, str]
    pipeline: PipelineConfig | None = None
    grad_accumulation: int = 1
    batch_axes: tuple[str, ...] = BATCH_AXES
    capacity_factor: float | None = None
    tp_overlap: bool | None = None  # None: predict_step's default for the platform
    remat_note: str = ""
    note: str = ""

    @property
    def chip(self) -> str:
        return self.cluster.chip.name

    @property
    def layout(self) -> str:
        text = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1)
        if self.pipeline is not None:
            p = self.pipeline
            text += f", {p.num_microbatches} microbatches {p.schedule}" + (
                f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        if self.grad_accumulation > 1:
            text += f", {self.grad_accumulation} accumulated microbatches"
        return text


def _config(spec: dict[str, tp.Any]) -> ModelConfig:
    if "hf" in spec:
        return ModelConfig.from_hf(dict(spec["hf"]))
    fields = {k: v for k, v in spec["config"].items() if k != "model_type"}
    return ModelConfig(**fields)


def _cluster(spec: dict[str, tp.Any]) -> Cluster:
    if "tpu" in spec:
        return Cluster.tpu(spec["tpu"], slices=spec.get("slices", 1))
    chip = {"h100": H100, "h200": H200, "h100-96gb-500w": H100_500W}[spec["gpu"]]
    return Cluster.gpu(chip, nodes=spec["nodes"])


def _run(raw: dict[str, tp.Any]) -> PublishedRun:
    pipeline = None
    if raw.get("pipeline"):
        p = raw["pipeline"]
        pipeline = PipelineConfig(p["stages"], p["microbatches"], p.get("schedule", "1f1b"),
                                  p.get("virtual_stages") if p.get("schedule") == "interleaved" else None,
                                  uneven=p.get("uneven", False))
    return PublishedRun(
        raw["name"], raw["framework"], _config(raw["model"]), _cluster(raw["cluster"]), dict(raw["mesh"]),
        tuple(raw["batch"]), float(raw["measured_s"]), float(raw["recompute"]), raw["dtype"], raw["source"],
        pipeline, raw.get("grad_accumulation", 1), tuple(raw.get("batch_axes", BATCH_AXES)),
        raw.get("capacity_factor"), raw.get("tp_overlap"), raw.get("remat_note", ""), raw.get("note", ""))


@functools.cache
def published_runs() -> tuple[PublishedRun, ...]:
    """Every published run the model is held against (``published_runs.json``)."""
    return tuple(_run(raw) for raw in json.loads(RUNS_FILE.read_text())["runs"])


def price(run: PublishedRun) -> StepTime:
    """``run``'s step as :func:`~workbench.core.cost.predicted.predict_step` predicts it."""
    return predict_step(run.config, run.cluster, run.mesh, batch=run.batch, task="train",
                        remat="full" if run.recompute > 0 else "none", recompute=run.recompute,
                        pipeline=run.pipeline, dtype=run.dtype, batch_axes=run.batch_axes,
                        grad_accumulation=run.grad_accumulation, capacity_factor=run.capacity_factor,
                        tp_overlap=run.tp_overlap)


@dataclasses.dataclass(frozen=True)
class Accuracy:
    """Predicted over measured step time on the published runs: each ratio, and the summary a view prints."""

    ratios: dict[str, float]

    @property
    def low(self) -> float:
        return min(self.ratios.values())

    @property
    def high(self) -> float:
        return max(self.ratios.values())

    @property
    def median_abs(self) -> float:
        """The median of ``max(r, 1/r)``: how far a typical prediction is off, either way."""
        return statistics.median(max(r, 1 / r) for r in self.ratios.values())

    @property
    def worst_abs(self) -> float:
        return max(max(r, 1 / r) for r in self.ratios.values())

    def text(self) -> str:
        runs = [r for r in published_runs() if r.name in self.ratios]
        frameworks = ", ".join(sorted({r.framework.split(" (")[0] for r in runs}))
        chips = ", ".join(sorted({" ".join(r.chip.split()[:2 if r.chip.startswith("TPU") else 1]) for r in runs}))
        return (f"on {len(self.ratios)} published runs ({frameworks}; {chips}) predictions were {self.low:.2f}x to "
                f"{self.high:.2f}x the measured step time, typically within {(self.median_abs - 1):.0%}")


@functools.cache
def accuracy() -> Accuracy:
    """How far :func:`price` was from each run's measurement (computed once)."""
    return Accuracy({run.name: price(run).time_s / run.measured_s for run in published_runs()})


def accuracy_text() -> str:
    """:meth:`Accuracy.text` of :func:`accuracy`, for a view to print beside a prediction."""
    return accuracy().text()


__all__ = ["RUNS_FILE", "Accuracy", "PublishedRun", "accuracy", "accuracy_text", "price", "published_runs"]
