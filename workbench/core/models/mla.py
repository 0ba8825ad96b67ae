"""Multi-head latent attention (DeepSeek-V2/V3), computed in its absorbed form: an MQA over latents.

Per token, ``kv_a_proj_with_mqa`` gives a latent ``c`` (``kv_lora_rank = C``, normed by ``kv_a_layernorm``)
and one rope key ``k_pe`` (``qk_rope_head_dim = R``) shared by all heads; ``kv_b_proj`` would expand ``c``
into per-head keys ``k_nope_h = c @ W_uk_h`` (``qk_nope_head_dim = N``) and values ``v_h = c @ W_uv_h``
(``v_head_dim = V``). Queries come from ``q_proj``, or the low-rank ``q_a_proj -> q_a_layernorm -> q_b_proj``.

Absorbed form: ``q_nope_h . k_nope_h = (q_nope_h @ W_uk_h^T) . c``, so each head's query becomes
``[q_nope_h @ W_uk_h^T ; q_pe_h]`` (``C + R``), every head reads ONE key ``[c ; k_pe]`` and ONE value ``c``
(``C``), and ``W_uv_h`` is applied after attention: ``out_h = attn_h @ W_uv_h``. That is plain GQA with one
key/value head and a value head dim of its own, so the registry's implementations that claim
``value_head_dim`` (vanilla, flash, paged) run MLA unchanged, and a KV cache holds ``C + R`` numbers per
token and layer (values are the keys' first ``C`` channels) instead of ``H * (N + R + V)``. The softmax scale
stays that of the expanded form, ``(N + R) ** -0.5`` (times YaRN's ``mscale(factor, mscale_all_dim) ** 2``).
The price: the logits contract over ``C + R`` instead of ``N + R`` per head, which prefill pays and decode
(reading the cache) gains from.
"""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from workbench.core.axes import EMPTY, FSDP, MODE_TRAIN, SP, DynamicShardingAxes, Replicated
from workbench.core.linear import ColumnParallelLinear, RowParallelLinear
from workbench.core.models.block import AttentionContext, RMSNorm
from workbench.core.models.config import ModelConfig, YarnRopeScaling
from workbench.core.models.rope import apply_rope
from workbench.core.models.stack import LayerCache
from workbench.core.operations import OperationRegistry

Array = jax.Array


# The down projections to a latent (D -> q_lora_rank, D -> C + R): D over the data axes, the latent whole,
# since an RMSNorm over it follows (a tp split would all-gather it back at once).
LatentDown = DynamicShardingAxes(((FSDP, SP), EMPTY), MODE_TRAIN)
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


