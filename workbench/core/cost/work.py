"""The work per layer kind of a predicted step on one device: its matmul FLOPs, HBM bytes and GEMMs.

One function per kind (:func:`attention_work`, :func:`mlp_work`, :func:`experts_work`,
:func:`embedding_head_work`, :func:`optimizer_work`) counts into a :class:`~.step_counts.StepCounts` and returns
the kind's weight groups (:class:`~.step_counts.WeightGroup`), whose collectives
:mod:`~workbench.core.cost.parallel.data` counts. Notation: ``n`` tokens a device holds, ``D`` hidden, ``F`` MLP
width, ``H`` heads of ``h`` dims, ``K`` key/value heads, ``V`` vocabulary, ``T`` sequence, ``m`` microbatches;
every dimension a mesh axis splits is divided by its size.

**Where the work goes.** Tokens split over the batch axes (``batch_axes``, default ``("fsdp", "dp")``, the
default ``PartitionAxis.batch_axis``) and the sequence over ``sp``; ``tp`` splits heads, MLP widths and the
vocabulary (Megatron); ``ep`` splits experts; ``pp`` the stacked layers (a MoE family's leading dense layers
run outside the pipeline, on every device, as :mod:`workbench.core.pipeline` runs them). An axis the batch
does not split repeats the work that axis does not split: with ``ep`` outside ``batch_axes`` every ``ep``
device runs the same attention (the experts still split: each takes ``1/ep`` of the tokens, as
:mod:`workbench.core.models.moe_alltoall` does).

**FLOPs** (Transformer Math): a matmul of a ``(n, a)`` input by an ``(a, b)`` weight is ``2nab``: ``2n`` times
the weight's elements. Per token: attention projections (q, k, v, o; MLA's absorbed form: ``q_a``, ``q_b``,
``kv_a``, ``W_uk``, ``W_uv``, ``o``); attention scores ``QK^T`` and ``PV``, ``2 T H (d_qk + d_v)``, counted as
the dense ``T x T`` product (the book's ``12 B T^2 N H`` a layer in training: a causal mask halves the useful
FLOPs only with a kernel that skips the masked blocks; a sliding window is not credited either); the MLP
``2 * 3DF`` (SwiGLU; GELU ``2 * 2DF``); a mixture of experts the top-``k`` experts, the shared experts and the
router ``2 D E``; the LM head ``2 D V`` (the embedding is a lookup, no FLOPs). The backward is twice the forward
(``6 N`` a token in all: the book's ``6 * params * tokens``); ``remat="full"`` recomputes each layer's forward in
its backward, except what the backward does not read, which XLA removes: a dense MLP's output projection
(and a MoE's shared experts' one), whose result only joins the residual stream (its recompute comes back with
sandwich norms, whose backward reads it). That is ``8 N - 2 N_down`` a token for a dense model (the compiled
step agrees exactly, ``tests/core/cost/test_predicted.py``). ``"dots_saveable"`` saves every matmul output and
recomputes elementwise ops only: no matmul FLOPs more, as ``"none"``. The head is outside the remat policy.
Decode: one token per sequence, attention over ``kv_length`` (split over ``sp``); prefill computes logits for
each sequence's last position only.

**HBM bytes** (the roofline chapter's memory time, for decode the Inference chapter's bound). Each pass reads
the (gathered) weights a device uses: forward, backward, a recompute; an FSDP gather also writes what it
gathers; the backward writes a gradient per microbatch; AdamW reads parameters, gradients and both moments and
writes three (7 accesses of each parameter's shard, moments in the parameters' dtype as optax keeps them).
Decode reads the weights of the experts its tokens reach (``1 - (1 - 1/E)^copies`` of them) and every layer's
KV cache (``2 K h`` elements a token, MLA's latent ``C + R``; a device reads its ``K / tp`` heads, one when ``tp``
is a multiple of ``K`` above it: each head repeated to one per device as serving engines keep it, all ``K`` where
they do not divide, MLA's latent whole), and writes one token of it; prefill writes the
cache. Activations: each matmul's input read and output written, attention as a fused (flash) kernel (Q read,
K and V read once, O written; the scores stay on chip), norms and residuals ``5 D`` a token a sublayer, the
gated activation ``3F``; a train step moves them three times (forward, and the backward's two reads) and again
under ``"full"``; the loss reads and writes float32 logits (the ledger's three copies).

Not counted: norm weights and their gradients, the softmax's statistics across ``tp``, the loss's scalars,
optimizer FLOPs (the roofline counts matmul FLOPs, as :func:`~workbench.core.cost.compiled_step.step_time` does).
"""

