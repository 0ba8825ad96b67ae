"""ONE decoder block for every family: norm, attention (:class:`.block.Attention`, or multi-head latent
attention, :mod:`.mla`), norm, MLP (:class:`.block.MLP` or a mixture of experts, :mod:`.moe`), each with a
residual.

Nothing in a block depends on its layer index: per-layer differences (the sliding window) are
call arguments, so the model stacks one block's parameters and scans them (:mod:`.stack`).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from workbench.core.models.block import MLP, Attention, make_norm
from workbench.core.models.config import ModelConfig
from workbench.core.models.mla import MLAttention
from workbench.core.models.moe import MoE
from workbench.core.models.stack import LayerCache, layer_view, num_stacked

Array = jax.Array


def make_mlp(config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs) -> nnx.Module:
    if config.mlp_type != "moe":
        return MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
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
        return num_stacked(self)

    def __getitem__(self, index: int) -> DecoderBlock:
        """Layer ``index`` of a stack, as a one-layer block holding copies of its parameter slices."""
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