def mla_softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` with YaRN's ``mscale_all_dim`` (DeepSeek-V3)."""
    scale = config.qk_head_dim ** -0.5
    s = config.rope_scaling
    if isinstance(s, YarnRopeScaling) and s.mscale_all_dim and s.factor > 1:
        mscale = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
        scale *= mscale * mscale
    return scale


def _latent_down(in_f: int, out_f: int, bias: bool, dtype, param_dtype, rngs: nnx.Rngs) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(in_f, out_f, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    layer.kernel.set_metadata(semantic_axes=LatentDown)
    if bias:
        layer.bias.set_metadata(semantic_axes=Replicated)
    return layer


class MLAttention(AttentionContext, nnx.Module):
    """Multi-head latent attention with the call of :class:`~workbench.core.models.block.Attention`.

    Parameter names are transformers' (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``); rope channels in the standard
    halves layout (an interleaved checkpoint is permuted at load, see ``hf_convert``).
    """

    def __init__(self, config: ModelConfig, *, attn_mechanism: str = "vanilla", dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        h, n, r, v, lat = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        linear = lambda kind, i, o, bias: kind(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if c.q_lora_rank is None:
            self.q_proj = linear(ColumnParallelLinear, c.hidden_size, h * (n + r), False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = nnx.data(None)
        else:
            self.q_proj = nnx.data(None)
            self.q_a_proj = _latent_down(c.hidden_size, c.q_lora_rank, c.attention_bias, dtype, param_dtype, rngs)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=LATENT_NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = linear(ColumnParallelLinear, c.q_lora_rank, h * (n + r), False)
        self.kv_a_proj_with_mqa = _latent_down(c.hidden_size, lat + r, c.attention_bias, dtype, param_dtype, rngs)
        self.kv_a_layernorm = RMSNorm(lat, eps=LATENT_NORM_EPS, param_dtype=param_dtype)
        # used through its kernel only: split per head into W_uk (C, H, N) and W_uv (C, H, V)
        self.kv_b_proj = linear(ColumnParallelLinear, lat, h * (n + v), False)
        self.o_proj = linear(RowParallelLinear, h * v, c.hidden_size, c.attention_out_bias)
        self.num_heads, self.nope_dim, self.rope_dim, self.v_head_dim, self.latent_dim = h, n, r, v, lat
        self.softmax_scale = mla_softmax_scale(c)
        self.dtype = dtype
        OperationRegistry.get(attn_mechanism)  # fail now, naming the registered ones
        self.attn_mechanism = attn_mechanism

    def queries(self, x_BTD: Array) -> Array:
        """``(B, T, H, N + R)`` queries, nope channels first."""
        if self.q_proj is not None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        return q.reshape(*x_BTD.shape[:2], self.num_heads, self.nope_dim + self.rope_dim)

    def up_projections(self) -> tuple[Array, Array]:
        """``W_uk (C, H, N)`` and ``W_uv (C, H, V)``: ``kv_b_proj``'s kernel split per head. A wrapped layer
        (a LoRA adapter, int8 weights) has no plain kernel: its effective one is the layer applied to the
        identity, one ``(C, C) x (C, H*(N+V))`` matmul per call."""
        layer = self.kv_b_proj
        if type(layer) is ColumnParallelLinear:
            (w,) = dtypes.promote_dtype((layer.kernel[...],), dtype=self.dtype)
        else:
            w = layer(jnp.eye(self.latent_dim, dtype=self.dtype))
        w_CHX = w.reshape(self.latent_dim, self.num_heads, self.nope_dim + self.v_head_dim)
        return w_CHX[..., :self.nope_dim], w_CHX[..., self.nope_dim:]

    def __call__(self, x_BTD: Array, cos_BTD: Array | None, sin_BTD: Array | None, mask_B1TS: Array | None, *,
                 sliding_window: int | None = None, cache: LayerCache | None = None) -> tuple[Array, tp.Any]:
        """Output ``(B, T, D)`` and the cache arrays after this layer's write (None without a cache)."""
        b, t, _ = x_BTD.shape
        lat = self.latent_dim
        q_BTHX = self.queries(x_BTD)
        q_nope_BTHN, q_pe_BTHR = q_BTHX[..., :self.nope_dim], q_BTHX[..., self.nope_dim:]
        ckv_BTX = self.kv_a_proj_with_mqa(x_BTD)
        c_BT1C = self.kv_a_layernorm(ckv_BTX[..., :lat])[:, :, None]
        k_pe_BT1R = ckv_BTX[:, :, None, lat:]
        q_pe_BTHR, k_pe_BT1R = apply_rope(q_pe_BTHR, cos_BTD, sin_BTD), apply_rope(k_pe_BT1R, cos_BTD, sin_BTD)
        w_uk_CHN, w_uv_CHV = self.up_projections()
        q_lat_BTHC = jnp.einsum("bthn,chn->bthc", q_nope_BTHN, w_uk_CHN)
        query_BTHK = jnp.concatenate([q_lat_BTHC, q_pe_BTHR.astype(q_lat_BTHC.dtype)], axis=-1)  # K = C + R
        key_BT1K = jnp.concatenate([c_BT1C, k_pe_BT1R.astype(c_BT1C.dtype)], axis=-1)
        options = self.op_options()
        if cache is None:
            op = OperationRegistry.create(self.attn_mechanism, self.operation_metadata())
            out = op(query_BTHK, key_BT1K, c_BT1C, mask=mask_B1TS, causal=True, sliding_window=sliding_window,
                     **options)
            out_BTHC, kv = out.attention_outputs, None
        else:  # the cache stores [c ; k_pe] once per token; its values are the first C channels
            out_BTHC, kv = cache.step.attend(cache.kv, cache.layer, query_BTHK, key_BT1K, None,
                                             attn_mechanism=self.attn_mechanism, sliding_window=sliding_window,
                                             **options)
        out_BTHV = jnp.einsum("bthc,chv->bthv", out_BTHC, w_uv_CHV.astype(out_BTHC.dtype))
        return self.o_proj(out_BTHV.reshape(b, t, self.num_heads * self.v_head_dim)), kv

    def op_options(self) -> dict[str, tp.Any]:
        """The extra arguments to the attention operation: the expanded form's softmax scale."""
        return {"softmax_scale": self.softmax_scale}
