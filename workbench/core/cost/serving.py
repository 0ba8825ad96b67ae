"""A served model's steps as serving engines measure them: the time per output token (TPOT) of a running batch, the
time to the first token (TTFT) of a prompt, and the output tokens a second they give.

An engine with continuous batching runs one step after another, each decoding one token of every sequence in
flight and admitting new requests, whose prompts it prefills in the same steps (chunked or whole). At a steady
``concurrency`` of requests with ``input_len`` prompt and ``output_len`` output tokens each, a step:

- **decodes** ``concurrency`` sequences (split over the replicas, ``dp``) against KV caches of the mean context,
  ``input_len + output_len / 2``: :func:`~workbench.core.cost.predicted.predict_step` with ``task="decode"``, its
  weights and KV cache read in the dtypes they are stored in (``weight_dtype``, ``kv_dtype``);
- **prefills** the requests it admits: ``concurrency / output_len`` a step (each request lasts ``output_len``
  steps), each a prompt of ``input_len`` tokens, priced as a prefill step without the weights' read, which the
  decode step it joins has already paid (the prompt's matmuls, attention and collectives);
- pays **the engine's own cost**, a cost a layer beyond the bytes and FLOPs (the gaps between a layer's small
  kernels, the collectives' latency, the scheduler and the sampler spread over the layers), fitted per engine and
  chip to measured decode steps (:data:`~workbench.core.hardware.calibration.ENGINE_LAYER`; none where no
  measurement prices it, and the step says so).

TPOT is that step's time; the output tokens a second are ``concurrency`` over it. :func:`serving_frontier`
sweeps each layout (tensor parallelism inside a replica, replicas over ``dp``) over the requests in flight up to
what its KV cache holds, and marks the Pareto front of ms a token against tokens a second a chip (the scaling book's
latency-throughput plot, "Serving LLaMA 3"). TTFT of a prompt is the prefill
of the prompts that arrive together (one, or a batch sent at once): one step and one engine step, or, where the
engine chunks prefill, a step and an engine step for every chunk of its prefill budget; it leaves out what an
engine's queue adds under load. The references are the scaling book's "Inference" and "Serving LLaMA 3" chapters
(https://jax-ml.github.io/scaling-book/inference/), whose decode bound is the bytes loaded a step.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.checks import one_of, positive_int
from workbench.core.cost.flops import model_shapes
from workbench.core.cost.predicted import predict_step, stored_bytes
from workbench.core.cost.roofline import rate_dtype
from workbench.core.cost.step import StepTime
from workbench.core.cost.step_counts import ITEM_BYTES
from workbench.core.cost.step_pricing import ATTENTION_TERMS, HBM_BOUND_KERNELS
from workbench.core.cost.work import device_kv_elements, device_weight_elements
from workbench.core.hardware.calibration import engine_layer
from workbench.core.hardware.cluster import Cluster
from workbench.core.vocab import SERVING_ENGINES


@dataclasses.dataclass(frozen=True)
class EngineCost:
    """An engine's own cost a step on a chip: ``per_layer_s`` over ``layers`` layers, and where the figure comes
    from (``note``)."""

    engine: str | None
    per_layer_s: float
    layers: int
    note: str

    @property
    def seconds(self) -> float:
        return self.per_layer_s * self.layers


def engine_cost(engine: str | None, cluster: Cluster, config: tp.Any) -> EngineCost:
    """The cost a step of ``engine`` serving ``config`` on ``cluster``'s chip, fitted to measured steps (a cost a
    layer); 0, saying so, where there is no engine (the workbench's own program) or no measurement of it on that
    chip."""
    layers = model_shapes(config).layers
    if engine is None:
        return EngineCost(None, 0.0, layers, "no engine: the kernels and collectives alone")
    evidence = engine_layer(one_of("engine", engine, SERVING_ENGINES), cluster.chip)
    if evidence is None:
        return EngineCost(engine, 0.0, layers, f"{engine}'s own cost a step is not priced: no measured decode step "
                                               f"of it on {cluster.chip.name}")
    return EngineCost(engine, evidence.value, layers, f"{engine} on {cluster.chip.name}: "
                                                      f"{evidence.value * 1e6:.0f} us a layer ({evidence.source})")


@dataclasses.dataclass(frozen=True)
class ServingStep:
    """One step of continuous batching at a steady ``concurrency``: the decode of the running batch (``decode``),
    the prefill work of the requests it admits (``prefill_s``), the engine's own cost (``engine``)."""

    decode: StepTime
    prefill_s: float
    engine: EngineCost
    concurrency: int
    context: int  # the decode's mean KV-cache length

    @property
    def time_s(self) -> float:
        """The step's seconds: the time per output token (TPOT) of every sequence in flight."""
        return self.decode.time_s + self.prefill_s + self.engine.seconds

    @property
    def tokens_per_s(self) -> float:
        """Output tokens a second over the cluster (every replica)."""
        return self.concurrency / self.time_s

    @property
    def tokens_per_s_per_chip(self) -> float:
        cluster = self.decode.cluster
        return self.tokens_per_s / (cluster.num_devices / cluster.devices_per_chip)

    def parts(self) -> dict[str, float]:
        """The step's seconds by what they price: "decode", "prefill of admitted requests", "engine"."""
        return {"decode": self.decode.time_s, "prefill of admitted requests": self.prefill_s,
                "engine": self.engine.seconds}


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """The time to the first token of ``prompts`` prompts sent at once. Whole (``chunk`` None): their prefill as one
    step (``prefill``) and one engine step. Chunked: ``steps`` steps of at most ``chunk`` tokens a replica, each its
    matmuls, fusions and collectives (``chunk_s``, the last step's share of them in ``last_chunk_s``) and an engine
    step, with the prompts' attention, quadratic in their length, priced once from ``prefill``."""

    prefill: StepTime
    engine: EngineCost
    prompts: int
    chunk: int | None = None
    steps: int = 1
    chunk_s: float = 0.0
    last_chunk_s: float = 0.0

    @property
    def attention_s(self) -> float:
        return sum(t.seconds for t in self.prefill.terms if t.name in ATTENTION_TERMS)

    @property
    def time_s(self) -> float:
        if self.chunk is None:
            return self.prefill.time_s + self.engine.seconds
        return ((self.steps - 1) * self.chunk_s + self.last_chunk_s + self.attention_s
                + self.steps * self.engine.seconds)


def _served(dtype: tp.Any, weight_dtype: str | None, kv_dtype: str | None) -> dict[str, tp.Any]:
    return {"dtype": dtype, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype}


def serving_step(config: tp.Any, cluster: Cluster, mesh_shape: tp.Mapping[str, int], *, concurrency: int,
                 input_len: int, output_len: int, dtype: tp.Any = "bf16", weight_dtype: str | None = None,
                 kv_dtype: str | None = None, engine: str | None = None) -> ServingStep:
    """A continuous-batching step of ``config`` served on ``cluster`` with a mesh of ``mesh_shape`` (``tp`` inside a
    replica, ``dp`` the replicas), ``concurrency`` requests in flight of ``input_len`` prompt and ``output_len``
    output tokens each (the module doc says what it prices). Raises ``ValueError`` where the replicas do not
    divide the concurrency."""
    concurrency = positive_int("concurrency", concurrency, what="a positive int (requests in flight)")
    input_len = positive_int("input_len", input_len, what="a positive int (prompt tokens)")
    output_len = positive_int("output_len", output_len, what="a positive int (output tokens)")
    served = _served(dtype, weight_dtype, kv_dtype)
    context = input_len + output_len // 2
    decode = predict_step(config, cluster, mesh_shape, batch=(concurrency, context), task="decode", **served)
    replicas = decode.mesh.get("dp", 1)
    prompt = predict_step(config, cluster, mesh_shape, batch=(replicas, input_len), task="prefill", **served)
    beyond_weights = prompt.time_s - sum(t.seconds for t in prompt.terms if t.name == HBM_BOUND_KERNELS[0])
    admitted = concurrency / replicas / output_len  # requests a replica admits a step
    return ServingStep(decode, admitted * beyond_weights, engine_cost(engine, cluster, config), concurrency,
                       context)


def time_to_first_token(config: tp.Any, cluster: Cluster, mesh_shape: tp.Mapping[str, int], *, input_len: int,
                        prompts: int = 1, prefill_chunk: int | None = None, dtype: tp.Any = "bf16",
                        weight_dtype: str | None = None, kv_dtype: str | None = None,
                        engine: str | None = None) -> FirstToken:
    """TTFT of ``prompts`` prompts of ``input_len`` tokens sent at once (a multiple of the replicas, ``dp``); an
    engine's queue under load is not in it.

    ``prefill_chunk`` None: one prefill step of them all and one engine step (TensorRT-LLM's context phase without
    chunking). A number of tokens: the engine's prefill budget a step (sglang's ``--chunked-prefill-size``, vLLM's
    ``--max-num-batched-tokens``), so a replica's prompt tokens take ``ceil(tokens / prefill_chunk)`` steps, each
    reading the weights again and paying the engine's step; attention is priced once over the whole prompts (a
    chunk attends to the cache its prompt's earlier chunks wrote)."""
    prompts = positive_int("prompts", prompts, what="a positive int (prompts sent at once)")
    served = _served(dtype, weight_dtype, kv_dtype)
    prefill = predict_step(config, cluster, mesh_shape, batch=(prompts, input_len), task="prefill", **served)
    cost = engine_cost(engine, cluster, config)
    if prefill_chunk is None:
        return FirstToken(prefill, cost, prompts)
    prefill_chunk = positive_int("prefill_chunk", prefill_chunk,
                                 what="a positive int (prompt tokens an engine step takes a replica) or None")
    replicas = prefill.mesh.get("dp", 1)
    tokens = prompts // replicas * input_len
    steps, last = -(-tokens // prefill_chunk), tokens % prefill_chunk or prefill_chunk

    def beyond_attention(chunk: int) -> float:
        step = predict_step(config, cluster, mesh_shape, batch=(replicas, chunk), task="prefill", **served)
        return sum(t.seconds for t in step.terms if t.name not in ATTENTION_TERMS)

    first = min(prefill_chunk, tokens)
    chunk_s = beyond_attention(first)
    return FirstToken(prefill, cost, prompts, prefill_chunk, steps, chunk_s,
                      chunk_s if last == first else beyond_attention(last))


# -- the latency-throughput frontier ----------------------------------------------------------------------------
def served_bytes(config: tp.Any, tp_size: int, *, dtype: tp.Any = "bf16", weight_dtype: str | None = None,
                 kv_dtype: str | None = None) -> tuple[float, float]:
    """What one device of a ``tp_size``-way replica holds: its weights' bytes (the layers' matmuls in their stored
    dtype; the head, the embedding and the norms' scales in bfloat16) and a token's KV cache bytes (its layers' K
    and V heads there)."""
    shapes = model_shapes(config)
    weight_item, kv_item = stored_bytes("decode", rate_dtype(dtype), weight_dtype, kv_dtype)
    w = device_weight_elements(shapes, tp_size)
    moe_layers = shapes.layers - shapes.dense_layers if shapes.moe else 0
    layer_weights = (shapes.layers * w["attention"] + (shapes.layers - moe_layers) * w["mlp"]
                     + moe_layers * (w["experts"] + w["shared"] + w["router"]))
    norms = (2 * shapes.layers + 1) * shapes.hidden  # each layer's two RMSNorm scales and the final one, replicated
    weights = layer_weights * weight_item + (w["head"] + w["embedding"] + norms) * ITEM_BYTES["bf16"]
    return weights, shapes.layers * device_kv_elements(shapes, tp_size) * kv_item


def kv_capacity(config: tp.Any, cluster: Cluster, tp_size: int, *, memory_fraction: float = 0.9,
                **served: tp.Any) -> int:
    """KV-cache tokens one replica of ``tp_size`` devices holds: ``memory_fraction`` of a device's HBM (what
    engines give themselves: vLLM's ``gpu_memory_utilization``, TensorRT-LLM's free-memory fraction) less its
    weights, over a token's cache bytes there. 0 where the weights alone do not fit."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction is the share of a device's HBM the engine takes, in (0, 1]; got "
                         f"{memory_fraction!r}")
    weights, kv = served_bytes(config, tp_size, **served)
    return max(0, int((memory_fraction * cluster.hbm_per_device - weights) // kv))


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """One serving layout at one concurrency: its step, and whether no other point is both faster a token and
    more tokens a second a chip (``on_front``)."""

    mesh: dict[str, int]
    step: ServingStep
    on_front: bool = False

    @property
    def ms_per_token(self) -> float:
        return self.step.time_s * 1e3

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.step.tokens_per_s_per_chip

    @property
    def layout(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in self.mesh.items())

    @property
    def label(self) -> str:
        return f"{self.layout}, {self.step.concurrency} in flight"


def serving_frontier(config: tp.Any, cluster: Cluster, *, input_len: int, output_len: int, dtype: tp.Any = "bf16",
                     weight_dtype: str | None = None, kv_dtype: str | None = None, engine: str | None = None,
                     memory_fraction: float = 0.9, tp_sizes: tp.Sequence[int] | None = None,
                     ) -> tuple[FrontierPoint, ...]:
    """Every serving layout of ``cluster`` (``tp`` a power of two within a node or slice's devices, the rest
    replicas over ``dp``) swept over the requests in flight, doubling from one a replica up to what its KV cache
    holds (:func:`kv_capacity`, each request at its full ``input_len + output_len``), with the Pareto front of ms a
    token against output tokens a second a chip marked. A layout whose weights do not fit is left out."""
    served = _served(dtype, weight_dtype, kv_dtype)
    devices = cluster.num_devices
    inner = cluster.gpus_per_node if cluster.platform == "gpu" else devices
    sizes = tp_sizes or [t for t in (2 ** i for i in range(inner.bit_length())) if t <= inner and devices % t == 0]
    points = []
    for tp_size in sizes:
        replicas = devices // tp_size
        mesh = {"dp": replicas, "tp": tp_size} if replicas > 1 else {"tp": tp_size}
        most = kv_capacity(config, cluster, tp_size, memory_fraction=memory_fraction, **served) // (
            input_len + output_len)
        per_replica = [b for b in (2 ** i for i in range(max(most, 1).bit_length())) if b <= most]
        if most and most not in per_replica:
            per_replica.append(most)
        for b in per_replica:
            step = serving_step(config, cluster, mesh, concurrency=b * replicas, input_len=input_len,
                                output_len=output_len, engine=engine, **served)
            points.append(FrontierPoint(mesh, step))
    return _mark_front(points)


def _mark_front(points: list[FrontierPoint]) -> tuple[FrontierPoint, ...]:
    """The points with the front marked: sorted by ms a token, a point is on it when it gives more tokens a second
    a chip than every faster point."""
    best, marked = -1.0, []
    for p in sorted(points, key=lambda p: (p.ms_per_token, -p.tokens_per_s_per_chip)):
        on = p.tokens_per_s_per_chip > best
        best = max(best, p.tokens_per_s_per_chip)
        marked.append(dataclasses.replace(p, on_front=on))
    return tuple(marked)


__all__ = ["EngineCost", "FirstToken", "FrontierPoint", "ServingStep", "engine_cost", "kv_capacity", "served_bytes",
           "serving_frontier", "serving_step", "time_to_first_token"]
