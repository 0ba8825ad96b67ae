"""Activations: what the forward keeps for the backward under each remat policy, per layer and per device, and the
attention's and the loss's buffers; the memory ledger (:mod:`workbench.core.cost.ledger`) adds them up.

What the forward keeps for the backward, per layer, times the layers (the layer scan stacks
them; a MoE's leading dense layers are a stack of their own). With ``b`` token rows and ``t`` positions per
device (the batch split over the data axes, the sequence over ``sp``), per row of one layer
(:func:`layer_set`; widths on one device: a kernel ``(L, ..., in, out)`` gives ``out`` times its leading dims,
each divided by the model-parallel axes that split it, not by data axes: FSDP gathers weights, it does not
split activations; ``H_l`` heads, ``t_kv`` keys):

* ``remat="full"`` keeps the layer's input: ``D``;
* ``"dots_saveable"`` keeps the input and every matmul output the backward needs, in the model's dtype: q, k,
  v, the attention's ``PV`` (``H_l Dh``), ``o_proj``'s output (the residual sum the next norm reads is
  recomputed from it), the MLP's gate and up (a dense MLP's ``down_proj`` only where a norm follows it,
  Gemma's sandwich: otherwise it feeds the next layer's input, kept already), and ``QK^T`` in float32
  (``H_l t_kv``: the logits are computed in float32, ``accumulation_dtype``). MLA (DeepSeek-V3, absorbed
  form): the q LoRA and latent projections, ``q_nope W_uk`` and ``PV`` (``H_l C`` each), ``PV W_uv``
  (``H_l V``); ``kv_b_proj`` never multiplies activations. A MoE keeps per expert row (``E / ep`` per token
  with the dense strategy, see :func:`_expert_rows`) gate, up and the expert's output (the combine's backward
  reads it), plus the router logits and combine weights, and a shared expert's gate and up;
* ``"none"`` keeps what jax's autodiff saves for every op (counted from ``jax.ad_checkpoint``'s saved
  residuals and matched buffer by buffer with the scan's stacked outputs on XLA:CPU and XLA:TPU): per norm
  ``NORM_RESIDUALS`` (RMSNorm the float32 normalised input and its cast; Gemma's ``1 + w`` RMSNorm two
  float32 arrays; LayerNorm three) plus the output of each norm that feeds a matmul; the rotated q and k
  (after q/k norms, which keep what a norm keeps), v, the attention output, the probabilities once in
  float32 and once in the model's dtype (``H_l t_kv`` each; the softmax's shift is a ``stop_gradient``, so no
  mask of its maxima is kept: the scan's stacked score arrays are one ``f32`` and one ``bf16`` on XLA:TPU, two and
  one before, and two ``f32`` on XLA:CPU, three before); the MLP's ``ACTIVATION_RESIDUALS`` arrays of
  its width (SwiGLU 6, GeGLU 8, GPT-2's GELU 6, GPT-OSS's clamped SwiGLU 9, gate and up included), per
  expert row for a MoE, plus the experts' outputs; MLA its two latent norms, the key ``[c ; k_pe]``, the
  value ``c``, the query, ``q_nope``, ``PV`` and its output;

with ``attention="flash"`` (cuDNN, FlashAttention, TPU splash: the kernel production runs use) or
``"flash_triton"`` (the same algorithm in Triton, at another rate the step model prices) no score is written to
HBM: a layer keeps the kernel's output and its float32 log-sum-exp per query and head (``H_l``) where the policy
saves the attention, instead of ``QK^T`` and the probabilities, and the attention's backward recomputes its scores
tile by tile in on-chip memory (no score-sized phase). Not measured here: XLA:CPU and this libtpu compile the
workbench's XLA attention, so the flash ledger is the XLA one with the score-sized arrays taken out, the
kernels' own design (FlashAttention-2, section 3.1).

With ``autograd="pytorch"`` (torchtitan, Megatron-LM, NeMo, llm-foundry) a layer without remat keeps what PyTorch's
autograd saves with fused norm and activation kernels, not every op's residual as JAX's autodiff does: each norm its
input and, feeding a matmul, its output; q, k and v (with q/k norms their inputs too), the attention output and the
flash kernel's log-sum-exp (an XLA-style attention keeps its probabilities, one per score, in the model's dtype
instead); a gated MLP its gate, up, the activation and their product (four arrays of its width; an activation
saves only its input), a plain one up and the activation's output (two), per expert row for a MoE, plus the
experts' outputs. All in the model's dtype. For GPT-3 this is Korthikanti et al., *Reducing Activation
Recomputation in Large Transformer Models* (2022), eq. (2) and (4) without their two dropout masks: ``(8 + 24 /
t) s b h`` bytes a layer with ``t``-way tensor parallelism, ``32 s b h / t`` with sequence parallelism. MLA keeps
JAX's count (its expanded PyTorch form is not modelled); ``"full"`` and ``"dots_saveable"`` keep the same either way.

With ``sequence_parallel=True`` (Megatron-LM's ``--sequence-parallel``, torchtitan's TP plan, MaxText's embed
activations over its tensor axis) the activations of width ``D`` outside the tensor-parallel matmuls (the layer's
input, the norms' residuals, ``o_proj``'s and a sandwich norm's ``down_proj``'s outputs, reduce-scattered instead
of all-reduced) are split over ``tp`` along the sequence: each device keeps ``D / tp`` of them a row.

With ``offload=True`` (MaxText's ``offload`` remat entries, torchtitan's CPU offload of saved activations) what
the policy saves lives in host memory (:attr:`ActivationBytes.host`); a device holds two layers of it, the one its
backward uses and the next one arriving (the ledger's assumption, not measured).
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import numpy as np

from workbench.core.axes import BATCH, LENGTH
from workbench.core.checks import one_of
from workbench.core.shapes import capacity
from workbench.core.vocab import ATTENTION_KERNELS, AUTOGRADS, REMATS

# A resolved workbench.core.sharding.plan.Layout (not imported: sharding sits above the cost layer).
Layout = tp.Any

# One layer's backward working set, in units of the layer's dots_saveable set (its matmul outputs), by compiler
# and remat policy: measured (the ledger's module doc says how: temporaries), not derived.
WORKING_SET = {"tpu": {"none": 0.5, "dots_saveable": 1.0, "full": 1.5},
               "cpu": {"none": 2.0, "dots_saveable": 2.0, "full": 2.75}}
# Bytes a score (one query's logit for one key, per head) that a layer's attention backward holds beyond what the
# forward kept, by compiler and remat policy: measured on XLA:TPU (the ledger's module doc, and
# attention_backward_bytes); XLA:CPU is not measured and counts no such phase.
SCORE_BYTES = {"tpu": {"none": 7, "dots_saveable": 7, "full": 8}, "cpu": {}}


def tokens_per_device(layout: Layout, batch: tuple[int, int], mode: str) -> tuple[int, int, int]:
    """``(b, t, data shards)``: rows and positions of the batch one device holds, and the batch's data split."""
    sizes = dict(layout.mesh.shape)
    decisions = layout.token_decisions(tuple(batch), mode)
    split = [math.prod(sizes[a] for a in d.chosen) for d in decisions]
    return batch[0] // split[0], batch[1] // split[1], split[0]


