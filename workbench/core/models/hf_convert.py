"""Hugging Face tensors <-> :class:`CausalLM` parameters: the name table, transposes, splits.

:func:`param_table` says, for each parameter path of a model built from ``config``, which
checkpoint tensor holds it and how (``Entry``). The decoder blocks' parameters are stacked
(``layers/self_attn/q_proj/kernel`` is ``(L, D, H*Dh)``), so their entries are *layered*: the
name holds ``{i}`` and layer ``i`` of the stack is the tensor ``model.layers.{i}...``. Loading
reads tensors through any mapping-like reader (a state dict, or a safetensors file opened
lazily), one layer slice at a time, so a loader can place each on its devices before reading
the next. :func:`to_hf_tensors` is the inverse and writes the names ``transformers`` saves.

Kinds: "copy"; "transpose" (HF ``Linear`` weights are ``(out, in)``, our kernels ``(in, out)``);
"qkv" (GPT-2's fused ``c_attn``, a ``Conv1D`` already ``(in, out)``: part ``i`` of 3 along the
last axis); "router", "gate", "up", "down" (Mixtral: the on-disk per-expert
``block_sparse_moe.experts.{j}.w1/w3/w2`` form, or transformers' in-memory fused
``mlp.experts.gate_up_proj (E, 2F, D)`` / ``down_proj (E, D, F)`` form). An entry with ``rope`` ("q" or
"kv", DeepSeek-V3 with ``rope_interleave``) also permutes the output features of its rope channels from
the checkpoint's interleaved pairs to the halves our rotary embedding rotates (:func:`rope_columns`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
import typing as tp

import numpy as np

from workbench.core.models.config import ModelConfig
from workbench.core.models.hf_entry import Entry
from workbench.core.models.hf_moe import (
    EXPERT_KINDS,
    FUSED_EXPERTS,
    expected_expert_names,
    moe_tensor_names,
    read_experts,
)
from workbench.core.models.protocol import check_model_class, is_classifier

Path = tuple[str | int, ...]
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def rope_columns(config: ModelConfig, rope: str) -> np.ndarray:
    """Our output feature ``j`` is the checkpoint's feature ``perm[j]`` (``rope`` "q": per head ``N`` nope then
    ``R`` rope channels; "kv": the latent then ``R`` rope channels). transformers' interleaved rotary pairs
    ``(x0, x1), (x2, x3), ...`` rotate exactly as halves ``(x0, x2, ..., x1, x3, ...)`` do with rotate_half, so
    with the columns permuted once the standard rope gives the same queries and keys (and the same cache)."""
    r = config.qk_rope_head_dim
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    if rope == "q":
        n = config.qk_nope_head_dim
        head = np.concatenate([np.arange(n), n + halves])
        return (np.arange(config.num_attention_heads)[:, None] * (n + r) + head).reshape(-1)
    return np.concatenate([np.arange(config.kv_lora_rank), config.kv_lora_rank + halves])


def to_checkpoint_columns(config: ModelConfig, entry: Entry, value: tp.Any) -> tp.Any:
    """A parameter value (our layout) with its rope columns back in the checkpoint's order (if ``entry.rope``)."""
    return value[..., np.argsort(rope_columns(config, entry.rope))] if entry.rope else value


class Reader(tp.Protocol):
    def __contains__(self, name: str) -> bool: ...
    def __getitem__(self, name: str) -> tp.Any: ...
    def keys(self) -> tp.Iterable[str]: ...


def _llama_layer(config: ModelConfig, stack: str = "layers", first: int = 0) -> dict[Path, Entry]:
    """Entries of one stack of decoder layers (``stack``), whose layer 0 is the checkpoint's layer ``first``."""
    table = _llama_layer_entries(config)
    return {(stack, *path[1:]): dataclasses.replace(e, first=first) for path, e in table.items()}


