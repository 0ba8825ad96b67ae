"""Compare attention implementations on the same inputs: numbers, speed, memory, kernel path.

The functions behind the ``AttentionLab`` widget, usable from scripts and tested on their own:

- :func:`make_inputs` draws BTHD query/key/value;
- :func:`compare` runs an implementation and a reference (``vanilla`` by default) on them: max
  abs difference, median run time and compile time of the jitted call, temporary memory
  (``compiled.memory_analysis().temp_size_in_bytes``) and the ``kernel_path`` that ran. An
  implementation that lacks a chosen option is *reported* as unsupported (who supports it
  instead), never run on something else;
- :func:`attention_weights` reads one head's weights from an implementation that returns them;
- :func:`model_comparison` switches a model's attention (``with_attention``) and compares logits
  and a short greedy generation.

Compiled calls are cached in the shared :data:`~workbench.core.programs.PROGRAMS` (implementation
class, metadata, options, input shapes), so switching back to an implementation already measured costs
its runs only.

>>> q, k, v = make_inputs(seq_len=64, heads=4, kv_heads=2, head_dim=16)
>>> c = compare("flash", q, k, v, causal=True, runs=1)
>>> c.impl.kernel_path, c.max_abs_diff < 1e-5
('flash/native', True)
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workbench.core.checks import is_int, positive_int
from workbench.core.hlo.collectives import collectives_in
from workbench.core.mesh import MESH_AXES, make_mesh
from workbench.core.models.generation import GenerationConfig
from workbench.core.models.tokenizer import as_tokenizer
from workbench.core.operations import AttentionOutput, OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import (
    ALL_FEATURES,
    CAUSAL,
    GQA,
    RETURN_WEIGHTS,
    SLIDING_WINDOW,
    SOFT_CAP,
    VALUE_DIM,
)
from workbench.core.operations.attention.paged import PAGED_KV
from workbench.core.programs import PROGRAMS

Array = jax.Array
DTYPES = ("float32", "bfloat16", "float16")
PAGE_SIZE = 16  # paged implementations get the keys cut into pages of this many tokens


# -- inputs and options ---------------------------------------------------------------------------
def make_inputs(seq_len: int = 256, heads: int = 8, kv_heads: int = 2, head_dim: int = 64, batch: int = 1,
                dtype: tp.Any = "float32", seed: int = 0) -> tuple[Array, Array, Array]:
    """Standard-normal ``query (B, T, H, D)``, ``key``/``value (B, T, KV, D)`` in ``dtype`` (NumPy's
    generator seeded with ``seed``).

    ``heads / kv_heads`` is the GQA ratio (1: multi-head, ``heads``: multi-query).
    """
    t, h, kv, d, b = (positive_int(n, x) for n, x in (("seq_len", seq_len), ("heads", heads),
                                                      ("kv_heads", kv_heads), ("head_dim", head_dim),
                                                      ("batch", batch)))
    if h % kv:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={kv}; pick kv_heads among "
                         f"{[n for n in range(1, h + 1) if h % n == 0]}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a float dtype such as {', '.join(DTYPES)}; got {dtype}")
    rng = np.random.default_rng(seed)  # NumPy draws: no compilation per shape and dtype
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
                 for shape in ((b, t, h, d), (b, t, kv, d), (b, t, kv, d)))


@dataclasses.dataclass(frozen=True)
class LabOptions:
    """The attention options the lab varies; ``None`` turns a window or cap off."""

    causal: bool = True
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self):
        if not isinstance(self.causal, bool | np.bool_):
            raise ValueError(f"causal must be True or False; got {self.causal!r}")
        object.__setattr__(self, "causal", bool(self.causal))
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", positive_int("sliding_window", self.sliding_window))
        if self.logits_soft_cap is not None:
            cap = self.logits_soft_cap
            if isinstance(cap, bool) or not isinstance(cap, int | float | np.number) or not cap > 0:
                raise ValueError(f"logits_soft_cap must be a positive number (or None for no cap); got {cap!r}")
            object.__setattr__(self, "logits_soft_cap", float(cap))

    def kwargs(self) -> dict[str, tp.Any]:
        """Keyword arguments of an attention call."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def features(self, query: Array, key: Array, value: Array | None = None) -> list[str]:
        """The capability names these options (and GQA inputs, or values with a head dim of their own, as
        MLA's latents) ask of an implementation."""
        used = {CAUSAL: self.causal, SLIDING_WINDOW: self.sliding_window is not None,
                SOFT_CAP: self.logits_soft_cap is not None, GQA: query.shape[2] != key.shape[2],
                VALUE_DIM: value is not None and value.shape[-1] != query.shape[-1]}
        return [f for f, on in used.items() if on]


