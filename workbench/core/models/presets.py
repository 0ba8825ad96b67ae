"""Tiny configs of every family, for tests, tutorials and CPU training runs; full-size configs to explore
abstractly.

``tiny_config(family)`` is a Hugging Face ``config.json`` dict, so one dict builds both sides
of a comparison: ``CausalLM`` through ``ModelConfig.from_hf`` and the transformers reference
through ``transformers.AutoConfig.for_model(**d)``. Sizes: hidden 64, 2 layers, 4 heads
(2 key/value heads), MLP 128, vocab 264 = the 259 ids of :class:`ByteTokenizer` rounded up to
a multiple of 8 so the vocab shards evenly over tp.

>>> tiny_config("qwen3")["head_dim"]
32

``full_config(name)`` is a published model's ``config.json`` typed in (nothing downloaded), for
``CausalLM.lazy_init`` and the explorer: shapes, shardings and memory without allocating a byte. ``FULL_SIZE`` names
them (Llama 2, 3, 3.1 and 3.2, Qwen3 dense and MoE, Mixtral, DeepSeek-V3); a MaxText or torchtitan recipe's model
name maps to one through ``workbench.core.interop.model_names.preset_name``.
"""

from __future__ import annotations

import copy
import typing as tp

import jax.numpy as jnp

from workbench.core.checks import positive_int
from workbench.core.models.config import ModelConfig
from workbench.core.models.tokenizer import ByteTokenizer

if tp.TYPE_CHECKING:  # not at run time: the configs and FAMILIES load without flax, which CausalLM needs
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
    # DeepSeek-V3: multi-head latent attention (q LoRA 32, latent 32, nope 16 + rope 8, values 16, interleaved
    # rope channels as in the checkpoints), a leading dense layer (MLP 128), then 8 sigmoid-routed experts of
    # width 32 in 4 groups (2 groups kept, 2 experts per token) plus a shared one; YaRN x4 over 64 positions.
    # 4 key/value heads = 4 heads, as transformers' DeepSeek-V3 needs (its cache holds the latent anyway)
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                        **{**_DECODER, "num_key_value_heads": 4, "num_hidden_layers": 3}, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 32.0, "beta_slow": 1.0}),
}
FAMILIES = tuple(_CONFIGS)

