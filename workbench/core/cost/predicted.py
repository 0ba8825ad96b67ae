"""A layout's step time predicted from the model's shapes, without compiling: what a layout search ranks by.

:func:`predict_step` counts, per device, the matmul FLOPs, the HBM bytes and every collective of one train,
prefill or decode step of a :class:`~workbench.core.models.config.ModelConfig` laid out on a mesh of
``(pp, dp, fsdp, ep, tp, sp)`` sizes, and prices them on a :class:`~workbench.core.hardware.cluster.Cluster` with
:mod:`workbench.core.hardware.network` (the roofline and :func:`~workbench.core.hardware.network.transfer`). It returns
a :class:`~workbench.core.cost.step.StepTime`, the same record a compiled step gets, with the work split by layer
kind (:meth:`~workbench.core.cost.step.StepTime.by_kind`: "attention", "mlp", "experts", "embedding+head",
"optimizer", "pipeline") and a pipeline's bubble. The references are the chapters of "How to Scale Your
Model" (Austin et al., https://jax-ml.github.io/scaling-book/): "Transformer Math" (transformers/),
"Training" (training/), "Training LLaMA 3" (applied-training/), "Inference" (inference/), "Serving LLaMA 3"
(applied-inference/) and "How to Think About GPUs" (gpus/).

>>> from workbench.core.hardware.cluster import Cluster
>>> from workbench.core.models.presets import full_config
>>> step = predict_step(full_config("llama-3-70b"), Cluster.h100(nodes=8), {"fsdp": 8, "tp": 8}, batch=(32, 4096))
>>> step.bound, round(step.time_s, 2), sorted(step.by_kind())
('compute', 2.91, ['attention', 'embedding+head', 'mlp', 'optimizer'])
>>> ideal = predict_step(full_config("llama-3-70b"), Cluster.h100(nodes=8), {"fsdp": 8, "tp": 8}, batch=(32, 4096),
...                      efficiency=1.0)  # the book's roofline: matmuls at peak, the longest part
>>> ideal.bound, round(ideal.time_s, 2), ideal.mfu_text()
('communication', 1.34, '≤ 69%')

The counts and the prices live where each piece is derived: :mod:`~workbench.core.cost.step_counts` (what a step
counts), :mod:`~workbench.core.cost.work` (the FLOPs, bytes and GEMMs of each layer kind: its doc derives them),
:mod:`~workbench.core.cost.parallel` (one module per parallelism: its collectives and what hides them) and
:mod:`~workbench.core.cost.step_pricing` (the measured step model and the roofline).

Compiled steps differ in ways ``tests/core/cost/test_predicted.py`` measures (a 4-layer Llama, fsdp=4 x tp=2):
the dots agree to the FLOP (XLA:CPU) or within 0.01 % (XLA:TPU); XLA:TPU's TP all-reduces are these to the
byte. Both compilers all-reduce the scanned layers' gradients whole over fsdp, then slice, where this model
reduce-scatters them (twice as long on the network). XLA:CPU (what a GPU cluster compiles to here) computes
bfloat16 as float32 (bytes x2) and all-reduces each column-parallel input gradient on its own (5 a dense layer's
backward, not 2); XLA:TPU gathers some weights again for each use in the backward (3.5x these gathers there).
"""

from __future__ import annotations

import math
import typing as tp

from workbench.core.checks import batch_shape, one_of, positive_int
from workbench.core.cost import work
from workbench.core.cost.flops import ModelShapes, model_flops, model_shapes
from workbench.core.cost.parallel import data, expert, sequence, tensor
from workbench.core.cost.parallel.pipeline import stage_collectives, staged_shares
from workbench.core.cost.roofline import rate_dtype
from workbench.core.cost.step import StepTime
from workbench.core.cost.step_counts import (
    ITEM_BYTES,
    KV_ITEM_BYTES,
    WEIGHT_ITEM_BYTES,
    WORK_KINDS,
    StepCounts,
    StepSizes,
)
from workbench.core.cost.step_pricing import measured_step, roofline_step
from workbench.core.hardware.cluster import Cluster
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.plan import BATCH_AXES
from workbench.core.vocab import ATTENTION_KERNELS, KV_DTYPES, REMATS, TASKS, WEIGHT_DTYPES
from workbench.core.zero import check_zero_stage


