"""Tiny configs of every family, for tests, tutorials and CPU training runs.

``tiny_config(family)`` is a Hugging Face ``config.json`` dict, so one dict builds both sides
of a comparison: ``CausalLM`` through ``ModelConfig.from_hf`` and the transformers reference
through ``transformers.AutoConfig.for_model(**d)``. Sizes: hidden 64, 2 layers, 4 heads
(2 key/value heads), MLP 128, vocab 264 = the 259 ids of :class:`ByteTokenizer` rounded up to
a multiple of 8 so the vocab shards evenly over tp.

>>> tiny_config("qwen3")["head_dim"]
32
"""

from __future__ import annotations

import copy
import typing as tp

import jax.numpy as jnp

from workbench.core.models.tokenizer import ByteTokenizer

if tp.TYPE_CHECKING:
    from workbench.core.models.causal_lm import CausalLM

TINY_VOCAB = 264
_TOKENS = dict(pad_token_id=ByteTokenizer.pad_token_id, bos_token_id=ByteTokenizer.bos_token_id,
               eos_token_id=ByteTokenizer.eos_token_id)
_DECODER = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, **_TOKENS)

_CONFIGS: dict[str, dict[str, tp.Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], **_DECODER),
    # every layer attends to the last 16 positions only
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], **_DECODER, head_dim=16,
                    sliding_window=16),
    # Qwen2 always has a bias on q/k/v (not on o); no sliding window unless use_sliding_window
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **_DECODER, use_sliding_window=False),
    # head_dim 32 != hidden / heads = 16; q/k RMSNorm; tied embeddings as in the small Qwen3 models
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **{**_DECODER, "tie_word_embeddings": True},
                  head_dim=32, use_sliding_window=False),
    # learned positions (n_positions 256), LayerNorm, GELU MLP, biases, tied head; no grouped kv heads
    "gpt2": dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=TINY_VOCAB, n_embd=64, n_layer=2,
                 n_head=4, n_inner=128, n_positions=256, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, **_TOKENS),
    # 4 experts, 2 routed per token
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], **_DECODER, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    # Qwen3-MoE: q/k norm, layer 0 a dense MLP (mlp_only_layers), then 4 experts of width 64, 2 per token
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], **_DECODER, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0],
                      decoder_sparse_step=1, norm_topk_prob=True, use_sliding_window=False),
    # GPT-OSS: learned attention sinks, biased q/k/v/o, alternating window-16 / full layers, YaRN (x4 over 64
    # positions), 4 experts (2 per token, softmax over their logits) with biases and the clamped SwiGLU
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], **_DECODER, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], attention_bias=True, swiglu_limit=7.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}),
    # Gemma 3: local layers (window 16, rope base 1e4) with a global one every 2nd layer (rope base 1e6),
    # sandwich norms, GeGLU, q/k norm, embeddings times sqrt(64), query scalar 32, tied embeddings
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   **{**_DECODER, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                      "rope_theta": 1_000_000.0},
                   head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=10_000.0,
                   query_pre_attn_scalar=32, final_logit_softcapping=None, attn_logit_softcapping=None),
}
FAMILIES = tuple(_CONFIGS)


def _check_family(family: str) -> None:
    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; tiny presets exist for {list(FAMILIES)}")


def tiny_config(family: str = "llama", *, vocab_size: int | None = None, **overrides: tp.Any) -> dict[str, tp.Any]:
    """The Hugging Face config dict of the tiny ``family`` model (a fresh copy, free to edit).

    ``overrides`` replace keys of that dict (e.g. ``num_hidden_layers=1``); unknown keys raise.
    """
    _check_family(family)
    config = copy.deepcopy(_CONFIGS[family])
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"tiny_config({family!r}) has no key {unknown}; its keys are {sorted(config)}")
    config.update(overrides)
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int (e.g. tokenizer.vocab_size); got {vocab_size!r}")
        config["vocab_size"] = vocab_size
    return config


def tiny(family: str = "llama", *, seed: int = 0, vocab_size: int | None = None, attn_mechanism: str = "auto",
         dtype=jnp.float32, **overrides: tp.Any) -> CausalLM:
    """A randomly initialised tiny ``CausalLM`` of ``family`` (see ``tiny_config``).

    ``vocab_size`` overrides 264, e.g. ``CharTokenizer.from_text(text).vocab_size``.
    ``attn_mechanism`` is any registered attention name, or "auto" (``CausalLM`` picks one for
    the default backend). ``overrides`` go to :func:`tiny_config`.
    """
    from flax import nnx

    from workbench.core.models.causal_lm import CausalLM
    from workbench.core.models.config import ModelConfig

    config = ModelConfig.from_hf(tiny_config(family, vocab_size=vocab_size, **overrides))
    return CausalLM(config, rngs=nnx.Rngs(seed), attn_mechanism=attn_mechanism, dtype=dtype)
