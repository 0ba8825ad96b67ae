"""The pieces of the decoder block: norms, attention (GQA, bias / q-k norm / sliding-window switches,
rotary or none) and the dense MLP (SwiGLU or GELU); :mod:`.decoder` puts them together.

Attention runs through ``OperationRegistry`` by name (BTHD layout), so swapping the
implementation is a string change. Kernels carry semantic axes (``ColumnWise`` for q/k/v and
gate/up, ``RowWise`` for o and down), which a ``PartitionAxis`` resolves into PartitionSpecs.
With a KV cache the cache object writes the new keys and values and runs attention over
what it holds (see ``cache.py``); the block does not know which kind of cache it has.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.core.axes import (
    BATCH,
    EMPTY,
    MODE_TRAIN,
    QUERY_LENGTH,
    TP,
    DynamicShardingAxes,
    PartitionAxis,
    Replicated,
)
from workbench.core.linear import ColumnParallelLinear, RowParallelLinear
from workbench.core.models.config import ModelConfig
from workbench.core.models.rope import apply_rope
from workbench.core.models.stack import LayerCache
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import accumulation_dtype

Array = jax.Array
# Hidden states between blocks: batch over the data axes, sequence over sp (not in decode: mode from dim 1),
# features whole (tensor-parallel layers all-reduce back to replicated features, Megatron style).
ACTIVATION_AXES = DynamicShardingAxes((BATCH, QUERY_LENGTH, EMPTY), 1)


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)`` over the last axis, normalised in float32 as Hugging Face does (float64 for a
    float64 ``x``); keeps x's dtype. ``unit_offset`` (Gemma): ``(1 + weight)`` times the normalised x, the
    product taken in float32 before the cast (Llama casts first), weight initialised to 0."""

    def __init__(self, dim: int, *, eps: float = 1e-6, unit_offset: bool = False, param_dtype=jnp.float32):
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype), semantic_axes=Replicated)
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(accumulation_dtype(x.dtype))
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight[...].astype(x32.dtype))).astype(x.dtype)
        return (self.weight[...] * x32.astype(x.dtype)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``weight * (x - mean) / std + bias`` in float32, or float64 for a float64 ``x`` (GPT-2); keeps x's dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), semantic_axes=Replicated)
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), semantic_axes=Replicated)
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(accumulation_dtype(x.dtype))
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]
        return y.astype(x.dtype)


def make_norm(config: ModelConfig, dim: int | None = None, *, param_dtype=jnp.float32) -> RMSNorm | LayerNorm:
    if config.norm_type == "layer":
        return LayerNorm(dim or config.hidden_size, eps=config.norm_eps, param_dtype=param_dtype)
    return RMSNorm(dim or config.hidden_size, eps=config.norm_eps, unit_offset=config.norm_unit_offset,
                   param_dtype=param_dtype)


class AttentionContext:
    """What an attention module passes to its operation besides the arrays: the mesh and PartitionAxis the
    model is laid on (``with_mesh`` sets them; sequence-parallel implementations need the mesh) and the
    options given to ``with_attention(name, **options)``. Kept as hashable statics, built per call."""

    mesh: tp.Any = None
    partition_axis: tp.Any = None
    attn_options: tuple[tuple[str, tp.Any], ...] = ()

    def operation_metadata(self) -> OperationMetadata:
        pa = self.partition_axis or PartitionAxis()
        return OperationMetadata(mesh=self.mesh, partition_axis=pa, sequence_axis_name=pa.sequence_parallel_axis,
                                 options=dict(self.attn_options))