# Published config.json values, typed in (nothing downloaded). DeepSeek-V3 (671B, 37B active): 61 layers of
# which 3 dense, MLA with q LoRA, 256 routed experts (8 per token, 8 groups of which 4 kept) + 1 shared,
# YaRN x40 over 4096 positions. Its released weights are FP8 (block-quantized); the config describes bf16.
_FULL_CONFIGS: dict[str, dict[str, tp.Any]] = {
    # meta-llama/Meta-Llama-3-70B config.json (Llama 3.1 adds its llama3 rope scaling and 131072 positions,
    # typed here as issue 16 gives them): GQA 64 heads / 8 key-value heads, untied embeddings.
    "llama-3-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    # meta-llama/Meta-Llama-3-8B config.json.
    "llama-3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    # meta-llama/Llama-3.2-1B config.json: 64-wide heads, tied embeddings.
    "llama-3.2-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    "deepseek-v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        attention_bias=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=1,
        scoring_func="sigmoid", topk_method="noaux_tc", torch_dtype="bfloat16"),
    # The configs below are the released config.json files as published, less the keys that only matter to
    # training in PyTorch (initializer_range, use_cache, pretraining_tp, attention_dropout, output_router_logits,
    # router_aux_loss_coef, transformers_version). The publishers' own files were not readable here (Meta's and
    # Mistral's repositories on the Hub are gated), so each was read from copies that name it as their source, and
    # every shape was checked against a second source: the framework configs the published runs use
    # (AI-Hypercomputer/maxtext src/maxtext/configs/models/<name>.yml at e591f30c, pytorch/torchtitan
    # torchtitan/models/<name>/__init__.py; tests/core/interop/test_model_names.py holds them).
    #
    # meta-llama/Llama-3.1-8B config.json (base model: eos 128001; the Instruct model lists 128001, 128008,
    # 128009), as copied in mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py "llama3_1_8b" and in
    # huggingface.co/NbAiLab/nb-llama-3.1-8B (its _name_or_path meta-llama/Llama-3.1-8B). Shapes: Meta's
    # meta-llama/llama-models models/llama3_1/api/sku_list.py (dim 4096, 32 layers, 32/8 heads, ffn multiplier 1.3
    # of multiple 1024 = 14336, norm_eps 1e-5, rope_theta 5e5, scaled rope) and maxtext llama3.1-8b.yml.
    "llama-3.1-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    # meta-llama/Llama-3.1-70B config.json, as copied in mlc-llm model_preset.py "llama3_1_70b" (the Instruct
    # file: its eos list replaced by the base model's 128001) and huggingface.co/radi-cho/Meta-Llama-3.1-70B-FLUTE
    # (from Meta-Llama-3.1-70B). Shapes: llama-models sku_list.py (dim 8192, 80 layers, 64/8 heads, multiplier
    # 1.3 of multiple 4096 = 28672) and maxtext llama3.1-70b.yml.
    "llama-3.1-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    # meta-llama/Llama-3.1-405B config.json, as copied in huggingface.co/migtissera/Meta-Llama-3.1-405B (base: eos
    # 128001) and huggingface.co/relaxml/Llama-3.1-405B-Instruct-QTIP-4Bit-TP8 (from Meta-Llama-3.1-405B-Instruct).
    # Key-value heads 8: copies of the first upload (transformers 4.42-4.44) say 16; later ones, Meta's own
    # llama-models sku_list.py (dim 16384, 126 layers, 128/8 heads, multiplier 1.2 of multiple 4096 = 53248),
    # maxtext llama3.1-405b.yml, torchtitan's llama3 "405B" and the Hub's parameter count (405.85B) say 8.
    "llama-3.1-405b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=16384,
        intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001,
        torch_dtype="bfloat16"),
    # meta-llama/Llama-2-70b-hf config.json (no rope_theta key: transformers' 10000), as copied in
    # huggingface.co/NousResearch/Nous-Puffin-70B (its _name_or_path meta-llama/Llama-2-70b-hf) and in mlc-llm
    # model_preset.py "llama2_70b"; shapes as maxtext llama2-70b.yml.
    "llama-2-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5, rope_scaling=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float16"),
    # Qwen/Qwen3-8B config.json, as copied verbatim in alibaba/InferSim hf_configs/qwen3-8B_config.json and
    # huggingface.co/thejaminator/qwen-hook-layer-9 ("Copy config.json from Qwen/Qwen3-8B"); shapes as maxtext
    # qwen3-8b.yml. q/k RMSNorm (the family), head_dim 128 != 4096 / 32.
    "qwen3-8b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=40960, max_window_layers=36, rms_norm_eps=1e-6,
        rope_theta=1000000, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
        torch_dtype="bfloat16"),
    # Qwen/Qwen3-32B config.json, as uploaded in huggingface.co/ronnywebdevs1/d-m-1 and typed in maxtext
    # src/MaxText/utils/ckpt_conversion/utils/hf_model_configs.py qwen3_32b_config; shapes as maxtext qwen3-32b.yml.
    "qwen3-32b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=5120,
        intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        hidden_act="silu", max_position_embeddings=40960, max_window_layers=64, rms_norm_eps=1e-6,
        rope_theta=1000000, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=151643, eos_token_id=151645,
        torch_dtype="bfloat16"),
    # Qwen/Qwen3-30B-A3B config.json, as copied verbatim in alibaba/InferSim hf_configs/qwen3-30B-A3B_config.json:
    # 48 layers, every one sparse (mlp_only_layers empty): 128 experts of width 768, 8 per token, renormalised.
    # Shapes as maxtext qwen3-30b-a3b.yml (whose rope_max_timescale 1e7 is the 2507 refresh's).
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        hidden_act="silu", max_position_embeddings=40960, max_window_layers=48, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    # Qwen3-235B-A22B: the config.json of its July 2025 refresh (Qwen/Qwen3-235B-A22B-Instruct-2507: 262,144
    # positions, rope_theta 5e6), as copied in alibaba/InferSim hf_configs/qwen3-235B-A22B_config.json and typed in
    # maxtext hf_model_configs.py qwen3_235b_a22b_thinking_2507_config; the April release has the same shapes
    # (its model card: 94 layers, 64/4 heads, 128 experts, 8 active) and maxtext qwen3-235b-a22b.yml these values.
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        hidden_act="silu", max_position_embeddings=262144, max_window_layers=94, rms_norm_eps=1e-6,
        rope_theta=5000000, rope_scaling=None, sliding_window=None, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=1536, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16"),
    # mistralai/Mixtral-8x7B-v0.1 config.json, as copied in mlc-llm model_preset.py "Mixtral-8x7B-v0.1" and
    # huggingface.co/ycros/DonutHole-8x7B (its _name_or_path mistralai/Mixtral-8x7B-v0.1); shapes as maxtext
    # mixtral-8x7b.yml. 8 experts of width 14336, 2 per token; no sliding window (null).
    "mixtral-8x7b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
    # mistralai/Mixtral-8x22B-Instruct-v0.1 config.json, as copied in huggingface.co/jsfs11/MixtralxWizardLM2-8x22B-
    # SLERP-v0.2 and sosoai/hansoldeco-Mixtral-8x22B-Instruct-v1 (both name it as _name_or_path). Its 32,768-token
    # vocabulary is maxtext mixtral-8x22b.yml's too (the published MaxText run); copies of the base model's first
    # community conversion (mistral-community/Mixtral-8x22B-v0.1) say 32000. Same shapes otherwise.
    "mixtral-8x22b": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32768, hidden_size=6144,
        intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
        hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"),
}
FULL_SIZE = tuple(_FULL_CONFIGS)


