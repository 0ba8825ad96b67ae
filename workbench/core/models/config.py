"""``ModelConfig``: the one config every decoder family maps onto.

A family is this config plus a few switches: qkv bias, q/k norm, sliding window, tied
embeddings (Llama, Mistral, Qwen2, Qwen3), LayerNorm + GELU MLP + learned positions (GPT-2),
a mixture of experts (Mixtral), sandwich norms with unit-offset RMSNorm, scaled embeddings, a
query scalar, a local rope base for sliding layers and logit soft-capping (Gemma 3), multi-head latent
attention with DeepSeek-V3's routing (DeepSeek-V3).
:meth:`ModelConfig.from_hf` reads a Hugging Face ``config.json`` dict and :meth:`ModelConfig.to_hf`
writes one back.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.checks import is_positive_int, positive_int

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "gemma3_text", "qwen3_moe",
                         "gpt_oss", "deepseek_v3")
LAYER_TYPES = ("full_attention", "sliding_attention")
NORM_TYPES = ("rms", "layer")
MLP_TYPES = ("swiglu", "gelu", "moe")
GELU_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu")
GATED_ACTS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, and GeGLU with tanh-approximated GELU (Gemma)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 rotary scaling (``rope_type="llama3"``): long wavelengths divided by ``factor``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Linear rotary scaling (``rope_type="linear"``): every inverse frequency divided by ``factor``."""

    factor: float


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (``rope_type="yarn"``, GPT-OSS, DeepSeek-V3): frequencies between ``beta_slow`` and
    ``beta_fast`` rotations over ``original_max_position_embeddings`` blend from extrapolated to
    divided by ``factor``; cos and sin are multiplied by an attention factor (given, or from
    ``factor`` with ``mscale`` / ``mscale_all_dim``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a decoder-only causal LM.

    ``attention_bias`` puts a bias on the q/k/v projections, ``attention_out_bias`` on the
    output projection (Llama ties both; Qwen2 has the first only). ``qk_norm`` applies an
    RMSNorm over ``head_dim`` to queries and keys before the rotation (Qwen3).
    ``layer_types[i]`` is "full_attention" or "sliding_attention" (window ``sliding_window``).
    ``norm_type`` "layer" (LayerNorm with bias), ``mlp_type`` "gelu" (``up -> gelu -> down`` with
    biases when ``mlp_bias``) and ``position_embedding`` "learned" make GPT-2; ``mlp_type`` "moe"
    (``num_local_experts``, top ``num_experts_per_tok``) makes Mixtral; ``moe_intermediate_size`` is the
    experts' width when it differs from ``intermediate_size`` and ``first_dense_layers`` the number of
    leading layers with a dense MLP of ``intermediate_size`` instead (Qwen3-MoE ``mlp_only_layers``,
    DeepSeek-V3 ``first_k_dense_replace``): the model stacks those layers apart (``dense_layers``);
    ``moe_norm_topk_prob=False`` keeps the top-k probabilities as they are (Qwen3-MoE's option).

    GPT-OSS: ``attention_sinks`` (a learned logit per head joins each softmax), experts routed by
    ``moe_routing="topk_softmax"`` (softmax over the top-k logits) with ``moe_router_bias`` and
    ``moe_expert_bias``, and ``moe_activation="clamped_swiglu"`` (``swiglu_alpha``, ``swiglu_limit``).

    Gemma 3: ``norm_unit_offset`` (RMSNorm scales by ``1 + weight``, in float32), ``sandwich_norms`` (a
    norm after attention and around the MLP too), ``embedding_multiplier`` (embeddings times
    ``sqrt(hidden_size)``), ``query_pre_attn_scalar`` (softmax scale ``query_pre_attn_scalar ** -0.5``
    instead of ``head_dim ** -0.5``), ``local_rope_theta`` (the rope base of sliding layers; full layers
    use ``rope_theta`` and ``rope_scaling``), ``attn_logit_softcapping`` / ``final_logit_softcapping``
    (``c * tanh(x / c)`` on attention logits / output logits), ``hidden_act="gelu_pytorch_tanh"`` (GeGLU).

    DeepSeek-V3: ``kv_lora_rank`` (not None) switches attention to multi-head latent attention (``mla.py``):
    keys and values come from a latent of ``kv_lora_rank`` per token plus a shared rope key of
    ``qk_rope_head_dim`` (then ``head_dim`` is ``qk_rope_head_dim``, the rotary table's width);
    ``qk_nope_head_dim`` / ``v_head_dim`` are the per-head key and value sizes; ``q_lora_rank`` (None: a plain
    ``q_proj``) puts a low-rank, normed bottleneck before the queries; ``rope_interleave`` says the checkpoint's
    rope channels are interleaved pairs (permuted to halves at load, back at save). Its experts:
    ``moe_routing="sigmoid_grouped"`` with ``moe_n_group`` / ``moe_topk_group`` (group-limited top-k),
    ``moe_routed_scaling`` and ``moe_shared_experts`` shared experts of width ``moe_intermediate_size``;
    ``attention_bias`` there biases ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
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
    rope_scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
    local_rope_theta: float | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    first_dense_layers: int = 0
    moe_routing: str = "softmax_topk"
    moe_norm_topk_prob: bool = True
    moe_router_bias: bool = False
    moe_expert_bias: bool = False
    moe_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    moe_shared_experts: int = 0
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embedding_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            object.__setattr__(self, name, positive_int(f"ModelConfig.{name}", getattr(self, name)))
        for name, allowed in (("norm_type", NORM_TYPES), ("mlp_type", MLP_TYPES),
                              ("position_embedding", ("rope", "learned"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name} must be one of {allowed}; got {getattr(self, name)!r}")
        allowed_acts = {"swiglu": GATED_ACTS, "moe": ("silu",), "gelu": GELU_ACTS}[self.mlp_type]
        if self.hidden_act not in allowed_acts:
            raise ValueError(f"hidden_act={self.hidden_act!r} does not fit mlp_type={self.mlp_type!r}: the gated MLP "
                             f"takes one of {GATED_ACTS}, MoE experts 'silu', the GELU MLP one of {GELU_ACTS}")
        for name in ("embedding_multiplier", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None; got {value!r}")
        if self.mlp_type == "moe" and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"a MoE needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_local_experts ({self.num_local_experts})")
        if not isinstance(self.first_dense_layers, int) or not 0 <= self.first_dense_layers < self.num_hidden_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers!r} must be an int in [0, num_hidden_layers="
                             f"{self.num_hidden_layers})")
        if self.first_dense_layers and self.mlp_type != "moe":
            raise ValueError("first_dense_layers only applies to a mixture of experts (mlp_type='moe')")
        if self.kv_lora_rank is not None:
            self._check_mla()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for the rotary embedding")
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", positive_int("sliding_window", self.sliding_window,
                                                                    what="a positive int or None"))
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

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not is_positive_int(getattr(self, name)):
                raise ValueError(f"multi-head latent attention (kv_lora_rank set) needs ModelConfig.{name} to be a "
                                 f"positive int; got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        if self.q_lora_rank is not None:
            object.__setattr__(self, "q_lora_rank", positive_int("q_lora_rank", self.q_lora_rank,
                                                                 what="a positive int or None (a plain q_proj)"))
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"with multi-head latent attention head_dim is the rotary width: set head_dim="
                             f"qk_rope_head_dim={self.qk_rope_head_dim} (got {self.head_dim})")
        if self.position_embedding != "rope" or self.attention_sinks or self.qk_norm or self.sliding_window:
            raise ValueError("multi-head latent attention takes rotary positions without sinks, q/k norm or a "
                             "sliding window; unset those switches")

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """The per-head query/key size the softmax scale is taken from (MLA: nope + rope, else head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> str:
        """Which rotary table layer ``layer`` uses: "local" (``local_rope_theta``, sliding layers of a
        config that has one) or "global" (``rope_theta`` with ``rope_scaling``)."""
        local = self.local_rope_theta is not None and self.layer_types[layer] == "sliding_attention"
        return "local" if local else "global"

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def dense_prefix(self) -> ModelConfig:
        """The config of the leading dense layers (``first_dense_layers`` of them): a SwiGLU MLP."""
        return self.replace(mlp_type="swiglu", num_local_experts=0, num_experts_per_tok=0, first_dense_layers=0,
                            moe_intermediate_size=None)

    def layer_kind(self, layer: int) -> tuple[int | None, str]:
        """What differs between layers of one stack: ``(sliding window or None, rope table)``."""
        return self.layer_window(layer), self.layer_rope(layer)

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
        if model_type == "gemma3_text":
            return cls(**_gemma3_fields(hf), **tokens)
        if model_type == "gpt_oss":
            return cls(**_gpt_oss_fields(hf), **tokens)
        if model_type == "deepseek_v3":
            return cls(**_deepseek_v3_fields(hf), **tokens)
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
        theta, scaling = _rope(rope, hf.get("rope_theta", 10000.0))
        bias = bool(hf.get("attention_bias", False))
        qkv_bias, out_bias = (True, False) if model_type == "qwen2" else (bias, bias)
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
            window, layer_types = None, None
        else:
            layer_types = hf.get("layer_types")
        head_dim = hf.get("head_dim") or hidden // heads
        moe = {"mlp_type": "moe", "num_local_experts": hf["num_local_experts"],
               "num_experts_per_tok": hf["num_experts_per_tok"]} if model_type == "mixtral" else {}
        if model_type == "qwen3_moe":
            moe = _qwen3_moe_fields(hf)
        return cls(vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
                   num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
                   num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
                   model_type=model_type, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 2048),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=qkv_bias,
                   attention_out_bias=out_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"), sliding_window=window,
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
        rope = _rope_dict(self.rope_theta, self.rope_scaling)
        if self.model_type == "gemma3_text":
            return base | _gemma3_hf(self, rope)
        if self.model_type == "gpt_oss":
            return base | _gpt_oss_hf(self, rope)
        if self.model_type == "deepseek_v3":
            return base | _deepseek_v3_hf(self, rope)
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
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None:
                out["max_window_layers"] = self.layer_types.count("full_attention")
        out["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            out["layer_types"] = list(self.layer_types)
        if self.model_type == "qwen3_moe":
            out |= {"num_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": self.moe_norm_topk_prob,
                    "decoder_sparse_step": 1, "mlp_only_layers": list(range(self.first_dense_layers)),
                    "attention_bias": self.attention_bias}
        if self.model_type == "mixtral":
            out |= {"num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "router_jitter_noise": 0.0}
        return out


def _rope(rope: tp.Mapping[str, tp.Any], theta: float
          ) -> tuple[float, RopeScaling | LinearRopeScaling | YarnRopeScaling | None]:
    """``(rope_theta, scaling)`` of a HF rope dict (``rope_parameters`` / ``rope_scaling``)."""
    theta = float(rope.get("rope_theta", theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        return theta, RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    if rope_type == "linear":
        return theta, LinearRopeScaling(float(rope["factor"]))
    if rope_type == "yarn":
        opt = lambda key: None if rope.get(key) is None else float(rope[key])
        return theta, YarnRopeScaling(float(rope["factor"]), int(rope["original_max_position_embeddings"]),
                                      float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0),
                                      opt("mscale"), opt("mscale_all_dim"), opt("attention_factor"),
                                      bool(rope.get("truncate", True)))
    if rope_type == "default":
        return theta, None
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: ('default', 'linear', 'llama3', 'yarn')")


def _rope_dict(theta: float, scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None) -> dict[str, tp.Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    kind = {LinearRopeScaling: "linear", YarnRopeScaling: "yarn", RopeScaling: "llama3"}[type(scaling)]
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return {"rope_type": kind, "rope_theta": theta, **fields}


def _qwen3_moe_fields(hf: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """Qwen3-MoE's experts: softmax top-k (renormalised when ``norm_topk_prob``), dense layers only as a
    leading run (``mlp_only_layers``)."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = sorted(set(hf.get("mlp_only_layers") or []) | {i for i in range(n) if (i + 1) % step})
    if dense != list(range(len(dense))):
        raise ValueError(f"Qwen3-MoE with dense layers {dense} (mlp_only_layers / decoder_sparse_step) is not "
                         f"supported: dense MLP layers must be the first ones (a leading run), the rest sparse")
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]  # transformers 5 writes the latter
    return {"mlp_type": "moe", "num_local_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf.get("moe_intermediate_size"), "first_dense_layers": len(dense),
            "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _gpt_oss_fields(hf: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """GPT-OSS: sinks, biased q/k/v/o, alternating sliding/full layers, YaRN, its MoE."""
    heads, hidden, n = hf["num_attention_heads"], hf["hidden_size"], hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta, scaling = _rope(rope, hf.get("rope_theta", 1.5e5))
    bias = bool(hf.get("attention_bias", True))
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
                num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hidden // heads, model_type="gpt_oss",
                norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=hf.get("max_position_embeddings", 131_072),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=bias,
                attention_out_bias=bias, sliding_window=hf.get("sliding_window"), layer_types=tuple(layer_types),
                mlp_type="moe", num_local_experts=hf["num_local_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_routing="topk_softmax", moe_router_bias=True, moe_expert_bias=True,
                moe_activation="clamped_swiglu", swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)), attention_sinks=True)


def _gpt_oss_hf(c: ModelConfig, rope: dict[str, tp.Any]) -> dict[str, tp.Any]:
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias,
            "attention_dropout": 0.0, "sliding_window": c.sliding_window, "layer_types": list(c.layer_types),
            "rope_parameters": rope, "num_local_experts": c.num_local_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "swiglu_limit": c.swiglu_limit,
            "swiglu_alpha": c.swiglu_alpha, "router_aux_loss_coef": 0.0, "hidden_act": "silu"}


def _deepseek_v3_fields(hf: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """DeepSeek-V3: multi-head latent attention, leading dense layers, then sigmoid-routed grouped experts
    plus shared ones. Its multi-token-prediction layers (``num_nextn_predict_layers``) are not part of the
    causal LM (transformers skips them too)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"DeepSeek-V3 hidden_act={act!r} is not supported; its MLPs and experts are SwiGLU ('silu')")
    heads, n = hf["num_attention_heads"], hf["num_hidden_layers"]
    experts = hf["n_routed_experts"] if "n_routed_experts" in hf else hf["num_local_experts"]
    if not experts:
        raise ValueError("DeepSeek-V3 without routed experts (n_routed_experts=None) is not supported")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):  # original (remote-code) configs
        if hf.get(key, want) != want:
            raise ValueError(f"DeepSeek-V3 with {key}={hf[key]!r} is not supported; its router is {key}={want!r}")
    first_dense = hf.get("first_k_dense_replace") or 0
    if first_dense >= n:
        raise ValueError(f"first_k_dense_replace={first_dense} makes every one of the {n} layers dense; at least the "
                         f"last layer must be a mixture of experts")
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    theta, scaling = _rope(rope, hf.get("rope_theta", 10000.0))
    bias = bool(hf.get("attention_bias", False))
    rope_dim = hf["qk_rope_head_dim"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=rope_dim,
                model_type="deepseek_v3", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=bias,
                attention_out_bias=bias, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=rope_dim, v_head_dim=hf["v_head_dim"],
                rope_interleave=bool(hf.get("rope_interleave", True)), mlp_type="moe", num_local_experts=experts,
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["moe_intermediate_size"],
                first_dense_layers=first_dense, moe_routing="sigmoid_grouped",
                moe_norm_topk_prob=bool(hf.get("norm_topk_prob", True)), moe_n_group=hf.get("n_group") or 1,
                moe_topk_group=hf.get("topk_group") or 1,
                moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                moe_shared_experts=hf.get("n_shared_experts") or 0)