def _linear(kind, in_f: int, out_f: int, bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
    return kind(in_f, out_f, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class Attention(AttentionContext, nnx.Module):
    """Multi-head attention with grouped key/value heads and (optionally) rotary positions.

    The block is the same for every layer; what differs per layer (the sliding window) comes as
    a call argument, so one block's parameters can be stacked and scanned over the layers.
    """

    def __init__(self, config: ModelConfig, *, attn_mechanism: str = "vanilla", dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = _linear(ColumnParallelLinear, c.hidden_size, h * d, c.attention_bias, dtype, param_dtype, rngs)
        self.k_proj = _linear(ColumnParallelLinear, c.hidden_size, kv * d, c.attention_bias, dtype, param_dtype, rngs)
        self.v_proj = _linear(ColumnParallelLinear, c.hidden_size, kv * d, c.attention_bias, dtype, param_dtype, rngs)
        self.o_proj = _linear(RowParallelLinear, h * d, c.hidden_size, c.attention_out_bias, dtype, param_dtype, rngs)
        if c.qk_norm:
            self.q_norm = make_norm(c, d, param_dtype=param_dtype)
            self.k_norm = make_norm(c, d, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = nnx.data(None)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.rotary = c.position_embedding == "rope"
        # GPT-OSS: a learned logit per query head that joins each row's softmax (heads split over tp)
        self.sinks = (nnx.Param(jnp.zeros((h,), param_dtype), semantic_axes=DynamicShardingAxes((TP,), MODE_TRAIN))
                      if c.attention_sinks else nnx.data(None))
        # passed to the attention operation: None keeps its defaults (1/sqrt(head_dim), no cap)
        self.softmax_scale = None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5
        self.logits_soft_cap = c.attn_logit_softcapping
        OperationRegistry.get(attn_mechanism)  # fail now, naming the registered ones
        self.attn_mechanism = attn_mechanism

    def __call__(self, x_BTD: Array, cos_BTD: Array | None, sin_BTD: Array | None, mask_B1TS: Array | None, *,
                 sliding_window: int | None = None, cache: LayerCache | None = None) -> tuple[Array, tp.Any]:
        """Output ``(B, T, D)`` and the cache arrays after this layer's write (None without a cache)."""
        b, t, _ = x_BTD.shape
        q_BTHD = self.q_proj(x_BTD).reshape(b, t, self.num_heads, self.head_dim)
        k_BTKD = self.k_proj(x_BTD).reshape(b, t, self.num_kv_heads, self.head_dim)
        v_BTKD = self.v_proj(x_BTD).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        if self.rotary:  # a step that re-positions keys (StreamingKVCache's: rotates_keys) takes them un-rotated
            q_BTHD = apply_rope(q_BTHD, cos_BTD, sin_BTD)
            if cache is None or not getattr(cache.step, "rotates_keys", False):
                k_BTKD = apply_rope(k_BTKD, cos_BTD, sin_BTD)
        options = self.op_options()
        if cache is None:
            op = OperationRegistry.create(self.attn_mechanism, self.operation_metadata())
            out = op(q_BTHD, k_BTKD, v_BTKD, mask=mask_B1TS, causal=True, sliding_window=sliding_window, **options)
            out_BTHD, kv = out.attention_outputs, None
        else:
            out_BTHD, kv = cache.step.attend(cache.kv, cache.layer, q_BTHD, k_BTKD, v_BTKD,
                                             attn_mechanism=self.attn_mechanism, sliding_window=sliding_window,
                                             **options)
        return self.o_proj(out_BTHD.reshape(b, t, self.num_heads * self.head_dim)), kv


    def op_options(self) -> dict[str, tp.Any]:
        """The family's extra arguments to the attention operation (only those it sets)."""
        options = {"softmax_scale": self.softmax_scale, "logits_soft_cap": self.logits_soft_cap,
                   "sinks": None if self.sinks is None else self.sinks[...]}
        return {k: v for k, v in options.items() if v is not None}


class MLP(nnx.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` (GeGLU with ``hidden_act="gelu_pytorch_tanh"``), or with
    ``mlp_type="gelu"`` ``down(gelu(up(x)))`` (GPT-2)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.mlp_type == "swiglu"
        self.gate_proj = (_linear(ColumnParallelLinear, d, f, bias, dtype, param_dtype, rngs) if self.gated
                          else nnx.data(None))
        self.up_proj = _linear(ColumnParallelLinear, d, f, bias, dtype, param_dtype, rngs)
        self.down_proj = _linear(RowParallelLinear, f, d, bias, dtype, param_dtype, rngs)
        self.exact_gelu = config.hidden_act == "gelu"
        self.gate_act = config.hidden_act if self.gated else None

    def __call__(self, x_BTD: Array) -> Array:
        if self.gated:
            gate = self.gate_proj(x_BTD)
            gate = jax.nn.silu(gate) if self.gate_act == "silu" else jax.nn.gelu(gate, approximate=True)
            return self.down_proj(gate * self.up_proj(x_BTD))
        return self.down_proj(jax.nn.gelu(self.up_proj(x_BTD), approximate=not self.exact_gelu))