from __future__ import annotations

import typing as tp

from workbench.core.cost.flops import ModelShapes
from workbench.core.cost.parallel.data import gather_writes, gathered_axes
from workbench.core.cost.parallel.expert import routed_tokens
from workbench.core.cost.parallel.sequence import kv_ring_elements
from workbench.core.cost.step_counts import (
    DENSE_WEIGHT_AXES,
    EXPERT_WEIGHT_AXES,
    ITEM_BYTES,
    AttentionKernels,
    StepCounts,
    StepSizes,
    WeightGroup,
)
from workbench.core.hardware.calibration import ADAMW_F32_BYTES, FLASH_BACKWARD
from workbench.core.shapes import stored_kv_heads

ADAMW_ACCESSES = 7  # reads: param, grad, mu, nu; writes: param, mu, nu
# HBM traffic of the loss: float32 logits written, their softmax, their cotangent. Bytes moved, not the ledger's
# LOGITS_COPIES (the copies resident at once, measured per compiler).
LOGITS_PASSES = 3
NORM_RESIDUAL = 5  # elements a token a sublayer: a norm's read and write, the residual add's two reads, a write


def kv_heads_per_device(shapes: ModelShapes, tp_size: int) -> int:
    """K / V heads of the cache a device holds (:func:`~workbench.core.models.cache.stored_kv_heads` split over
    ``tp``; all of them where they do not divide; MLA's latent is not split)."""
    if not shapes.kv_split:
        return shapes.kv_heads
    stored = stored_kv_heads(shapes.kv_heads, shapes.heads, tp_size)
    return stored // tp_size if stored % tp_size == 0 else stored


def device_kv_elements(shapes: ModelShapes, tp_size: int) -> float:
    """A token's K and V elements in one layer's cache on a device (its :func:`kv_heads_per_device` heads)."""
    return shapes.kv_cache / shapes.kv_heads * kv_heads_per_device(shapes, tp_size)


def device_weight_elements(shapes: ModelShapes, tp_size: int, ep: int = 1) -> dict[str, float]:
    """A device's weight elements under ``tp`` (and ``ep`` for the routed experts), gathered over ``fsdp``: one
    layer's of each kind ("attention", "mlp", "experts" routed, "shared", "router") and the "head" and "embedding"."""
    return {"attention": shapes.attn_split / tp_size + shapes.attn_rep, "mlp": shapes.mlp / tp_size,
            "experts": shapes.experts / ep * shapes.expert / tp_size, "shared": shapes.shared / tp_size,
            "router": shapes.router, "head": shapes.head / tp_size, "embedding": shapes.embed / tp_size}


def _weight_passes(step: StepSizes, axes: tp.Sequence[str]) -> int:
    """Accesses of a layer's weights a step makes: its reads, an FSDP gather's writes, its gradient's writes."""
    return step.weight_reads + gather_writes(step, axes) + step.grad_writes


def _layer_runs(step: StepSizes, layers: int) -> tuple[int, int, float]:
    """Runs of a layer's GEMMs: forward, backward and recomputed forwards, over ``layers`` layers."""
    m = step.microbatches
    return layers * m, layers * m * step.train, layers * m * step.recompute


