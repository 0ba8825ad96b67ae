"""The memory ledger: bytes per device of a train step, a prefill or a decode step, predicted from structure.

Parts, per device (every device holds the same; specs divide their dimensions):

- ``params``: each parameter's block (:class:`workbench.core.explore.Layout`);
- ``grads``: a train step's gradients, one per parameter, its dtype and sharding (they live through the update);
- ``optimizer``: AdamW two moments + an int32 count; SGD with momentum one trace; Adafactor a row and a column
  statistic for a matrix whose two largest dims are >= 128 (replicated: they are small), else a full second
  moment, plus a count and two one-element placeholders per parameter (optax's state, in the params' dtype);
- ``activations``: what the forward keeps for the backward, per layer, times the layers (the layer scan stacks
  them). With ``b`` tokens rows and ``t`` positions per device (the batch split over the data axes, the
  sequence over ``sp``), in the model's dtype:

  * ``remat="full"`` keeps each layer's input: ``b t D``;
  * ``"dots_saveable"`` keeps the input and every matmul output the backward needs: ``b t`` times the summed
    output width of the block's kernels on one device (a kernel ``(L, ..., in, out)`` gives ``out`` times its
    leading dims, each divided by the model-parallel axes that split it, not by data axes: FSDP gathers
    weights, it does not split activations) plus attention's two dots, ``QK^T`` (``H_l t`` per row) and ``PV``
    (``H_l Dh``); not a dense MLP's ``down_proj``: it feeds only the next layer's input, kept already;
  * ``"none"`` keeps, beyond those, what the backward of each elementwise op needs: the two norms' float32
    inputs and normalised outputs (and q/k norms' where the family has them), the rotated q and k, the softmax
    probabilities, the MLP's activation and product, the residual sums;

- ``temporaries``: an estimate of what lives only inside the step: the loss's float32 logits, their softmax and
  cotangent (``3 b t V_l 4`` bytes), and one layer's working set while its backward runs. That set depends on
  the compiler, and its size here is measured, not derived (XLA's buffer assignment on a 4- and an 8-layer
  Llama, whose difference isolates the per-layer part from the rest): XLA:TPU fuses the elementwise chains,
  so it holds about one layer's ``"none"`` set with ``remat="none"`` and one layer's ``"dots_saveable"`` set
  otherwise; XLA:CPU (which compiles GPU and CPU clusters in the worker) holds a ``"none"`` set, half as much
  again with ``remat="full"``;
- ``kv_cache``: keys and values of every layer (:func:`workbench.core.explore.memory_per_device`);
- with a ``pipeline`` (a :class:`workbench.core.pipeline.PipelineConfig` on a ``pp`` mesh axis): the stacked
  layers' parameters, gradients and optimizer state divide by the stage count (the layout must split
  ``LAYERS`` over ``pp``: ``pipeline_partition_axis()``); ``activations`` are what the schedule keeps alive,
  the stage inputs and incoming gradients of its buffers (:func:`~workbench.core.pipeline.activation_stash_bytes`:
  ``m`` microbatches with GPipe, at most ``p`` with 1F1B) plus the executor's whole-batch input and output
  (the embeddings and their gradient); ``temporaries`` are one stage's backward for one microbatch (its
  recomputed activations under the remat policy and one layer's working set) and that microbatch's logits;
- ``inputs``: the token ids.

:func:`ledger` returns a :class:`Ledger`; with a cluster it is held against the HBM of one device.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import numpy as np

from workbench.core.axes import BATCH, LENGTH, MODE_DECODE, MODE_TRAIN, PartitionAxis
from workbench.core.explore import Layout, memory_per_device
from workbench.core.steps import OPTIMIZERS

KINDS = ("train", "prefill", "decode")
REMATS = ("none", "dots_saveable", "full")
LOGITS_COPIES = 3  # float32 logits, their softmax, their cotangent
ADAFACTOR_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per device by part (see the module doc), and the device's HBM when a cluster is known."""

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
        gib = lambda n: f"{n / 2**30:.3f} GiB"
        lines = [f"{self.kind} step, remat={self.remat}: {gib(self.total)} per device"]
        lines += [f"  {part:<12}{gib(n)}" for part, n in self.parts().items() if n]
        if self.hbm_per_device is not None:
            verdict = "fits" if self.fits else f"does NOT fit: {gib(-self.headroom)} over"
            lines.append(f"  HBM {gib(self.hbm_per_device)}: {verdict}")
        return "\n".join(lines)