def _llama_layer_entries(config: ModelConfig) -> dict[Path, Entry]:
    hf = "model.layers.{i}"
    out: dict[Path, Entry] = {}
    if config.mla:
        out |= _mla_entries(config, hf)
    norms = ("input_layernorm", "post_attention_layernorm")
    norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if config.sandwich_norms else ()
    for norm in norms:
        out[("layers", norm, "weight")] = Entry(f"{hf}.{norm}.weight", layered=True)
    for proj in () if config.mla else ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[("layers", "self_attn", proj, "kernel")] = Entry(f"{hf}.self_attn.{proj}.weight", "transpose", layered=True)
        if config.attention_bias if proj != "o_proj" else config.attention_out_bias:
            out[("layers", "self_attn", proj, "bias")] = Entry(f"{hf}.self_attn.{proj}.bias", layered=True)
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[("layers", "self_attn", norm, "weight")] = Entry(f"{hf}.self_attn.{norm}.weight", layered=True)
    if config.attention_sinks:
        out[("layers", "self_attn", "sinks")] = Entry(f"{hf}.self_attn.sinks", layered=True)
    if config.mlp_type == "moe" and config.model_type == "gpt_oss":  # fused (E, D, 2F), gate/up interleaved
        mlp, (gate_up, down) = f"{hf}.mlp", FUSED_EXPERTS
        out[("layers", "mlp", "router_kernel")] = Entry(f"{mlp}.router.weight", "transpose", layered=True)
        out[("layers", "mlp", "router_bias")] = Entry(f"{mlp}.router.bias", layered=True)
        for part, name in enumerate(("gate", "up")):
            out[("layers", "mlp", f"{name}_proj")] = Entry(f"{mlp}.{gate_up}", "interleave", part, True)
            out[("layers", "mlp", f"{name}_bias")] = Entry(f"{mlp}.{gate_up}_bias", "interleave", part, True)
        out[("layers", "mlp", "down_proj")] = Entry(f"{mlp}.{down}", layered=True)
        out[("layers", "mlp", "down_bias")] = Entry(f"{mlp}.{down}_bias", layered=True)
    elif config.mlp_type == "moe":
        out[("layers", "mlp", "router_kernel")] = Entry(hf, "router", layered=True)
        for proj in ("gate", "up", "down"):
            out[("layers", "mlp", f"{proj}_proj")] = Entry(hf, proj, layered=True)
        if config.moe_routing == "sigmoid_grouped":  # DeepSeek-V3
            out[("layers", "mlp", "correction_bias")] = Entry(f"{hf}.mlp.gate.e_score_correction_bias", layered=True)
        if config.moe_shared_experts:
            for proj in ("gate", "up", "down"):
                out[("layers", "mlp", f"shared_{proj}")] = Entry(f"{hf}.mlp.shared_experts.{proj}_proj.weight",
                                                                 "transpose", layered=True)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[("layers", "mlp", proj, "kernel")] = Entry(f"{hf}.mlp.{proj}.weight", "transpose", layered=True)
    return out


def _mla_entries(config: ModelConfig, hf: str) -> dict[Path, Entry]:
    """DeepSeek-V3's attention tensors (``mla.py``); rope columns permuted when ``rope_interleave``."""
    attn = f"{hf}.self_attn"
    rope = lambda which: which if config.rope_interleave else ""
    out: dict[Path, Entry] = {}
    kernel = lambda proj, which="": Entry(f"{attn}.{proj}.weight", "transpose", layered=True, rope=rope(which))
    if config.q_lora_rank is None:
        out[("layers", "self_attn", "q_proj", "kernel")] = kernel("q_proj", "q")
    else:
        out[("layers", "self_attn", "q_a_proj", "kernel")] = kernel("q_a_proj")
        out[("layers", "self_attn", "q_a_layernorm", "weight")] = Entry(f"{attn}.q_a_layernorm.weight", layered=True)
        out[("layers", "self_attn", "q_b_proj", "kernel")] = kernel("q_b_proj", "q")
    out[("layers", "self_attn", "kv_a_proj_with_mqa", "kernel")] = kernel("kv_a_proj_with_mqa", "kv")
    out[("layers", "self_attn", "kv_a_layernorm", "weight")] = Entry(f"{attn}.kv_a_layernorm.weight", layered=True)
    out[("layers", "self_attn", "kv_b_proj", "kernel")] = kernel("kv_b_proj")
    out[("layers", "self_attn", "o_proj", "kernel")] = kernel("o_proj")
    if config.attention_bias:
        for proj, which in (("q_a_proj", ""), ("kv_a_proj_with_mqa", "kv"))[config.q_lora_rank is None:]:
            out[("layers", "self_attn", proj, "bias")] = Entry(f"{attn}.{proj}.bias", layered=True, rope=rope(which))
    if config.attention_out_bias:
        out[("layers", "self_attn", "o_proj", "bias")] = Entry(f"{attn}.o_proj.bias", layered=True)
    return out