def attention_work(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> list[WeightGroup]:
    """The attention layers' FLOPs (projections and scores), bytes (weights, activations, KV cache), GEMMs and
    flash-attention calls."""
    tp_size, d, ab, n, layers = step.sizes["tp"], shapes.hidden, step.item_bytes, step.tokens, step.layers_attention
    heads = shapes.heads / tp_size
    weight_bytes = device_weight_elements(shapes, tp_size)["attention"] * step.weight_item_bytes
    kv_ring = kv_ring_elements(shapes, tp_size)
    kv_cache = device_kv_elements(shapes, tp_size)
    score_width = shapes.score_qk + shapes.score_v
    per_layer = 2 * n * (shapes.attn_split / tp_size + shapes.attn_rep) + 2 * n * step.kv_span * heads * score_width
    nbytes = weight_bytes * _weight_passes(step, DENSE_WEIGHT_AXES)
    nbytes += step.flop_passes * ab * (n * (shapes.attn_act_full + shapes.attn_act_split / tp_size + heads * score_width
                                            + NORM_RESIDUAL * d)
                                       + (0 if step.decode else step.sequences * step.length * kv_ring))
    kb = step.kv_item_bytes
    if step.decode:
        nbytes += kb * kv_cache * (step.sequences * step.kv_span + n)  # read the cache, write the new token
    elif step.task == "prefill":
        nbytes += kb * kv_cache * n
    counts.flops["attention"] += layers * (step.flop_passes * per_layer)
    counts.recomputed += layers * step.remat_passes * per_layer
    counts.bytes["attention"] += layers * nbytes
    _attention_gemms(counts, step, shapes, heads, kv_ring)
    counts.attention.append(AttentionKernels(
        layers * step.microbatches * 2 * step.microbatch_tokens * step.kv_span * heads * score_width,
        0.5 if step.causal and not step.decode and step.length > 1 else 1.0, step.kv_span, shapes.score_qk,
        (FLASH_BACKWARD + step.recompute) if step.train else 0.0,
        layers * (kb * kv_cache * step.sequences * step.kv_span if step.decode
                  else ab * n * shapes.attn_act_split / tp_size)))
    counts.fused["attention"] += (layers * step.microbatches * ab * step.microbatch_tokens
                                  * (NORM_RESIDUAL * d + shapes.attn_act_split / tp_size) * step.fused_passes)
    return [WeightGroup("attention", weight_bytes, DENSE_WEIGHT_AXES, layers, "attention")]


def _attention_gemms(counts: StepCounts, step: StepSizes, shapes: ModelShapes, heads: float, kv_ring: float
                     ) -> None:
    tokens, d, tp_size = step.microbatch_tokens, shapes.hidden, step.sizes["tp"]
    runs = _layer_runs(step, step.layers_attention)
    if shapes.kv_split:  # the fused q, k, v projection and the output projection
        counts.gemm("attention", tokens, d, (heads * shapes.score_v + kv_ring), *runs)
        counts.gemm("attention", tokens, heads * shapes.score_v, d, *runs)
    else:  # MLA: its projections as one GEMM of their total width
        counts.gemm("attention", tokens, d, (shapes.attn_split / tp_size + shapes.attn_rep) / d, *runs)


def mlp_work(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> list[WeightGroup]:
    """The dense MLPs' FLOPs (the output projection's recompute only with sandwich norms), bytes and GEMMs."""
    layers = step.layers_dense
    if not layers:
        return []
    tp_size, d, ab, n, remat = step.sizes["tp"], shapes.hidden, step.item_bytes, step.tokens, step.remat_passes
    weight_bytes = device_weight_elements(shapes, tp_size)["mlp"] * step.weight_item_bytes
    recomputed = shapes.mlp - (0 if shapes.recompute_down else shapes.mlp_down)
    flops = (3 if step.train else 1) * 2 * n * shapes.mlp / tp_size + remat * 2 * n * recomputed / tp_size
    nbytes = weight_bytes * _weight_passes(step, DENSE_WEIGHT_AXES)
    nbytes += step.flop_passes * ab * n * (shapes.mlp_act_full + shapes.mlp_act_split / tp_size + NORM_RESIDUAL * d)
    width = shapes.mlp_down / d  # F
    forward, backward, again = _layer_runs(step, layers)
    tokens = step.microbatch_tokens
    counts.gemm("mlp", tokens, d, (shapes.mlp - shapes.mlp_down) / d / tp_size, forward, backward, again)
    counts.gemm("mlp", tokens, width / tp_size, d, forward, backward, again * shapes.recompute_down)
    counts.fused["mlp"] += (forward * ab * tokens * (NORM_RESIDUAL * d + (shapes.mlp_act_split - 2 * width) / tp_size)
                            * step.fused_passes)
    counts.flops["mlp"] += layers * flops
    counts.recomputed += layers * remat * 2 * n * recomputed / tp_size
    counts.bytes["mlp"] += layers * nbytes
    return [WeightGroup("mlp", weight_bytes, DENSE_WEIGHT_AXES, layers, "MLP")]


class _ExpertSizes(tp.NamedTuple):
    copies: float  # routed copies of the tokens a device sends
    experts_bytes: float  # a layer's routed experts on a device, gathered
    shared_bytes: float
    router_bytes: float
    width: float  # an expert's width on a device (Fe / tp)
    shared_recomputed: float  # shared-expert weights remat="full" recomputes


def _expert_sizes(step: StepSizes, shapes: ModelShapes) -> _ExpertSizes:
    ep, tp_size, wb = step.sizes["ep"], step.sizes["tp"], step.weight_item_bytes
    weights = device_weight_elements(shapes, tp_size, ep)
    return _ExpertSizes(
        copies=routed_tokens(step) * shapes.topk,
        experts_bytes=weights["experts"] * wb, shared_bytes=weights["shared"] * wb, router_bytes=weights["router"] * wb,
        width=shapes.expert_width / tp_size,
        shared_recomputed=shapes.shared - (0 if shapes.recompute_down else shapes.hidden * shapes.shared_width))


def experts_work(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> list[WeightGroup]:
    """The MoE layers' FLOPs (top-k routed experts, shared experts, router), bytes (decode reads the experts its
    tokens reach) and GEMMs (each expert's rows padded to ``capacity_factor``)."""
    layers = step.layers_moe
    if not layers:
        return []
    tp_size, d, ab, n, remat = step.sizes["tp"], shapes.hidden, step.item_bytes, step.tokens, step.remat_passes
    sizes = _expert_sizes(step, shapes)
    reached = 1 - (1 - 1 / shapes.experts) ** (sizes.copies * step.sizes["ep"])  # share of its experts reached
    recomputed = sizes.copies * shapes.expert / tp_size + n * sizes.shared_recomputed / tp_size + n * shapes.router
    flops = ((3 if step.train else 1) * 2 * (sizes.copies * shapes.expert / tp_size + n * shapes.shared / tp_size
                                             + n * shapes.router)
             + remat * 2 * recomputed)
    nbytes = (sizes.experts_bytes * (step.weight_reads * reached + gather_writes(step, ("fsdp",)) + step.grad_writes)
              + sizes.shared_bytes * _weight_passes(step, DENSE_WEIGHT_AXES)
              + sizes.router_bytes * (step.weight_reads + step.grad_writes))
    nbytes += step.flop_passes * ab * (n * (2 * d + shapes.router / d + NORM_RESIDUAL * d)  # router in / out, norm
                                       + sizes.copies * (3 * d + 6 * sizes.width + 4 * d)  # experts, dispatch, return
                                       + (n * (3 * d + 6 * shapes.shared_width / tp_size) if shapes.shared else 0))
    _expert_gemms(counts, step, shapes, sizes)
    counts.flops["experts"] += layers * flops
    counts.recomputed += layers * remat * 2 * recomputed
    counts.bytes["experts"] += layers * nbytes
    groups = [WeightGroup("experts", sizes.experts_bytes, EXPERT_WEIGHT_AXES if step.experts_fsdp else ("ep", "tp"),
                          layers, "expert")]
    if shapes.shared:
        groups.append(WeightGroup("experts", sizes.shared_bytes, DENSE_WEIGHT_AXES, layers, "shared expert"))
    return [*groups, WeightGroup("experts", sizes.router_bytes, (), layers, "router")]


def _expert_gemms(counts: StepCounts, step: StepSizes, shapes: ModelShapes, sizes: _ExpertSizes) -> None:
    """Each local expert's two GEMMs over its balanced (padded) rows, the shared experts', the router's; and the
    memory-bound work around them."""
    ep, tp_size, d, m = step.sizes["ep"], step.sizes["tp"], shapes.hidden, step.microbatches
    tokens, ab = step.microbatch_tokens, step.item_bytes
    local = shapes.experts / ep
    per_expert = sizes.copies / m * ep / shapes.experts  # tokens one of this device's experts takes, balanced
    rows = per_expert * (step.capacity_factor or 1.0)
    forward, backward, again = _layer_runs(step, step.layers_moe)
    expert_runs = forward * local
    gated_widths = shapes.expert / d  # the expert's widths: 3 Fe gated
    counts.gemm("experts", rows, d, (gated_widths - shapes.expert_width) / tp_size, expert_runs,
                expert_runs * step.train, expert_runs * step.recompute)
    counts.gemm("experts", rows, shapes.expert_width / tp_size, d, expert_runs, expert_runs * step.train,
                expert_runs * step.recompute)
    if shapes.shared:
        counts.gemm("experts", tokens, d, 2 * shapes.shared_width / tp_size, forward, backward, again)
        counts.gemm("experts", tokens, shapes.shared_width / tp_size, d, forward, backward, again)
    counts.gemm("experts", routed_tokens(step) / m, d, shapes.experts, forward, backward, again)
    # a token's norm and residual, the router's softmax; each routed copy permuted out and back (read and
    # write, dispatch and combine) and its gated activation over the (padded) rows
    counts.fused["experts"] += forward * ab * step.fused_passes * (
        tokens * (NORM_RESIDUAL * d + 2 * shapes.experts) + local * rows * (4 * d + 3 * shapes.expert_width / tp_size)
        + (tokens * 3 * shapes.shared_width / tp_size if shapes.shared else 0))


def embedding_head_work(counts: StepCounts, step: StepSizes, shapes: ModelShapes) -> list[WeightGroup]:
    """The LM head's FLOPs and GEMM, the loss's float32 logits, the embedding's lookups (outside the pipeline
    and the remat policy); under vocabulary tiling the backward recomputes each tile's logits (MaxText's
    ``vocabulary_tiling.py``: its custom VJP runs the head again, tile by tile): one more forward GEMM and logits
    pass."""
    tp_size, d, ab, train = step.sizes["tp"], shapes.hidden, step.item_bytes, step.train
    head_tokens, n = step.head_tokens, step.tokens
    # serving engines keep the head and the embedding in bfloat16 where they quantise the layers (ModelOpt's fp8,
    # AWQ, GPTQ leave them out)
    item = step.item_bytes if train else ITEM_BYTES["bf16"]
    weights = device_weight_elements(shapes, tp_size)
    head_bytes, embed_bytes = weights["head"] * item, weights["embedding"] * item
    vocab = shapes.vocab / tp_size
    gathered = bool(gathered_axes(step.sizes, DENSE_WEIGHT_AXES))
    nbytes = head_bytes * ((2 if train else 1) + (1 if train else 0) + (1 + train) * gathered)
    nbytes += ab * head_tokens * vocab * (2 if train else 1) + (LOGITS_PASSES * 4 * head_tokens * vocab if train else 0)
    nbytes += ab * n * d * (4 if train else 2) + (embed_bytes if train else 0)  # lookups (and their gradient)
    again = 1 if train and step.vocab_tiles > 1 else 0  # the tiles' logits recomputed in the backward
    counts.flops["embedding+head"] += ((3 if train else 1) + again) * 2 * head_tokens * shapes.head / tp_size
    counts.gemm("embedding+head", head_tokens / step.microbatches, d, vocab, step.microbatches,
                step.microbatches * train, step.microbatches * again)
    counts.fused["embedding+head"] += (((LOGITS_PASSES + again) * 4 * head_tokens * vocab if train else 0)
                                       + ab * n * d * (4 if train else 2))
    counts.bytes["embedding+head"] += nbytes
    groups = [WeightGroup("embedding+head", head_bytes, DENSE_WEIGHT_AXES, 1, "head", 2 if train else 1, False)]
    if shapes.embed:
        groups.append(WeightGroup("embedding+head", embed_bytes, DENSE_WEIGHT_AXES, 1, "embedding", 1, False))
    return groups


def optimizer_work(counts: StepCounts, step: StepSizes, shard_bytes: float) -> None:
    """AdamW's update of a device's ``shard_bytes`` of parameters (a ``1/dp`` split of them under ZeRO-1): its
    accesses, and its float32 master weights and moments as memory-bound bytes."""
    if step.train:
        counts.bytes["optimizer"] += ADAMW_ACCESSES * shard_bytes / (step.sizes["dp"] if step.zero else 1)
        counts.fused["optimizer"] += (ADAMW_F32_BYTES * shard_bytes / step.weight_item_bytes
                                      / (step.sizes["dp"] if step.zero else 1))
