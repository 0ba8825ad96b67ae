"""An independent NumPy float64 forward of the Llama family as Hugging Face transformers defines it.

Everything is float64, including the three places where transformers' own float64 forward drops
to float32 (RMSNorm, the rotary cos/sin and inv_freq, the attention softmax), so this is the
reference float32 forwards are measured against (``benchmarks/numerics.py``). It reads a
checkpoint directory (``config.json`` + ``*.safetensors`` with transformers' parameter names)
and shares no code with workbench.

Covered: token embedding, RMSNorm, default rotary (``rotate_half``), grouped-query causal
attention with an optional left-padding ``attention_mask (B, T)`` (positions ``cumsum(mask) - 1``,
padded keys hidden; padded queries get meaningless logits), q/k/v/o and MLP biases when the
checkpoint has them, SwiGLU MLP, final norm, tied or untied head.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open


def load(path: str | pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config, weights)`` of a checkpoint directory, every weight as float64."""
    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            weights.update({name: f.get_tensor(name).astype(np.float64) for name in f.keys()})
    return config, weights


def rms_norm(x_BTD: np.ndarray, weight_D: np.ndarray, eps: float) -> np.ndarray:
    return weight_D * x_BTD / np.sqrt(np.mean(x_BTD * x_BTD, axis=-1, keepdims=True) + eps)


def linear(x: np.ndarray, weights: dict, name: str) -> np.ndarray:
    """``x @ W.T + b`` with transformers' ``(out, in)`` weight; the bias only when the checkpoint has one."""
    y = x @ weights[f"{name}.weight"].T
    return y + weights[f"{name}.bias"] if f"{name}.bias" in weights else y


def rotate_half(x: np.ndarray) -> np.ndarray:
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def rotary(positions_BT: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` ``(B, T, head_dim)``, inverse frequencies and angles in float64."""
    inv_freq_K = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles_BTK = positions_BT[..., None].astype(np.float64) * inv_freq_K
    angles_BTD = np.concatenate([angles_BTK, angles_BTK], axis=-1)
    return np.cos(angles_BTD), np.sin(angles_BTD)


def attention(x_BTD, weights, prefix, config, cos_BTD, sin_BTD, visible_BTS) -> np.ndarray:
    b, t, _ = x_BTD.shape
    h, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // h
    q_BTHD = linear(x_BTD, weights, f"{prefix}.q_proj").reshape(b, t, h, d)
    k_BTKD = linear(x_BTD, weights, f"{prefix}.k_proj").reshape(b, t, kv, d)
    v_BTKD = linear(x_BTD, weights, f"{prefix}.v_proj").reshape(b, t, kv, d)
    cos_BT1D, sin_BT1D = cos_BTD[:, :, None], sin_BTD[:, :, None]
    q_BTHD = q_BTHD * cos_BT1D + rotate_half(q_BTHD) * sin_BT1D
    k_BTKD = k_BTKD * cos_BT1D + rotate_half(k_BTKD) * sin_BT1D
    # query head i reads key/value head i // (h // kv), as transformers' repeat_kv
    q_BHTD = q_BTHD.transpose(0, 2, 1, 3)
    k_BHSD = np.repeat(k_BTKD, h // kv, axis=2).transpose(0, 2, 1, 3)
    v_BHSD = np.repeat(v_BTKD, h // kv, axis=2).transpose(0, 2, 1, 3)
    scores_BHTS = (q_BHTD @ k_BHSD.transpose(0, 1, 3, 2)) * d**-0.5
    scores_BHTS = np.where(visible_BTS[:, None], scores_BHTS, -np.inf)
    max_BHT1 = np.max(scores_BHTS, axis=-1, keepdims=True)
    p_BHTS = np.exp(scores_BHTS - np.where(np.isfinite(max_BHT1), max_BHT1, 0.0))
    weights_BHTS = p_BHTS / np.maximum(np.sum(p_BHTS, axis=-1, keepdims=True), np.finfo(np.float64).tiny)
    out_BTHD = (weights_BHTS @ v_BHSD).transpose(0, 2, 1, 3)
    return linear(out_BTHD.reshape(b, t, h * d), weights, f"{prefix}.o_proj")


def mlp(x_BTD: np.ndarray, weights: dict, prefix: str) -> np.ndarray:
    gate_BTF = linear(x_BTD, weights, f"{prefix}.gate_proj")
    silu_BTF = gate_BTF / (1.0 + np.exp(-gate_BTF))
    return linear(silu_BTF * linear(x_BTD, weights, f"{prefix}.up_proj"), weights, f"{prefix}.down_proj")


def forward(config: dict, weights: dict[str, np.ndarray], input_ids_BT: np.ndarray,
            attention_mask_BT: np.ndarray | None = None) -> np.ndarray:
    """Float64 logits ``(B, T, V)`` of a Llama-family model (``config``, ``weights`` from :func:`load`)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError(f"numpy_reference covers default rotary only; got {rope}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    h = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // h
    eps = config["rms_norm_eps"]
    b, t = input_ids_BT.shape
    keep_BT = np.ones((b, t), bool) if attention_mask_BT is None else np.asarray(attention_mask_BT).astype(bool)
    positions_BT = np.maximum(np.cumsum(keep_BT, axis=-1) - 1, 0)
    cos_BTD, sin_BTD = rotary(positions_BT, head_dim, theta)
    visible_BTS = np.tril(np.ones((t, t), bool))[None] & keep_BT[:, None, :]
    x_BTD = weights["model.embed_tokens.weight"][np.asarray(input_ids_BT)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x_BTD = x_BTD + attention(rms_norm(x_BTD, weights[f"{p}.input_layernorm.weight"], eps), weights,
                                  f"{p}.self_attn", config, cos_BTD, sin_BTD, visible_BTS)
        x_BTD = x_BTD + mlp(rms_norm(x_BTD, weights[f"{p}.post_attention_layernorm.weight"], eps), weights,
                            f"{p}.mlp")
    x_BTD = rms_norm(x_BTD, weights["model.norm.weight"], eps)
    tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in weights
    return x_BTD @ weights["model.embed_tokens.weight" if tied else "lm_head.weight"].T