def predict_step(config: tp.Any, cluster: Cluster, mesh_shape: tp.Mapping[str, int], *, batch: tuple[int, int],
                 task: str = "train", remat: str = "full", pipeline: PipelineConfig | None = None,
                 kv_length: int | None = None, dtype: tp.Any = "bf16", efficiency: float | None = None,
                 overlap: bool = True, batch_axes: tp.Sequence[str] = BATCH_AXES, zero_stage: int = 0,
                 grad_accumulation: int = 1, recompute: float | None = None, capacity_factor: float | None = None,
                 tp_overlap: bool | None = None, causal: bool = True, experts_fsdp: bool = True,
                 ring_overlap: bool = True, attention: str = "flash", vocab_tiles: int = 1,
                 weight_dtype: str | None = None, kv_dtype: str | None = None) -> StepTime:
    """The predicted time of one ``task`` step of ``config`` on ``cluster`` with a mesh of ``mesh_shape`` (workbench
    axes, e.g. ``{"fsdp": 16, "tp": 4}``), derived from shapes alone (:mod:`~workbench.core.cost.work` and
    :mod:`~workbench.core.cost.parallel` derive every term).

    ``batch = (sequences, length)``: the global batch of a train step or a prefill; for decode the sequences
    and the context length (one new token each; ``kv_length`` overrides the length). ``remat`` is the layers'
    rematerialisation policy (train only); ``pipeline`` a :class:`PipelineConfig` whose ``num_stages`` is the
    mesh's ``pp``; ``dtype`` the parameters' and activations' ("bf16", or "int8" / "fp8": 1 byte, their peak
    rate); ``batch_axes`` the mesh axes the batch splits over; ``zero_stage=1`` the optimizer state split over
    ``dp`` (ZeRO-1, :mod:`workbench.core.zero`).

    By default the step is priced by the measured step model
    (:func:`~workbench.core.cost.step_pricing.measured_terms`): kernels at the efficiencies
    :mod:`~workbench.core.hardware.calibration` cites, memory-bound work beside the matmuls, and only the communication
    that nothing hides (``overlap=False``: none hidden). ``grad_accumulation`` microbatches run one after another
    (no pipeline); ``recompute`` the fraction of a layer's forward matmuls its backward recomputes (default: 1 under
    ``remat="full"``, else 0; MaxText's "minimal" / "save_qkv_proj" policies lie between); ``capacity_factor`` pads
    each expert to ``factor x`` its balanced share of tokens (None: dropless, ragged GEMMs); ``tp_overlap`` hides
    the tensor-parallel collectives behind the matmuls (collective matmul, async TP; default: on TPU, where XLA
    decomposes them into windowed einsums unless told not to, off on GPU, where it takes async TP or Megatron's
    ``--tp-comm-overlap``); ``causal`` lets the attention kernel skip masked tiles; ``ring_overlap=False``
    leaves ring attention's passes exposed instead of hidden behind the attention kernels (the slow end of a
    ring no published run validates: :mod:`workbench.core.advisor.regimes`); ``experts_fsdp=False`` keeps the
    expert weights whole over ``fsdp`` (split over ``ep`` and ``tp`` only: no gathers, an all-reduce of their
    gradients over the data axes instead); ``attention`` names the attention kernel, whose rate prices its calls
    (:func:`~workbench.core.cost.kernels.attention_rate`; ``"xla"`` at the flash rate); ``vocab_tiles > 1`` computes
    the loss tile by tile and recomputes each tile's logits in the backward (MaxText's ``num_vocab_tiling``: the LM
    head's forward GEMM and its float32 logits pass once more). A served model (prefill, decode) may store its
    weights and its KV cache in other dtypes than it computes in: ``weight_dtype`` (one of ``WEIGHT_DTYPES``: fp8 or
    int8 stored as such, read once a step and never cast again; "int4" weight-only with its scales; the head and
    the embedding stay bfloat16, as ModelOpt, AWQ and GPTQ leave them) and ``kv_dtype`` (one of ``KV_DTYPES``);
    each defaults to ``dtype``'s (``dtype="fp4"``: NVFP4 weights, an fp8 cache). ``efficiency`` (a float) prices
    the old way instead: the roofline with matmuls at that fraction of peak, compute, memory and communication
    overlapped (1: the ideal, whose MFU and HFU are upper bounds). Raises ``ValueError`` for a batch or sequence
    the mesh does not divide, and for ``pp > 1`` without a matching ``pipeline``.
    """
    sizes = _check(task, remat, batch, batch_axes, mesh_shape, cluster)
    zero = check_zero_stage(zero_stage) == 1 and task == "train" and sizes["dp"] > 1
    shapes = model_shapes(config)
    rate = rate_dtype(dtype)
    stored = stored_bytes(task, rate, weight_dtype, kv_dtype)
    step = _step_sizes(shapes, sizes, batch, task=task, remat=remat, pipeline=pipeline, kv_length=kv_length,
                       rate=rate, batch_axes=batch_axes, zero=zero, grad_accumulation=grad_accumulation,
                       recompute=recompute, capacity_factor=capacity_factor, causal=causal, experts_fsdp=experts_fsdp,
                       attention=attention, vocab_tiles=vocab_tiles, stored=stored)
    counts = _count_step(shapes, step)
    staged = staged_shares(shapes, step)
    # MFU's model FLOPs (PaLM's): the whole step's, shared over every device; work a device repeats is not counted
    model = model_flops(config, batch, task=task, kv_length=kv_length) / cluster.num_devices
    if efficiency is not None:
        return roofline_step(counts, step, cluster, efficiency=efficiency, overlap=overlap, staged=staged,
                             model_flops=model)
    if tp_overlap is None:
        tp_overlap = cluster.platform == "tpu"
    return measured_step(counts, step, cluster, overlap=overlap, tp_overlap=tp_overlap, staged=staged,
                         model_flops=model, ring_overlap=ring_overlap)