def _model_split(param: tp.Any, dim: int, data_axes: set[str], sizes: dict[str, int]) -> int:
    """How many ways the model-parallel axes (not the data axes) split dimension ``dim`` of ``param``."""
    return math.prod(sizes[a] for a in param.decisions[dim].chosen if a not in data_axes)


# Arrays of the width of one MLP activation that the backward keeps per token (or per expert row) without
# remat, gate and up projections included: what jax's autodiff saves of each activation (counted with
# jax.ad_checkpoint's saved residuals). SwiGLU silu(g) * u: g, u, three of silu's and the product; GeGLU: g, u,
# five of the tanh GELU's (3 g^2, the tanh, the cdf, ...) and the product; GPT-2's GELU: up and the same five;
# the exact GELU three; GPT-OSS's clamped SwiGLU with its clip and min masks nine.
ACTIVATION_RESIDUALS = {("swiglu", "silu"): 6, ("swiglu", "gelu_pytorch_tanh"): 8, ("gelu", "gelu_new"): 6,
                        ("gelu", "gelu_pytorch_tanh"): 6, ("gelu", "gelu"): 4, ("moe", "silu"): 6,
                        ("moe", "clamped_swiglu"): 9}
# Float32 (and model dtype) arrays a norm's backward keeps per normalised element: RMSNorm the float32
# x * rsqrt and its cast; Gemma's (1 + w) RMSNorm, which scales in float32, two float32 arrays; LayerNorm the
# centred input, the normalised and the scaled values, in float32. A norm whose output feeds a matmul keeps
# that output too (the matmul's weight gradient reads it).
NORM_RESIDUALS = {"rms": (1, 1), "rms_unit_offset": (2, 0), "layer": (3, 0)}
# Arrays of an MLP's width PyTorch's autograd keeps per token (or expert row) without remat, by whether the MLP is
# gated: an activation kernel saves its input only, a product both operands, a matmul its input (Korthikanti et al.
# 2022, section 4.1: a GELU MLP's first linear output and the GELU's output); gated: gate, up, act(gate), product.
TORCH_ACTIVATION_RESIDUALS = {True: 4, False: 2}


