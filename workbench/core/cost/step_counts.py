"""What :func:`~workbench.core.cost.predicted.predict_step` counts of one step on one device, before pricing.

:class:`StepSizes` is the step as a device sees it (its tokens, microbatches, passes, layers; the mesh's axis sizes).
:class:`StepCounts` gathers what each layer kind (:data:`WORK_KINDS`) costs: its matmul FLOPs and HBM bytes (what the
roofline prices), its GEMMs by shape, its flash-attention calls and its memory-bound bytes (what the measured step
model prices, :mod:`~workbench.core.cost.step_pricing`), and every collective, merged when alike. The work per
layer kind is :mod:`~workbench.core.cost.work`'s; each parallelism's collectives are
:mod:`~workbench.core.cost.parallel`'s.
"""

from __future__ import annotations

import dataclasses
import typing as tp

WORK_KINDS = ("attention", "mlp", "experts", "embedding+head", "optimizer", "pipeline")
LAYER_KINDS = ("attention", "mlp", "experts")  # the kinds the remat policy and a pipeline's stages hold
# bytes an activation element takes at each matmul rate; fp4 (NVFP4, a serving format) quantises each GEMM's
# operands at its input and keeps the activations between kernels in bfloat16
ITEM_BYTES = {"bf16": 2, "int8": 1, "fp8": 1, "fp4": 2}
# bytes a stored weight takes: int4 is weight-only quantisation (AWQ, GPTQ) with a 16-bit scale a group of 128;
# fp4 is NVFP4, 4-bit values with an fp8 scale a block of 16 (NVIDIA's Blackwell format)
WEIGHT_ITEM_BYTES = {"bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5 + 2 / 128, "fp4": 0.5 + 1 / 16}
# a KV-cache element's bytes at each matmul rate, where kv_dtype is not given (NVFP4 checkpoints keep an fp8 cache)
KV_ITEM_BYTES = {"bf16": 2, "int8": 1, "fp8": 1, "fp4": 1}
# a bf16 operand cast to fp8 with a dynamic per-tensor scale: read for its amax, read and written as fp8 (the
# second read fused with the first where the compiler can: Transformer Engine, torch.compile)
FP8_CAST_BYTES = 3
DENSE_WEIGHT_AXES = ("fsdp", "sp", "tp")  # mesh axes that split a projection, the head or the embedding
EXPERT_WEIGHT_AXES = ("ep", "fsdp", "tp")


class WeightGroup(tp.NamedTuple):
    """``layers`` layers' weights of one kind (``part``) that move together: ``gathered_bytes`` a layer once
    gathered, the mesh ``axes`` that split them, and how often a step gathers them (default: the FSDP
    ``gather_runs``); ``pipelined``: they sit in the pipeline's stages."""

    part: str
    gathered_bytes: float
    axes: tuple[str, ...]
    layers: int
    name: str
    gathers: int | None = None
    pipelined: bool = True


class Gemm(tp.NamedTuple):
    """``forward`` runs of an ``(rows, inner) @ (inner, cols)`` GEMM of layer kind ``part``, ``backward`` runs of
    its two gradients, ``again`` recomputed forwards."""

    part: str
    rows: float
    inner: float
    cols: float
    forward: float
    backward: float
    again: float


class AttentionKernels(tp.NamedTuple):
    """A step's flash-attention calls: their ``dense`` score FLOPs, the ``causal`` share computed, the keys each
    query sees (``length``), the head width, the backward's multiple of the forward, and the bytes they read."""

    dense: float
    causal: float
    length: float
    head_dim: float
    backward: float
    nbytes: float


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """One step as one device runs it: the mesh's axis sizes, its tokens and microbatches, how many times it
    passes over the weights and activations, and how many layers of each kind it holds."""

    sizes: dict[str, int]  # the mesh's axis sizes, every workbench axis
    task: str
    train: bool
    decode: bool
    batch_axes: tuple[str, ...]
    token_axes: frozenset[str]  # axes that split the tokens (the batch axes, and sp but in decode)
    zero: bool  # ZeRO-1 applies: a train step with dp > 1
    pipelined: bool  # a pipeline runs the stacked layers
    sequences: int  # sequences a device holds
    length: int  # the batch's sequence length
    tokens: int  # tokens a device holds (n)
    kv_span: int  # keys a query attends to on this device
    head_tokens: int  # tokens the LM head computes logits for
    microbatches: int  # a pipeline's, or the gradient accumulation's (m)
    virtual_stages: int
    stacked_layers: int  # the stacked layers a device runs (all of them, or its stages')
    bubble: float  # the pipeline's idle fraction of the schedule
    remat_passes: int  # 1: remat="full" recomputes each layer's forward (train); else 0
    recompute: float  # the fraction of the forward's matmuls the backward recomputes
    recompute_any: bool  # remat is not "none", or some matmuls are recomputed
    item_bytes: int  # bytes an element of the activations (and of the weights in a train step)
    weight_item_bytes: float  # bytes a stored weight takes (int4: half a byte and its scales)
    kv_item_bytes: float  # bytes an element of the KV cache
    rate: str  # the dtype the matmuls run at
    causal: bool
    attention: str  # the attention kernel (:data:`~workbench.core.vocab.ATTENTION_KERNELS`), which sets its rate
    vocab_tiles: int  # the loss computed in this many tiles of tokens, its logits recomputed in the backward
    capacity_factor: float | None
    experts_fsdp: bool
    layers_attention: int
    layers_dense: int  # layers with a dense MLP
    layers_moe: int  # layers with experts

    @property
    def microbatch_tokens(self) -> float:
        """Tokens a device holds in one microbatch."""
        return self.tokens / self.microbatches

    @property
    def flop_passes(self) -> int:
        """Forward, backward (twice the forward) and a recompute: the multiple of a forward's FLOPs."""
        return 3 + self.remat_passes if self.train else 1

    @property
    def gather_runs(self) -> int:
        """FSDP gathers of a layer's weights: forward and backward, per microbatch."""
        return 2 * self.microbatches if self.train else self.microbatches

    @property
    def weight_reads(self) -> int:
        """Reads of a layer's weights: forward, backward and a recompute, per microbatch."""
        return (2 + self.remat_passes) * self.microbatches if self.train else self.microbatches

    @property
    def grad_writes(self) -> int:
        """Writes of a layer's gradient: one per microbatch of a train step."""
        return self.microbatches if self.train else 0

    @property
    def fused_passes(self) -> int:
        """Passes of the memory-bound fusions: forward, the backward's two, a recompute where any."""
        return 1 + (2 + self.recompute_any if self.train else 0)


class StepCounts:
    """Per-kind FLOPs and bytes, the collectives (merged when alike), and what the measured step model prices
    beyond the roofline: each kind's GEMMs by shape, its flash-attention calls, its memory-bound bytes."""

    def __init__(self, sizes: dict[str, int], fp8: bool = False, cast_weights: bool = True):
        self.sizes, self.fp8, self.cast_weights = sizes, fp8, cast_weights
        self.flops = dict.fromkeys(WORK_KINDS, 0.0)
        self.bytes = dict.fromkeys(WORK_KINDS, 0.0)
        self.fused = dict.fromkeys(WORK_KINDS, 0.0)
        self.comms: dict[tuple, list] = {}  # (part, kind, axes, bytes, name) -> [runs, pipelined, role]
        self.gemms: list[Gemm] = []
        self.attention: list[AttentionKernels] = []
        self.recomputed = 0.0  # the FLOPs remat="full" recomputes (in ``flops``)

    def comm(self, part: str, kind: str, axes: tp.Sequence[str], nbytes: float, runs: float, name: str,
             pipelined: bool = False, role: str = "critical") -> None:
        """``runs`` of a ``kind`` collective of ``nbytes`` over those of ``axes`` larger than 1. ``role`` says what
        may hide it: "gather" / "grad" (FSDP and data parallelism), "ring" (SP), "tp", else "critical"."""
        axes = tuple(a for a in axes if self.sizes[a] > 1)
        if not axes or runs <= 0 or nbytes <= 0:
            return
        key = (part, kind, axes, int(nbytes), name)
        entry = self.comms.setdefault(key, [0, pipelined, role])
        entry[0] += int(runs)

    def gemm(self, part: str, rows: float, inner: float, cols: float, forward: float, backward: float,
             again: float = 0.0) -> None:
        """Count a GEMM (:class:`Gemm`); under fp8 its operands' casts as memory-bound bytes: both operands in
        training (dynamic scaling of the weights a step updates), the activations only where the weights are
        stored in fp8 (``cast_weights=False``: serving)."""
        if rows > 0 and inner > 0 and cols > 0 and forward > 0:
            self.gemms.append(Gemm(part, rows, inner, cols, forward, backward, again))
            if self.fp8 and part != "embedding+head":  # dynamic scaling: operands read for amax, written as fp8
                weights = inner * cols if self.cast_weights else 0.0
                self.fused[part] += FP8_CAST_BYTES * ((forward + again) * (rows * inner + weights)
                                                      + backward * (rows * cols + rows * inner))