def _check(task: str, remat: str, batch: tp.Any, batch_axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
           cluster: Cluster) -> dict[str, int]:
    """The task, remat policy, batch and batch axes, each on its own; the mesh's axis sizes."""
    one_of("task", task, TASKS)
    one_of("remat", remat, REMATS)
    batch_shape(batch)
    sizes = cluster.axis_sizes(mesh_shape)
    bad = sorted(set(batch_axes) - {"dp", "fsdp", "ep"})
    if bad:
        raise ValueError(f"batch_axes split the batch: a subset of ('dp', 'fsdp', 'ep'); got {bad}")
    return sizes



def stored_bytes(task: str, rate: str, weight_dtype: str | None, kv_dtype: str | None) -> tuple[float, float]:
    """Bytes a stored weight and a KV-cache element take: ``weight_dtype``'s and ``kv_dtype``'s, else ``rate``'s."""
    if task == "train" and (weight_dtype is not None or kv_dtype is not None or rate == "fp4"):
        raise ValueError("weight_dtype, kv_dtype and fp4 describe a served model (task='prefill' or 'decode'); a "
                         "train step keeps its weights in dtype (bf16, int8 or fp8) and has no KV cache")
    weight = WEIGHT_ITEM_BYTES[rate if weight_dtype is None else one_of("weight_dtype", weight_dtype, WEIGHT_DTYPES)]
    kv = KV_ITEM_BYTES[rate if kv_dtype is None else one_of("kv_dtype", kv_dtype, KV_DTYPES)]
    return weight, kv


def _check_schedule(big: int, data_ways: int, pp: int, pipeline: PipelineConfig | None, grad_accumulation: int,
                    recompute: float | None, capacity_factor: float | None, batch_axes: tuple[str, ...]) -> None:
    """The batch, pipeline, accumulation, recompute and capacity arguments, each against the others."""
    if big % data_ways:
        raise ValueError(f"{big} sequences do not split over the batch axes {batch_axes} ({data_ways} ways); use a "
                         f"multiple of {data_ways} or fewer data-parallel devices")
    if pp > 1 and pipeline is None:
        raise ValueError(f"the mesh has pp={pp}: pass pipeline=PipelineConfig(num_stages={pp}, num_microbatches=...)")
    if pipeline is not None and pipeline.num_stages != pp:
        raise ValueError(f"PipelineConfig(num_stages={pipeline.num_stages}) but the mesh has pp={pp}; make them equal")
    positive_int("grad_accumulation", grad_accumulation, what="a positive int (microbatches a step)")
    if pipeline is not None and grad_accumulation != 1:
        raise ValueError("a pipeline's microbatches are its gradient accumulation: pass num_microbatches in "
                         "PipelineConfig and leave grad_accumulation=1")
    if recompute is not None and not 0 <= recompute <= 1:
        raise ValueError(f"recompute is the fraction of the forward's matmuls recomputed, in [0, 1]; got {recompute}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor pads each expert's tokens: a positive number; got {capacity_factor}")
    if big % (data_ways * grad_accumulation):
        raise ValueError(f"{big} sequences do not split into {grad_accumulation} microbatches over {data_ways} "
                         f"data-parallel ways; use a batch that is a multiple of {data_ways * grad_accumulation}")
    if pipeline is not None:
        pipeline.check_batch(big, data_ways)