def _gpt2_layer() -> dict[Path, Entry]:
    hf = "transformer.h.{i}"
    out: dict[Path, Entry] = {}
    for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        for p in ("weight", "bias"):
            out[("layers", ours, p)] = Entry(f"{hf}.{theirs}.{p}", layered=True)
    for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        out[("layers", "self_attn", proj, "kernel")] = Entry(f"{hf}.attn.c_attn.weight", "qkv", part, layered=True)
        out[("layers", "self_attn", proj, "bias")] = Entry(f"{hf}.attn.c_attn.bias", "qkv", part, layered=True)
    for path, theirs in ((("self_attn", "o_proj"), "attn.c_proj"), (("mlp", "up_proj"), "mlp.c_fc"),
                         (("mlp", "down_proj"), "mlp.c_proj")):
        out[("layers", *path, "kernel")] = Entry(f"{hf}.{theirs}.weight", layered=True)
        out[("layers", *path, "bias")] = Entry(f"{hf}.{theirs}.bias", layered=True)
    return out


def param_table(config: ModelConfig, *, classifier: bool = False) -> dict[Path, Entry]:
    """Parameter path -> checkpoint entry for a model built from ``config`` (stacked layers: layered entries)."""
    table: dict[Path, Entry] = {}
    if config.model_type == "gpt2":
        table[("embed_tokens",)] = Entry("transformer.wte.weight")
        table[("embed_positions",)] = Entry("transformer.wpe.weight")
        table |= _gpt2_layer()
        table[("norm", "weight")] = Entry("transformer.ln_f.weight")
        table[("norm", "bias")] = Entry("transformer.ln_f.bias")
        return table
    table[("embed_tokens",)] = Entry("model.embed_tokens.weight")
    k = config.first_dense_layers
    if k:
        table |= _llama_layer(config.dense_prefix(), "dense_layers")
    table |= _llama_layer(config, "layers", k)
    table[("norm", "weight")] = Entry("model.norm.weight")
    if classifier:
        table[("score", "kernel")] = Entry("score.weight", "transpose")
    elif not config.tie_word_embeddings:
        table[("lm_head", "kernel")] = Entry("lm_head.weight", "transpose")
    return table


def _np(x: tp.Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor: bfloat16 has no NumPy dtype
        x = x.detach().cpu()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        return x.numpy()
    return np.asarray(x)


def _floating(dtype: tp.Any) -> bool:
    """Whether a checkpoint tensor's dtype can hold weights (bfloat16 included)."""
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))


def _read(reader: Reader, name: str, used: set[str]) -> np.ndarray:
    if name not in reader:
        raise KeyError(name)
    used.add(name)
    return _np(reader[name])


def stack_size(config: ModelConfig, path: Path) -> int:
    """How many layers the stack of parameter ``path`` holds (``dense_layers``: the leading dense ones)."""
    k = config.first_dense_layers
    return k if path[0] == "dense_layers" else config.num_hidden_layers - k


def load_param(config: ModelConfig, path: Path, entry: Entry, reader: Reader,
               used: set[str] | None = None) -> np.ndarray:
    """The value of parameter ``path`` in our layout, read from ``reader`` (names it reads go into ``used``);
    a layered entry is read layer by layer and stacked (use :func:`load_layer` for one slice)."""
    if entry.layered:
        return np.stack([load_layer(config, entry, reader, i, used) for i in range(stack_size(config, path))])
    return load_layer(config, entry, reader, None, used)