def unsupported_reason(name: str, options: LabOptions, query: Array, key: Array, *,
                       return_weights: bool = False, value: Array | None = None) -> str | None:
    """``"unsupported: <feature>; supported by: ..."`` when ``name`` lacks something asked, else None."""
    caps = OperationRegistry.capabilities(name)
    canonical = OperationRegistry.canonical_name(name)
    for feature in [*options.features(query, key, value), *([RETURN_WEIGHTS] if return_weights else [])]:
        if not caps.supports(feature):
            others = [n for n in OperationRegistry.supporting(feature) if n != canonical]
            return f"unsupported: {feature}; supported by: {', '.join(others) or 'none registered'}"
    dtype = str(jnp.dtype(query.dtype))
    if dtype not in caps.dtypes:
        others = [n for n in OperationRegistry.list_implementations()
                  if n != canonical and dtype in OperationRegistry.capabilities(n).dtypes]
        return f"unsupported: dtype {dtype}; supported by: {', '.join(others) or 'none registered'}"
    return None


def capability_summary(name: str) -> str:
    """One line for a menu: ``"sdpa · no logits_soft_cap, return_weights"``; extras and mesh axes too."""
    caps = OperationRegistry.capabilities(name)
    lacks = sorted(ALL_FEATURES - caps.features)
    extra = sorted(caps.features - ALL_FEATURES)
    parts = ["all features" if not lacks else "no " + ", ".join(lacks)]
    parts += [f"+{e}" for e in extra]
    parts += [f"needs mesh axis {a}" for a in caps.mesh_axes]
    return f"{OperationRegistry.canonical_name(name)} · {'; '.join(parts)}"


# -- running one implementation ---------------------------------------------------------------------
def default_metadata(name: str, seq_len: int) -> OperationMetadata:
    """Metadata to run ``name`` in the lab: for an implementation that needs a mesh axis (``ring`` and
    ``ulysses`` need ``sp``), a mesh with as many devices on it as divide both the device count and
    ``seq_len`` (the rest on ``fsdp``)."""
    axes = OperationRegistry.capabilities(name).mesh_axes
    if not axes:
        return OperationMetadata()
    unknown = [a for a in axes if a not in MESH_AXES or a == "fsdp"]
    if unknown or len(axes) > 1:
        raise ValueError(f"{name} needs mesh axes {list(axes)}; the lab builds a mesh for one axis among "
                         f"{', '.join(a for a in MESH_AXES if a != 'fsdp')}: pass metadata=OperationMetadata(mesh=...)")
    devices = jax.device_count()
    n = max(d for d in range(1, devices + 1) if devices % d == 0 and seq_len % d == 0)
    return OperationMetadata(mesh=make_mesh(**{axes[0]: n}))