def _device_tokens(sequences: int, length: int, kv_length: int | None, sp: int, task: str) -> tuple[int, int, int]:
    """Tokens a device holds, the keys each attends to there, and the tokens the head computes logits for."""
    if task == "decode":
        kv = kv_length or length
        if kv % sp:
            raise ValueError(f"a KV cache of {kv} positions does not split over sp={sp}")
        return sequences, kv // sp, sequences
    if length % sp:
        raise ValueError(f"a sequence of {length} positions does not split over sp={sp}")
    return sequences * length // sp, length, (sequences * length // sp if task == "train" else sequences)


def _step_sizes(shapes: ModelShapes, sizes: dict[str, int], batch: tuple[int, int], *, task: str, remat: str,
                pipeline: PipelineConfig | None, kv_length: int | None, rate: str, batch_axes: tp.Sequence[str],
                zero: bool, grad_accumulation: int, recompute: float | None, capacity_factor: float | None,
                causal: bool, experts_fsdp: bool, attention: str, vocab_tiles: int,
                stored: tuple[float, float]) -> StepSizes:
    """The step as one device runs it (:class:`StepSizes`), once the arguments agree with each other."""
    train = task == "train"
    remat_passes = 1 if train and remat == "full" else 0
    batch_axes = tuple(dict.fromkeys(batch_axes))
    data_ways = math.prod(sizes[a] for a in batch_axes)
    big, length = batch
    _check_schedule(big, data_ways, sizes["pp"], pipeline, grad_accumulation, recompute, capacity_factor, batch_axes)
    virtual = pipeline.virtual_stages if pipeline is not None else 1
    stacked = shapes.layers - shapes.dense_layers
    stacked_layers = pipeline.stage_layers(stacked) * virtual if pipeline is not None else stacked
    sequences = big // data_ways  # sequences a device holds
    tokens, kv_span, head_tokens = _device_tokens(sequences, length, kv_length, sizes["sp"], task)
    recomputed = (remat_passes if recompute is None else recompute) if train else 0
    return StepSizes(
        sizes=sizes, task=task, train=train, decode=task == "decode", batch_axes=batch_axes,
        token_axes=frozenset(batch_axes) | ({"sp"} if task != "decode" else frozenset()), zero=zero,
        pipelined=pipeline is not None, sequences=sequences, length=length, tokens=tokens, kv_span=kv_span,
        head_tokens=head_tokens, virtual_stages=virtual, stacked_layers=stacked_layers,
        microbatches=pipeline.num_microbatches if pipeline is not None else grad_accumulation,
        bubble=pipeline.bubble_fraction if pipeline is not None else 0.0, remat_passes=remat_passes,
        recompute=recomputed, recompute_any=remat != "none" or recomputed > 0, item_bytes=ITEM_BYTES[rate],
        weight_item_bytes=stored[0], kv_item_bytes=stored[1],
        rate=rate, causal=causal, attention=one_of("attention", attention, ATTENTION_KERNELS),
        vocab_tiles=positive_int("vocab_tiles", vocab_tiles, what="a positive int (tiles the loss's tokens are in)"),
        capacity_factor=capacity_factor, experts_fsdp=experts_fsdp,
        layers_attention=shapes.dense_layers + stacked_layers,
        layers_dense=shapes.dense_layers + (0 if shapes.moe else stacked_layers),
        layers_moe=stacked_layers if shapes.moe else 0)


def _count_step(shapes: ModelShapes, step: StepSizes) -> StepCounts:
    """Each layer kind's work, then each parallelism's collectives for it, in the order the step runs them; then
    the optimizer over every weight shard and the pipeline's sends."""
    counts = StepCounts(step.sizes, fp8=step.rate == "fp8", cast_weights=step.train)
    shard_bytes = 0.0
    for layer_work, layer_collectives in (
            (work.attention_work, (tensor.attention_all_reduces, sequence.attention_collectives)),
            (work.mlp_work, (tensor.mlp_all_reduces,) if step.layers_dense else ()),
            (work.experts_work, (expert.moe_collectives, tensor.moe_all_reduces) if step.layers_moe else ()),
            (work.embedding_head_work, (tensor.embedding_head_all_reduces,))):
        for group in layer_work(counts, step, shapes):
            shard_bytes += data.weight_collectives(counts, step, group)
        for collectives in layer_collectives:
            collectives(counts, step, shapes)
    work.optimizer_work(counts, step, shard_bytes)
    stage_collectives(counts, step, shapes)
    return counts


__all__ = ["BATCH_AXES", "WORK_KINDS", "predict_step", "stored_bytes"]
