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
- ``activations``: what the forward keeps for the backward, per layer, times the layers
  (:func:`~workbench.core.cost.activations.activation_bytes`; what each remat policy keeps is counted in
  :mod:`workbench.core.cost.activations`);

- ``temporaries``: what lives only inside the step; the largest of three phases, since the loss's buffers are gone
  before the layers' backward starts (a Llama with an 8192-word vocabulary peaks at the loss at every remat policy):
  the loss's logits (``LOGITS_COPIES`` float32 copies of ``b t V_l 4`` bytes: XLA:CPU two, the logits and their
  softmax, the cotangent taking the logits' buffer; XLA:TPU 1.6, the slope of its HBM peak over the vocabulary, 6.4
  bytes a logit, measured on a two-layer bfloat16 Llama at 16k, 32k and 64k words on v5p ``fsdp=8``), one layer's
  backward, or its attention's backward. One layer's backward holds one layer's weights all-gathered over the data
  axes and their unreduced gradient (twice the layer's bytes with the FSDP split undone), and a working set of
  cotangents and recomputed values that depends on the compiler: measured, not derived, in units of the layer's
  ``"dots_saveable"`` set (:data:`~workbench.core.cost.activations.WORKING_SET`; XLA's buffer assignment at 4 and 8
  layers, whose difference isolates the per-layer part from the rest, over the dense and MoE families): XLA:TPU
  fuses the elementwise chains and holds about one set (half without remat, one and a half with ``remat="full"``,
  which recomputes the matmuls), XLA:CPU (which compiles GPU and CPU clusters in the worker) about two (2.75 with
  ``"full"``). With remat, a model with two stacks (a MoE's dense leading layers) recomputes in each stack's
  backward loop apart: their sets add up. Layers of several kinds (Gemma 3's and GPT-OSS's alternating sliding and
  full attention) run as a ``lax.switch`` in the scan, and XLA keeps the other branches' buffers too: measured about
  one layer's ``"none"`` set per further kind (XLA:TPU at every policy, XLA:CPU without remat; XLA:CPU's full-remat
  backward holds about a third of it). Mixed precision (float32 parameters, a bfloat16 ``dtype``) on XLA:TPU adds
  the parameters' bfloat16 copy, alive through every phase (:func:`cast_bytes`), and the layer's gathered weights
  and gradient are that copy's, in bfloat16 (measured: a 4-layer Llama at every remat policy on dp, ZeRO-1 and fsdp
  within 7.4 % of the compiled peak, from -11.9 % to +22.1 % when they were counted in float32 and the copy not at
  all). The attention's backward (:func:`~workbench.core.cost.activations.attention_backward_bytes`) holds arrays
  the size of the layer's scores, ``H_l t_kv`` a row, one of them being the peak with long sequences and many heads
  on a device: measured on XLA:TPU about 7 bytes a score, and 8 with ``remat="full"``, which recomputes the
  forward's logits (:data:`~workbench.core.cost.activations.SCORE_BYTES`; the scores ``"none"`` and
  ``"dots_saveable"`` save are ``activations``), beside about one layer's gathered weights. The softmax's shift (its
  row maximum) is a ``stop_gradient``, as in ``jax.nn.softmax`` and flash kernels; when the gradient flowed
  through it, the phase held two float32 arrays a score and the causal mask (``pred``), 9 bytes, and 13 with
  ``remat="full"``, as the buffer assignment (``--xla_dump_to``) of Llama-3-70B on v5p ``fsdp=1024``, 4096
  positions, showed: three ``f32[64, 4096, 4096]`` and a ``pred`` one live at its peak. Short sequences (the
  families' tests, 256 positions) peak in the other phases;
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
- the program as production runs it (the :class:`~workbench.core.plan.Plan`'s ``attention``, ``vocab_tiles``,
  ``offload``, ``sequence_parallel`` and ``autograd``): a flash attention kernel (``"flash"``, ``"flash_triton"``)
  writes no
  scores to HBM (no score-sized arrays in ``activations`` or ``temporaries``:
  :mod:`~workbench.core.cost.activations`); the loss over
  ``vocab_tiles`` chunks of the tokens (MaxText's ``num_vocab_tiling``, chunked cross-entropy) holds one chunk's
  logits; ``offload`` keeps what the remat policy saves in host memory (``host``, beside the HBM parts, not in
  ``total``) and two layers of it in HBM; ``sequence_parallel`` splits the width-``D`` activations outside the
  tensor-parallel matmuls over ``tp``; ``autograd="pytorch"`` counts what PyTorch's autograd keeps of a layer
  without remat instead of JAX's residuals (:mod:`~workbench.core.cost.activations`). The defaults (the function's
  and a ``Plan``'s) are the workbench's own
  program (what ``compile_step`` builds and the measurements above compiled); ``plan.PRODUCTION`` is production's;
- with a ``pipeline`` (a :class:`workbench.core.pipeline.PipelineConfig` on a ``pp`` mesh axis): the stacked
  layers' parameters, gradients and optimizer state divide by the stage count (the layout must split
  ``LAYERS`` over ``pp``: ``pipeline_partition_axis()``); ``activations`` are what the schedule keeps alive,
  the stage inputs and incoming gradients of its buffers (:func:`~workbench.core.pipeline.activation_stash_bytes`:
  ``m`` microbatches with GPipe, at most ``p`` with 1F1B) plus the executor's whole-batch input and output
  (the embeddings and their gradient); ``temporaries`` are one stage's backward for one microbatch (its
  recomputed activations under the remat policy) and the larger of one layer's backward and that microbatch's
  logits;