@dataclasses.dataclass(frozen=True)
class LayerSet:
    """What one layer keeps per token row for its backward under each remat policy, as ``(elements in the
    model's dtype, float32 elements)`` (see the module doc)."""

    full: tuple[float, float]
    dots_saveable: tuple[float, float]
    none: tuple[float, float]

    def bytes_per_row(self, remat: str, itemsize: int) -> float:
        model_dtype, f32 = getattr(self, remat)
        return model_dtype * itemsize + f32 * 4


def _width(layout: Layout, path: str, data_axes: set[str], sizes: dict[str, int]) -> float:
    """Output elements per token of the stacked kernel ``path`` ``(L, ..., in, out)`` on one device: ``out``
    times the leading dims (experts), each divided by the model-parallel axes that split it."""
    p = layout[path]
    out = p.shape[-1] / _model_split(p, len(p.shape) - 1, data_axes, sizes)
    return out * math.prod(n / _model_split(p, i, data_axes, sizes) for i, n in enumerate(p.shape[1:-2], 1))


def _norm_kind(c: tp.Any) -> str:
    return "layer" if c.norm_type == "layer" else "rms_unit_offset" if c.norm_unit_offset else "rms"


def _expert_rows(layout: Layout, prefix: str, strategy: str, data_axes: set[str], sizes: dict[str, int],
                 tokens: int, capacity_factor: float | None) -> float:
    """Expert rows per local token a MoE layer computes: ``dense`` runs each of the device's ``E / ep``
    experts on every token; ``alltoall`` packs each device's share ``n`` of the tokens into ``E`` buffers of ``C``
    slots (``capacity``) and gets as many rows back for its ``E / ep`` experts, so ``E C / tokens`` rows per token
    (``E / ep`` without a capacity factor); ``ragged`` sorts the ``k`` copies of every token of the batch (GSPMD
    gathers the data axes for the global sort), as TPU and GPU kernels run ``ragged_dot`` (XLA:CPU lowers it to a
    masked dot over every expert, which this does not count)."""
    c = layout.config
    gate = layout[prefix + "mlp/gate_proj"]
    if strategy == "alltoall":
        # the ep devices that hold the same tokens (the batch not split over ep) each dispatch 1/ep of them
        ep_axis = layout.partition_axis.expert_parallel_axis
        token_axes = {a for d in layout.partition_axis.explain((BATCH, LENGTH), layout.mode, mesh=layout.mesh)
                      for a in d.chosen}
        share = tokens / (sizes.get(ep_axis, 1) if ep_axis not in token_axes else 1)
        slots = capacity(math.ceil(share), c.num_experts_per_tok, c.num_local_experts, capacity_factor)
        return c.num_local_experts * slots / tokens
    if strategy == "ragged":
        return c.num_experts_per_tok * math.prod(sizes[a] for a in data_axes)
    return c.num_local_experts / _model_split(gate, 1, data_axes, sizes)