def load_layer(config: ModelConfig, entry: Entry, reader: Reader, layer: int | None,
               used: set[str] | None = None) -> np.ndarray:
    """Layer ``layer``'s slice of a layered parameter (or the whole of an unlayered one), in our layout."""
    used = set() if used is None else used
    entry = entry.at(layer)
    kind, name = entry.kind, entry.name
    if kind in ("copy", "transpose"):
        value = _read(reader, name, used)
        value = value.T if kind == "transpose" else value
        return value[..., rope_columns(config, entry.rope)] if entry.rope else value
    if kind == "qkv":
        return np.split(_read(reader, name, used), 3, axis=-1)[entry.part]
    if kind == "interleave":
        return _read(reader, name, used)[..., entry.part::2]
    return read_experts(config, entry, lambda n: _read(reader, n, used), lambda n: n in reader)


def expected_names(config: ModelConfig, entry: Entry, layer: int | None = None) -> str:
    """Human-readable checkpoint name(s) an entry reads, for error messages."""
    entry = entry.at(layer)
    if entry.kind in EXPERT_KINDS:
        return expected_expert_names(config, entry)
    return entry.name


def ignorable(config: ModelConfig, name: str) -> bool:
    """Checkpoint tensors that are not parameters here (rotary buffers, GPT-2 mask buffers, a tied head,
    DeepSeek-V3's multi-token-prediction layers after the last decoder layer, which transformers skips too)."""
    if config.model_type == "deepseek_v3" and name.startswith("model.layers."):
        index = name.split(".")[2]
        if index.isdigit() and int(index) >= config.num_hidden_layers:
            return True
    return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor to write: its name, shape, dtype and how to compute it (on the host)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    read: tp.Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def tensor_plan(config: ModelConfig, params: tp.Mapping[Path, tp.Any], get: tp.Callable[[Path, int | None], np.ndarray],
                *, classifier: bool = False, dtype: tp.Any = None) -> list[CheckpointTensor]:
    """The checkpoint tensors (the names ``transformers`` writes) of parameters ``params`` (path -> anything
    with a shape and dtype), in the order a streaming writer wants them (layer by layer); ``get(path, layer)``
    gives one parameter, or layer ``layer``'s slice of a stacked one, as NumPy when a tensor is read.
    ``dtype`` (default: each parameter's) is the one written."""
    table = param_table(config, classifier=classifier)
    if set(params) != set(table):
        extra = sorted(".".join(map(str, p)) for p in set(params) ^ set(table))
        raise ValueError(f"the model's parameters do not fit the Hugging Face layout ({extra[:4]}); merge LoRA "
                         f"adapters (unwrap_lora_to_layers) or undo quantization before saving")
    items = list(table.items())
    first = next((k for k, (_, e) in enumerate(items) if e.layered), len(items))
    layered = [(p, e) for p, e in items if e.layered]
    units = [(p, e, None) for p, e in items[:first]]
    units += [(p, e.at(i), i) for i in range(max(params[p].shape[0] for p, _ in layered)) for p, e in layered
              if i < params[p].shape[0]]
    units += [(p, e, None) for p, e in items[first:] if not e.layered]
    out: list[CheckpointTensor] = []
    qkv: dict[str, dict[int, tuple]] = {}
    for path, entry, i in units:
        shape = tuple(params[path].shape)[(0 if i is None else 1):]
        dt = np.dtype(dtype if dtype is not None else params[path].dtype)
        if entry.kind == "copy":
            out.append(CheckpointTensor(entry.name, shape, dt,
                                        lambda p=path, i=i, e=entry: to_checkpoint_columns(config, e, get(p, i))))
        elif entry.kind == "transpose":
            out.append(CheckpointTensor(entry.name, shape[::-1], dt,
                                        lambda p=path, i=i, e=entry: to_checkpoint_columns(config, e, get(p, i)).T))
        elif entry.kind in ("qkv", "interleave"):  # one fused tensor of 3 (q, k, v) or 2 (gate, up) parameters
            parts = qkv.setdefault(entry.name, {})
            parts[entry.part] = path
            n = 3 if entry.kind == "qkv" else 2
            if len(parts) == n:
                paths = [parts[k] for k in range(n)]
                out.append(CheckpointTensor(entry.name, (*shape[:-1], n * shape[-1]), dt,
                                            lambda ps=paths, i=i: fuse([get(p, i) for p in ps])))
        else:  # a router or experts: per-expert tensors, named as the family's checkpoints name them
            for j, name in enumerate(moe_tensor_names(config, entry)):
                if entry.kind == "router":
                    out.append(CheckpointTensor(name, shape[::-1], dt, lambda p=path, i=i: get(p, i).T))
                else:
                    out.append(CheckpointTensor(name, shape[1:][::-1], dt, lambda p=path, i=i, j=j: get(p, i)[j].T))
    return out


