"""Hugging Face tensors <-> :class:`CausalLM` parameters: the name table, transposes, splits.

:func:`param_table` says, for each parameter path of a model built from ``config``, which
checkpoint tensor holds it and how (``Entry``). Loading reads tensors through any mapping-like
reader (a state dict, or a safetensors file opened lazily), one parameter at a time, so a
loader can place each on its devices before reading the next. :func:`to_hf_tensors` is the
inverse and writes the names ``transformers`` saves on disk.

Kinds: "copy"; "transpose" (HF ``Linear`` weights are ``(out, in)``, our kernels ``(in, out)``);
"qkv" (GPT-2's fused ``c_attn``, a ``Conv1D`` already ``(in, out)``: part ``i`` of 3 along the
last axis); "router", "gate", "up", "down" (Mixtral: the on-disk per-expert
``block_sparse_moe.experts.{j}.w1/w3/w2`` form, or transformers' in-memory fused
``mlp.experts.gate_up_proj (E, 2F, D)`` / ``down_proj (E, D, F)`` form).
"""

from __future__ import annotations

import dataclasses
import typing as tp

import numpy as np

from workbench.core.models.config import ModelConfig
from workbench.core.models.moe import from_hf_experts, from_legacy_experts, to_legacy_experts

Path = tuple[str | int, ...]
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    kind: str = "copy"
    part: int = 0


class Reader(tp.Protocol):
    def __contains__(self, name: str) -> bool: ...
    def __getitem__(self, name: str) -> tp.Any: ...
    def keys(self) -> tp.Iterable[str]: ...


def _llama_layer(config: ModelConfig, i: int) -> dict[Path, Entry]:
    hf = f"model.layers.{i}"
    out: dict[Path, Entry] = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[("layers", i, norm, "weight")] = Entry(f"{hf}.{norm}.weight")
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[("layers", i, "self_attn", proj, "kernel")] = Entry(f"{hf}.self_attn.{proj}.weight", "transpose")
        if config.attention_bias if proj != "o_proj" else config.attention_out_bias:
            out[("layers", i, "self_attn", proj, "bias")] = Entry(f"{hf}.self_attn.{proj}.bias")
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[("layers", i, "self_attn", norm, "weight")] = Entry(f"{hf}.self_attn.{norm}.weight")
    if config.mlp_type == "moe":
        out[("layers", i, "mlp", "router_kernel")] = Entry(hf, "router")
        for proj in ("gate", "up", "down"):
            out[("layers", i, "mlp", f"{proj}_proj")] = Entry(hf, proj)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[("layers", i, "mlp", proj, "kernel")] = Entry(f"{hf}.mlp.{proj}.weight", "transpose")
    return out


def _gpt2_layer(i: int) -> dict[Path, Entry]:
    hf = f"transformer.h.{i}"
    out: dict[Path, Entry] = {}
    for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        for p in ("weight", "bias"):
            out[("layers", i, ours, p)] = Entry(f"{hf}.{theirs}.{p}")
    for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        out[("layers", i, "self_attn", proj, "kernel")] = Entry(f"{hf}.attn.c_attn.weight", "qkv", part)
        out[("layers", i, "self_attn", proj, "bias")] = Entry(f"{hf}.attn.c_attn.bias", "qkv", part)
    for path, theirs in ((("self_attn", "o_proj"), "attn.c_proj"), (("mlp", "up_proj"), "mlp.c_fc"),
                         (("mlp", "down_proj"), "mlp.c_proj")):
        out[("layers", i, *path, "kernel")] = Entry(f"{hf}.{theirs}.weight")
        out[("layers", i, *path, "bias")] = Entry(f"{hf}.{theirs}.bias")
    return out


def param_table(config: ModelConfig, *, classifier: bool = False) -> dict[Path, Entry]:
    """Parameter path -> checkpoint entry for a model built from ``config``."""
    table: dict[Path, Entry] = {}
    if config.model_type == "gpt2":
        table[("embed_tokens",)] = Entry("transformer.wte.weight")
        table[("embed_positions",)] = Entry("transformer.wpe.weight")
        for i in range(config.num_hidden_layers):
            table |= _gpt2_layer(i)
        table[("norm", "weight")] = Entry("transformer.ln_f.weight")
        table[("norm", "bias")] = Entry("transformer.ln_f.bias")
        return table
    table[("embed_tokens",)] = Entry("model.embed_tokens.weight")
    for i in range(config.num_hidden_layers):
        table |= _llama_layer(config, i)
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


def _read(reader: Reader, name: str, used: set[str]) -> np.ndarray:
    if name not in reader:
        raise KeyError(name)
    used.add(name)
    return _np(reader[name])


def load_param(config: ModelConfig, entry: Entry, reader: Reader, used: set[str] | None = None) -> np.ndarray:
    """The value of one parameter in our layout, read from ``reader`` (names it reads go into ``used``)."""
    used = set() if used is None else used
    kind, name = entry.kind, entry.name
    if kind == "copy":
        return _read(reader, name, used)
    if kind == "transpose":
        return _read(reader, name, used).T
    if kind == "qkv":
        return np.split(_read(reader, name, used), 3, axis=-1)[entry.part]
    legacy = f"{name}.block_sparse_moe"
    if kind == "router":
        key = f"{legacy}.gate.weight" if f"{legacy}.gate.weight" in reader else f"{name}.mlp.gate.weight"
        return _read(reader, key, used).T
    which = ("gate", "up", "down").index(kind)
    if f"{legacy}.experts.0.w1.weight" in reader:
        names = [f"{legacy}.experts.{j}.{w}.weight" for j in range(config.num_local_experts)
                 for w in ("w1", "w2", "w3")]
        return from_legacy_experts({n: _read(reader, n, used) for n in names}, f"{legacy}.experts.")[which]
    fused = (f"{name}.mlp.experts.gate_up_proj", f"{name}.mlp.experts.down_proj")
    return from_hf_experts(*(_read(reader, n, used) for n in fused))[which]