# -- the parts -----------------------------------------------------------------------------------------
def optimizer_bytes(layout: Layout, name: str) -> int:
    """Bytes per device of optax's ``name`` state for the parameters of ``layout`` (see the module doc)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")
    count = 4  # int32 step count, replicated
    if name == "adamw":
        return 2 * layout.param_bytes + count
    if name == "sgd":
        return layout.param_bytes
    total = count
    for p in layout.params:
        dims = sorted(p.shape, reverse=True)
        item = p.dtype.itemsize
        if len(dims) >= 2 and dims[1] >= ADAFACTOR_MIN_DIM:  # v_row and v_col (replicated), v a placeholder
            n = math.prod(p.shape)
            total += (n // dims[0] + n // dims[1] + 1) * item
        else:  # a full v like the parameter, v_row and v_col placeholders
            total += p.bytes_per_device + 2 * item
    return total


def _axis_sizes(layout: Layout) -> dict[str, int]:
    return dict(zip(layout.mesh.axis_names, layout.mesh.axis_sizes, strict=True))


def _tokens_per_device(layout: Layout, batch: tuple[int, int], mode: str) -> tuple[int, int, int]:
    """``(b, t, data shards)``: rows and positions of the batch one device holds, and the batch's data split."""
    sizes = _axis_sizes(layout)
    decisions = layout.partition_axis.explain((BATCH, LENGTH), mode, shape=batch, mesh=layout.mesh)
    split = [math.prod(sizes[a] for a in d.chosen) for d in decisions]
    return batch[0] // split[0], batch[1] // split[1], split[0]


def _model_split(param: tp.Any, dim: int, data_axes: set[str], sizes: dict[str, int]) -> int:
    """How many ways the model-parallel axes (not the data axes) split dimension ``dim`` of ``param``."""
    return math.prod(sizes[a] for a in param.decisions[dim].chosen if a not in data_axes)


def _layer_widths(layout: Layout, data_axes: set[str], t_kv: int) -> tuple[float, float, float]:
    """Per token row of one layer, elements kept by ``dots_saveable`` beyond the layer input, the extra ones
    ``none`` keeps, and the float32 norm inputs ``none`` keeps (counted apart: their dtype is float32)."""
    sizes = _axis_sizes(layout)
    c = layout.config
    dots = 0.0
    for p in layout.params:
        if not p.path.startswith("layers/") or not p.path.endswith("kernel") or len(p.shape) < 3:
            continue
        if p.path.endswith("down_proj/kernel") and len(p.shape) == 3:
            continue  # a dense MLP's output feeds only the next layer's input, kept anyway
        out = p.shape[-1] / _model_split(p, len(p.shape) - 1, data_axes, sizes)
        lead = math.prod(n / _model_split(p, i, data_axes, sizes) for i, n in enumerate(p.shape[1:-2], start=1))
        dots += out * lead
    q = layout["layers/self_attn/q_proj/kernel"] if "layers/self_attn/q_proj/kernel" in layout.paths else None
    head_dim = c.v_head_dim if c.mla else c.head_dim
    heads = c.num_attention_heads / (_model_split(q, 2, data_axes, sizes) if q is not None else 1)
    dots += heads * t_kv + heads * head_dim  # QK^T and PV
    mlp = [p for p in layout.params if p.path.startswith("layers/mlp/") and p.path.endswith("up_proj/kernel")]
    mlp_width = sum(p.shape[-1] / _model_split(p, len(p.shape) - 1, data_axes, sizes) *
                    math.prod(n / _model_split(p, i, data_axes, sizes) for i, n in enumerate(p.shape[1:-2], 1))
                    for p in mlp)
    rotated = heads * c.qk_head_dim + (c.num_key_value_heads * c.head_dim / max(1.0, c.num_attention_heads / heads)
                                       if not c.mla else 0)
    extra = rotated + heads * t_kv + 2 * mlp_width + 2 * c.hidden_size  # rope'd q/k, probs, act/product, residuals
    norms = 4 if c.sandwich_norms else 2
    norms_f32 = 2 * norms * c.hidden_size + (2 * rotated if c.qk_norm else 0)
    return dots, extra, norms_f32


def activation_bytes(layout: Layout, batch: tuple[int, int], remat: str, dtype: tp.Any, compiler: str = "tpu"
                     ) -> tuple[int, int]:
    """``(kept for the backward, one layer's working set)`` in bytes per device (see the module doc);
    ``compiler`` ("tpu" or "cpu") is the XLA backend whose working set to estimate."""
    if remat not in REMATS:
        raise ValueError(f"remat must be one of {REMATS} for the ledger; got {remat!r}")
    b, t, _ = _tokens_per_device(layout, batch, layout.mode)
    data_axes = set(_data_axes(layout))
    item = np.dtype(dtype).itemsize
    c = layout.config
    dots, extra, norms_f32 = _layer_widths(layout, data_axes, batch[1])
    rows = b * t
    per_layer = {"full": c.hidden_size * item,
                 "dots_saveable": (c.hidden_size + dots) * item,
                 "none": (c.hidden_size + dots + extra) * item + norms_f32 * 4}
    if compiler == "tpu":
        working = (per_layer["none"] if remat == "none" else per_layer["dots_saveable"]) * rows
    else:
        working = (1.5 if remat == "full" else 1.0) * per_layer["none"] * rows
    return int(c.num_hidden_layers * per_layer[remat] * rows), int(working)