def to_hf_tensors(config: ModelConfig, params: tp.Mapping[Path, np.ndarray], *,
                  classifier: bool = False) -> dict[str, np.ndarray]:
    """Checkpoint tensors (the names ``transformers`` writes to disk) from parameter values by path."""
    arrays = {path: np.asarray(value) for path, value in params.items()}
    get = lambda path, layer: arrays[path] if layer is None else arrays[path][layer]
    return {t.name: np.ascontiguousarray(t.read()) for t in tensor_plan(config, arrays, get, classifier=classifier)}


def fuse(parts: list[np.ndarray]) -> np.ndarray:
    """GPT-2's q/k/v side by side (3 parts), or GPT-OSS's gate/up interleaved column by column (2 parts)."""
    if len(parts) == 3:
        return np.concatenate(parts, axis=-1)
    return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)


Read = tp.Callable[[int | None], np.ndarray]
Place = tp.Callable[[Path, tp.Any, Read, int | None], tp.Any]


XLA_ALIGNMENT = 64  # XLA:CPU takes a host buffer without copying when it is aligned to this many bytes


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised NumPy array whose data is ``XLA_ALIGNMENT``-aligned, so ``jax.device_put`` on a CPU
    device adopts it instead of copying it (it must not be written after it is put).

    Large buffers are anonymous memory maps of 4 KiB pages: NumPy asks the kernel for huge pages for its
    large arrays, and on a machine whose memory is fragmented each such load then waits for compaction
    (measured: alternate loads of a 538 MB checkpoint took 0.16 s and 0.8-1.0 s; with 4 KiB pages 0.26-0.33 s).
    """
    import mmap

    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < (1 << 20):
        raw = np.empty(nbytes + XLA_ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % XLA_ALIGNMENT
        return raw[start:start + nbytes].view(dtype).reshape(shape)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned, freed with the array
    return np.frombuffer(pages, dtype).reshape(shape)


def convert_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, transposing before casting: NumPy casts a strided (transposed) source 2x slower
    than it transposes one and casts the contiguous result (measured for float32 <-> bfloat16)."""
    if src.dtype != dst.dtype and not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    dst[...] = src


def place_on_default_device(path: Path, var: tp.Any, read: Read, num_layers: int | None) -> tp.Any:
    """The default ``place``: the parameter as one array on the default device, in the parameter's dtype.

    Each value is converted (transposed, cast, layer slices stacked) once, into an aligned host buffer
    that a CPU device adopts without a second copy; never a view of the mapped file, which the array
    must not alias (a later save to the same file would change it)."""
    import jax

    buf = host_buffer(tuple(var.shape), var.dtype)
    threads = min(4, os.cpu_count() or 1)  # NumPy copies drop the GIL
    if num_layers is None:  # one array (the embedding): converted in row blocks, one per thread
        value = read(None)
        bounds = np.linspace(0, buf.shape[0], threads + 1).astype(int) if buf.ndim else [0, 0]
        items = [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a] or [...]
        fill = lambda rows: convert_into(buf[rows], value[rows])
    else:  # a stack: each layer's slice converted (transposed, cast) straight into it
        fill = lambda i: convert_into(buf[i], read(i))
        items = range(num_layers)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, items))
    return jax.device_put(buf)


