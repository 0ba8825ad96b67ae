"""``generate``: compiled greedy / sampling / beam-search decoding over a KV cache, token-equal to Hugging Face.

The model contract (``CausalLM`` implements it): ``model.init_cache(batch_size, max_length)`` returns a
pytree with a static ``max_length`` (and ``reorder(index_B)`` for beam search);
``model(input_ids_BT, attention_mask_BT, cache=cache)`` returns ``.logits (B, T, V)`` and the updated
``.cache``. The prefill gets the left-padded prompt and its mask, each decode step ``(B, 1)`` tokens and
a mask of ones; the cache tracks positions itself.

Two programs run per call, each compiled once per (graphdef, config, input shapes and shardings) and
cached in the shared :data:`~workbench.core.programs.PROGRAMS` (thread-safe, bounded), so a second
call with the same shapes does not recompile: the prefill (the prompt's logits) and a ``lax.while_loop``
that picks every new token and runs the decode steps; the cache is donated to both. Greedy / sampling
live in :mod:`.sampling`, beam search in :mod:`.beam_search`. On a mesh with Explicit axes both programs run
as on Auto axes (:func:`~workbench.core.mesh.call_on_auto_axes`), their outputs typed replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from workbench.core.checks import is_int
from workbench.core.mesh import call_on_auto_axes, explicit_mesh_of
from workbench.core.models.beam_search import beam_programs, best_sequences
from workbench.core.models.cache import KVCache, PagedKVCache, StreamingKVCache
from workbench.core.models.generation_config import GenerationConfig
from workbench.core.models.layer_views import LAYER_LOOP, layer_views, reading_views, viewable
from workbench.core.models.sampling import sample_programs
from workbench.core.programs import PROGRAMS, signature

Array = jax.Array


@dataclasses.dataclass
class GenerationOutput:
    """``sequences (B, prompt_len + num_new_tokens)`` int32: the prompt, then new tokens (pad after a row's EOS).

    ``cache`` is the cache after the last step; ``timings`` holds seconds for ``compile`` (0 when cached),
    ``prefill`` and ``decode``. ``layer_loop`` says how the decode loop ran the stacked layers: ``"scan"`` or
    ``"views"`` (``generate``'s ``layer_loop``; the prefill always scans).
    """

    sequences: Array
    num_new_tokens: int
    cache: tp.Any = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    layer_loop: str = "scan"


class _StreamSlot:
    """Where a compiled loop finds the current call's streamer (the compiled program outlives the call)."""

    def __init__(self):
        self.streamer = None
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def __call__(self, tokens_B) -> np.bool_:
        if self.error is not None:
            return np.bool_(True)
        try:
            return np.bool_(_stream(self.streamer, np.asarray(tokens_B)))
        except BaseException as e:
            # raised here it would surface as XLA's "CpuCallback error"; instead the loop ends after this step
            # (the cache consistent) and generate raises it as it was
            self.error = e
            return np.bool_(True)


@contextlib.contextmanager
def _interrupt_as_raised() -> tp.Iterator[None]:
    """A kernel interrupt that lands in JAX's own host-callback code (the main thread runs the streamer's callback
    on CPU) surfaces as XLA's "CpuCallback error"; raise it as the KeyboardInterrupt it was."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "KeyboardInterrupt" in str(e):
            raise KeyboardInterrupt from e
        raise


def _stream(streamer, tokens) -> bool:
    """Hand ``tokens`` to the streamer; True when it asks to stop."""
    if hasattr(streamer, "put"):
        streamer.put(tokens)
        should_stop = getattr(streamer, "should_stop", None)
        return bool(should_stop()) if callable(should_stop) else False
    result = streamer(tokens)
    return isinstance(result, (bool, np.bool_)) and bool(result)


def _check_inputs(model, input_ids, attention_mask, config: GenerationConfig, cache, streamer):
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be an int array (batch, prompt_len); got {input_ids.dtype} "
                         f"{input_ids.shape}")
    b, p = input_ids.shape
    if attention_mask is None:
        attention_mask = jnp.ones((b, p), jnp.int32)
    attention_mask = jnp.asarray(attention_mask).astype(jnp.int32)
    if attention_mask.shape != (b, p):
        raise ValueError(f"attention_mask has shape {attention_mask.shape}; it must be (B, prompt_len) = {(b, p)}")
    rows = b * config.num_beams
    needed = p + config.max_new_tokens
    if cache is None:
        cache = model.init_cache(rows, needed)
    if isinstance(cache, StreamingKVCache):  # bounded memory, unbounded length: old tokens are evicted
        if cache.batch_size != rows:
            raise ValueError(f"the streaming cache holds {cache.batch_size} rows but this call needs {rows} (batch "
                             f"{b} x num_beams {config.num_beams}): init_streaming_cache({rows}, ...)")
    else:
        _check_length(cache, p, config, rows)
    if isinstance(cache, PagedKVCache):
        _check_page_budget(cache, attention_mask, config)
    if config.num_beams > 1:
        if isinstance(cache, PagedKVCache) or not callable(getattr(cache, "reorder", None)):
            raise ValueError(f"beam search reorders the cache each step but {type(cache).__name__} cannot (rows of a "
                             f"paged cache would share pages); use the contiguous model.init_cache(...) or num_beams=1")
        if streamer is not None:
            raise ValueError("a streamer cannot be used with beam search (as in Hugging Face); set num_beams=1")
    if streamer is not None and not (hasattr(streamer, "put") or callable(streamer)):
        raise TypeError(f"streamer must have put(tokens)/end() or be a callable; got {type(streamer).__name__}")
    return input_ids.astype(jnp.int32), attention_mask, _distinct_buffers(cache)


def _check_length(cache, prompt_len: int, config: GenerationConfig, rows: int) -> None:
    """A cache with a ``max_length`` must hold the prompt plus ``max_new_tokens``."""
    needed = prompt_len + config.max_new_tokens
    max_length = getattr(cache, "max_length", None)
    if not is_int(max_length):
        raise TypeError(f"cache must have an int max_length (the contract of model.init_cache); got "
                        f"{type(cache).__name__}")
    if needed > max_length:
        raise ValueError(f"the cache holds {max_length} positions but the prompt ({prompt_len}) plus max_new_tokens "
                         f"({config.max_new_tokens}) needs {needed}: lower max_new_tokens or pass a cache made with "
                         f"model.init_cache({rows}, {needed})")


def _check_page_budget(cache: PagedKVCache, attention_mask, config: GenerationConfig) -> None:
    """Inside the compiled loop a page shortage cannot raise, so check the whole call's need up front."""
    final_B = np.asarray(attention_mask).sum(1) + config.max_new_tokens - 1  # the last token is never fed back
    need = cache.pages_to_take(final_B)
    if need > int(cache.num_free):
        raise ValueError(f"the paged cache has {int(cache.num_free)} free pages but this call needs up to {need} "
                         f"(prompt + max_new_tokens per row, {cache.page_size} tokens a page); pass a larger "
                         f"num_pages to init_ragged_pages, or release() finished rows")


def _distinct_buffers(tree):
    """Copy leaves that repeat an earlier leaf (``k = v = zeros``), since a buffer can be donated only once."""
    seen = set()

    def distinct(x):
        if isinstance(x, jax.Array):
            if id(x) in seen:
                return jnp.copy(x)
            seen.add(id(x))
        return x

    return jax.tree.map(distinct, tree)


def resolve_config(model: nnx.Module, config: GenerationConfig | None, prompt_len: int) -> GenerationConfig:
    """``config``'s unset fields from ``model.generation_config``, then transformers' defaults (see
    :mod:`.generation_config`): the config ``generate`` runs with for a prompt of ``prompt_len`` tokens."""
    config = (config or GenerationConfig()).merged(getattr(model, "generation_config", None))
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return config.resolved(prompt_len, max_positions)


def generate(model: nnx.Module, input_ids, generation_config: GenerationConfig | None = None,
             attention_mask=None, prng_key: Array | None = None, streamer=None, cache=None,
             layer_loop: str | None = None) -> GenerationOutput:
    """Decode ``max_new_tokens`` after the (left-padded) prompt ``input_ids (B, P)``, as HF ``generate`` does.

    Fields ``generation_config`` leaves unset (or no config at all) come from ``model.generation_config``
    (a checkpoint's ``generation_config.json``: its EOS, pad, length and sampling defaults), then from
    transformers' defaults, in transformers' order (:func:`resolve_config`).

    ``attention_mask`` None means all ones (HF would infer it from pad tokens). Rows stop at an EOS and
    are padded after it; the loop ends when every row has, so ``sequences`` is trimmed like HF's.
    Sampling uses ``prng_key`` (None: ``jax.random.key(0)``). ``cache`` (default
    ``model.init_cache(B * num_beams, P + max_new_tokens)``) is donated: use ``output.cache``.

    ``streamer``: an object with ``put(tokens)`` / ``end()`` (HF's ``TextStreamer`` works) gets the
    prompt ``(B, P)`` then each step's tokens ``(B,)``; a plain callable gets each step's tokens.
    If ``streamer.should_stop()`` (or the callable) returns True, decoding stops after that step.
    Beam search (``num_beams > 1``, see :mod:`.beam_search`) runs compiled too and takes no streamer.

    ``layer_loop``: how the decode loop runs the stacked layers. None or ``"scan"``: ``lax.scan`` (compile time
    flat in depth). ``"views"``: unrolled over per-layer views of the stacked weights, so a CPU decode step reads
    each weight once rather than copying each layer's slice first (SmolLM2-135M: 1.3-1.5x faster a step); it
    takes seconds more to compile (about 0.12 s a layer on a 2-core CPU), so it pays on long or repeated
    decodes of the same shapes (:mod:`~workbench.core.models.layer_views`). ``output.layer_loop`` says which ran.
    """
    config = generation_config or GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig (GenerationConfig.from_hf(...) converts HF's); "
                        f"got {type(config).__name__}")
    config = resolve_config(model, config, np.shape(input_ids)[-1])
    key, args, programs = _plan(model, input_ids, config, attention_mask, prng_key, streamer, cache)
    timings = {"compile": 0.0, "prefill": 0.0, "decode": 0.0}
    sig = signature(args)
    run_prefill = _program((*key, "prefill", sig), lambda: _compile(programs()[0], args, (3,)), timings)
    if streamer is not None and hasattr(streamer, "put"):
        streamer.put(np.asarray(args[1]))
    t0 = time.perf_counter()
    with _interrupt_as_raised():
        s, cache = jax.block_until_ready(run_prefill(*args))
    timings["prefill"] = time.perf_counter() - t0
    layers = _layers(model, layer_loop)
    state, views = args[0], layer_views(model) if layers == "views" else None
    # the decode loop's inputs are the prefill's outputs, so the prefill's signature determines their avals
    run_decode, slot = _program((*key, layers, "decode", sig),
                                lambda: _decode_entry(programs, streamer is not None, (state, views, s, cache)),
                                timings)
    t0 = time.perf_counter()
    if slot is None:
        with _interrupt_as_raised():
            s, cache = jax.block_until_ready(run_decode(state, views, s, cache))
    else:
        with slot.lock:  # two threads streaming through one program take turns
            slot.streamer, slot.error = streamer, None
            try:
                with _interrupt_as_raised():
                    s, cache = jax.block_until_ready(run_decode(state, views, s, cache))
            finally:
                slot.streamer, error, slot.error = None, slot.error, None
        if error is not None:
            raise error
        if hasattr(streamer, "end"):
            streamer.end()
    timings["decode"] = time.perf_counter() - t0
    prompt_len = args[1].shape[1]
    if config.num_beams > 1:
        sequences, n_new = best_sequences(s, prompt_len)
    else:
        n_new = int(s.step)
        sequences = s.seq_BL[:, :prompt_len + n_new]
    return GenerationOutput(sequences=sequences, num_new_tokens=n_new, cache=cache, timings=timings,
                            layer_loop=layers)


def _plan(model, input_ids, config, attention_mask, prng_key, streamer, cache):
    """``(key, args, programs)``: the cache key of this call's programs (without input avals), the prefill's
    arguments, and ``programs(on_tokens=None) -> (prefill, decode)``."""
    input_ids, mask, cache = _check_inputs(model, input_ids, attention_mask, config, cache, streamer)
    prompt_len = input_ids.shape[1]
    graphdef, state = nnx.split(model)
    if config.num_beams > 1:
        key = ("generate", "beam", graphdef, config, prompt_len)
        args = (state, jnp.repeat(input_ids, config.num_beams, 0), jnp.repeat(mask, config.num_beams, 0), cache)
        return key, args, lambda on_tokens=None: beam_programs(graphdef, config, prompt_len)
    key = ("generate", "sample", graphdef, config, prompt_len, streamer is not None)
    args = (state, input_ids, mask, cache, jax.random.key(0) if prng_key is None else prng_key)
    return key, args, lambda on_tokens=None: sample_programs(graphdef, config, prompt_len, on_tokens)


def _is_cache(x: tp.Any) -> bool:
    return isinstance(x, KVCache | PagedKVCache | StreamingKVCache)


def _out_specs(out: tp.Any, args: tuple) -> tp.Any:
    """Every output typed replicated, but a cache typed as the call's cache came in (``init_cache`` on a mesh splits
    its rows and heads: replicating it after the prefill would undo that, and its donated buffers go unused)."""
    given = next((x for x in args if _is_cache(x)), None)
    spec = lambda x: jax.typeof(x).sharding.spec if explicit_mesh_of(x) is not None else P()
    cache_specs = None if given is None else jax.tree.map(spec, given)
    same = lambda x: cache_specs is not None and jax.tree.structure(x) == jax.tree.structure(given)
    return jax.tree.map(lambda x: cache_specs if _is_cache(x) and same(x) else jax.tree.map(lambda _: P(), x), out,
                        is_leaf=_is_cache)


def _compile(fn: tp.Callable, args: tuple, donate: tuple[int, ...]):
    mesh = explicit_mesh_of(args)
    if mesh is not None:  # written for Auto axes: on Explicit ones run as on Auto axes, outputs typed replicated
        program = fn  # (a cache typed as it came in)
        fn = lambda *a: call_on_auto_axes(program, a, mesh, lambda out: _out_specs(out, args))
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def _layers(model: nnx.Module, layer_loop: str | None) -> str:
    """``generate``'s ``layer_loop`` resolved: ``"scan"`` unless ``"views"`` was asked for (and the model's
    platform and placement allow it, else a ValueError saying what to change)."""
    if layer_loop not in (None, "scan", "views"):
        raise ValueError(f"layer_loop must be None or 'scan' (lax.scan over the stacked layers) or 'views' (unrolled "
                         f"over per-layer views of them); got {layer_loop!r}")
    if layer_loop != "views":
        return "scan"
    if not viewable(model):
        platforms = sorted(k for k, v in LAYER_LOOP.items() if v == "views")
        raise ValueError(f"layer_loop='views' needs every stacked weight as one array on one device of a platform "
                         f"whose decode reads views ({', '.join(platforms)}); use layer_loop='scan' (or None) for "
                         f"this model")
    return "views"


def _reading(program: tp.Callable) -> tp.Callable:
    """``program(state, *rest)`` as ``(state, views, *rest)``: with ``views`` (per-layer views of the stacked
    weights, :func:`~workbench.core.models.layer_views.layer_views`) the layers run unrolled over them."""

    def run(state, views, *rest):
        if views is None:
            return program(state, *rest)
        with reading_views(state, views):
            return program(state, *rest)

    return run


def _decode_entry(programs, streaming: bool, args: tuple) -> tuple[tp.Any, _StreamSlot | None]:
    """The compiled decode loop ``(state, views, s, cache)`` and the slot its host callback reads the streamer
    from (evicted with it)."""
    slot = _StreamSlot() if streaming else None
    return _compile(_reading(programs(slot)[1]), args, (3,)), slot


def _program(key: tuple, build: tp.Callable, timings: dict):
    """``PROGRAMS[key]`` (built once); adds the seconds spent compiling, or waiting for another thread
    compiling the same program, to ``timings["compile"]``."""
    found = PROGRAMS.get(key, build)
    timings["compile"] += found.seconds
    return found.value


def is_compiled(model: nnx.Module, input_ids, generation_config: GenerationConfig | None = None,
                attention_mask=None, cache=None, *, streamer: bool = False, prng_key: Array | None = None,
                layer_loop: str | None = None) -> bool:
    """Whether ``generate`` with these arguments (``streamer``: with one or not; ``layer_loop`` as generate's)
    would reuse compiled programs, so it starts decoding without compiling. Nothing is compiled or run; ``cache``
    is not donated.
    """
    config = resolve_config(model, generation_config, np.shape(input_ids)[-1])
    key, args, _ = _plan(model, input_ids, config, attention_mask, prng_key, _stream if streamer else None, cache)
    sig = signature(args)
    layers = _layers(model, layer_loop)
    return (*key, "prefill", sig) in PROGRAMS and (*key, layers, "decode", sig) in PROGRAMS
