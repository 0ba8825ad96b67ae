"""``ModelConfig``: the one config every decoder family maps onto.

A family is this config plus a few switches: qkv bias, q/k norm, sliding window, tied
embeddings (Llama, Mistral, Qwen2, Qwen3), LayerNorm + GELU MLP + learned positions (GPT-2),
a mixture of experts (Mixtral). :meth:`ModelConfig.from_hf` reads a Hugging Face
``config.json`` dict and :meth:`ModelConfig.to_hf` writes one back.
"""

from __future__ import annotations

import dataclasses
import typing as tp

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral")
LAYER_TYPES = ("full_attention", "sliding_attention")
NORM_TYPES = ("rms", "layer")
MLP_TYPES = ("swiglu", "gelu", "moe")
GELU_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 rotary scaling (``rope_type="llama3"``): long wavelengths divided by ``factor``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a decoder-only causal LM.

    ``attention_bias`` puts a bias on the q/k/v projections, ``attention_out_bias`` on the
    output projection (Llama ties both; Qwen2 has the first only). ``qk_norm`` applies an
    RMSNorm over ``head_dim`` to queries and keys before the rotation (Qwen3).
    ``layer_types[i]`` is "full_attention" or "sliding_attention" (window ``sliding_window``).
    ``norm_type`` "layer" (LayerNorm with bias), ``mlp_type`` "gelu" (``up -> gelu -> down`` with
    biases when ``mlp_bias``) and ``position_embedding`` "learned" make GPT-2; ``mlp_type`` "moe"
    (``num_local_experts``, top ``num_experts_per_tok``) makes Mixtral.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    model_type: str = "llama"
    norm_eps: float = 1e-6
    norm_type: str = "rms"
    mlp_type: str = "swiglu"
    hidden_act: str = "silu"
    mlp_bias: bool = False
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        for name, allowed in (("norm_type", NORM_TYPES), ("mlp_type", MLP_TYPES),
                              ("position_embedding", ("rope", "learned"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name} must be one of {allowed}; got {getattr(self, name)!r}")
        act_ok = self.hidden_act == "silu" if self.mlp_type != "gelu" else self.hidden_act in GELU_ACTS
        if not act_ok:
            raise ValueError(f"hidden_act={self.hidden_act!r} does not fit mlp_type={self.mlp_type!r}: SwiGLU and "
                             f"MoE experts use 'silu', the GELU MLP one of {GELU_ACTS}")
        if self.mlp_type == "moe" and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"a MoE needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_local_experts ({self.num_local_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for the rotary embedding")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None; got {self.sliding_window!r}")
        layer_types = self.layer_types
        if layer_types is None:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            layer_types = (kind,) * self.num_hidden_layers
        layer_types = tuple(layer_types)
        if len(layer_types) != self.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must hold num_hidden_layers={self.num_hidden_layers} entries from "
                             f"{LAYER_TYPES}; got {layer_types}")
        if "sliding_attention" in layer_types and self.sliding_window is None:
            raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is None; set a window")
        object.__setattr__(self, "layer_types", layer_types)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def replace(self, **changes: tp.Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: tp.Mapping[str, tp.Any]) -> ModelConfig:
        """Read a Hugging Face config dict (``config.json``), or a ``PretrainedConfig`` (via ``to_dict()``)."""
        if not isinstance(hf, tp.Mapping) and hasattr(hf, "to_dict"):
            hf = hf.to_dict()
        if not isinstance(hf, tp.Mapping):
            raise TypeError(f"ModelConfig.from_hf takes a HF config dict; got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        tokens = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if model_type == "gpt2":
            return cls(**_gpt2_fields(hf), **tokens)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; the decoder block's MLP is SwiGLU ('silu')")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported for this family; its MLP projections have no bias")
        if model_type == "mixtral" and hf.get("router_jitter_noise", 0.0):
            raise ValueError("router_jitter_noise > 0 is not supported (it only acts in training); set it to 0.0")
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})  # transformers 4.x key
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: ('default', 'llama3')")
        bias = bool(hf.get("attention_bias", False))
        qkv_bias, out_bias = (True, False) if model_type == "qwen2" else (bias, bias)
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            window, layer_types = None, None
        else:
            layer_types = hf.get("layer_types")
        head_dim = hf.get("head_dim") or hidden // heads
        moe = {"mlp_type": "moe", "num_local_experts": hf["num_local_experts"],
               "num_experts_per_tok": hf["num_experts_per_tok"]} if model_type == "mixtral" else {}
        return cls(vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
                   num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
                   model_type=model_type, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 2048),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=qkv_bias,
                   attention_out_bias=out_bias, qk_norm=model_type == "qwen3", sliding_window=window,
                   layer_types=None if layer_types is None else tuple(layer_types), **moe, **tokens)

    def to_hf(self) -> dict[str, tp.Any]:
        """A Hugging Face ``config.json`` dict that builds the same model in ``transformers``."""
        tokens = {k: getattr(self, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if isinstance(tokens["eos_token_id"], tuple):
            tokens["eos_token_id"] = list(tokens["eos_token_id"])
        base = {"model_type": self.model_type, "architectures": [ARCHITECTURES[self.model_type]],
                "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings, **tokens}
        if self.model_type == "gpt2":
            return base | {"n_embd": self.hidden_size, "n_layer": self.num_hidden_layers,
                           "n_head": self.num_attention_heads, "n_inner": self.intermediate_size,
                           "n_positions": self.max_position_embeddings, "layer_norm_epsilon": self.norm_eps,
                           "activation_function": self.hidden_act, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                           "attn_pdrop": 0.0}
        rope: dict[str, tp.Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
        out = base | {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                      "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                      "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                      "rms_norm_eps": self.norm_eps, "hidden_act": self.hidden_act,
                      "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
                      "rope_parameters": rope, "attention_dropout": 0.0}
        if self.rope_scaling is not None:
            out["rope_scaling"] = rope
        if self.model_type in ("llama", "mistral", "mixtral"):
            out["attention_bias"] = self.attention_bias
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None:
                out["max_window_layers"] = self.layer_types.count("full_attention")
        out["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2" or self.model_type == "qwen3":
            out["layer_types"] = list(self.layer_types)
        if self.model_type == "mixtral":
            out |= {"num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "router_jitter_noise": 0.0}
        return out


def _gpt2_fields(hf: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise ValueError(f"GPT-2 with {key}=True is not supported; set it to False")
    if not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 with scale_attn_weights=False is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_ACTS:
        raise ValueError(f"GPT-2 activation_function={act!r} is not supported; supported: {GELU_ACTS}")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
                num_hidden_layers=hf["n_layer"], num_attention_heads=heads, num_key_value_heads=heads,
                head_dim=hidden // heads, model_type="gpt2", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                norm_type="layer", mlp_type="gelu", hidden_act=act, mlp_bias=True, position_embedding="learned",
                max_position_embeddings=hf.get("n_positions", 1024), tie_word_embeddings=True, attention_bias=True,
                attention_out_bias=True)
