"""Training steps others measured and published, priced by the step model: how true its predictions are.

``published_runs.json`` (beside this module) holds each run with a complete configuration (MaxText's recipes and
README tables on TPU v4, v5e, v5p and v6e; torchtitan, Megatron-Bridge, NeMo and llm-foundry on H100 and H200): the
model, the cluster, the layout, the batch, the recompute, the dtype, the program (its attention kernel, vocabulary
tiles, offload), the measured step time, and where each was published
(the raw records, every quote and derivation, are in ``benchmarks/data/published_runs_*.json``).
:func:`price` predicts one from its plan (:func:`workbench.core.cost.price.price`); :func:`accuracy` says how
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

from workbench.core.cost.price import price as price_plan
from workbench.core.cost.step import StepTime
from workbench.core.hardware.chips import B200, H100, H100_500W, H200
from workbench.core.hardware.cluster import Cluster
from workbench.core.models.config import ModelConfig
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import BATCH_AXES, PRODUCTION, Plan

RUNS_FILE = pathlib.Path(__file__).with_name("published_runs.json")
# predicted / measured within this band: a run the step model predicts (issue 47's target for every run); a run
# inside it validates the regimes of its layout (:mod:`workbench.core.advisor.regimes`)
BAND = (0.7, 1.35)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One measured training step and everything needed to price it: the model, the cluster, the global batch and
    the :class:`~workbench.core.plan.Plan` it ran as (its recompute the fraction of a layer's forward matmuls the
    framework's policy recomputes)."""

    name: str
    framework: str
    config: ModelConfig
    cluster: Cluster
    plan: Plan
    batch: tuple[int, int]
    measured_s: float
    source: dict[str, str]
    remat_note: str = ""
    note: str = ""
    not_held: str = ""  # why the step model is not held to this run (:func:`not_held_runs`), else empty

    @property
    def chip(self) -> str:
        return self.cluster.chip.name

    @property
    def layout(self) -> str:
        return self.plan.label()


def _config(spec: dict[str, tp.Any]) -> ModelConfig:
    if "hf" in spec:
        return ModelConfig.from_hf(dict(spec["hf"]))
    fields = {k: v for k, v in spec["config"].items() if k != "model_type"}
    return ModelConfig(**fields)


def _cluster(spec: dict[str, tp.Any]) -> Cluster:
    if "tpu" in spec:
        return Cluster.tpu(spec["tpu"], slices=spec.get("slices", 1))
    if spec["gpu"] == "gb200":
        return Cluster.gb200_nvl72(spec["racks"], gpus_per_rack=spec["gpus_per_rack"])
    chip = {"h100": H100, "h200": H200, "h100-96gb-500w": H100_500W, "b200": B200}[spec["gpu"]]
    return Cluster.gpu(chip, nodes=spec["nodes"])


# whose autodiff each framework's runs use (Plan.autograd): MaxText's JAX, the others PyTorch's autograd
AUTOGRAD_OF = {"MaxText": "jax", "MaxText (2023 README table)": "jax", "llm-foundry": "pytorch",
               "torchtitan": "pytorch", "Megatron-Bridge": "pytorch", "NeMo": "pytorch"}


def _autograd(raw: dict[str, tp.Any]) -> str:
    """The run's own ``autograd`` where it gives one, else its framework's (:data:`AUTOGRAD_OF`)."""
    if "autograd" in raw:
        return raw["autograd"]
    if raw["framework"] not in AUTOGRAD_OF:
        raise ValueError(f"published run {raw['name']!r}: framework {raw['framework']!r} has no known autodiff; "
                         f"give the run an 'autograd' ('jax' or 'pytorch') or add the framework to AUTOGRAD_OF "
                         f"(known: {', '.join(AUTOGRAD_OF)})")
    return AUTOGRAD_OF[raw["framework"]]