def _paged_call(op: tp.Any, query: Array, key: Array, value: Array, kwargs: dict) -> AttentionOutput:
    """Run a paged implementation on contiguous keys: cut into pages, identity page table."""
    b, s, kv, _ = key.shape
    n = -(-s // PAGE_SIZE)
    pad = ((0, 0), (0, n * PAGE_SIZE - s), (0, 0), (0, 0))
    pages = [jnp.pad(x, pad).reshape(b * n, PAGE_SIZE, kv, x.shape[-1]) for x in (key, value)]  # values: own dim
    table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
    return op(query, *pages, page_table=table, kv_lengths=jnp.full((b,), s, jnp.int32), **kwargs)


def _freeze(value: tp.Any) -> tp.Any:
    if isinstance(value, tp.Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, _freeze(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return value


def _cache_key(impl_cls: type, metadata: OperationMetadata, options: LabOptions, return_weights: bool,
               args: tuple[Array, ...]) -> tp.Any:
    avals = tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in args)
    key = ("attention_lab", impl_cls, _freeze(metadata), options, return_weights, avals)
    try:
        hash(key)
    except TypeError:  # unhashable metadata options: compile every time
        return None
    return key


def compiled_call(name: str, metadata: OperationMetadata, options: LabOptions, args: tuple[Array, ...], *,
                  return_weights: bool = False) -> tuple[tp.Any, float, int | None, bool]:
    """``(executable, compile_ms, temp_bytes, cached)`` of ``name`` on ``args`` with ``options``.

    ``compile_ms`` is the wall time of ``jax.jit(f).lower(...).compile()`` when it was compiled;
    ``cached`` says whether that happened earlier.
    """
    impl_cls = OperationRegistry.get(name)
    key = _cache_key(impl_cls, metadata, options, return_weights, args)
    build = lambda: _compile(impl_cls, metadata, options, args, return_weights)
    if key is None:
        return (*build(), False)
    found = PROGRAMS.get(key, build)
    return (*found.value, not found.compiled)


def _compile(impl_cls: type, metadata: OperationMetadata, options: LabOptions, args: tuple[Array, ...],
             return_weights: bool) -> tuple[tp.Any, float, int | None]:
    """``(executable, compile_ms, temp_bytes)`` of one implementation on ``args``."""
    op = impl_cls(metadata)
    kwargs = options.kwargs() | ({"return_weights": True} if return_weights else {})
    if PAGED_KV in impl_cls.capabilities.features:
        fn = lambda q, k, v: _paged_call(op, q, k, v, kwargs)
    else:
        fn = lambda q, k, v: op(q, k, v, **kwargs)
    start = time.perf_counter()
    executable = jax.jit(fn).lower(*args).compile()
    compile_ms = (time.perf_counter() - start) * 1e3
    stats = executable.memory_analysis()
    return executable, compile_ms, None if stats is None else int(stats.temp_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Run:
    """One implementation on the lab's inputs: its output and its cost, or why it did not run."""

    name: str
    kernel_path: str | None = None
    output: Array | None = None
    median_ms: float | None = None
    compile_ms: float | None = None
    temp_bytes: int | None = None
    cached: bool = False  # compiled by an earlier call (compile_ms is from then)
    unsupported: str | None = None  # "unsupported: <feature>; supported by: ..."
    error: str | None = None  # what the implementation raised
    collectives: tuple[str, ...] = ()  # the compiled call's, e.g. "collective-permute over sp x 7 runs"

    @property
    def ok(self) -> bool:
        return self.output is not None

    @property
    def note(self) -> str:
        return self.unsupported or (f"error: {self.error}" if self.error else "")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """An implementation against a reference on the same inputs and options."""

    impl: Run
    reference: Run
    options: LabOptions
    max_abs_diff: float | None  # None unless both ran

    def output_difference(self, head: int = 0, batch: int = 0) -> np.ndarray:
        """``|impl - reference|`` of one head's output, ``(T, D)`` float32."""
        if self.max_abs_diff is None:
            raise ValueError(f"no difference to show: {self.impl.note or self.reference.note}")
        a, b = (np.asarray(r.output[batch, :, head], np.float32) for r in (self.impl, self.reference))
        return np.abs(a - b)

    def position_difference(self) -> np.ndarray:
        """``(T,)``: the largest ``|impl - reference|`` of each query position (over batch, heads, dims)."""
        if self.max_abs_diff is None:
            raise ValueError(f"no difference to show: {self.impl.note or self.reference.note}")
        a, b = (np.asarray(r.output, np.float32) for r in (self.impl, self.reference))
        return np.abs(a - b).max(axis=(0, 2, 3))

    def rows(self) -> list[dict[str, tp.Any]]:
        """Table rows (implementation first, then the reference)."""
        return [{"implementation": run.name, "role": "reference" if run is self.reference else "compared",
                 "kernel_path": run.kernel_path, "max_abs_diff": diff if run.ok else None,
                 "median_ms": run.median_ms, "compile_ms": run.compile_ms, "temp_bytes": run.temp_bytes,
                 "cached": run.cached, "collectives": run.collectives, "note": run.note}
                for run, diff in ((self.impl, self.max_abs_diff), (self.reference, 0.0 if self.reference.ok else None))]


def _prepare(name: str, options: LabOptions, args: tuple[Array, ...], metadata: OperationMetadata | None,
             return_weights: bool = False) -> tuple[Run, tp.Any]:
    """A Run holding the compiled call's costs (or why there is none), and the call with its inputs bound.

    An implementation that needs mesh axes runs on its mesh's devices: the inputs are copied there, replicated
    (recorded inputs usually live on one device), and the axes it splits over must hold more than one device."""
    canonical = OperationRegistry.canonical_name(name)
    reason = unsupported_reason(canonical, options, args[0], args[1], return_weights=return_weights, value=args[2])
    if reason:
        return Run(canonical, unsupported=reason), None
    try:
        md = metadata if metadata is not None else default_metadata(canonical, args[1].shape[1])
    except ValueError as e:
        return Run(canonical, error=f"ValueError: {e}"), None
    axes = OperationRegistry.capabilities(canonical).mesh_axes
    if axes and all(md.mesh is None or md.mesh.shape.get(a, 1) == 1 for a in axes):
        t, n = args[1].shape[1], jax.device_count()
        return Run(canonical, unsupported=(
            f"unsupported: {canonical} splits the sequence over {' x '.join(axes)}, and these {t} positions divide "
            f"over no group of more than one of the {n} devices; choose a sequence length that a device count "
            f"divides")), None
    if md.mesh is not None:
        replicated = NamedSharding(md.mesh, PartitionSpec())
        args = tuple(jax.device_put(x, replicated) for x in args)
    try:
        executable, compile_ms, temp, cached = compiled_call(canonical, md, options, args,
                                                             return_weights=return_weights)
        call = functools.partial(executable, *args)
        out = jax.block_until_ready(call())  # warm-up
    except Exception as e:  # an implementation's own refusal (shapes, mesh, ...) is a result, not a crash
        return Run(canonical, error=f"{type(e).__name__}: {e}"), None
    return Run(canonical, kernel_path=getattr(out, "kernel_path", None), output=out.attention_outputs,
               compile_ms=compile_ms, temp_bytes=temp, cached=cached,
               collectives=collectives_summary(executable, md.mesh)), call


def collectives_summary(executable: tp.Any, mesh: tp.Any) -> tuple[str, ...]:
    """``"<kind> over <mesh axes> x <runs>"`` for each kind of collective in a compiled call (from its HLO),
    so a sequence-parallel implementation shows what it moves (ring: permutes over sp; ulysses: all-to-alls)."""
    runs: dict[str, int] = {}
    for c in collectives_in(executable.as_text(), mesh if mesh is not None and mesh.size > 1 else None):
        key = f"{c.kind} over {'×'.join(c.mesh_axes or ()) or 'devices'}"
        runs[key] = runs.get(key, 0) + c.trips
    return tuple(f"{k} × {n}" for k, n in sorted(runs.items()))


def _time_round_robin(calls: dict[str, tp.Any], runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {n: [] for n in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def compare(impl: str, query: Array, key: Array, value: Array, *, reference: str = "vanilla", causal: bool = True,
            sliding_window: int | None = None, logits_soft_cap: float | None = None, runs: int = 5,
            metadata: OperationMetadata | None = None,
            reference_metadata: OperationMetadata | None = None) -> Comparison:
    """Run ``impl`` and ``reference`` on the same inputs; times are medians of ``runs`` round-robin calls.

    ``metadata`` defaults to :func:`default_metadata` (a mesh for implementations that need one).
    Unknown names and invalid options raise ``ValueError``; an implementation that lacks an option
    or raises on these inputs gives a :class:`Run` with ``unsupported`` or ``error`` set.
    """
    options = LabOptions(causal, sliding_window, logits_soft_cap)
    runs = positive_int("runs", runs)
    args = (query, key, value)
    for x in args:
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"query, key and value must be 4-D BTHD arrays; got shape {getattr(x, 'shape', x)}")
    ref_run, ref_exe = _prepare(reference, options, args, reference_metadata)
    impl_run, impl_exe = _prepare(impl, options, args, metadata)
    calls = {n: e for n, e in (("impl", impl_exe), ("reference", ref_exe)) if e is not None}
    medians = _time_round_robin(calls, runs)
    if "impl" in medians:
        impl_run = dataclasses.replace(impl_run, median_ms=medians["impl"])
    if "reference" in medians:
        ref_run = dataclasses.replace(ref_run, median_ms=medians["reference"])
    diff = None
    if impl_run.ok and ref_run.ok:
        # on the host: an implementation run on a mesh leaves its output on other devices than the reference's
        diff = float(np.max(np.abs(np.asarray(impl_run.output, np.float32) - np.asarray(ref_run.output, np.float32))))
    return Comparison(impl_run, ref_run, options, diff)


def attention_weights(query: Array, key: Array, *, head: int = 0, batch: int = 0, impl: str = "vanilla",
                      causal: bool = True, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                      metadata: OperationMetadata | None = None) -> np.ndarray:
    """``(T, S)`` float32 attention weights of one head from ``impl`` (one that returns weights)."""
    options = LabOptions(causal, sliding_window, logits_soft_cap)
    for what, index, size in (("head", head, query.shape[2]), ("batch", batch, query.shape[0])):
        if not is_int(index) or not 0 <= index < size:
            raise ValueError(f"{what} must be an int in [0, {size}); got {index!r}")
    run, call = _prepare(impl, options, (query, key, key), metadata, return_weights=True)
    if call is None:
        raise ValueError(f"{run.name}: no attention weights: {run.note}")
    weights = call().attention_weights
    return np.asarray(weights[batch, head], np.float32)


# -- inside a model ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelRun:
    """A model running one attention implementation: logits, a greedy continuation, the model itself."""

    name: str
    model: tp.Any
    logits: np.ndarray  # (B, T, V) float32
    new_tokens: list[list[int]]
    text: list[str] | None  # decoded new tokens when a tokenizer was given


@dataclasses.dataclass(frozen=True)
class ModelComparison:
    impl: ModelRun
    reference: ModelRun
    logits_max_abs_diff: float  # over the positions the attention mask keeps
    position_max_abs_diff: np.ndarray  # (T,): max over batch and vocab, 0 at padded positions

    @property
    def same_tokens(self) -> bool:
        return self.impl.new_tokens == self.reference.new_tokens


@functools.cache
def _logits_fn() -> tp.Callable[[tp.Any, Array, Array], Array]:
    """``model(ids, mask).logits`` under ``nnx.jit``: compiled once per model structure and shapes."""
    from flax import nnx

    return nnx.jit(lambda m, i, a: m(i, a).logits)


def _model_run(model: tp.Any, name: str, ids: Array, mask: Array, max_new_tokens: int, tokenizer: tp.Any) -> ModelRun:
    caps = OperationRegistry.capabilities(name)
    if PAGED_KV in caps.features:
        raise ValueError(f"{name} reads a paged KV cache: a model uses it through generate(cache="
                         f"model.init_ragged_pages(...)), not as its attention; choose a contiguous implementation")
    switched = model.with_attention(name)
    logits = _logits_fn()(switched, ids, mask)
    out = switched.generate(ids, generation_config=GenerationConfig(max_new_tokens=max_new_tokens),
                            attention_mask=mask)
    new = [list(map(int, row)) for row in np.asarray(out.sequences[:, ids.shape[1]:])]
    text = None if tokenizer is None else [tokenizer.decode(row) for row in new]
    return ModelRun(OperationRegistry.canonical_name(name), switched, np.asarray(logits, np.float32), new, text)


def model_comparison(model: tp.Any, impl: str, input_ids: tp.Any, attention_mask: tp.Any = None, *,
                     reference: str = "vanilla", max_new_tokens: int = 8, tokenizer: tp.Any = None
                     ) -> ModelComparison:
    """``model.with_attention(impl)`` against ``model.with_attention(reference)``: logits and greedy tokens.

    ``input_ids (B, T)`` int; ``attention_mask`` 1 = token (left padding), None = all ones. The
    model passed in is left as it is; both switched models are returned in the runs. ``tokenizer``
    (ours, a Hugging Face one, or a local directory: anything ``as_tokenizer`` takes) decodes the
    continuations into ``ModelRun.text``.
    """
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be an int array (batch, length); got {ids.dtype} {ids.shape}")
    mask = jnp.ones(ids.shape, jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {mask.shape}; it must be (B, T) = {ids.shape} like input_ids")
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    if tokenizer is not None:
        tokenizer = as_tokenizer(tokenizer)
    ref = _model_run(model, reference, ids, mask, max_new_tokens, tokenizer)
    run = _model_run(model, impl, ids, mask, max_new_tokens, tokenizer)
    keep = np.asarray(mask, bool)[:, :, None]
    diff = np.where(keep, np.abs(run.logits - ref.logits), 0.0)
    per_position = diff.max(axis=(0, 2))
    return ModelComparison(run, ref, float(per_position.max()), per_position)
