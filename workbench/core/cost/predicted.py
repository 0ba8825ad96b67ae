"""A layout's step time predicted from the model's shapes, without compiling: what a layout search ranks by.

:func:`predict_step` counts, per device, the matmul FLOPs, the HBM bytes and every collective of one train,
prefill or decode step of a :class:`~workbench.core.models.config.ModelConfig` laid out on a mesh of
``(pp, dp, fsdp, ep, tp, sp)`` sizes, and prices them on a :class:`~workbench.core.hardware.cluster.Cluster` with
:mod:`workbench.core.hardware.network` (the roofline and :func:`~workbench.core.hardware.network.transfer`). It returns
a
:class:`~workbench.core.cost.step_time.StepTime`, the same record a compiled step gets, with the work split by layer
kind (:meth:`~workbench.core.cost.step_time.StepTime.by_kind`: "attention", "mlp", "experts", "embedding+head",
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

The derivation (``n``: tokens a device holds, ``D`` hidden, ``F`` MLP width, ``H`` heads of ``h`` dims, ``K``
key/value heads, ``V`` vocabulary, ``T`` sequence, ``m`` microbatches; every dimension a mesh axis splits is
divided by its size):

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

**Collectives**, each ``cost.transfer(kind, bytes, axes, mesh, cluster)`` times its runs (Training chapter;
GPUs chapter for NVLink and the network between nodes):

- FSDP: weights shard over ``fsdp`` and ``sp`` (the workbench's layout: ``('fsdp', 'sp')`` on the embedding
  dimension; experts over ``fsdp`` only). Each layer's weights are all-gathered in the forward and again in
  the backward (GSPMD inserts the gather after autodiff: the backward saves the sharded weight, not the
  gathered one, whatever the remat policy; per microbatch under a pipeline), and the gradients are
  reduce-scattered once a step;
- data parallelism: gradients all-reduced over the token axes a weight is replicated on (``dp``, and ``sp``
  for experts), after the reduce-scatter when both; with ZeRO-1 (``zero_stage=1``) the ``dp`` share is a
  reduce-scatter into the optimizer state's split and an all-gather of the updated weights (the same bytes),
  and the optimizer's traffic divides by ``dp``;
- TP (Megatron, no sequence parallelism): an all-reduce of the ``n D`` activations after attention's output
  projection and after the MLP's, the same two in the backward (the input gradients of the column-parallel
  projections, summed before one all-reduce), and the recompute's (the attention one only, as above); the
  embedding's vocabulary-split lookup and the head's input gradient one each;
- EP: two all-to-alls of the ``n k D`` routed copies a MoE layer forward (dispatch, return), two backward, two
  more under ``"full"``; with ``ep`` outside ``batch_axes`` an all-gather of the ``1/ep`` token split after the
  layer (its transpose, a reduce-scatter, in the backward); perfectly balanced, nothing dropped;
- SP (ring attention): each layer passes its K and V around the ``sp`` ring, ``sp - 1`` collective-permutes
  forward and twice that backward (K, V and their gradients); decode, with the cache split over ``sp``,
  all-reduces each layer's partial attention outputs;
- PP: a collective-permute of the ``n D / m`` activations per microbatch and stage, forward and backward, and
  the bubble: ``(p - 1) / (v m + p - 1)`` of the schedule idle (:class:`~.pipeline_schedule.PipelineConfig`'s
  closed form), ``f / (1 - f)`` times the pipelined layers' busy time added to the step.

The step overlaps compute, memory and communication (``overlap=True``: the longest part, the book's
assumption) or runs them one after another; the bubble adds either way. Not counted: norm weights and their
gradients, the softmax's statistics across ``tp``, the loss's scalars, optimizer FLOPs (the roofline counts
matmul FLOPs, as :func:`~workbench.core.cost.step_time.step_time` does).

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

from workbench.core.checks import batch_shape, positive_int
from workbench.core.cost.flops import model_flops, model_shapes
from workbench.core.cost.kernels import attention_efficiency, gemm_efficiency, memory_seconds
from workbench.core.cost.roofline import check_chip, rate_dtype, roofline
from workbench.core.cost.step_time import CollectiveTime, StepTime, Term, WorkPart
from workbench.core.hardware.calibration import ADAMW_F32_BYTES, FLASH_BACKWARD, calibration
from workbench.core.hardware.cluster import Cluster
from workbench.core.hardware.network import transfer
from workbench.core.mesh import MESH_AXES
from workbench.core.pipeline_schedule import PipelineConfig
from workbench.core.shapes import stored_kv_heads
from workbench.core.vocab import REMATS, TASKS
from workbench.core.zero import check_zero_stage

WORK_KINDS = ("attention", "mlp", "experts", "embedding+head", "optimizer", "pipeline")
BATCH_AXES = ("fsdp", "dp")  # PartitionAxis.batch_axis
_ITEM_BYTES = {"bf16": 2, "int8": 1, "fp8": 1}
# a bf16 operand cast to fp8 with a dynamic per-tensor scale: read for its amax, read and written as fp8 (the
# second read fused with the first where the compiler can: Transformer Engine, torch.compile)
FP8_CAST_BYTES = 3
ADAMW_ACCESSES = 7  # reads: param, grad, mu, nu; writes: param, mu, nu
# HBM traffic of the loss: float32 logits written, their softmax, their cotangent. Bytes moved, not the ledger's
# LOGITS_COPIES (the copies resident at once, measured per compiler).
LOGITS_PASSES = 3
NORM_RESIDUAL = 5  # elements a token a sublayer: a norm's read and write, the residual add's two reads, a write
_DENSE_W = ("fsdp", "sp", "tp")  # mesh axes that split a projection, the head or the embedding
_EXPERT_W = ("ep", "fsdp", "tp")


class _Acc:
    """Per-kind FLOPs and bytes, the collectives (merged when alike), and what the step model prices beyond the
    roofline: each kind's GEMMs by shape, its flash-attention FLOPs, its memory-bound bytes."""

    def __init__(self, sizes: dict[str, int], fp8: bool = False):
        self.sizes, self.fp8 = sizes, fp8
        self.flops = dict.fromkeys(WORK_KINDS, 0.0)
        self.bytes = dict.fromkeys(WORK_KINDS, 0.0)
        self.fused = dict.fromkeys(WORK_KINDS, 0.0)
        self.comms: dict[tuple, list] = {}
        self.gemms: list[tuple[str, float, float, float, float, float, float]] = []
        self.attention: list[tuple[float, float, float, float, float, float]] = []
        self.recomputed = 0.0  # the FLOPs remat="full" recomputes (in ``flops``)

    def comm(self, part: str, kind: str, axes: tp.Sequence[str], nbytes: float, runs: float, name: str,
             pipelined: bool = False, role: str = "critical") -> None:
        axes = tuple(a for a in axes if self.sizes[a] > 1)
        if not axes or runs <= 0 or nbytes <= 0:
            return
        key = (part, kind, axes, int(nbytes), name)
        entry = self.comms.setdefault(key, [0, pipelined, role])
        entry[0] += int(runs)

    def gemm(self, part: str, m: float, k: float, n: float, forward: float, backward: float, again: float = 0.0
             ) -> None:
        """``forward`` runs of an ``(m, k) @ (k, n)`` GEMM, ``backward`` runs of its two gradients, ``again``
        recomputed forwards."""
        if m > 0 and k > 0 and n > 0 and forward > 0:
            self.gemms.append((part, m, k, n, forward, backward, again))
            if self.fp8 and part != "embedding+head":  # dynamic scaling: operands read for amax, written as fp8
                self.fused[part] += FP8_CAST_BYTES * ((forward + again) * (m * k + k * n)
                                                      + backward * (m * n + m * k))