- ``inputs``: the token ids;
- with gradient accumulation (``grad_accumulation=k``, a train step without a pipeline): one of the ``k``
  microbatches of the batch (:func:`~workbench.core.plan.microbatch`, ``B / k`` rows) counted as a step, its
  activations, temporaries and token ids, plus the running sum of their gradients in ``temporaries`` (a second
  set of gradients, alive from the first microbatch's backward to the update).

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

from workbench.core.axes import MODE_DECODE, MODE_TRAIN, PartitionAxis, shard_shape
from workbench.core.checks import one_of, positive_int
from workbench.core.cost.activations import (
    activation_bytes,
    cast_bytes,
    gathered_layer_bytes,
    layer_set,
    layer_stacks,
    logits_bytes,
    moe_strategy_of,
    tokens_per_device,
)
from workbench.core.pipeline_schedule import activation_stash_bytes
from workbench.core.plan import microbatch
from workbench.core.units import format_bytes
from workbench.core.vocab import ATTENTION_KERNELS, AUTOGRADS, OPTIMIZERS, TASKS
from workbench.core.zero import state_split

# A resolved workbench.core.sharding.plan.Layout: the ledger reads its parameters' blocks and its mesh; it is not
# imported, since sharding sits above the cost layer (the ledger is arithmetic over what a layout resolved).
Layout = tp.Any

# The loss phase's logits, in float32 copies of them, by compiler: measured (see the module doc).
LOGITS_COPIES = {"tpu": 1.6, "cpu": 2.0}
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
    host: int = 0  # offloaded activations, in host memory (not in total, which is HBM)

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
        if self.host:
            lines.append(f"  {'host':<12}{gib(self.host)} (offloaded activations, in host memory)")
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
    one_of("optimizer", name, OPTIMIZERS)
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


# -- the ledger ------------------------------------------------------------------------------------------
def ledger(model: tp.Any, layout: Layout, *, kind: str = "train", batch: tuple[int, int] = (8, 128),
           optimizer: str = "adamw", remat: str | None = None, kv_length: int | None = None,
           cluster: tp.Any = None, partition_axis: PartitionAxis | None = None, pipeline: tp.Any = None,
           zero_stage: int | None = None, grad_accumulation: int = 1, attention: str = "xla", vocab_tiles: int = 1,
           offload: bool = False, sequence_parallel: bool = False, autograd: str = "jax") -> Ledger:
    """Bytes per device of one ``kind`` step of ``model`` laid out by ``layout`` (see the module doc).

    ``batch = (B, T)``: rows and positions of a train step or a prefill (a decode step takes ``(B, 1)``);
    ``remat`` defaults to the model's policy; ``kv_length`` sizes the KV cache of a prefill or decode step
    (default ``T``); ``cluster`` adds its HBM per device and picks the compiler whose temporaries to estimate
    (XLA:TPU for a TPU cluster, else XLA:CPU, which compiles GPU and CPU clusters here). ``pipeline`` (a
    ``PipelineConfig``, train steps only) counts a pipelined step (see the module doc); ``zero_stage`` (default the
    layout's) splits the optimizer state over ``dp`` at 1; ``grad_accumulation`` (train steps without a pipeline)
    counts one of that many microbatches of ``batch`` and the sum of their gradients (see the module doc).
    ``attention`` (``"xla"``, ``"flash"`` or ``"flash_triton"``), ``vocab_tiles``, ``offload``,
    ``sequence_parallel`` and ``autograd`` (``"jax"`` or ``"pytorch"``) are the program's (see the module doc; a
    :class:`~workbench.core.plan.Plan` names them).
    """
    one_of("kind", kind, TASKS)
    one_of("attention", attention, ATTENTION_KERNELS)
    one_of("autograd", autograd, AUTOGRADS)
    positive_int("vocab_tiles", vocab_tiles, what="a positive int (chunks the loss's tokens are computed in)")
    program = dict(attention=attention, vocab_tiles=vocab_tiles, offload=offload, sequence_parallel=sequence_parallel,
                   autograd=autograd)
    if offload and kind != "train":
        raise ValueError(f"offload moves a train step's saved activations to the host; a {kind} step saves none: "
                         f"pass offload=False")
    if grad_accumulation != 1:
        micro = microbatch(batch, grad_accumulation)
        if kind != "train":
            raise ValueError(f"gradient accumulation is a train step's; a {kind} step takes grad_accumulation=1")
        if pipeline is not None:
            raise ValueError("a pipeline's microbatches are its gradient accumulation: fold the accumulation into "
                             "the pipeline's microbatches (PipelineConfig.num_microbatches) and leave "
                             "grad_accumulation=1")
        one = ledger(model, layout, kind=kind, batch=micro, optimizer=optimizer, remat=remat, kv_length=kv_length,
                     cluster=cluster, partition_axis=partition_axis, zero_stage=zero_stage, **program)
        return dataclasses.replace(one, temporaries=one.temporaries + one.grads)
    remat = getattr(model, "remat", "none") if remat is None else remat
    dtype = np.dtype(getattr(model, "dtype", np.float32))
    hbm = None if cluster is None else cluster.hbm_per_device
    compiler = "tpu" if cluster is None or cluster.platform == "tpu" else "cpu"
    ids = int(np.prod(batch)) * 4 // max(1, tokens_per_device(layout, batch, layout.mode)[2])
    moe = dict(zip(("moe_strategy", "capacity_factor"), moe_strategy_of(model, layout), strict=True))
    # mixed precision on XLA:TPU: the weights' compute-dtype copy, alive through a train step (cast_bytes)
    cast = cast_bytes(layout, dtype) if compiler == "tpu" else 0
    # ZeRO-1 on XLA:TPU from libtpu 0.0.50: the parameters' working copy beside their donated buffers
    copies = zero_parameter_copy_bytes(layout, zero_stage, compiler, getattr(cluster, "libtpu", None)) \
        if kind == "train" else 0
    loss = lambda rows: int(LOGITS_COPIES[compiler] * logits_bytes(layout, rows) / vocab_tiles)
    if pipeline is not None:
        if kind != "train":
            raise ValueError("the pipeline ledger counts train steps; pass kind='train' or pipeline=None")
        if offload:
            raise ValueError("offload with a pipeline is not modelled: a stage's stash of microbatches is what it "
                             "keeps; pass offload=False")
        kept, temporaries = pipeline_activation_bytes(layout, pipeline, batch, remat, dtype, compiler, **moe,
                                                      attention=attention, vocab_tiles=vocab_tiles,
                                                      sequence_parallel=sequence_parallel, autograd=autograd)
        return Ledger(kind, remat, layout.param_bytes, gradient_bytes(layout, zero_stage),
                      optimizer_bytes(layout, optimizer, zero_stage), kept, cast + copies + temporaries, 0, ids, hbm)
    if kind == "train":
        acts = activation_bytes(layout, batch, remat, dtype, compiler, **moe, attention=attention, offload=offload,
                                sequence_parallel=sequence_parallel, autograd=autograd)
        return Ledger(kind, remat, layout.param_bytes, gradient_bytes(layout, zero_stage),
                      optimizer_bytes(layout, optimizer, zero_stage), acts.kept,
                      cast + copies + max(acts.working, loss(batch)), 0, ids, hbm, host=acts.host)
    b, t = batch
    length = kv_length or t
    if layout.mode != MODE_TRAIN and kind == "decode" and layout.mode != MODE_DECODE:
        raise ValueError(f"a decode step's layout is resolved in decode mode; this one is {layout.mode!r}")
    kv = kv_cache_bytes(layout, b, length, dtype)
    step_batch = batch if kind == "prefill" else (b, 1)
    sb, st, _ = tokens_per_device(layout, step_batch, layout.mode)
    layers = [(prefix, layer_set(layout, prefix, t_kv=length, moe_strategy=moe["moe_strategy"], tokens=sb * st,
                                 capacity_factor=moe["capacity_factor"], attention=attention,
                                 sequence_parallel=sequence_parallel))
              for prefix, _ in layer_stacks(layout)]
    # one layer's gathered weights and its matmul outputs, then the logits
    working = max(gathered_layer_bytes(layout, prefix) + s.bytes_per_row("dots_saveable", dtype.itemsize) * sb * st
                  for prefix, s in layers)
    return Ledger(kind, "none", layout.param_bytes, kv_cache=kv,
                  temporaries=int(working) + logits_bytes(layout, step_batch) // vocab_tiles, inputs=ids,
                  hbm_per_device=hbm)


def pipeline_activation_bytes(layout: Layout, pipeline: tp.Any, batch: tuple[int, int], remat: str, dtype: tp.Any,
                              compiler: str = "tpu", moe_strategy: str = "dense",
                              capacity_factor: float | None = None, attention: str = "xla",
                              vocab_tiles: int = 1, sequence_parallel: bool = False,
                              autograd: str = "jax") -> tuple[int, int]:
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
    data_ways = tokens_per_device(layout, batch, layout.mode)[2]
    pipeline.check_batch(big, data_ways)
    item = np.dtype(dtype).itemsize
    stash = activation_stash_bytes(pipeline, batch_size=big, seq_len=t, hidden_size=c.hidden_size, dtype=dtype,
                                   data_ways=data_ways)
    b = big // data_ways
    whole = 2 * b * t * c.hidden_size * item  # the embeddings in, their gradient out
    micro = (big // pipeline.num_microbatches, t)
    working = activation_bytes(layout, micro, remat, dtype, compiler, moe_strategy, capacity_factor,
                               attention=attention, sequence_parallel=sequence_parallel, autograd=autograd).working
    per_stage = pipeline.check_layers(c.num_hidden_layers - c.first_dense_layers)
    mb, mt, _ = tokens_per_device(layout, micro, layout.mode)
    stage_layer = layer_set(layout, "layers/", t_kv=t, moe_strategy=moe_strategy, tokens=mb * mt,
                            capacity_factor=capacity_factor, attention=attention, sequence_parallel=sequence_parallel,
                            autograd=autograd)
    stage_kept = int(per_stage * stage_layer.bytes_per_row(remat, item) * mb * mt)
    loss = int(LOGITS_COPIES[compiler] * logits_bytes(layout, micro) / vocab_tiles)
    return stash + whole, stage_kept + max(working, loss)
