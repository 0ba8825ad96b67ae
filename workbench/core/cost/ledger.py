"""The memory ledger: bytes per device of a train step, a prefill or a decode step, predicted from structure.

Parts, per device (every device holds the same; specs divide their dimensions):

- ``params``: each parameter's block (:class:`workbench.core.sharding.plan.Layout`);
- ``grads``: a train step's gradients, one per parameter, its dtype and sharding (they live through the update);
  with ZeRO-1 split like the optimizer state: XLA slices each reduced gradient to the state's ``dp`` split and
  does not keep it whole (measured in :mod:`workbench.core.zero`), so the compiled step holds ZeRO-2's
  gradients;
- ``optimizer``: AdamW two moments + an int32 count; SGD with momentum one trace; Adafactor a row and a column
  statistic for a matrix whose two largest dims are >= 128 (replicated: they are small), else a full second
  moment, plus a count and two one-element placeholders per parameter (optax's state, in the params' dtype);
  arrays shaped like their parameter split over ``dp`` as well with ZeRO-1 (``zero_stage=1``,
  :mod:`workbench.core.zero`);
- ``activations``: what the forward keeps for the backward, per layer, times the layers (the layer scan stacks
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
    (after q/k norms, which keep what a norm keeps), v, the attention output, the probabilities twice in
    float32 and once in the model's dtype (``H_l t_kv`` each); the MLP's ``ACTIVATION_RESIDUALS`` arrays of
    its width (SwiGLU 6, GeGLU 8, GPT-2's GELU 6, GPT-OSS's clamped SwiGLU 9, gate and up included), per
    expert row for a MoE, plus the experts' outputs; MLA its two latent norms, the key ``[c ; k_pe]``, the
    value ``c``, the query, ``q_nope``, ``PV`` and its output;

- ``temporaries``: what lives only inside the step; the largest of three phases, since the loss's buffers are gone
  before the layers' backward starts (a Llama with an 8192-word vocabulary peaks at the loss at every remat
  policy): the loss's logits (``LOGITS_COPIES`` float32 copies of ``b t V_l 4`` bytes: XLA:CPU two, the logits
  and their softmax, the cotangent taking the logits' buffer; XLA:TPU 1.6, the slope of its HBM peak over the
  vocabulary, 6.4 bytes a logit, measured on a two-layer bfloat16 Llama at 16k, 32k and 64k words on v5p
  ``fsdp=8``), one layer's backward, or its attention's backward. One layer's backward
  holds one layer's weights all-gathered over the data axes and their unreduced gradient (twice the layer's
  bytes with the FSDP split undone), and a working set of cotangents and recomputed values that depends on the
  compiler: measured, not derived, in units of the layer's ``"dots_saveable"`` set (``WORKING_SET``; XLA's
  buffer assignment at 4 and 8 layers, whose difference isolates the per-layer part from the rest, over the
  dense and MoE families): XLA:TPU fuses the elementwise chains and holds about one set (half without remat,
  one and a half with ``remat="full"``, which recomputes the matmuls), XLA:CPU (which compiles GPU and CPU
  clusters in the worker) about two (2.75 with ``"full"``). With remat, a model with two stacks (a MoE's dense
  leading layers) recomputes in each stack's backward loop apart: their sets add up. Layers of several kinds
  (Gemma 3's and GPT-OSS's alternating sliding and full attention) run as a ``lax.switch`` in the scan, and XLA
  keeps the other branches' buffers too: measured about one layer's ``"none"`` set per further kind (XLA:TPU at
  every policy, XLA:CPU without remat; XLA:CPU's full-remat backward holds about a third of it). Mixed
  precision (float32 parameters, a bfloat16 ``dtype``) on XLA:TPU adds the parameters' bfloat16 copy, alive
  through every phase (:func:`cast_bytes`), and the layer's gathered weights and gradient are that copy's, in
  bfloat16 (measured: a 4-layer Llama at every remat policy on dp, ZeRO-1 and fsdp within 7.4 % of the compiled
  peak, from -11.9 % to +22.1 % when they were counted in float32 and the copy not at all). The attention's
  backward (:func:`attention_backward_bytes`) holds arrays the size of the layer's scores, ``H_l t_kv`` a row, one
  of them being the peak with long sequences and many heads on a device: XLA:TPU makes two float32 ones (the
  softmax's backward) and the causal mask as one byte a score (``pred``), 9 bytes a score, and with
  ``remat="full"`` the recomputed float32 logits besides, 13 (:data:`SCORE_BYTES`; the scores ``"none"`` and
  ``"dots_saveable"`` save are ``activations``), beside about one layer's gathered weights. Seen in the buffer
  assignment (``--xla_dump_to``) of Llama-3-70B on v5p ``fsdp=1024``, 4096 positions, ``remat="full"``: three
  ``f32[64, 4096, 4096]`` (4 GiB each) and a ``pred`` one live at its 19.55 GiB peak, where the two other phases
  gave 15.77 GiB (-19.4 %). Short sequences (the families' tests, 256 positions) peak in the other phases;
- with ZeRO-1 on XLA:TPU from libtpu 0.0.50 on, a train step's ``temporaries`` also hold a working copy of the
  parameters whose update is gathered back over ``dp`` (:func:`zero_parameter_copy_bytes`). The compiled step (the
  same HLO with libtpu 0.0.42 and 0.0.50) copies each such parameter on entry, the forward and backward read the
  copy, and the update writes the gathered new value into the donated parameter's buffer at the end. libtpu 0.0.42
  lends that buffer to other values meanwhile (the rotated copies, the layer scan's saved activations: seen in the
  buffer assignment, ``--xla_dump_to``), so its peak holds one set of parameters; 0.0.50 keeps it reserved from
  entry to the final write, so its peak holds two. Measured, 0.0.50's peak minus 0.0.42's for a 4-layer Llama
  on v5p:2x2x2, no remat / ``remat="full"`` (the parameters per device in brackets): bfloat16 on dp=8 +32.0 / +30.3
  MiB (32), float32 master weights +64.0 / +56.0 (64), dp=2 x fsdp=4 +7.5 / +5.5 (8), dp=4 x tp=2 +12.0 / +19.9
  (16), pipelined pp=2 x dp=4 +16.0 / +17.0 (17); without ZeRO nothing is copied and both peaks are equal. The
  release is the cluster's (``Cluster.libtpu``), by default the newest measured (:data:`LIBTPU_NEWEST_MEASURED`):
  a prediction for a cluster is for the compiler it runs, not the one installed here. Releases between 0.0.42
  and 0.0.50 are not measured and count as 0.0.42. To hold the ledger against a step compiled here, give the
  cluster the installed release (``Cluster.tpu(..., libtpu=libtpu_version())``);
- ``kv_cache``: keys and values of every layer (:func:`kv_cache_bytes`);
- with a ``pipeline`` (a :class:`workbench.core.pipeline.PipelineConfig` on a ``pp`` mesh axis): the stacked
  layers' parameters, gradients and optimizer state divide by the stage count (the layout must split
  ``LAYERS`` over ``pp``: ``pipeline_partition_axis()``); ``activations`` are what the schedule keeps alive,
  the stage inputs and incoming gradients of its buffers (:func:`~workbench.core.pipeline.activation_stash_bytes`:
  ``m`` microbatches with GPipe, at most ``p`` with 1F1B) plus the executor's whole-batch input and output
  (the embeddings and their gradient); ``temporaries`` are one stage's backward for one microbatch (its
  recomputed activations under the remat policy) and the larger of one layer's backward and that microbatch's
  logits;
- ``inputs``: the token ids.

A prefill or decode step's temporaries are one layer's gathered weights and matmul outputs, then the logits.

The reference is XLA's HBM buffer assignment: on a TPU, compile with ``compiler_options=TPU_HBM_ONLY``
(:mod:`workbench.core.compile.virtual`) where a tiny model's peak is to be compared, since memory-space assignment to
a TensorCore's VMEM reshapes it (negligible at real sizes).

:func:`ledger` returns a :class:`Ledger`; with a cluster it is held against the HBM of one device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
import typing as tp

import numpy as np

from workbench.core.axes import BATCH, LENGTH, MODE_DECODE, MODE_TRAIN, PartitionAxis, shard_shape
from workbench.core.pipeline_schedule import activation_stash_bytes
from workbench.core.shapes import capacity
from workbench.core.units import format_bytes
from workbench.core.vocab import OPTIMIZERS, REMATS, TASKS
from workbench.core.zero import state_split

# A resolved workbench.core.sharding.plan.Layout: the ledger reads its parameters' blocks and its mesh; it is not
# imported, since sharding sits above the cost layer (the ledger is arithmetic over what a layout resolved).
Layout = tp.Any

# The loss phase's logits, in float32 copies of them, by compiler: measured (see the module doc).
LOGITS_COPIES = {"tpu": 1.6, "cpu": 2.0}
# One layer's backward working set, in units of the layer's dots_saveable set (its matmul outputs), by compiler
# and remat policy: measured (see the module doc), not derived.
WORKING_SET = {"tpu": {"none": 0.5, "dots_saveable": 1.0, "full": 1.5},
               "cpu": {"none": 2.0, "dots_saveable": 2.0, "full": 2.75}}
# Bytes a score (one query's logit for one key, per head) that a layer's attention backward holds beyond what the
# forward kept, by compiler and remat policy: measured on XLA:TPU (see the module doc and attention_backward_bytes);
# XLA:CPU is not measured and counts no such phase.
SCORE_BYTES = {"tpu": {"none": 9, "dots_saveable": 9, "full": 13}, "cpu": {}}
ADAFACTOR_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor
# The libtpu from which XLA:TPU keeps a donated parameter's buffer reserved while a ZeRO-1 step works on a copy of
# the parameter: measured on 0.0.42.1 (lends it to other values) and 0.0.50.1 (see the module doc).
LIBTPU_HOLDS_DONATED_PARAMETERS = (0, 0, 50)
# What the ledger predicts for when a cluster names no libtpu release: the newest one measured.
LIBTPU_NEWEST_MEASURED = (0, 0, 50)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per device by part (see the module doc), and the device's HBM when a cluster is known.

    ``kind`` is the step (:data:`TASKS`), or ``"state"`` for what a layout holds between steps: parameters,
    optimizer state and a KV cache, no step's gradients, activations or temporaries
    (:func:`workbench.core.views.explore.layout_memory`)."""

    kind: str
    remat: str
    params: int
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    kv_cache: int = 0
    inputs: int = 0
    hbm_per_device: float | None = None

    PARTS: tp.ClassVar[tuple[str, ...]] = ("params", "grads", "optimizer", "activations", "kv_cache",
                                           "temporaries", "inputs")

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in self.PARTS)

    @property
    def fits(self) -> bool | None:
        """Whether the total fits the device's HBM (None without a cluster)."""
        return None if self.hbm_per_device is None else self.total <= self.hbm_per_device

    @property
    def headroom(self) -> float | None:
        """HBM left per device (negative: bytes missing), None without a cluster."""
        return None if self.hbm_per_device is None else self.hbm_per_device - self.total

    def parts(self) -> dict[str, int]:
        return {part: getattr(self, part) for part in self.PARTS}

    def __str__(self) -> str:
        gib = functools.partial(format_bytes, unit="GiB", decimals=3)
        what = "between steps" if self.kind == "state" else f"{self.kind} step, remat={self.remat}"
        lines = [f"{what}: {gib(self.total)} per device"]
        lines += [f"  {part:<12}{gib(n)}" for part, n in self.parts().items() if n]
        if self.hbm_per_device is not None:
            verdict = "fits" if self.fits else f"does NOT fit: {gib(-self.headroom)} over"
            lines.append(f"  HBM {gib(self.hbm_per_device)}: {verdict}")
        return "\n".join(lines)