def load_model(config: ModelConfig, reader: Reader, *, model_cls: type, strict: bool = True,
               place: Place | None = None, progress: tp.Callable[[tp.Iterable], tp.Iterable] | None = None,
               **model_kwargs: tp.Any):
    """A model of ``model_cls`` (:class:`CausalLM`, :class:`SequenceClassifier`) holding the tensors ``reader`` has.

    Parameters are read one (layer slice) at a time: ``place(path, abstract_param, read, num_layers)``
    builds each stored array, calling ``read(i)`` for layer ``i``'s slice of a stacked parameter
    (``num_layers`` of them) or ``read(None)`` for the whole of an unstacked one; the default puts it
    on the default device, a loader passes one that places it on its mesh. Raises ValueError naming
    the parameter for a missing, mis-shaped or non-floating tensor and (with ``strict``) for tensors
    the model has no place for.
    """
    from flax import nnx

    check_model_class(model_cls)
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    table = param_table(config, classifier=is_classifier(model_cls))
    if set(flat) != set(table):
        raise ValueError(f"internal: parameters {sorted(set(flat) ^ set(table))[:4]} have no checkpoint entry")
    place = place or place_on_default_device
    used: set[str] = set()

    def reader_for(path, entry):
        var = flat[path]
        label = ".".join(map(str, path))

        def read(i: int | None) -> np.ndarray:
            want = tuple(var.shape) if i is None else tuple(var.shape[1:])
            try:
                value = load_layer(config, entry, reader, i, used)
            except KeyError as missing:
                raise ValueError(f"the checkpoint has no {missing.args[0]!r} ({expected_names(config, entry, i)}), "
                                 f"needed for parameter {label} {tuple(var.shape)} of this {config.model_type} "
                                 f"config") from None
            except (ValueError, IndexError) as err:  # a fused or permuted tensor whose shape does not divide
                raise ValueError(f"{expected_names(config, entry, i)} does not fit parameter {label} "
                                 f"{tuple(var.shape)} of this {config.model_type} config ({err}); check that "
                                 f"config.json matches the checkpoint, or re-save the checkpoint") from None
            names = expected_names(config, entry, i)
            where = "" if i is None else f" (layer {i} of the stacked {tuple(var.shape)})"
            if tuple(value.shape) != want:
                found, layout = tuple(value.shape), " (in the parameter's layout, after conversion)"
                if entry.kind in ("copy", "transpose"):  # the tensor as stored, so the message matches the file
                    flip = (lambda s: s[::-1]) if entry.kind == "transpose" else (lambda s: s)
                    found, want, layout = flip(found), flip(want), ""
                raise ValueError(f"{names} gives shape {found} for parameter {label}{where}; expected {want}"
                                 f"{layout} for this {config.model_type} config (check that config.json matches "
                                 f"the checkpoint, or re-save the checkpoint)")
            if not _floating(value.dtype):
                raise ValueError(f"{names} has dtype {value.dtype} for parameter {label}{where}; expected a floating "
                                 f"dtype (float32, bfloat16, float16, float64; it is cast to the parameter's "
                                 f"{np.dtype(var.dtype).name}): the checkpoint is damaged or not this model's, re-save "
                                 f"it with floating weights")
            return value

        return read

    work = [(path, entry, flat[path].shape[0] if entry.layered else None) for path, entry in table.items()]
    for path, entry, layers in (progress(work) if progress else work):
        flat[path].set_value(place(path, flat[path], reader_for(path, entry), layers))
    unused = sorted(k for k in reader.keys() if k not in used and not ignorable(config, k))
    if strict and unused:
        raise ValueError(f"checkpoint tensors with no matching parameter: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}; pass strict=False to ignore them")
    return nnx.merge(graphdef, state)


def from_hf_state_dict(config: ModelConfig, state_dict: tp.Mapping[str, tp.Any], *, model_cls: type,
                       strict: bool = True, **model_kwargs: tp.Any):
    """A model of ``model_cls`` from a HF ``state_dict`` (name -> tensor); :mod:`.auto`'s
    ``from_hf_state_dict`` defaults to :class:`CausalLM`."""
    return load_model(config, state_dict, model_cls=model_cls, strict=strict, **model_kwargs)


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """The checkpoint tensors of ``model`` (host NumPy copies), named as ``transformers`` saves them."""
    from flax import nnx

    flat = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return to_hf_tensors(model.config, flat, classifier=is_classifier(model))