def _run(raw: dict[str, tp.Any]) -> PublishedRun:
    pipeline = None
    if raw.get("pipeline"):
        p = raw["pipeline"]
        pipeline = PipelineConfig(p["stages"], p["microbatches"], p.get("schedule", "1f1b"),
                                  p.get("virtual_stages") if p.get("schedule") == "interleaved" else None,
                                  uneven=p.get("uneven", False))
    recompute = float(raw["recompute"])
    remat = raw.get("remat", "full" if recompute > 0 else "none")
    plan = Plan(dict(raw["mesh"]), remat=remat, recompute=recompute, pipeline=pipeline,
                dtype=raw["dtype"], batch_axes=tuple(raw.get("batch_axes", BATCH_AXES)),
                grad_accumulation=raw.get("grad_accumulation", 1), capacity_factor=raw.get("capacity_factor"),
                tp_overlap=raw.get("tp_overlap"), **{**PRODUCTION, **{k: raw[k] for k in PRODUCTION if k in raw},
                                                     "autograd": _autograd(raw)})
    return PublishedRun(raw["name"], raw["framework"], _config(raw["model"]), _cluster(raw["cluster"]), plan,
                        tuple(raw["batch"]), float(raw["measured_s"]), raw["source"], raw.get("remat_note", ""),
                        raw.get("note", ""), raw.get("not_held", ""))


@functools.cache
def published_runs() -> tuple[PublishedRun, ...]:
    """Every published run the model is held against (``published_runs.json``)."""
    return tuple(_run(raw) for raw in json.loads(RUNS_FILE.read_text())["runs"])


# More experts than this: a fine-grained mixture of experts (DeepSeek-V3's 256, Qwen3-MoE's 128, GPT-OSS's 128), whose
# published steps the model is not held to (:func:`not_held_runs`); Mixtral's 8 large experts are held.
FINE_GRAINED_EXPERTS = 16


def fine_grained_moe(config: tp.Any) -> bool:
    """Whether ``config`` (a :class:`~workbench.core.models.config.ModelConfig`, or a model with one) is a
    fine-grained mixture of experts, a kind of step the model is not held to."""
    config = getattr(config, "config", config)
    return getattr(config, "mlp_type", "") == "moe" and getattr(config, "num_local_experts", 0) > FINE_GRAINED_EXPERTS


@functools.cache
def not_held_runs() -> tuple[PublishedRun, ...]:
    """Published runs priced and shown but not held within :data:`BAND`: a kind of step the model is known to miss
    (each run's ``not_held`` says why; today the fine-grained MoE runs, on TPU7x, B200 and GB200). A view predicting
    such a step prints their spread beside it (:func:`workbench.core.interop.out_of_sample.accuracy_text`)."""
    return tuple(_run(raw) for raw in json.loads(RUNS_FILE.read_text()).get("not_held", []))


def price(run: PublishedRun) -> StepTime:
    """``run``'s step as the step model predicts it (:func:`workbench.core.cost.price.price` of its plan)."""
    return price_plan(run.plan, run.config, run.cluster, run.batch, "train")


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
        chips = ", ".join(sorted({"GB200" if "GB200" in r.chip else " ".join(r.chip.split()[:2 if r.chip.startswith(
            "TPU") else 1]) for r in runs}))
        return (f"on {len(self.ratios)} published training steps ({frameworks}; {chips}) predictions were "
                f"{self.low:.2f}x to "
                f"{self.high:.2f}x the measured step time, typically within {(self.median_abs - 1):.0%}")


@functools.cache
def accuracy() -> Accuracy:
    """How far :func:`price` was from each run's measurement (computed once)."""
    return Accuracy({run.name: price(run).time_s / run.measured_s for run in published_runs()})


__all__ = ["BAND", "FINE_GRAINED_EXPERTS", "RUNS_FILE", "Accuracy", "PublishedRun", "accuracy", "fine_grained_moe",
           "not_held_runs", "price", "published_runs"]