def _deepseek_v3_hf(c: ModelConfig, rope: dict[str, tp.Any]) -> dict[str, tp.Any]:
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "moe_intermediate_size": c.expert_intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "n_shared_experts": c.moe_shared_experts, "n_routed_experts": c.num_local_experts,
            "routed_scaling_factor": c.moe_routed_scaling, "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim,
            "qk_nope_head_dim": c.qk_nope_head_dim, "n_group": c.moe_n_group, "topk_group": c.moe_topk_group,
            "num_experts_per_tok": c.num_experts_per_tok, "first_k_dense_replace": c.first_dense_layers,
            "norm_topk_prob": c.moe_norm_topk_prob, "hidden_act": "silu",
            "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_eps,
            "rope_parameters": rope, "rope_interleave": c.rope_interleave, "attention_bias": c.attention_bias,
            "attention_dropout": 0.0}


def _gemma3_fields(hf: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """Gemma 3 (text): a ``config.json`` as transformers 5 writes it (``rope_parameters`` per layer type)
    or as the released checkpoints have it (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern``)."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True (an encoder) is not supported; set it false")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={hf['attn_logit_softcapping']}: transformers' Gemma 3 does not "
                         f"apply it (Gemma 2 did), so a model exact to it cannot either; set it to null")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 hidden_activation={act!r} is not supported; its MLP is GeGLU 'gelu_pytorch_tanh'")
    n = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:  # released configs: every `sliding_window_pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = hf.get("rope_parameters") or {}
    nested = isinstance(params.get("full_attention"), tp.Mapping)
    full = dict(params["full_attention"]) if nested else {**params, **(hf.get("rope_scaling") or {})}
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    theta, scaling = _rope(full, hf.get("rope_theta", 1_000_000.0))
    local_theta, local_scaling = _rope(local, hf.get("rope_local_base_freq", 10_000.0))
    if local_scaling is not None:
        raise ValueError("Gemma 3 with a scaled rope on its sliding layers is not supported; sliding_attention "
                         "rope_parameters must be rope_type 'default'")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
                num_hidden_layers=n, num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hidden // heads, model_type="gemma3_text",
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), hidden_act=act, rope_theta=theta, rope_scaling=scaling,
                local_rope_theta=local_theta, max_position_embeddings=hf.get("max_position_embeddings", 131_072),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                attention_bias=bool(hf.get("attention_bias", False)),
                attention_out_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
                sliding_window=hf.get("sliding_window"), layer_types=tuple(layer_types), norm_unit_offset=True,
                sandwich_norms=True, embedding_multiplier=float(hidden) ** 0.5,
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                final_logit_softcapping=hf.get("final_logit_softcapping"))


def _gemma3_hf(c: ModelConfig, rope: dict[str, tp.Any]) -> dict[str, tp.Any]:
    query_scalar = c.query_pre_attn_scalar
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps,
            "hidden_activation": c.hidden_act, "max_position_embeddings": c.max_position_embeddings,
            "attention_bias": c.attention_bias, "attention_dropout": 0.0,
            "query_pre_attn_scalar": int(query_scalar) if float(query_scalar).is_integer() else query_scalar,
            "sliding_window": c.sliding_window, "layer_types": list(c.layer_types),
            "rope_parameters": {"full_attention": rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta}},
            "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}


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
