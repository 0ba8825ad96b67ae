"""ONE decoder block for every family: norm, attention (GQA, bias / q-k norm / sliding-window
switches, rotary or none; or multi-head latent attention, ``mla.py``), norm, MLP (SwiGLU, GELU or a
mixture of experts), each with a residual.

Attention runs through ``OperationRegistry`` by name (BTHD layout), so swapping the
implementation is a string change. Kernels carry semantic axes (``ColumnWise`` for q/k/v and
gate/up, ``RowWise`` for o and down), which a ``PartitionAxis`` resolves into PartitionSpecs.
With a KV cache the cache object writes the new keys and values and runs attention over
what it holds (see ``cache.py``); the block does not know which kind of cache it has.
Nothing in a block depends on its layer index: per-layer differences (the sliding window) are
call arguments, so the model stacks one block's parameters and scans them (``stack.py``).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.core.axes import MODE_TRAIN, TP, DynamicShardingAxes, Replicated
from workbench.core.linear import ColumnParallelLinear, RowParallelLinear
from workbench.core.models.config import ModelConfig
from workbench.core.models.rope import apply_rope
from workbench.core.operations import OperationMetadata, OperationRegistry
from workbench.core.operations.attention.common import accumulation_dtype

Array = jax.Array

if tp.TYPE_CHECKING:
    from workbench.core.models.cache import LayerCache


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
        from workbench.core.axes import PartitionAxis

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
        if self.rotary:
            q_BTHD, k_BTKD = apply_rope(q_BTHD, cos_BTD, sin_BTD), apply_rope(k_BTKD, cos_BTD, sin_BTD)
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


def make_mlp(config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Module:
    if config.mlp_type != "moe":
        return MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    from workbench.core.models.moe import MoE

    c = config
    return MoE(c.hidden_size, c.expert_intermediate_size, c.num_local_experts, c.num_experts_per_tok,
               routing=c.moe_routing, router_bias=c.moe_router_bias, expert_bias=c.moe_expert_bias,
               activation=c.moe_activation, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit,
               norm_topk_prob=c.moe_norm_topk_prob, n_group=c.moe_n_group, topk_group=c.moe_topk_group,
               routed_scaling_factor=c.moe_routed_scaling,
               shared_intermediate_size=c.moe_shared_experts * c.expert_intermediate_size, dtype=dtype,
               param_dtype=param_dtype, rngs=rngs)


def make_attention(config: ModelConfig, *, attn_mechanism: str, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Module:
    """:class:`Attention`, or multi-head latent attention when ``config.kv_lora_rank`` is set (DeepSeek-V3)."""
    if not config.mla:
        return Attention(config, attn_mechanism=attn_mechanism, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    from workbench.core.models.mla import MLAttention

    return MLAttention(config, attn_mechanism=attn_mechanism, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class DecoderBlock(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with ``sandwich_norms``
    (Gemma) ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``. Norm names follow Hugging
    Face: ``post_attention_layernorm`` is the pre-MLP norm without sandwich norms, the norm of the
    attention output with them (then ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``).

    A model holds its blocks stacked (see :mod:`.stack`): one ``DecoderBlock`` whose parameters
    have a leading ``layers`` axis; indexing the stack gives a one-layer block like this one.
    """

    def __init__(self, config: ModelConfig, *, attn_mechanism: str = "vanilla", dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.input_layernorm = make_norm(config, param_dtype=param_dtype)
        self.self_attn = make_attention(config, attn_mechanism=attn_mechanism, dtype=dtype, param_dtype=param_dtype,
                                        rngs=rngs)
        self.post_attention_layernorm = make_norm(config, param_dtype=param_dtype)
        self.mlp = make_mlp(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, param_dtype=param_dtype)
            self.post_feedforward_layernorm = make_norm(config, param_dtype=param_dtype)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = nnx.data(None)
        self.moe = config.mlp_type == "moe"
        self.num_layers: int | None = None  # set on a stack of layers (stack.stack_blocks)

    def __len__(self) -> int:
        from workbench.core.models.stack import num_stacked

        return num_stacked(self)

    def __getitem__(self, index: int) -> DecoderBlock:
        """Layer ``index`` of a stack, as a one-layer block holding copies of its parameter slices."""
        from workbench.core.models.stack import layer_view

        return layer_view(self, index)

    def __iter__(self) -> tp.Iterator[DecoderBlock]:
        return (self[i] for i in range(len(self)))

    def __call__(self, x_BTD: Array, cos_BTD: Array | None, sin_BTD: Array | None, mask_B1TS: Array | None, *,
                 sliding_window: int | None = None, cache: LayerCache | None = None
                 ) -> tuple[Array, tp.Any, Array | None]:
        """New hidden states, the cache arrays after this layer, and router logits ``(B*T, E)`` for a MoE."""
        attn_BTD, kv = self.self_attn(self.input_layernorm(x_BTD), cos_BTD, sin_BTD, mask_B1TS,
                                      sliding_window=sliding_window, cache=cache)
        sandwich = self.pre_feedforward_layernorm is not None
        if sandwich:
            x_BTD = x_BTD + self.post_attention_layernorm(attn_BTD)
            h_BTD = self.pre_feedforward_layernorm(x_BTD)
        else:
            x_BTD = x_BTD + attn_BTD
            h_BTD = self.post_attention_layernorm(x_BTD)
        if self.moe:
            mlp_BTD, router_NE = self.mlp(h_BTD)
        else:
            mlp_BTD, router_NE = self.mlp(h_BTD), None
        if sandwich:
            mlp_BTD = self.post_feedforward_layernorm(mlp_BTD)
        return x_BTD + mlp_BTD, kv, router_NE