def _data_axes(layout: Layout) -> tuple[str, ...]:
    """The mesh axes the batch dimension of a step's tokens is split over."""
    (batch_dim, _) = layout.partition_axis.explain((BATCH, LENGTH), layout.mode, mesh=layout.mesh)
    return tuple(batch_dim.chosen)


def logits_bytes(layout: Layout, batch: tuple[int, int]) -> int:
    """One float32 copy of the logits a device computes: ``b t V_l 4``."""
    b, t, _ = _tokens_per_device(layout, batch, layout.mode)
    head = "lm_head/kernel" if "lm_head/kernel" in layout.paths else "embed_tokens"
    p = layout[head]
    vocab_dim = len(p.shape) - 1 if head == "lm_head/kernel" else 0
    split = _model_split(p, vocab_dim, set(_data_axes(layout)), _axis_sizes(layout))
    return int(b * t * layout.config.vocab_size / split * 4)


# -- the ledger ------------------------------------------------------------------------------------------
def ledger(model: tp.Any, layout: Layout, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
           optimizer: str = "adamw", remat: str | None = None, kv_length: int | None = None,
           cluster: tp.Any = None, partition_axis: PartitionAxis | None = None, pipeline: tp.Any = None) -> Ledger:
    """Bytes per device of one ``kind`` step of ``model`` laid out by ``layout`` (see the module doc).

    ``batch = (B, T)``: rows and positions of a train step or a prefill (a decode step takes ``(B, 1)``);
    ``remat`` defaults to the model's policy; ``kv_length`` sizes the KV cache of a prefill or decode step
    (default ``T``); ``cluster`` adds its HBM per device and picks the compiler whose temporaries to estimate
    (XLA:TPU for a TPU cluster, else XLA:CPU, which compiles GPU and CPU clusters here). ``pipeline`` (a
    ``PipelineConfig``, train steps only) counts a pipelined step (see the module doc).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    remat = getattr(model, "remat", "none") if remat is None else remat
    dtype = np.dtype(getattr(model, "dtype", np.float32))
    hbm = None if cluster is None else cluster.hbm_per_device
    compiler = "tpu" if cluster is None or cluster.platform == "tpu" else "cpu"
    ids = int(np.prod(batch)) * 4 // max(1, _tokens_per_device(layout, batch, layout.mode)[2])
    if pipeline is not None:
        if kind != "train":
            raise ValueError("the pipeline ledger counts train steps; pass kind='train' or pipeline=None")
        kept, temporaries = pipeline_activation_bytes(layout, pipeline, batch, remat, dtype, compiler)
        return Ledger(kind, remat, layout.param_bytes, layout.param_bytes, optimizer_bytes(layout, optimizer),
                      kept, temporaries, 0, ids, hbm)
    if kind == "train":
        kept, working = activation_bytes(layout, batch, remat, dtype, compiler)
        return Ledger(kind, remat, layout.param_bytes, layout.param_bytes, optimizer_bytes(layout, optimizer),
                      kept, working + LOGITS_COPIES * logits_bytes(layout, batch), 0, ids, hbm)
    b, t = batch
    length = kv_length or t
    if layout.mode != MODE_TRAIN and kind == "decode" and layout.mode != MODE_DECODE:
        raise ValueError(f"a decode step's layout is resolved in decode mode; this one is {layout.mode!r}")
    kv = memory_per_device(layout, optimizer=None, kv_cache=(b, length, dtype)).kv_cache
    step_batch = batch if kind == "prefill" else (b, 1)
    _, working = activation_bytes(layout, step_batch, "full", dtype, compiler)
    return Ledger(kind, "none", layout.param_bytes, kv_cache=kv,
                  temporaries=working // 2 + logits_bytes(layout, step_batch), inputs=ids, hbm_per_device=hbm)


def pipeline_activation_bytes(layout: Layout, pipeline: tp.Any, batch: tuple[int, int], remat: str, dtype: tp.Any,
                              compiler: str = "tpu") -> tuple[int, int]:
    """``(kept, temporaries)`` bytes per device of a pipelined train step (see the module doc)."""
    from workbench.core.pipeline import activation_stash_bytes

    sizes = _axis_sizes(layout)
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
    kept_all, working = activation_bytes(layout, micro, remat, dtype, compiler)
    per_stage = pipeline.check_layers(c.num_hidden_layers - c.first_dense_layers)
    stage_kept = kept_all * per_stage // c.num_hidden_layers
    return stash + whole, stage_kept + working + LOGITS_COPIES * logits_bytes(layout, micro)