def layer_set(layout: Layout, prefix: str = "layers/", *, t_kv: int, moe_strategy: str = "dense",
              tokens: int = 1, capacity_factor: float | None = None, attention: str = "xla",
              sequence_parallel: bool = False, autograd: str = "jax") -> LayerSet:
    """Per token row, what one layer of the stack under ``prefix`` keeps for its backward (see the module
    doc for the three policies, the ``attention`` kernels, ``sequence_parallel`` and ``autograd``); ``t_kv`` keys
    per query, ``tokens`` the device's tokens (a MoE's capacity)."""
    one_of("attention", attention, ATTENTION_KERNELS)
    one_of("autograd", autograd, AUTOGRADS)
    flash = attention != "xla"  # every flash kernel keeps no scores; they differ in rate only
    sizes = dict(layout.mesh.shape)
    data_axes = set(_data_axes(layout))
    c = layout.config
    width = lambda name: _width(layout, prefix + name, data_axes, sizes)
    has = lambda name: prefix + name in layout.paths
    d = c.hidden_size
    # the width-D activations outside the tensor-parallel matmuls, split over tp along the sequence with SP
    ds = d / (sizes.get(layout.partition_axis.tensor_parallel_axis, 1) if sequence_parallel else 1)
    # -- attention: heads on this device, its dot outputs and what its elementwise ops keep
    if c.mla:
        q_path = "self_attn/q_b_proj/kernel" if has("self_attn/q_b_proj/kernel") else "self_attn/q_proj/kernel"
        heads = c.num_attention_heads / _model_split(layout[prefix + q_path], 2, data_axes, sizes)
        lat, rope = c.kv_lora_rank, c.qk_rope_head_dim
        q_lora = width("self_attn/q_a_proj/kernel") if has("self_attn/q_a_proj/kernel") else 0
        # absorbed form (mla.py): kv_b_proj's halves act per head, q_nope -> q_lat (H C) and PV (H C) -> (H V);
        # every head reads one key [c ; k_pe] and one value c
        attn_dots = q_lora + width(q_path) + width("self_attn/kv_a_proj_with_mqa/kernel") + heads * lat \
            + heads * lat + heads * c.v_head_dim + ds
        rms_f32, rms_dt = NORM_RESIDUALS["rms"]
        scores_dt = 0 if flash else heads * t_kv  # the probabilities in the model's dtype
        attn_none = ((rms_dt + 1) * q_lora + rms_dt * lat + (lat + rope) + lat + heads * (lat + rope)
                     + heads * c.qk_nope_head_dim + heads * lat + heads * c.v_head_dim + scores_dt,
                     rms_f32 * (q_lora + lat))
    else:
        q, k, v = (width(f"self_attn/{n}_proj/kernel") for n in "qkv")
        heads = c.num_attention_heads / _model_split(layout[prefix + "self_attn/q_proj/kernel"], 2, data_axes, sizes)
        attn_dots = q + k + v + heads * c.head_dim + ds  # PV, o_proj's output (the residual sum's operand)
        qk_f32, qk_dt = NORM_RESIDUALS[_norm_kind(c)] if c.qk_norm else (0, 0)
        # rotated q and k, v, the attention output, the probabilities in the model's dtype (+ two float32 below)
        scores_dt = 0 if flash else heads * t_kv
        attn_none = (q + k + v + heads * c.head_dim + scores_dt + qk_dt * (q + k), qk_f32 * (q + k))
        # PyTorch: q, k, v, the output, a q/k norm's input, and the probabilities (XLA-style) or the log-sum-exp
        torch_attn = (q + k + v + heads * c.head_dim + scores_dt + (q + k if c.qk_norm else 0), heads if flash else 0)
    # QK^T: float32 logits (accumulation_dtype), then the float32 softmax; a flash kernel's log-sum-exp instead
    attn_f32 = heads if flash else heads * t_kv
    # -- MLP: a dense one (swiglu / gelu), or experts
    moe = c.mlp_type == "moe" and prefix == "layers/"
    if moe:
        rows = _expert_rows(layout, prefix, moe_strategy, data_axes, sizes, tokens, capacity_factor)
        gate = layout[prefix + "mlp/gate_proj"]  # (L, E, D, F)
        per_row = gate.shape[-1] / _model_split(gate, 3, data_axes, sizes)
        experts = c.num_local_experts
        # gate and up per expert row, the experts' outputs (the combine reads them), router logits and weights
        mlp_dots = rows * (2 * per_row + d) + 2 * experts
        mlp_none = rows * (ACTIVATION_RESIDUALS[("moe", c.moe_activation)] * per_row + d) + 2 * experts
        torch_mlp = rows * (TORCH_ACTIVATION_RESIDUALS[True] * per_row + d) + 2 * experts
        if has("mlp/shared_gate"):
            shared = width("mlp/shared_gate")
            mlp_dots += 2 * shared
            mlp_none += ACTIVATION_RESIDUALS[("swiglu", "silu")] * shared
            torch_mlp += TORCH_ACTIVATION_RESIDUALS[True] * shared
    else:
        up = width("mlp/up_proj/kernel")
        gated = has("mlp/gate_proj/kernel")
        mlp_type = "swiglu" if gated else c.mlp_type
        mlp_dots = (2 if gated else 1) * up + (ds if c.sandwich_norms else 0)  # down_proj feeds the post-MLP norm
        mlp_none = ACTIVATION_RESIDUALS[(mlp_type, c.hidden_act)] * up
        torch_mlp = TORCH_ACTIVATION_RESIDUALS[gated] * up
    # -- norms over D: their residuals, and the outputs that feed the attention's and the MLP's matmuls
    norms = 4 if c.sandwich_norms else 2
    n_f32, n_dt = NORM_RESIDUALS[_norm_kind(c)]
    dots = (ds + attn_dots + mlp_dots, attn_f32)
    scores_f32 = 0 if flash else attn_f32  # one float32 array a score (beside scores_dt's in the model's dtype)
    none = (attn_none[0] + mlp_none + (norms * n_dt + 2) * ds, attn_none[1] + scores_f32 + attn_f32 * flash
            + norms * n_f32 * ds)
    if autograd == "pytorch" and not c.mla:  # each norm's input, and the two that feed matmuls their outputs
        none = (torch_attn[0] + torch_mlp + (norms + 2) * ds, torch_attn[1])
    return LayerSet(full=(ds, 0), dots_saveable=dots, none=none)