def _kv_heads_per_device(s: tp.Any, tp_: int) -> int:
    """K / V heads of the cache a device holds (:func:`~workbench.core.shapes.stored_kv_heads` split over
    ``tp``; all of them where they do not divide; MLA's latent is not split)."""
    if not s.kv_split:
        return s.kv_heads
    stored = stored_kv_heads(s.kv_heads, s.heads, tp_)
    return stored // tp_ if stored % tp_ == 0 else stored


def _check(task: str, remat: str, batch: tp.Any, batch_axes: tp.Sequence[str], mesh_shape: tp.Mapping[str, int],
           cluster: Cluster) -> dict[str, int]:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}; got {task!r}")
    if remat not in REMATS:
        raise ValueError(f"remat must be one of {REMATS}; got {remat!r}")
    batch_shape(batch)
    sizes = cluster.axis_sizes(mesh_shape)
    bad = sorted(set(batch_axes) - {"dp", "fsdp", "ep"})
    if bad:
        raise ValueError(f"batch_axes split the batch: a subset of ('dp', 'fsdp', 'ep'); got {bad}")
    return sizes


def predict_step(config: tp.Any, cluster: Cluster, mesh_shape: tp.Mapping[str, int], *, batch: tuple[int, int],
                 task: str = "train", remat: str = "full", pipeline: PipelineConfig | None = None,
                 kv_length: int | None = None, dtype: tp.Any = "bf16", efficiency: float | None = None,
                 overlap: bool = True, batch_axes: tp.Sequence[str] = BATCH_AXES, zero_stage: int = 0,
                 grad_accumulation: int = 1, recompute: float | None = None, capacity_factor: float | None = None,
                 tp_overlap: bool | None = None, causal: bool = True, experts_fsdp: bool = True) -> StepTime:
    """The predicted time of one ``task`` step of ``config`` on ``cluster`` with a mesh of ``mesh_shape`` (workbench
    axes, e.g. ``{"fsdp": 16, "tp": 4}``), derived from shapes alone (see the module doc for every term).

    ``batch = (sequences, length)``: the global batch of a train step or a prefill; for decode the sequences
    and the context length (one new token each; ``kv_length`` overrides the length). ``remat`` is the layers'
    rematerialisation policy (train only); ``pipeline`` a :class:`PipelineConfig` whose ``num_stages`` is the
    mesh's ``pp``; ``dtype`` the parameters' and activations' ("bf16", or "int8" / "fp8": 1 byte, their peak
    rate); ``batch_axes`` the mesh axes the batch splits over; ``zero_stage=1`` the optimizer state split over
    ``dp`` (ZeRO-1, :mod:`workbench.core.zero`).

    By default the step is priced by the measured step model (:func:`_measured_terms`): kernels at the efficiencies
    :mod:`~workbench.core.hardware.calibration` cites, memory-bound work beside the matmuls, and only the communication
    that nothing hides (``overlap=False``: none hidden). ``grad_accumulation`` microbatches run one after another
    (no pipeline); ``recompute`` the fraction of a layer's forward matmuls its backward recomputes (default: 1 under
    ``remat="full"``, else 0; MaxText's "minimal" / "save_qkv_proj" policies lie between); ``capacity_factor`` pads
    each expert to ``factor x`` its balanced share of tokens (None: dropless, ragged GEMMs); ``tp_overlap`` hides
    the tensor-parallel collectives behind the matmuls (collective matmul, async TP; default: on TPU, where XLA
    decomposes them into windowed einsums unless told not to, off on GPU, where it takes async TP or Megatron's
    ``--tp-comm-overlap``); ``causal`` lets the attention kernel skip masked tiles; ``experts_fsdp=False`` keeps the
    expert weights whole over ``fsdp`` (split over ``ep`` and ``tp`` only: no gathers, an all-reduce of their
    gradients over the data axes instead). ``efficiency`` (a float) prices
    the old way instead: the roofline with matmuls at that fraction of peak, compute, memory and communication
    overlapped (1: the ideal, whose MFU and HFU are upper bounds). Raises ``ValueError`` for a batch or sequence
    the mesh does not divide, and for ``pp > 1`` without a matching ``pipeline``.
    """
    sizes = _check(task, remat, batch, batch_axes, mesh_shape, cluster)
    zero = check_zero_stage(zero_stage) == 1 and task == "train" and sizes["dp"] > 1
    mesh = dict(sizes)
    s = model_shapes(config)
    pp, ep, tp_, sp = sizes["pp"], sizes["ep"], sizes["tp"], sizes["sp"]
    rate = rate_dtype(dtype)
    wb = ab = _ITEM_BYTES[rate]
    train, decode = task == "train", task == "decode"
    r = 1 if train and remat == "full" else 0
    batch_axes = tuple(dict.fromkeys(batch_axes))
    data = math.prod(sizes[a] for a in batch_axes)
    big, length = batch
    if big % data:
        raise ValueError(f"{big} sequences do not split over the batch axes {batch_axes} ({data} ways); use a "
                         f"multiple of {data} or fewer data-parallel devices")
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
    if big % (data * grad_accumulation):
        raise ValueError(f"{big} sequences do not split into {grad_accumulation} microbatches over {data} "
                         f"data-parallel ways; use a batch that is a multiple of {data * grad_accumulation}")
    m = pipeline.num_microbatches if pipeline is not None else grad_accumulation
    v = pipeline.virtual_stages if pipeline is not None else 1
    if pipeline is not None:
        pipeline.check_batch(big, data)
    stacked = s.layers - s.dense_layers
    stacked_dev = pipeline.stage_layers(stacked) * v if pipeline is not None else stacked
    bubble = pipeline.bubble_fraction if pipeline is not None else 0.0

    seqs = big // data  # sequences a device holds
    if decode:
        kv = kv_length or length
        if kv % sp:
            raise ValueError(f"a KV cache of {kv} positions does not split over sp={sp}")
        n, span_kv, n_head = seqs, kv // sp, seqs
    else:
        if length % sp:
            raise ValueError(f"a sequence of {length} positions does not split over sp={sp}")
        n, span_kv, n_head = seqs * length // sp, length, (seqs * length // sp if train else seqs)
    nm = n / m
    d, k = s.hidden, s.topk
    passes = 3 + r if train else 1  # forward, backward (twice the forward), recompute
    g_runs = 2 * m if train else m  # FSDP gathers: forward and backward, per microbatch
    w_reads = (2 + r) * m if train else m
    grad_writes = m if train else 0
    acts = passes  # activation traffic: forward, the backward's two reads, a recompute
    rg = (r if recompute is None else recompute) if train else 0  # forward matmuls recomputed, as a fraction
    fused_passes = 1 + (2 + (remat != "none" or rg > 0) if train else 0)  # forward, backward's two, recompute
    tokens = set(batch_axes) | ({"sp"} if not decode else set())
    acc = _Acc(sizes, fp8=rate == "fp8")

    def gather(axes: tp.Sequence[str]) -> tuple[str, ...]:
        return tuple(a for a in ("fsdp", "sp") if a in axes and sizes[a] > 1)

    def weights(part: str, gathered_bytes: float, axes: tp.Sequence[str], layers: int, name: str,
                gathers: int | None = None, pipelined: bool = True) -> float:
        """Collectives of a weight group (FSDP gathers; gradient reduce-scatter, all-reduce), and its shard's
        bytes (what the optimizer updates)."""
        g = gather(axes)
        ways = math.prod(sizes[a] for a in g)
        acc.comm(part, "all-gather", g, gathered_bytes, layers * (g_runs if gathers is None else gathers),
                 f"{name} weights (FSDP)", pipelined, "gather")
        shard = gathered_bytes / ways
        if train:
            # sharded gradients are reduce-scattered per microbatch of an accumulation (a pipeline's once a step)
            acc.comm(part, "reduce-scatter", g, shard, layers * (1 if pipeline is not None else m),
                     f"{name} gradients (FSDP)", role="grad")
            reduce = [a for a in MESH_AXES if a in tokens and a not in axes]
            if zero and "dp" in reduce:  # ZeRO-1: the dp share reduce-scattered, the updated block gathered back
                reduce.remove("dp")
                acc.comm(part, "reduce-scatter", ("dp",), shard / sizes["dp"], layers, f"{name} gradients (ZeRO-1)",
                         role="grad")
                acc.comm(part, "all-gather", ("dp",), shard, layers, f"{name} updated weights (ZeRO-1)")
            acc.comm(part, "all-reduce", reduce, shard, layers, f"{name} gradients (data parallel)", role="grad")
        return shard * layers

    def gather_writes(axes: tp.Sequence[str]) -> int:
        return g_runs if gather(axes) else 0

    shard_bytes = 0.0
    layers_attn = s.dense_layers + stacked_dev
    layers_dense = s.dense_layers + (0 if s.moe else stacked_dev)
    layers_moe = stacked_dev if s.moe else 0

    # -- attention ------------------------------------------------------------------------------------------
    heads = s.heads / tp_
    w_attn = (s.attn_split / tp_ + s.attn_rep) * wb
    kv_ring = s.kv_ring / (tp_ if s.kv_split else 1)
    kv_cache = s.kv_cache / s.kv_heads * _kv_heads_per_device(s, tp_)
    per_layer = 2 * n * (s.attn_split / tp_ + s.attn_rep) + 2 * n * span_kv * heads * (s.score_qk + s.score_v)
    attn_flops = passes * per_layer
    attn_bytes = w_attn * (w_reads + gather_writes(_DENSE_W) + grad_writes)
    attn_bytes += acts * ab * (n * (s.attn_act_full + s.attn_act_split / tp_ + heads * (s.score_qk + s.score_v)
                                    + NORM_RESIDUAL * d) + (0 if decode else seqs * length * kv_ring))
    if decode:
        attn_bytes += ab * kv_cache * (seqs * span_kv + n)  # read the cache, write the new token
    elif task == "prefill":
        attn_bytes += ab * kv_cache * n
    acc.flops["attention"] += layers_attn * attn_flops
    acc.recomputed += layers_attn * r * per_layer
    acc.bytes["attention"] += layers_attn * attn_bytes
    runs_f, runs_b, runs_r = layers_attn * m, layers_attn * m * train, layers_attn * m * rg
    if s.kv_split:  # the fused q, k, v projection and the output projection
        acc.gemm("attention", nm, d, (heads * s.score_v + kv_ring), runs_f, runs_b, runs_r)
        acc.gemm("attention", nm, heads * s.score_v, d, runs_f, runs_b, runs_r)
    else:  # MLA: its projections as one GEMM of their total width
        acc.gemm("attention", nm, d, (s.attn_split / tp_ + s.attn_rep) / d, runs_f, runs_b, runs_r)
    acc.attention.append((layers_attn * m * 2 * nm * span_kv * heads * (s.score_qk + s.score_v),
                          0.5 if causal and not decode and length > 1 else 1.0, span_kv, s.score_qk,
                          (FLASH_BACKWARD + rg) if train else 0.0,
                          layers_attn * ab * (kv_cache * seqs * span_kv if decode else n * s.attn_act_split / tp_)))
    acc.fused["attention"] += layers_attn * m * ab * nm * (NORM_RESIDUAL * d + s.attn_act_split / tp_) * fused_passes
    shard_bytes += weights("attention", w_attn, _DENSE_W, layers_attn, "attention")
    tp_runs = m * (1 + (1 + r if train else 0))
    acc.comm("attention", "all-reduce", ("tp",), nm * d * ab, layers_attn * tp_runs, "attention output (TP)", True,
             "tp")
    if not decode:
        ring = m * (sp - 1) * (1 + (2 + r if train else 0))
        acc.comm("attention", "collective-permute", ("sp",), nm * kv_ring * ab, layers_attn * ring,
                 "K, V round the ring (SP)", True, "ring")
    else:
        acc.comm("attention", "all-reduce", ("sp",), seqs * heads * (s.score_v + 2) * 4, layers_attn,
                 "partial attention outputs (SP)", True)

    # -- dense MLPs -------------------------------------------------------------------------------------------
    w_mlp = s.mlp / tp_ * wb
    recomputed = s.mlp - (0 if s.recompute_down else s.mlp_down)
    mlp_flops = (3 if train else 1) * 2 * n * s.mlp / tp_ + r * 2 * n * recomputed / tp_
    mlp_bytes = w_mlp * (w_reads + gather_writes(_DENSE_W) + grad_writes)
    mlp_bytes += acts * ab * n * (s.mlp_act_full + s.mlp_act_split / tp_ + NORM_RESIDUAL * d)
    mlp_tp_runs = m * (1 + (1 + (r if s.recompute_down else 0) if train else 0))
    if layers_dense:
        width = s.mlp_down / d  # F
        runs_f, runs_b, runs_r = layers_dense * m, layers_dense * m * train, layers_dense * m * rg
        acc.gemm("mlp", nm, d, (s.mlp - s.mlp_down) / d / tp_, runs_f, runs_b, runs_r)
        acc.gemm("mlp", nm, width / tp_, d, runs_f, runs_b, runs_r * s.recompute_down)
        acc.fused["mlp"] += runs_f * ab * nm * (NORM_RESIDUAL * d + (s.mlp_act_split - 2 * width) / tp_) * fused_passes
        acc.flops["mlp"] += layers_dense * mlp_flops
        acc.recomputed += layers_dense * r * 2 * n * recomputed / tp_
        acc.bytes["mlp"] += layers_dense * mlp_bytes
        shard_bytes += weights("mlp", w_mlp, _DENSE_W, layers_dense, "MLP")
        acc.comm("mlp", "all-reduce", ("tp",), nm * d * ab, layers_dense * mlp_tp_runs, "MLP output (TP)", True,
                 "tp")

    # -- mixtures of experts ------------------------------------------------------------------------------------
    moe_flops = moe_bytes = 0.0
    if layers_moe:
        n_e = n if "ep" in batch_axes else n / ep  # tokens a device sends to the experts
        copies = n_e * k
        w_exp = s.experts / ep * s.expert / tp_ * wb
        reached = 1 - (1 - 1 / s.experts) ** (copies * ep)  # share of this device's experts some token reaches
        w_shared = s.shared / tp_ * wb
        w_router = s.router * wb
        fe = s.expert_width / tp_
        shared_recomputed = s.shared - (0 if s.recompute_down else d * s.shared_width)
        moe_flops = ((3 if train else 1) * 2 * (copies * s.expert / tp_ + n * s.shared / tp_ + n * s.router)
                     + r * 2 * (copies * s.expert / tp_ + n * shared_recomputed / tp_ + n * s.router))
        moe_bytes = (w_exp * (w_reads * reached + gather_writes(("fsdp",)) + grad_writes)
                     + w_shared * (w_reads + gather_writes(_DENSE_W) + grad_writes)
                     + w_router * (w_reads + grad_writes))
        moe_bytes += acts * ab * (n * (2 * d + s.router / d + NORM_RESIDUAL * d)  # router in / out, norm, residual
                                  + copies * (3 * d + 6 * fe + 4 * d)  # the experts' matmuls, dispatch and return
                                  + (n * (3 * d + 6 * s.shared_width / tp_) if s.shared else 0))
        fe_mat = s.expert / d  # the expert's widths: 3 Fe gated
        local = s.experts / ep
        per_expert = copies / m * ep / s.experts  # tokens one of this device's experts takes, balanced
        rows = per_expert * (capacity_factor or 1.0)
        runs_f, runs_b, runs_r = layers_moe * m, layers_moe * m * train, layers_moe * m * rg
        runs_e = runs_f * local
        acc.gemm("experts", rows, d, (fe_mat - s.expert_width) / tp_, runs_e, runs_e * train, runs_e * rg)
        acc.gemm("experts", rows, s.expert_width / tp_, d, runs_e, runs_e * train, runs_e * rg)
        if s.shared:
            acc.gemm("experts", nm, d, 2 * s.shared_width / tp_, runs_f, runs_b, runs_r)
            acc.gemm("experts", nm, s.shared_width / tp_, d, runs_f, runs_b, runs_r)
        acc.gemm("experts", n_e / m, d, s.experts, runs_f, runs_b, runs_r)
        # a token's norm and residual, the router's softmax; each routed copy permuted out and back (read and
        # write, dispatch and combine) and its gated activation over the (padded) rows
        acc.fused["experts"] += runs_f * ab * fused_passes * (
            nm * (NORM_RESIDUAL * d + 2 * s.experts) + local * rows * (4 * d + 3 * s.expert_width / tp_)
            + (nm * 3 * s.shared_width / tp_ if s.shared else 0))
        acc.flops["experts"] += layers_moe * moe_flops
        acc.recomputed += layers_moe * r * 2 * (copies * s.expert / tp_ + n * shared_recomputed / tp_ + n * s.router)
        acc.bytes["experts"] += layers_moe * moe_bytes
        shard_bytes += weights("experts", w_exp, _EXPERT_W if experts_fsdp else ("ep", "tp"), layers_moe, "expert")
        if s.shared:
            shard_bytes += weights("experts", w_shared, _DENSE_W, layers_moe, "shared expert")
        shard_bytes += weights("experts", w_router, (), layers_moe, "router")
        a2a_runs = m * (2 + (2 + 2 * r if train else 0))
        acc.comm("experts", "all-to-all", ("ep",), copies / m * d * ab, layers_moe * a2a_runs,
                 "routed tokens (EP)", True)
        if "ep" not in batch_axes:
            acc.comm("experts", "all-gather", ("ep",), nm * d * ab, runs_f * (1 + r), "token split (EP)", True)
            if train:
                acc.comm("experts", "reduce-scatter", ("ep",), nm / ep * d * ab, runs_f, "token split (EP)", True)
        acc.comm("experts", "all-reduce", ("tp",), nm * d * ab, layers_moe * tp_runs, "MoE output (TP)", True, "tp")

    # -- embedding and head (outside the pipeline and the remat policy) ----------------------------------------
    w_head = s.head / tp_ * wb
    w_embed = s.embed / tp_ * wb
    head_flops = (3 if train else 1) * 2 * n_head * s.head / tp_
    vocab = s.vocab / tp_
    head_bytes = w_head * ((2 if train else 1) + (1 if train else 0) + (1 + train) * bool(gather(_DENSE_W)))
    head_bytes += ab * n_head * vocab * (2 if train else 1) + (LOGITS_PASSES * 4 * n_head * vocab if train else 0)
    head_bytes += ab * n * d * (4 if train else 2) + (w_embed if train else 0)  # lookups (and their gradient)
    acc.flops["embedding+head"] += head_flops
    acc.gemm("embedding+head", n_head / m, d, vocab, m, m * train)
    acc.fused["embedding+head"] += ((LOGITS_PASSES * 4 * n_head * vocab if train else 0)
                                    + ab * n * d * (4 if train else 2))
    acc.bytes["embedding+head"] += head_bytes
    shard_bytes += weights("embedding+head", w_head, _DENSE_W, 1, "head", gathers=2 if train else 1, pipelined=False)
    if s.embed:
        shard_bytes += weights("embedding+head", w_embed, _DENSE_W, 1, "embedding", gathers=1, pipelined=False)
    acc.comm("embedding+head", "all-reduce", ("tp",), n * d * ab, 1 + train, "embedding lookup, head input (TP)",
             role="tp")

    # -- the optimizer and the pipeline ---------------------------------------------------------------------------
    if train:
        acc.bytes["optimizer"] += ADAMW_ACCESSES * shard_bytes / (sizes["dp"] if zero else 1)
        acc.fused["optimizer"] += ADAMW_F32_BYTES * shard_bytes / wb / (sizes["dp"] if zero else 1)
    if pp > 1:
        acc.comm("pipeline", "collective-permute", ("pp",), nm * d * ab, m * v * (2 if train else 1),
                 "activations between stages (PP)", True)

    # -- price it ----------------------------------------------------------------------------------------------------
    # the share of each kind's per-layer collectives the schedule runs (a MoE's dense prefix runs before it)
    staged = {"attention": stacked_dev / layers_attn, "mlp": 0.0 if s.moe or not layers_dense else 1.0,
              "experts": 1.0, "pipeline": 1.0}
    parts = tuple(WorkPart(kind, acc.flops[kind], acc.bytes[kind]) for kind in WORK_KINDS
                  if acc.flops[kind] or acc.bytes[kind])
    # MFU's model FLOPs (PaLM's): the whole step's, shared over every device; work a device repeats is not counted
    model = model_flops(config, batch, task=task, kv_length=kv_length) / cluster.num_devices
    flops, hbm = sum(acc.flops.values()), sum(acc.bytes.values())
    if efficiency is None:
        if tp_overlap is None:
            tp_overlap = cluster.platform == "tpu"
        timed, terms, achieved = _measured_terms(acc, cluster, mesh, rate, train=train, overlap=overlap,
                                                 tp_overlap=tp_overlap, staged=staged, bubble=bubble,
                                                 fused_passes=fused_passes)
        # the hardware FLOPs run: ``recompute``'s share of what remat="full" recomputes
        line = roofline(flops - (acc.recomputed * (1 - rg / r) if r else 0.0), hbm, cluster, rate)
        return StepTime(cluster, mesh, line, timed, achieved, overlap, None, parts, bubble, terms[-1].seconds, model,
                        terms)
    timed = []
    pipelined_s = 0.0
    for (part, kind, axes, nbytes, name), (runs, pipelined, _) in acc.comms.items():
        t = transfer(kind, nbytes, axes, mesh, cluster)
        timed.append(CollectiveTime(kind, axes, nbytes, runs, t.seconds, t.level, t.bound, name, False, part))
        if pipelined and bubble:
            pipelined_s += t.seconds * runs * staged.get(part, 0.0)
    line = roofline(flops, hbm, cluster, rate, efficiency)
    bubble_s = 0.0
    if bubble:
        stage_flops = sum(staged[kind] * acc.flops[kind] for kind in ("attention", "mlp", "experts"))
        stage_bytes = sum(staged[kind] * acc.bytes[kind] for kind in ("attention", "mlp", "experts"))
        stage = roofline(stage_flops, stage_bytes, cluster, rate, efficiency)
        busy = (max(stage.time_s, pipelined_s) if overlap else stage.time_s + pipelined_s)
        bubble_s = busy * bubble / (1 - bubble)
    return StepTime(cluster, mesh, line, tuple(timed), efficiency, overlap, None, parts, bubble, bubble_s, model)


