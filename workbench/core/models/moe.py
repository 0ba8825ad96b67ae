"""The Mixtral sparse mixture-of-experts layer, exact against Hugging Face ``MixtralSparseMoeBlock``.

A router ``x @ router_kernel`` scores every expert; softmax in float32 over all experts, keep the
top ``k``, renormalise them to sum to 1. Each expert is a SwiGLU MLP ``down(silu(gate(x)) * up(x))``
and a token's output is the weighted sum of its ``k`` experts' outputs. Router jitter (HF applies it
only in training) is not supported: ``router_jitter_noise`` must be 0.

Strategies, chosen by ``strategy`` (at construction, per call, or ``model.with_options(moe_strategy=...)``);
``"auto"`` (the default) is ``"alltoall"`` on a mesh with an ``ep`` axis of size > 1, else ``"dense"``:

- ``"dense"``: every expert runs on every token, combined with ``(N, E)`` routing weights that are 0
  off the top-k. ``E/k`` times the FLOPs, but plain einsums that GSPMD shards over ``ep``: the
  combine (a contraction over the expert axis) becomes an all-reduce over ``ep`` (with ``tp``, the
  down projection's contraction adds ``tp`` to it); FSDP-sharded weights are all-gathered over ``fsdp``.
- ``"ragged"``: token copies sorted by expert, ``jax.lax.ragged_dot`` over the expert groups, then
  unsorted and weighted. The sort is global, so GSPMD all-gathers tokens and routing over the batch
  axes; the ragged dots contract over the ep-sharded expert axis (and the fsdp-sharded ``D``), so
  all-reduces over ``ep`` (and ``fsdp``) follow. Neither strategy gathers experts over ``ep``.
  (On CPU XLA lowers ``ragged_dot`` to a masked dense dot; TPU/GPU have native kernels.)
- ``"alltoall"``: expert parallelism proper (:mod:`.moe_alltoall`): each device routes its own tokens,
  packs them per expert into ``capacity_factor``-sized buffers (None: never drop, then it equals
  ``dense``), and two ``all_to_all``s over ``ep`` carry them to the device holding their expert and
  back. It needs the model's mesh (``shard_model`` / ``with_mesh`` gives it); without one it runs the
  same dispatch on one device.

Parameter layouts (the contract the checkpoint converter maps onto): ``router_kernel (D, E)``,
``gate_proj (E, D, F)``, ``up_proj (E, D, F)``, ``down_proj (E, F, D)``. :mod:`.hf_moe` converts Hugging Face's
tensors to and from them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from workbench.core.axes import (
    EMPTY,
    EP,
    MODE_TRAIN,
    TP,
    ColumnWise,
    DynamicShardingAxes,
    ExpertColumnWise,
    ExpertRowWise,
    PartitionAxis,
    RowWise,
)
from workbench.core.models.block import ACTIVATION_AXES
from workbench.core.models.moe_alltoall import Dispatch, Experts, alltoall

__all__ = ["STRATEGIES", "MoE", "RouterReplicated"]

Array = jax.Array
STRATEGIES = ("auto", "dense", "ragged", "alltoall")
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")
ACTIVATIONS = ("silu", "clamped_swiglu")
DEFAULT_KERNEL_INIT = nnx.initializers.normal(0.02)  # HF Mixtral's initializer_range
# The router kernel is replicated: it is tiny (D*E), and sharding D over tp would need an all-reduce
# of the (N, E) logits before softmax and top-k; replicated, each device routes its own tokens.
RouterReplicated = DynamicShardingAxes((EMPTY, EMPTY), MODE_TRAIN)
PARAM_AXES = {"router_kernel": RouterReplicated, "gate_proj": ExpertColumnWise, "up_proj": ExpertColumnWise,
              "down_proj": ExpertRowWise, "router_bias": DynamicShardingAxes((EMPTY,), MODE_TRAIN),
              "gate_bias": DynamicShardingAxes((EP, TP), MODE_TRAIN),
              "up_bias": DynamicShardingAxes((EP, TP), MODE_TRAIN),
              "down_bias": DynamicShardingAxes((EP, EMPTY), MODE_TRAIN),
              "correction_bias": DynamicShardingAxes((EMPTY,), MODE_TRAIN),
              "shared_gate": ColumnWise, "shared_up": ColumnWise, "shared_down": RowWise}


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown MoE strategy {strategy!r}; use one of {STRATEGIES}")
    return strategy


class MoE(nnx.Module):
    """Mixtral's sparse MoE block: ``__call__(x_BTD) -> (y_BTD, router_logits_NE)`` with ``N = B*T``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, num_experts_per_tok: int, *,
                 strategy: str = "auto", router_jitter_noise: float = 0.0, routing: str = "softmax_topk",
                 router_bias: bool = False, expert_bias: bool = False, activation: str = "silu",
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, norm_topk_prob: bool = True,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 shared_intermediate_size: int = 0, capacity_factor: float | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, precision=None, kernel_init=DEFAULT_KERNEL_INIT,
                 rngs: nnx.Rngs):
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} must be between 1 and "
                             f"num_experts={num_experts}; lower it or add experts")
        if router_jitter_noise:
            raise ValueError(f"router_jitter_noise={router_jitter_noise}: router jitter (HF applies it only in "
                             f"training) is not supported; set router_jitter_noise=0.0")
        if routing not in ROUTINGS or activation not in ACTIVATIONS:
            raise ValueError(f"routing={routing!r} / activation={activation!r}: use one of {ROUTINGS} / {ACTIVATIONS}")
        D, F, E = hidden_size, intermediate_size, num_experts
        shapes = {"router_kernel": (D, E), "gate_proj": (E, D, F), "up_proj": (E, D, F), "down_proj": (E, F, D)}
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(kernel_init(rngs.params(), shape, param_dtype),
                                          semantic_axes=PARAM_AXES[name]))
        biases = {"router_bias": (E,)} if router_bias else {}
        biases |= {"gate_bias": (E, F), "up_bias": (E, F), "down_bias": (E, D)} if expert_bias else {}
        for name in ("router_bias", "gate_bias", "up_bias", "down_bias"):
            setattr(self, name, nnx.Param(jnp.zeros(biases[name], param_dtype), semantic_axes=PARAM_AXES[name])
                    if name in biases else nnx.data(None))
        self.routing, self.activation = routing, activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        if routing == "sigmoid_grouped" and (E % n_group or not 1 <= topk_group <= n_group
                                             or num_experts_per_tok > topk_group * (E // n_group)):
            raise ValueError(f"grouped routing: {E} experts must split into n_group={n_group} equal groups, "
                             f"1 <= topk_group={topk_group} <= n_group, and the kept groups must hold at least "
                             f"num_experts_per_tok={num_experts_per_tok} experts")
        # DeepSeek-V3's bias for choosing experts only (aux-loss-free balancing; no gradient reaches it)
        self.correction_bias = (nnx.Param(jnp.zeros((E,), param_dtype), semantic_axes=PARAM_AXES["correction_bias"])
                                if routing == "sigmoid_grouped" else nnx.data(None))
        Fs = shared_intermediate_size
        for name, shape in (("shared_gate", (D, Fs)), ("shared_up", (D, Fs)), ("shared_down", (Fs, D))):
            setattr(self, name, nnx.Param(kernel_init(rngs.params(), shape, param_dtype),
                                          semantic_axes=PARAM_AXES[name]) if Fs else nnx.data(None))
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.strategy = check_strategy(strategy)
        self.capacity_factor = capacity_factor
        # the mesh and PartitionAxis the model is laid on (with_mesh sets them): the alltoall strategy's shard_map
        self.mesh, self.partition_axis = None, None
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision

    def route(self, x_ND: Array, router_kernel_DE: Array) -> tuple[Array, Array, Array]:
        """Router logits ``(N, E)`` and the top-k weights (float32, or float64) and expert ids ``(N, k)``.

        ``softmax_topk`` (Mixtral, Qwen3-MoE): softmax over all experts, top k, renormalised to sum to 1
        (unless ``norm_topk_prob`` is False: Qwen3-MoE's option);
        ``topk_softmax`` (GPT-OSS): top k of the logits (with the router bias), softmax over those k;
        ``sigmoid_grouped`` (DeepSeek-V3): see :meth:`_grouped`."""
        logits_NE = jnp.matmul(x_ND, router_kernel_DE, precision=self.precision)
        if self.router_bias is not None:
            logits_NE = logits_NE + self.router_bias[...].astype(logits_NE.dtype)
        return logits_NE, *self.choose(logits_NE)

    def choose(self, logits_NE: Array) -> tuple[Array, Array]:
        """The top-k weights and expert ids ``(N, k)`` for router logits ``(N, E)`` (a model output's
        ``router_logits[layer]``), by this layer's routing (see :meth:`route`)."""
        acc = jnp.promote_types(logits_NE.dtype, jnp.float32)
        if self.routing == "sigmoid_grouped":
            return self._grouped(logits_NE.astype(acc))
        if self.routing == "topk_softmax":
            top_NK, experts_NK = jax.lax.top_k(logits_NE, self.num_experts_per_tok)
            return jax.nn.softmax(top_NK.astype(acc), axis=-1), experts_NK
        probs_NE = jax.nn.softmax(logits_NE.astype(acc), axis=-1)
        weights_NK, experts_NK = jax.lax.top_k(probs_NE, self.num_experts_per_tok)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdims=True)
        return weights_NK, experts_NK

    def _grouped(self, logits_NE: Array) -> tuple[Array, Array]:
        """DeepSeek-V3: sigmoid scores; experts chosen by score + ``correction_bias`` among the ``topk_group``
        groups (of ``n_group``) whose two best biased scores sum highest; weights are the chosen experts'
        unbiased scores, renormalised (``norm_topk_prob``), times ``routed_scaling_factor``."""
        N, E = logits_NE.shape
        scores_NE = jax.nn.sigmoid(logits_NE)
        choice_NE = scores_NE + self.correction_bias[...].astype(scores_NE.dtype)
        group_NG = jax.lax.top_k(choice_NE.reshape(N, self.n_group, E // self.n_group), 2)[0].sum(-1)
        _, groups_NK = jax.lax.top_k(group_NG, self.topk_group)
        keep_NG = jnp.zeros_like(group_NG, bool).at[jnp.arange(N)[:, None], groups_NK].set(True)
        keep_NE = jnp.repeat(keep_NG, E // self.n_group, axis=1)
        _, experts_NK = jax.lax.top_k(jnp.where(keep_NE, choice_NE, -jnp.inf), self.num_experts_per_tok)
        weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdims=True) + 1e-20)
        return weights_NK * self.routed_scaling_factor, experts_NK

    def shared(self, x_ND: Array) -> Array | None:
        """The shared experts' SwiGLU on every token (DeepSeek-V3), or None."""
        if self.shared_gate is None:
            return None
        gate, up, down = dtypes.promote_dtype((self.shared_gate[...], self.shared_up[...], self.shared_down[...]),
                                              dtype=self.dtype)
        h = jax.nn.silu(jnp.matmul(x_ND, gate, precision=self.precision)) * jnp.matmul(x_ND, up,
                                                                                        precision=self.precision)
        return jnp.matmul(h, down, precision=self.precision)

    def experts(self) -> Experts:
        """The expert weights (and biases) in the compute dtype, with the gated activation to use."""
        names = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")
        values = [None if getattr(self, n) is None else getattr(self, n)[...] for n in names]
        present = [v for v in values if v is not None]
        present = dtypes.promote_dtype(tuple(present), dtype=self.dtype)
        it = iter(present)
        values = [None if v is None else next(it) for v in values]
        act = functools.partial(_gated, activation=self.activation, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return Experts(*values, act=act)

    def __call__(self, x_BTD: Array, *, strategy: str | None = None) -> tuple[Array, Array]:
        if x_BTD.ndim != 3 or x_BTD.shape[-1] != self.hidden_size:
            raise ValueError(f"input shape {x_BTD.shape}: MoE expects (batch, length, hidden_size="
                             f"{self.hidden_size})")
        strategy = self.resolved_strategy(strategy)
        B, T, D = x_BTD.shape
        x_BTD, router_DE = dtypes.promote_dtype((x_BTD, self.router_kernel[...]), dtype=self.dtype)
        x_ND = x_BTD.reshape(B * T, D)
        logits_NE, weights_NK, experts_NK = self.route(x_ND, router_DE)
        if strategy == "alltoall":
            y_ND = self._alltoall(x_BTD, weights_NK, experts_NK).reshape(B * T, D)
        else:
            run = _dense if strategy == "dense" else _ragged
            y_ND = run(x_ND, weights_NK, experts_NK, self.experts(), self.precision)
        shared_ND = self.shared(x_ND)
        if shared_ND is not None:
            y_ND = y_ND + shared_ND.astype(y_ND.dtype)
        return y_ND.astype(x_BTD.dtype).reshape(B, T, D), logits_NE


    def resolved_strategy(self, strategy: str | None = None) -> str:
        """The strategy a call runs: ``strategy`` (else the module's), with ``"auto"`` resolved on its mesh."""
        strategy = check_strategy(self.strategy if strategy is None else strategy)
        if strategy != "auto":
            return strategy
        on_ep = self.mesh is not None and dict(self.mesh.shape).get(self._partition_axis().expert_parallel_axis, 1) > 1
        return "alltoall" if on_ep else "dense"

    def _partition_axis(self):
        return self.partition_axis or PartitionAxis()

    def _alltoall(self, x_BTD: Array, weights_NK: Array, experts_NK: Array) -> Array:
        return self.dispatch(x_BTD, weights_NK, experts_NK)[0]

    def dispatch(self, x_BTD: Array, weights_NK: Array | None = None, experts_NK: Array | None = None
                 ) -> tuple[Array, Dispatch]:
        """The ``alltoall`` strategy's output ``(B, T, D)`` (routed experts only) and its :class:`Dispatch`
        counts (tokens per expert, copies dropped at ``capacity_factor``); routes ``x_BTD`` if not given."""
        B, T, D = x_BTD.shape
        if weights_NK is None:
            x_BTD = dtypes.promote_dtype((x_BTD,), dtype=self.dtype)[0]
            _, weights_NK, experts_NK = self.route(x_BTD.reshape(B * T, D), self.router_kernel[...].astype(x_BTD.dtype))
        pa, token_spec = self._partition_axis(), jax.sharding.PartitionSpec()
        if self.mesh is not None:
            token_spec = pa.resolve(ACTIVATION_AXES, shape=x_BTD.shape, mesh=self.mesh)
        K = self.num_experts_per_tok
        return alltoall(x_BTD, weights_NK.reshape(B, T, K), experts_NK.reshape(B, T, K), self.experts(),
                        mesh=self.mesh, token_spec=token_spec, ep_axis=pa.expert_parallel_axis,
                        tp_axis=pa.tensor_parallel_axis, capacity_factor=self.capacity_factor,
                        precision=self.precision)


def _gated(g: Array, u: Array, *, activation: str, alpha: float, limit: float) -> Array:
    """``silu(g) * u`` (SwiGLU), or GPT-OSS's clamped form ``(clip(u) + 1) * g' * sigmoid(alpha * g')`` with
    ``g' = min(g, limit)`` and ``u`` clipped to ``[-limit, limit]``."""
    if activation == "silu":
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, limit)
    return (jnp.clip(u, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))


def _dense(x_ND, weights_NK, experts_NK, ex: Experts, precision) -> Array:
    """Every expert on every token; the (N, E) weights are the top-k weights, 0 elsewhere."""
    E = ex.gate_EDF.shape[0]
    combine_NE = jnp.einsum("nk,nke->ne", weights_NK, jax.nn.one_hot(experts_NK, E, dtype=weights_NK.dtype))
    g_ENF = jnp.einsum("nd,edf->enf", x_ND, ex.gate_EDF, precision=precision)
    u_ENF = jnp.einsum("nd,edf->enf", x_ND, ex.up_EDF, precision=precision)
    if ex.gate_bias_EF is not None:
        g_ENF, u_ENF = g_ENF + ex.gate_bias_EF[:, None], u_ENF + ex.up_bias_EF[:, None]
    y_END = jnp.einsum("enf,efd->end", ex.act(g_ENF, u_ENF), ex.down_EFD, precision=precision)
    if ex.down_bias_ED is not None:
        y_END = y_END + ex.down_bias_ED[:, None]
    return jnp.einsum("end,ne->nd", y_END, combine_NE.astype(y_END.dtype), precision=precision)


def _ragged(x_ND, weights_NK, experts_NK, ex: Experts, precision) -> Array:
    """Token copies sorted by expert, one ragged dot per projection over the expert groups, unsorted."""
    N, K = experts_NK.shape
    E = ex.gate_EDF.shape[0]
    experts_M = experts_NK.reshape(N * K)  # M = N*K token copies, copy m is token m // K
    order_M = jnp.argsort(experts_M, stable=True)
    sizes_E = jnp.bincount(experts_M, length=E).astype(jnp.int32)
    xs_MD = x_ND[order_M // K]
    g_MF = jax.lax.ragged_dot(xs_MD, ex.gate_EDF, sizes_E, precision=precision)
    u_MF = jax.lax.ragged_dot(xs_MD, ex.up_EDF, sizes_E, precision=precision)
    sorted_experts_M = experts_M[order_M]
    if ex.gate_bias_EF is not None:
        g_MF, u_MF = g_MF + ex.gate_bias_EF[sorted_experts_M], u_MF + ex.up_bias_EF[sorted_experts_M]
    ys_MD = jax.lax.ragged_dot(ex.act(g_MF, u_MF), ex.down_EFD, sizes_E, precision=precision)
    if ex.down_bias_ED is not None:
        ys_MD = ys_MD + ex.down_bias_ED[sorted_experts_M]
    y_NKD = ys_MD[jnp.argsort(order_M)].reshape(N, K, -1)
    return jnp.einsum("nkd,nk->nd", y_NKD, weights_NK.astype(y_NKD.dtype), precision=precision)