def layer_stacks(layout: Layout) -> list[tuple[str, int]]:
    """The stacked layers: ``(path prefix, layers)``; a MoE's leading dense layers stack apart."""
    c = layout.config
    k = c.first_dense_layers
    return [(prefix, n) for prefix, n in (("dense_layers/", k), ("layers/", c.num_hidden_layers - k)) if n]


def moe_strategy_of(model: tp.Any, layout: Layout) -> tuple[str, float | None]:
    """The MoE strategy a model's layers run on the layout's mesh (``auto``: all-to-all on an ``ep`` axis of
    size > 1, else dense) and its capacity factor."""
    mlp = getattr(getattr(model, "layers", None), "mlp", None)
    strategy = getattr(mlp, "strategy", "auto")
    if strategy == "auto":
        ep = dict(layout.mesh.shape).get(layout.partition_axis.expert_parallel_axis, 1)
        strategy = "alltoall" if ep > 1 else "dense"
    return strategy, getattr(mlp, "capacity_factor", None)


def gathered_layer_bytes(layout: Layout, prefix: str, dtype: tp.Any = None) -> float:
    """Bytes of one layer of the stack under ``prefix`` on a device once its weights are all-gathered over the
    data axes (FSDP): the layer's block with the data splits undone, the model-parallel ones kept; in ``dtype``
    where given (XLA:TPU casts each device's block to the compute dtype, then gathers the cast: a bfloat16
    all-gather of float32 master weights, see :func:`cast_bytes`), else in the parameters' own."""
    sizes = dict(layout.mesh.shape)
    data_axes = set(_data_axes(layout))
    total = 0.0
    for p in layout.params:
        if p.path.startswith(prefix):
            data = math.prod(sizes[a] for d in p.decisions for a in d.chosen if a in data_axes)
            item = p.dtype.itemsize if dtype is None else np.dtype(dtype).itemsize
            total += p.bytes_per_device / p.dtype.itemsize * item / p.shard_shape[0] * data
    return total