_LAYER_KINDS = ("attention", "mlp", "experts")


def _measured_terms(acc: _Acc, cluster: Cluster, mesh: dict[str, int], rate: str, *, train: bool, overlap: bool,
                    tp_overlap: bool, staged: dict[str, float], bubble: float, fused_passes: int
                    ) -> tuple[tuple[CollectiveTime, ...], tuple[Term, ...], float]:
    """The step as the measured model prices it: its collectives at the network's attained bandwidth, the terms
    whose sum is the step (the bubble last) and the matmuls' achieved fraction of peak.

    Matmuls, attention kernels and memory-bound fusions run one after another on a device (one stream of
    kernels). FSDP gathers run ahead of the layer that needs them and hide behind the forward's (the backward's)
    work, gradient reductions behind the backward's; what exceeds that work is exposed, and so are the first
    layer's gather and the last layer's reduction, which nothing precedes or follows. Ring attention's passes
    hide behind the attention kernels. Tensor-, expert- and pipeline-parallel collectives sit between dependent
    matmuls: exposed unless ``tp_overlap`` (collective matmul, async TP) hides the tensor-parallel ones behind the
    matmuls."""
    check_chip(cluster)
    cal = calibration(cluster.chip.name)
    peaks = {name: cluster.chip.peak_flops(name) / cluster.devices_per_chip for name in {rate, "bf16"}}
    bandwidth = cluster.chip.hbm_bandwidth / cluster.devices_per_chip

    bound = {"compute": 0.0, "memory": 0.0}  # matmul seconds by what bounds each GEMM

    def gemm_s(m: float, k: float, n: float, dtype: str, runs: float) -> float:
        compute = 2 * m * k * n / (peaks[dtype] * gemm_efficiency(m, k, n, cal, dtype))
        memory = memory_seconds((m * k + k * n + m * n) * _ITEM_BYTES[dtype], cal, bandwidth)
        bound["compute" if compute >= memory else "memory"] += runs * max(compute, memory)
        return runs * max(compute, memory)

    fwd, bwd = dict.fromkeys(WORK_KINDS, 0.0), dict.fromkeys(WORK_KINDS, 0.0)
    gemm_flops = 0.0
    for part, m, k, n, forward, backward, again in acc.gemms:
        # low-precision training (Transformer Engine, torchao float8) keeps the LM head in bfloat16
        dtype = "bf16" if part == "embedding+head" else rate
        fwd[part] += gemm_s(m, k, n, dtype, forward)
        bwd[part] += gemm_s(m, n, k, dtype, backward) + gemm_s(k, m, n, dtype, backward) + gemm_s(m, k, n, dtype, again)
        gemm_flops += 2 * m * k * n * (forward + 2 * backward + again)
    matmul_s = sum(fwd.values()) + sum(bwd.values())
    attention = {"compute": 0.0, "memory": 0.0}
    for dense, causal, length, head_dim, backward, nbytes in acc.attention:
        compute = dense * causal / (peaks["bf16"] * attention_efficiency(length, head_dim, cal))  # flash: bf16
        memory = memory_seconds(nbytes, cal, bandwidth)  # a decode step's KV cache read
        t = max(compute, memory)
        fwd["attention"] += t
        bwd["attention"] += backward * t
        attention["compute" if compute >= memory else "memory"] += t * (1 + backward)
    attention_s = sum(attention.values())
    fused = {kind: cal.fusion.value * memory_seconds(acc.fused[kind], cal, bandwidth) for kind in _LAYER_KINDS}
    fused["embedding+head"] = memory_seconds(acc.fused["embedding+head"], cal, bandwidth)
    optimizer_s = memory_seconds(acc.fused["optimizer"], cal, bandwidth)
    for kind, t in fused.items():
        fwd[kind] += t / fused_passes
        bwd[kind] += t - t / fused_passes

    timed, role_s, role_runs = [], {}, {}
    staged_comm = 0.0
    for (part, kind, axes, nbytes, name), (runs, pipelined, role) in acc.comms.items():
        t = transfer(kind, nbytes, axes, mesh, cluster)
        seconds = max(t.bandwidth_s / cal.network.value, t.latency_s)  # the attained bandwidth; hops as they are
        timed.append(CollectiveTime(kind, axes, nbytes, runs, seconds, t.level, t.bound, name, False, part))
        role_s[role] = role_s.get(role, 0.0) + seconds * runs
        role_runs[role] = role_runs.get(role, 0) + runs
        if pipelined and role in ("tp", "critical"):
            staged_comm += seconds * runs * staged.get(part, 0.0)
    gathers, grads = role_s.get("gather", 0.0), role_s.get("grad", 0.0)
    forward_s, backward_s = sum(fwd.values()), sum(bwd.values())
    if not overlap:
        hidden_not = gathers + grads + role_s.get("ring", 0.0)
    else:
        first = gathers / role_runs["gather"] if gathers else 0.0
        last = grads / role_runs["grad"] if grads else 0.0
        g_fwd = gathers / 2 if train else gathers
        hidden_not = (first + last + max(0.0, g_fwd - forward_s) + max(0.0, gathers - g_fwd + grads - backward_s)
                      + max(0.0, role_s.get("ring", 0.0) - attention_s))
    tp_s = role_s.get("tp", 0.0)
    critical = (max(0.0, tp_s - matmul_s) if tp_overlap and overlap else tp_s) + role_s.get("critical", 0.0)
    achieved = gemm_flops / (peaks[rate] * matmul_s) if matmul_s else 1.0
    terms = [
        Term("matmuls", bound["compute"], "compute", f"{gemm_flops:.3g} FLOP at {achieved:.0%} of peak (each GEMM's "
             f"shape on the {cal.tile}-wide unit; large ones at {cal.gemm.value:.0%})"),
        Term("matmuls bound by HBM", bound["memory"], "memory", f"GEMMs whose operands take longer to read than to "
             f"multiply (few rows: decode), at {cal.hbm.value:.0%} of HBM bandwidth"),
        Term("attention kernels", attention["compute"], "compute", "flash attention, masked tiles skipped, forward "
             f"and backward ({FLASH_BACKWARD}x the forward)"),
        Term("attention bound by HBM", attention["memory"], "memory", "reading the KV cache"),
        Term("memory-bound fusions", sum(fused.values()), "memory", f"norms, RoPE, activations, residuals, MoE "
             f"permutes, the loss, at {cal.hbm.value:.0%} of HBM bandwidth ({cal.fusion.value:g}x the minimal "
             f"traffic in the layers)"),
        Term("optimizer update", optimizer_s, "memory", f"AdamW with float32 master weights and moments, "
                                                        f"{ADAMW_F32_BYTES} B a parameter"),
        Term("FSDP and gradient communication, exposed", hidden_not, "communication",
             "what the forward's and backward's work does not hide, the first gather and the last reduction"
             if overlap else "nothing hidden (overlap=False)"),
        Term("TP, EP and PP collectives", critical, "communication",
             "between dependent matmuls, on the critical path" + (" (TP hidden by collective matmuls)"
                                                                   if tp_overlap else "")),
    ]
    bubble_s = 0.0
    if bubble:
        busy = sum(staged.get(kind, 0.0) * (fwd[kind] + bwd[kind]) for kind in _LAYER_KINDS) + staged_comm
        bubble_s = busy * bubble / (1 - bubble)
    terms.append(Term("pipeline bubble", bubble_s, "bubble", f"{bubble:.0%} of the schedule's ticks idle"))
    return tuple(timed), tuple(terms), min(1.0, achieved)


__all__ = ["BATCH_AXES", "WORK_KINDS", "predict_step"]