# -- the parts -----------------------------------------------------------------------------------------
def _state_block_bytes(layout: Layout, zero_stage: int | None) -> tp.Callable[[tp.Any], int]:
    """Bytes per device of an array shaped like a parameter and split like its optimizer state (the parameter's
    block, over ``dp`` too at ZeRO-1)."""
    zero = layout.zero_stage if zero_stage is None else zero_stage
    sizes = dict(layout.mesh.shape)
    if not zero or sizes.get("dp", 1) == 1:
        return lambda p: p.bytes_per_device
    return lambda p: p.bytes_per_device // state_split(p.spec, p.shape, sizes, zero)


def gradient_bytes(layout: Layout, zero_stage: int | None = None) -> int:
    """Bytes per device of a train step's gradients at their peak: each parameter's block, or at ZeRO-1 its
    optimizer state's (see the module doc)."""
    return sum(map(_state_block_bytes(layout, zero_stage), layout.params))


def optimizer_bytes(layout: Layout, name: str, zero_stage: int | None = None) -> int:
    """Bytes per device of optax's ``name`` state for the parameters of ``layout`` (see the module doc); an array
    shaped like its parameter is split over ``dp`` too at ``zero_stage=1`` (default: the layout's,
    :mod:`workbench.core.zero`)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")
    like_param = _state_block_bytes(layout, zero_stage)
    count = 4  # int32 step count, replicated
    if name == "adamw":
        return 2 * sum(like_param(p) for p in layout.params) + count
    if name == "sgd":
        return sum(like_param(p) for p in layout.params)
    total = count
    for p in layout.params:
        dims = sorted(p.shape, reverse=True)
        item = p.dtype.itemsize
        if len(dims) >= 2 and dims[1] >= ADAFACTOR_MIN_DIM:  # v_row and v_col (replicated), v a placeholder
            n = math.prod(p.shape)
            total += (n // dims[0] + n // dims[1] + 1) * item
        else:  # a full v like the parameter, v_row and v_col placeholders
            total += like_param(p) + 2 * item
    return total


@functools.cache
def libtpu_version() -> tuple[int, ...] | None:
    """The installed ``libtpu`` package's release as integers (``"0.0.50.1"`` -> ``(0, 0, 50, 1)``), read once;
    None where it is not installed."""
    try:
        text = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    release = re.match(r"\d+(\.\d+)*", text)
    if release is None:
        raise ValueError(f"libtpu's version {text!r} does not start with a release number (such as 0.0.50)")
    return tuple(int(n) for n in release.group().split("."))


def zero_parameter_copy_bytes(layout: Layout, zero_stage: int | None = None, compiler: str = "tpu",
                              libtpu: tuple[int, ...] | None = None) -> int:
    """Bytes per device of the working copy of the parameters a ZeRO-1 train step gathers back over ``dp``
    (those whose optimizer state ``dp`` splits), which XLA:TPU holds beside the donated parameters from libtpu
    0.0.50 on (see the module doc); 0 without ZeRO-1, on XLA:CPU, or with an older ``libtpu`` release (default
    :data:`LIBTPU_NEWEST_MEASURED`)."""
    if compiler != "tpu" or (libtpu or LIBTPU_NEWEST_MEASURED) < LIBTPU_HOLDS_DONATED_PARAMETERS:
        return 0
    state = _state_block_bytes(layout, zero_stage)
    return sum(p.bytes_per_device for p in layout.params if state(p) < p.bytes_per_device)


def kv_cache_bytes(layout: Layout, batch: int, max_length: int, dtype: tp.Any) -> int:
    """Bytes per device of a KV cache: keys and values of every layer, ``layers x 2 x (B, S, KV, D)`` (MLA:
    ``layers x (B, S, 1, C + R)``, values inside the keys), split as
    :func:`~workbench.core.sharding.plan.kv_cache_spec` says."""
    _, decisions = layout.kv_cache_decisions(batch, max_length)
    block = shard_shape(decisions, dict(layout.mesh.shape))
    arrays = 1 if layout.config.mla else 2  # MLA's values are the first channels of its keys
    return arrays * layout.config.num_hidden_layers * math.prod(block) * np.dtype(dtype).itemsize


def _tokens_per_device(layout: Layout, batch: tuple[int, int], mode: str) -> tuple[int, int, int]:
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
              tokens: int = 1, capacity_factor: float | None = None) -> LayerSet:
    """Per token row, what one layer of the stack under ``prefix`` keeps for its backward (see the module
    doc for the three policies); ``t_kv`` keys per query, ``tokens`` the device's tokens (a MoE's capacity)."""
    sizes = dict(layout.mesh.shape)
    data_axes = set(_data_axes(layout))
    c = layout.config
    width = lambda name: _width(layout, prefix + name, data_axes, sizes)
    has = lambda name: prefix + name in layout.paths
    d = c.hidden_size
    # -- attention: heads on this device, its dot outputs and what its elementwise ops keep
    if c.mla:
        q_path = "self_attn/q_b_proj/kernel" if has("self_attn/q_b_proj/kernel") else "self_attn/q_proj/kernel"
        heads = c.num_attention_heads / _model_split(layout[prefix + q_path], 2, data_axes, sizes)
        lat, rope = c.kv_lora_rank, c.qk_rope_head_dim
        q_lora = width("self_attn/q_a_proj/kernel") if has("self_attn/q_a_proj/kernel") else 0
        # absorbed form (mla.py): kv_b_proj's halves act per head, q_nope -> q_lat (H C) and PV (H C) -> (H V);
        # every head reads one key [c ; k_pe] and one value c
        attn_dots = q_lora + width(q_path) + width("self_attn/kv_a_proj_with_mqa/kernel") + heads * lat \
            + heads * lat + heads * c.v_head_dim + d
        rms_f32, rms_dt = NORM_RESIDUALS["rms"]
        attn_none = ((rms_dt + 1) * q_lora + rms_dt * lat + (lat + rope) + lat + heads * (lat + rope)
                     + heads * c.qk_nope_head_dim + heads * lat + heads * c.v_head_dim + heads * t_kv,
                     rms_f32 * (q_lora + lat))
    else:
        q, k, v = (width(f"self_attn/{n}_proj/kernel") for n in "qkv")
        heads = c.num_attention_heads / _model_split(layout[prefix + "self_attn/q_proj/kernel"], 2, data_axes, sizes)
        attn_dots = q + k + v + heads * c.head_dim + d  # PV, o_proj's output (the residual sum's operand)
        qk_f32, qk_dt = NORM_RESIDUALS[_norm_kind(c)] if c.qk_norm else (0, 0)
        # rotated q and k, v, the attention output, the probabilities in the model's dtype (+ two float32 below)
        attn_none = (q + k + v + heads * c.head_dim + heads * t_kv + qk_dt * (q + k), qk_f32 * (q + k))
    attn_f32 = heads * t_kv  # QK^T: float32 logits (accumulation_dtype), then the float32 softmax
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
        if has("mlp/shared_gate"):
            shared = width("mlp/shared_gate")
            mlp_dots += 2 * shared
            mlp_none += ACTIVATION_RESIDUALS[("swiglu", "silu")] * shared
    else:
        up = width("mlp/up_proj/kernel")
        gated = has("mlp/gate_proj/kernel")
        mlp_type = "swiglu" if gated else c.mlp_type
        mlp_dots = (2 if gated else 1) * up + (d if c.sandwich_norms else 0)  # down_proj feeds the post-MLP norm
        mlp_none = ACTIVATION_RESIDUALS[(mlp_type, c.hidden_act)] * up
    # -- norms over D: their residuals, and the outputs that feed the attention's and the MLP's matmuls
    norms = 4 if c.sandwich_norms else 2
    n_f32, n_dt = NORM_RESIDUALS[_norm_kind(c)]
    dots = (d + attn_dots + mlp_dots, attn_f32)
    none = (attn_none[0] + mlp_none + (norms * n_dt + 2) * d, attn_none[1] + 2 * attn_f32 + norms * n_f32 * d)
    return LayerSet(full=(d, 0), dots_saveable=dots, none=none)


def _stacks(layout: Layout) -> list[tuple[str, int]]:
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


def _gathered_layer_bytes(layout: Layout, prefix: str, dtype: tp.Any = None) -> float:
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


def activation_bytes(layout: Layout, batch: tuple[int, int], remat: str, dtype: tp.Any, compiler: str = "tpu",
                     moe_strategy: str = "dense", capacity_factor: float | None = None) -> tuple[int, int]:
    """``(kept for the backward, the backward's working set)`` in bytes per device (see the module doc);
    ``compiler`` ("tpu" or "cpu") is the XLA backend whose working set to estimate."""
    if remat not in REMATS:
        raise ValueError(f"remat must be one of {REMATS} for the ledger; got {remat!r}")
    if compiler not in WORKING_SET:
        raise ValueError(f"compiler must be one of {tuple(WORKING_SET)}; got {compiler!r}")
    b, t, _ = _tokens_per_device(layout, batch, layout.mode)
    item = np.dtype(dtype).itemsize
    rows = b * t
    stacks = [(prefix, n, layer_set(layout, prefix, t_kv=batch[1], moe_strategy=moe_strategy, tokens=rows,
                                    capacity_factor=capacity_factor)) for prefix, n in _stacks(layout)]
    kept = sum(n * s.bytes_per_row(remat, item) for _, n, s in stacks) * rows
    dots = [s.bytes_per_row("dots_saveable", item) * rows for _, _, s in stacks]
    recompute = sum(dots) if remat != "none" else max(dots)  # with remat each stack's loop recomputes apart
    switch = max((_layer_kinds(layout, prefix) - 1) * s.bytes_per_row("none", item) * rows
                 for prefix, _, s in stacks)
    cast_dtype = dtype if compiler == "tpu" else None  # XLA:TPU gathers the compute-dtype copy (cast_bytes)
    gathered = max(_gathered_layer_bytes(layout, prefix, cast_dtype) for prefix, _, _ in stacks)
    working = 2 * gathered + WORKING_SET[compiler][remat] * recompute + switch
    attention = attention_backward_bytes(layout, batch, remat, dtype, compiler)
    return int(kept), int(max(working, attention))


def attention_scores(layout: Layout, batch: tuple[int, int], prefix: str = "layers/") -> float:
    """Score elements (query x key x head) one layer's attention computes on a device: ``b t H_l t_kv``, the heads
    the model-parallel axes leave on it, every key of the sequence (the scores are materialised in full)."""
    b, t, _ = _tokens_per_device(layout, batch, layout.mode)
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

    Measured on XLA:TPU (libtpu 0.0.42), peak minus arguments, kept activations and gradients, against this: a
    2-layer Llama (hidden 1024, 8 heads of 128, 4096 positions, v5p:2x2x1 ``fsdp=4``) none / dots_saveable / full
    1.10 / 1.07 / 1.68 GiB against 1.15 / 1.15 / 1.65; Llama-3-70B's layers, ``remat="full"``, one sequence of
    4096 a device, 14.59 against 15.28 on v5p:2x2x2 ``fsdp=8`` (2 layers), 13.78 on v5p:4x4x4 ``fsdp=64`` (8
    layers), 14.03 on v5p:8x8x16 ``fsdp=1024`` (80 layers). The whole ledger: -1.6 to +3.4 %, -3.6 %, +5.3 %, +2.9 %
    (-40.0 to -7.1 %, -26.6 %, -23.1 %, -19.4 % before this phase was counted)."""
    per_score = SCORE_BYTES[compiler].get(remat, 0)
    if not per_score:
        return 0
    cast_dtype = dtype if compiler == "tpu" else None
    return int(max(per_score * attention_scores(layout, batch, prefix)
                   + _gathered_layer_bytes(layout, prefix, cast_dtype) for prefix, _ in _stacks(layout)))


def _data_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes the batch dimension of a step's tokens is split over."""
    (batch_dim, _) = layout.token_decisions()
    return tuple(batch_dim.chosen)


def logits_bytes(layout: Layout, batch: tuple[int, int]) -> int:
    """One float32 copy of the logits a device computes: ``b t V_l 4``."""
    b, t, _ = _tokens_per_device(layout, batch, layout.mode)
    head = "lm_head/kernel" if "lm_head/kernel" in layout.paths else "embed_tokens"
    p = layout[head]
    vocab_dim = len(p.shape) - 1 if head == "lm_head/kernel" else 0
    split = _model_split(p, vocab_dim, set(_data_axes(layout)), dict(layout.mesh.shape))
    return int(b * t * layout.config.vocab_size / split * 4)


# -- the ledger ------------------------------------------------------------------------------------------
def ledger(model: tp.Any, layout: Layout, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
           optimizer: str = "adamw", remat: str | None = None, kv_length: int | None = None,
           cluster: tp.Any = None, partition_axis: PartitionAxis | None = None, pipeline: tp.Any = None,
           zero_stage: int | None = None) -> Ledger:
    """Bytes per device of one ``kind`` step of ``model`` laid out by ``layout`` (see the module doc).

    ``batch = (B, T)``: rows and positions of a train step or a prefill (a decode step takes ``(B, 1)``);
    ``remat`` defaults to the model's policy; ``kv_length`` sizes the KV cache of a prefill or decode step
    (default ``T``); ``cluster`` adds its HBM per device and picks the compiler whose temporaries to estimate
    (XLA:TPU for a TPU cluster, else XLA:CPU, which compiles GPU and CPU clusters here). ``pipeline`` (a
    ``PipelineConfig``, train steps only) counts a pipelined step (see the module doc); ``zero_stage`` (default the
    layout's) splits the optimizer state over ``dp`` at 1.
    """
    if kind not in TASKS:
        raise ValueError(f"kind must be one of {TASKS}; got {kind!r}")
    remat = getattr(model, "remat", "none") if remat is None else remat
    dtype = np.dtype(getattr(model, "dtype", np.float32))
    hbm = None if cluster is None else cluster.hbm_per_device
    compiler = "tpu" if cluster is None or cluster.platform == "tpu" else "cpu"
    ids = int(np.prod(batch)) * 4 // max(1, _tokens_per_device(layout, batch, layout.mode)[2])
    moe = dict(zip(("moe_strategy", "capacity_factor"), moe_strategy_of(model, layout), strict=True))
    # mixed precision on XLA:TPU: the weights' compute-dtype copy, alive through a train step (cast_bytes)
    cast = cast_bytes(layout, dtype) if compiler == "tpu" else 0
    # ZeRO-1 on XLA:TPU from libtpu 0.0.50: the parameters' working copy beside their donated buffers
    copies = zero_parameter_copy_bytes(layout, zero_stage, compiler, getattr(cluster, "libtpu", None)) \
        if kind == "train" else 0
    if pipeline is not None:
        if kind != "train":
            raise ValueError("the pipeline ledger counts train steps; pass kind='train' or pipeline=None")
        kept, temporaries = pipeline_activation_bytes(layout, pipeline, batch, remat, dtype, compiler, **moe)
        return Ledger(kind, remat, layout.param_bytes, gradient_bytes(layout, zero_stage),
                      optimizer_bytes(layout, optimizer, zero_stage), kept, cast + copies + temporaries, 0, ids, hbm)
    if kind == "train":
        kept, working = activation_bytes(layout, batch, remat, dtype, compiler, **moe)
        return Ledger(kind, remat, layout.param_bytes, gradient_bytes(layout, zero_stage),
                      optimizer_bytes(layout, optimizer, zero_stage), kept,
                      cast + copies + max(working, int(LOGITS_COPIES[compiler] * logits_bytes(layout, batch))), 0,
                      ids, hbm)
    b, t = batch
    length = kv_length or t
    if layout.mode != MODE_TRAIN and kind == "decode" and layout.mode != MODE_DECODE:
        raise ValueError(f"a decode step's layout is resolved in decode mode; this one is {layout.mode!r}")
    kv = kv_cache_bytes(layout, b, length, dtype)
    step_batch = batch if kind == "prefill" else (b, 1)
    sb, st, _ = _tokens_per_device(layout, step_batch, layout.mode)
    layers = [(prefix, layer_set(layout, prefix, t_kv=length, moe_strategy=moe["moe_strategy"], tokens=sb * st,
                                 capacity_factor=moe["capacity_factor"])) for prefix, _ in _stacks(layout)]
    # one layer's gathered weights and its matmul outputs, then the logits
    working = max(_gathered_layer_bytes(layout, prefix) + s.bytes_per_row("dots_saveable", dtype.itemsize) * sb * st
                  for prefix, s in layers)
    return Ledger(kind, "none", layout.param_bytes, kv_cache=kv,
                  temporaries=int(working) + logits_bytes(layout, step_batch), inputs=ids, hbm_per_device=hbm)


def pipeline_activation_bytes(layout: Layout, pipeline: tp.Any, batch: tuple[int, int], remat: str, dtype: tp.Any,
                              compiler: str = "tpu", moe_strategy: str = "dense",
                              capacity_factor: float | None = None) -> tuple[int, int]:
    """``(kept, temporaries)`` bytes per device of a pipelined train step (see the module doc)."""
    sizes = dict(layout.mesh.shape)
    if sizes.get("pp", 1) != pipeline.num_stages:
        raise ValueError(f"PipelineConfig(num_stages={pipeline.num_stages}) but the layout's mesh has pp="
                         f"{sizes.get('pp', 1)}; make them equal")
    layers = next((p for p in layout.params if p.path.startswith("layers/")), None)
    if pipeline.num_stages > 1 and (layers is None or "pp" not in layers.decisions[0].chosen):
        raise ValueError("a pipelined layout stores each stage's layers on its own devices: resolve it with "
                         "pipeline_partition_axis() (LAYERS over pp)")
    c = layout.config
    big, t = batch
    data_ways = _tokens_per_device(layout, batch, layout.mode)[2]
    pipeline.check_batch(big, data_ways)
    item = np.dtype(dtype).itemsize
    stash = activation_stash_bytes(pipeline, batch_size=big, seq_len=t, hidden_size=c.hidden_size, dtype=dtype,
                                   data_ways=data_ways)
    b = big // data_ways
    whole = 2 * b * t * c.hidden_size * item  # the embeddings in, their gradient out
    micro = (big // pipeline.num_microbatches, t)
    _, working = activation_bytes(layout, micro, remat, dtype, compiler, moe_strategy, capacity_factor)
    per_stage = pipeline.check_layers(c.num_hidden_layers - c.first_dense_layers)
    mb, mt, _ = _tokens_per_device(layout, micro, layout.mode)
    stage_layer = layer_set(layout, "layers/", t_kv=t, moe_strategy=moe_strategy, tokens=mb * mt,
                            capacity_factor=capacity_factor)
    stage_kept = int(per_stage * stage_layer.bytes_per_row(remat, item) * mb * mt)
    return stash + whole, stage_kept + max(working, int(LOGITS_COPIES[compiler] * logits_bytes(layout, micro)))