def full_config_dict(name: str) -> dict[str, tp.Any]:
    """The published ``config.json`` dict of the full-size model ``name`` (a fresh copy)."""
    if name not in _FULL_CONFIGS:
        raise ValueError(f"unknown full-size config {name!r}; known: {list(FULL_SIZE)}. For another model, "
                         f"ModelConfig.from_hf(its config.json as a dict)")
    return copy.deepcopy(_FULL_CONFIGS[name])


def full_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of the full-size model ``name``, e.g. for ``CausalLM.lazy_init(config)``."""
    return ModelConfig.from_hf(full_config_dict(name))


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
        config["vocab_size"] = positive_int("vocab_size", vocab_size, what="a positive int (e.g. tokenizer.vocab_size)")
    return config


def tiny(family: str = "llama", *, seed: int = 0, vocab_size: int | None = None, attn_mechanism: str = "auto",
         dtype=jnp.float32, **overrides: tp.Any) -> CausalLM:
    """A randomly initialised tiny ``CausalLM`` of ``family`` (see ``tiny_config``).

    ``vocab_size`` overrides 264, e.g. ``CharTokenizer.from_text(text).vocab_size``.
    ``attn_mechanism`` is any registered attention name, or "auto" (``CausalLM`` picks one for
    the default backend). ``overrides`` go to :func:`tiny_config`.
    """
    from flax import nnx  # here, not at the top: the configs and FAMILIES load without flax

    from workbench.core.models.causal_lm import CausalLM  # needs flax, as above

    config = ModelConfig.from_hf(tiny_config(family, vocab_size=vocab_size, **overrides))
    return CausalLM(config, rngs=nnx.Rngs(seed), attn_mechanism=attn_mechanism, dtype=dtype)
