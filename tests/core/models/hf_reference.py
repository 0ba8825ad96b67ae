"""Tiny random-weight Hugging Face models (the reference) for every family, and a left-padded batch."""

import numpy as np
import pytest

from workbench.core.models import ModelConfig, from_hf_state_dict

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
DEEPSEEK = dict(**{**TINY, "num_key_value_heads": 4, "rms_norm_eps": 1e-5}, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, first_k_dense_replace=1, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
                routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                                 "mscale_all_dim": 0.8, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                 "beta_slow": 1.0})
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3_ROPE),
    "mistral": lambda: transformers.MistralConfig(**TINY, head_dim=16, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    # switches beyond each family's default: o_proj bias + tied head; sliding window on layer 1 only
    "llama-bias-tied": lambda: transformers.LlamaConfig(**TINY, attention_bias=True, tie_word_embeddings=True),
    "qwen2-sliding-layers": lambda: transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=3,
                                                             max_window_layers=1),
    # local (window 4, rope base 1e4) and global (linear-scaled rope base 1e6) layers; query scalar != head_dim
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, num_hidden_layers=3, head_dim=16,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # a leading dense layer (mlp_only_layers), then experts of their own width; renormalised top-k
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, num_hidden_layers=3, head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True),
    # transformers' default: the top-k probabilities are not renormalised
    "qwen3_moe-unnormalised": lambda: transformers.Qwen3MoeConfig(
        **{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, num_hidden_layers=2, head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    # sinks, biased attention, alternating window-4 / full layers, YaRN, top-k-then-softmax MoE with biased,
    # clamped-SwiGLU experts (limit 0.1: gate and up values reach ~0.5 here, so the clamps act)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, num_hidden_layers=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.1),
    # multi-head latent attention (q LoRA, interleaved rope channels, value dim != nope dim, YaRN with
    # mscale / mscale_all_dim), a leading dense layer, then 8 sigmoid-routed experts in 4 groups (2 kept, 2 per
    # token) plus a shared one; rms_norm_eps != 1e-6 (the latent norms keep transformers' default eps)
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK),
    # a plain q_proj, rope channels in halves, biased q_a/kv_a/o projections, default rope, tied embeddings
    "deepseek_v3-no-q-lora": lambda: transformers.DeepseekV3Config(
        **{**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False, "attention_bias": True,
           "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}
MAIN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "gemma3", "qwen3_moe", "gpt_oss",
                 "deepseek_v3")
B, T, PAD = 2, 12, 4


def hf_model(family, *, cls=None, seed=0, **config_changes):
    """A float32 eval-mode HF model with random weights, norms and biases (so a wrong mapping shows)."""
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    if "num_hidden_layers" in config_changes and getattr(config, "layer_types", None) is not None:
        # per-layer lists follow the depth: rebuild so the config derives them for the new depth
        d = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        config = type(config)(**{**d, "num_hidden_layers": config_changes["num_hidden_layers"]})
    for key, value in config_changes.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    model = (cls or transformers.AutoModelForCausalLM).from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith((".bias", "_bias", ".sinks")):
                p.copy_(0.1 * torch.randn_like(p) if not name.endswith(".sinks") else torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias (a buffer): picks experts
                buf.copy_(0.1 * torch.randn_like(buf))
    return model


def state_dict(model):
    return {k: v.numpy() for k, v in model.state_dict().items()}


def pair(family):
    """The tiny HF ``family`` model and ours with its weights."""
    hf = hf_model(family)
    return hf, from_hf_state_dict(ModelConfig.from_hf(hf.config.to_dict()), state_dict(hf))


def hf_generate(hf, ids, mask, config):
    """HF ``generate`` greedy with the fields ``config`` (a workbench ``GenerationConfig``) sets; both sides fill
    the rest from the model's generation config, then defaults."""
    with torch.no_grad():
        return hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), **{"do_sample": False,
                                                                                   **config.to_hf()}).numpy()


def batch(b=B, t=T, pad=PAD, seed=0):
    """Random ids and a left-padded mask (row 1 has ``pad`` padding tokens)."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, (b, t))
    mask = np.ones((b, t), np.int64)
    mask[1, :pad] = 0
    return ids, mask


def hf_positions(mask):
    return np.maximum(np.cumsum(mask, -1) - 1, 0)  # what HF generate() passes for left padding


def hf_forward(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(hf_positions(mask)), **kwargs)