def expected_names(config: ModelConfig, entry: Entry) -> str:
    """Human-readable checkpoint name(s) an entry reads, for error messages."""
    if entry.kind in ("router", "gate", "up", "down"):
        w = {"router": "gate.weight", "gate": "experts.*.w1.weight", "up": "experts.*.w3.weight",
             "down": "experts.*.w2.weight"}[entry.kind]
        return f"{entry.name}.block_sparse_moe.{w}"
    return entry.name


def ignorable(config: ModelConfig, name: str) -> bool:
    """Checkpoint tensors that are not parameters here (rotary buffers, GPT-2 mask buffers, a tied head)."""
    return name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")


def to_hf_tensors(config: ModelConfig, params: tp.Mapping[Path, np.ndarray], *,
                  classifier: bool = False) -> dict[str, np.ndarray]:
    """Checkpoint tensors (the names ``transformers`` writes to disk) from parameter values by path."""
    out: dict[str, np.ndarray] = {}
    qkv: dict[str, list[np.ndarray | None]] = {}
    experts: dict[str, dict[str, np.ndarray]] = {}
    for path, entry in param_table(config, classifier=classifier).items():
        value = np.asarray(params[path])
        if entry.kind == "copy":
            out[entry.name] = value
        elif entry.kind == "transpose":
            out[entry.name] = np.ascontiguousarray(value.T)
        elif entry.kind == "qkv":
            qkv.setdefault(entry.name, [None] * 3)[entry.part] = value
        elif entry.kind == "router":
            out[f"{entry.name}.block_sparse_moe.gate.weight"] = np.ascontiguousarray(value.T)
        else:
            experts.setdefault(entry.name, {})[entry.kind] = value
    for name, parts in qkv.items():
        out[name] = np.concatenate(parts, axis=-1)
    for name, e in experts.items():
        tensors = to_legacy_experts(e["gate"], e["up"], e["down"], prefix=f"{name}.block_sparse_moe.experts.")
        out |= {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    return out


def load_model(config: ModelConfig, reader: Reader, *, model_cls: type | None = None, strict: bool = True,
               place: tp.Callable[[Path, np.ndarray, tp.Any], tp.Any] | None = None,
               progress: tp.Callable[[tp.Iterable], tp.Iterable] | None = None, **model_kwargs: tp.Any):
    """A model of ``model_cls`` (default :class:`CausalLM`) holding the tensors ``reader`` has.

    Parameters are read one at a time; ``place(path, value, abstract_param)`` turns each into the
    array stored (default ``jnp.asarray`` in the parameter's dtype; a loader passes one that
    puts it on its devices). Raises ValueError naming the parameter for a missing or mis-shaped
    tensor and (with ``strict``) for tensors the model has no place for.
    """
    import jax.numpy as jnp
    from flax import nnx

    from workbench.core.models.causal_lm import CausalLM, SequenceClassifier

    model_cls = model_cls or CausalLM
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0), **model_kwargs))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    table = param_table(config, classifier=issubclass(model_cls, SequenceClassifier))
    if set(flat) != set(table):
        raise ValueError(f"internal: parameters {sorted(set(flat) ^ set(table))[:4]} have no checkpoint entry")
    place = place or (lambda path, value, var: jnp.asarray(value, dtype=var.dtype))
    used: set[str] = set()
    items = list(table.items())
    for path, entry in (progress(items) if progress else items):
        var = flat[path]
        label = ".".join(map(str, path))
        try:
            value = load_param(config, entry, reader, used)
        except KeyError as missing:
            raise ValueError(f"the checkpoint has no {missing.args[0]!r} ({expected_names(config, entry)}), needed "
                             f"for parameter {label} {tuple(var.shape)} of this {config.model_type} config") from None
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"{expected_names(config, entry)} gives shape {tuple(value.shape)} for parameter {label}; "
                             f"expected {tuple(var.shape)} for this {config.model_type} config (check that "
                             f"config.json matches the checkpoint)")
        var.set_value(place(path, value, var))
    unused = sorted(k for k in reader.keys() if k not in used and not ignorable(config, k))
    if strict and unused:
        raise ValueError(f"checkpoint tensors with no matching parameter: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}; pass strict=False to ignore them")
    return nnx.merge(graphdef, state)


def from_hf_state_dict(config: ModelConfig, state_dict: tp.Mapping[str, tp.Any], *, strict: bool = True,
                       **model_kwargs: tp.Any):
    """A :class:`CausalLM` (or ``model_cls=SequenceClassifier``) from a HF ``state_dict`` (name -> tensor)."""
    return load_model(config, state_dict, strict=strict, **model_kwargs)


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """The checkpoint tensors of ``model`` (host NumPy copies), named as ``transformers`` saves them."""
    from flax import nnx

    from workbench.core.models.causal_lm import SequenceClassifier

    flat = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return to_hf_tensors(model.config, flat, classifier=isinstance(model, SequenceClassifier))