def cast_bytes(layout: Layout, dtype: tp.Any) -> int:
    """Bytes per device of the parameters cast to the compute ``dtype`` where theirs differs (mixed precision:
    float32 master weights, ``dtype=bfloat16``): 2 bytes a parameter on top of the float32 ones. The layers cast
    their weights per use, but XLA:TPU hoists each stacked weight's cast out of the layer scan: it converts the
    device's whole block once, before the forward loop, and keeps the copy until the backward loop ends (seen in
    the compiled train step's HLO on dp and fsdp); FSDP then all-gathers one layer of the copy at a time.
    XLA:CPU, which has no bfloat16 arithmetic, keeps no such copy and gathers the float32 weights. 0 when the
    parameters are already in ``dtype``."""
    item = np.dtype(dtype).itemsize
    return sum(p.bytes_per_device // p.dtype.itemsize * item for p in layout.params if p.dtype != np.dtype(dtype))


def _layer_kinds(layout: Layout, prefix: str) -> int:
    """How many kinds of layer (sliding window, rotary table) the stack under ``prefix`` switches between."""
    c = layout.config
    k = c.first_dense_layers
    layers = range(k) if prefix == "dense_layers/" else range(k, c.num_hidden_layers)
    return len({c.layer_kind(i) for i in layers})


class ActivationBytes(tp.NamedTuple):
    """A train step's activations per device: ``kept`` for the backward in HBM, the backward's ``working`` set,
    and what is ``host``-resident (offloaded: :func:`activation_bytes`)."""

    kept: int
    working: int
    host: int = 0


def activation_bytes(layout: Layout, batch: tuple[int, int], remat: str, dtype: tp.Any, compiler: str = "tpu",
                     moe_strategy: str = "dense", capacity_factor: float | None = None, attention: str = "xla",
                     offload: bool = False, sequence_parallel: bool = False, autograd: str = "jax") -> ActivationBytes:
    """What a train step keeps for its backward, its backward's working set and (``offload=True``) what it keeps
    in host memory, in bytes per device (see the module doc); ``compiler`` ("tpu" or "cpu") is the XLA backend
    whose working set to estimate, ``attention`` the kernel (:data:`~workbench.core.vocab.ATTENTION_KERNELS`)."""
    one_of("remat", remat, REMATS, what=" for the ledger")
    if compiler not in WORKING_SET:
        raise ValueError(f"compiler must be one of {tuple(WORKING_SET)}; got {compiler!r}")
    b, t, _ = tokens_per_device(layout, batch, layout.mode)
    item = np.dtype(dtype).itemsize
    rows = b * t
    stacks = [(prefix, n, layer_set(layout, prefix, t_kv=batch[1], moe_strategy=moe_strategy, tokens=rows,
                                    capacity_factor=capacity_factor, attention=attention,
                                    sequence_parallel=sequence_parallel, autograd=autograd))
              for prefix, n in layer_stacks(layout)]
    kept = sum(n * s.bytes_per_row(remat, item) for _, n, s in stacks) * rows
    dots = [s.bytes_per_row("dots_saveable", item) * rows for _, _, s in stacks]
    recompute = sum(dots) if remat != "none" else max(dots)  # with remat each stack's loop recomputes apart
    switch = max((_layer_kinds(layout, prefix) - 1) * s.bytes_per_row("none", item) * rows
                 for prefix, _, s in stacks)
    cast_dtype = dtype if compiler == "tpu" else None  # XLA:TPU gathers the compute-dtype copy (cast_bytes)
    gathered = max(gathered_layer_bytes(layout, prefix, cast_dtype) for prefix, _, _ in stacks)
    working = 2 * gathered + WORKING_SET[compiler][remat] * recompute + switch
    scores = attention_backward_bytes(layout, batch, remat, dtype, compiler) if attention == "xla" else 0
    if offload:  # all of it written to the host; two layers' saved sets on the device
        in_flight = 2 * max(s.bytes_per_row(remat, item) for _, _, s in stacks) * rows
        return ActivationBytes(int(min(kept, in_flight)), int(max(working, scores)), int(kept))
    return ActivationBytes(int(kept), int(max(working, scores)))


def attention_scores(layout: Layout, batch: tuple[int, int], prefix: str = "layers/") -> float:
    """Score elements (query x key x head) one layer's attention computes on a device: ``b t H_l t_kv``, the heads
    the model-parallel axes leave on it, every key of the sequence (the scores are materialised in full)."""
    b, t, _ = tokens_per_device(layout, batch, layout.mode)
    c = layout.config
    q_path = prefix + ("self_attn/q_b_proj/kernel" if prefix + "self_attn/q_b_proj/kernel" in layout.paths
                       else "self_attn/q_proj/kernel")
    heads = c.num_attention_heads / _model_split(layout[q_path], 2, set(_data_axes(layout)), dict(layout.mesh.shape))
    return b * t * heads * batch[1]


def attention_backward_bytes(layout: Layout, batch: tuple[int, int], remat: str, dtype: tp.Any,
                             compiler: str = "tpu") -> int:
    """Bytes per device of a train step's attention-backward phase (see the module doc): :data:`SCORE_BYTES` a
    score of one layer (:func:`attention_scores`) and one layer's gathered weights (in the compute ``dtype`` on
    XLA:TPU); 0 where the compiler's are not measured (XLA:CPU).

    Measured on XLA:TPU (libtpu 0.0.42), the whole ledger against the compiled peak: a 2-layer Llama (hidden 1024, 8
    heads of 128, 4096 positions, v5p:2x2x1 ``fsdp=4``) none / dots_saveable / full +0.9 / +2.4 / -2.5 % (the bytes
    a score that would match exactly: 6.78 / 6.58 / 8.25); Llama-3-70B's layers, ``remat="full"``, one sequence of
    4096 a device, +6.1 % on v5p:2x2x2 ``fsdp=8`` (2 layers), +7.3 % on v5p:4x4x4 ``fsdp=64`` (8 layers), +3.5 % on
    v5p:8x8x16 ``fsdp=1024`` (80 layers): there the ledger's peak is now another phase, not this one. Before the
    softmax's shift stopped its gradient (9 and 13 bytes a score, the phase the peak): -1.6 to +3.4 %, -3.6 %,
    +5.3 %, +2.9 %; -40.0 to -7.1 %, -26.6 %, -23.1 %, -19.4 % before this phase was counted at all. A flash kernel
    has no such phase (:func:`activation_bytes` leaves it out under ``attention="flash"``)."""
    per_score = SCORE_BYTES[compiler].get(remat, 0)
    if not per_score:
        return 0
    cast_dtype = dtype if compiler == "tpu" else None
    return int(max(per_score * attention_scores(layout, batch, prefix)
                   + gathered_layer_bytes(layout, prefix, cast_dtype) for prefix, _ in layer_stacks(layout)))


def _data_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes the batch dimension of a step's tokens is split over."""
    (batch_dim, _) = layout.token_decisions()
    return tuple(batch_dim.chosen)


def logits_bytes(layout: Layout, batch: tuple[int, int]) -> int:
    """One float32 copy of the logits a device computes: ``b t V_l 4``."""
    b, t, _ = tokens_per_device(layout, batch, layout.mode)
    head = "lm_head/kernel" if "lm_head/kernel" in layout.paths else "embed_tokens"
    p = layout[head]
    vocab_dim = len(p.shape) - 1 if head == "lm_head/kernel" else 0
    split = _model_split(p, vocab_dim, set(_data_axes(layout)), dict(layout.mesh.shape))
    return int(b * t * layout.config.vocab_size / split * 4)
