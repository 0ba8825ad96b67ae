"""FLOPs of a transformer step by formula (train, prefill, decode), and the utilisation they give: MFU and HFU.

Per token, a matmul by a weight of ``n`` elements is ``2n`` FLOPs forward (a multiply and an add per
element) and ``4n`` backward (the gradient with respect to the input and the one with respect to the weight,
each a matmul of the same size). Over the ``N`` weights a token meets that is ``6N`` a token (Kaplan et al.
2020, "Scaling Laws for Neural Language Models", section 2.1; Hoffmann et al. 2022, "Chinchilla", appendix F).
Attention adds its scores ``QK^T`` and their use ``PV``, ``2 T H (d_qk + d_v)`` a token and layer forward over
a context of ``T``, three times that in training: ``6 L H (d_qk + d_v) T``, PaLM's ``12 L H Q T`` when
``d_qk = d_v = Q`` (Chowdhery et al. 2022, "PaLM", appendix B), counted over the whole ``T x T`` square as
PaLM counts it (a causal mask leaves half of it unused).

``N`` here is every weight a token is multiplied by: each layer's attention projections and MLP (a mixture
of experts: the ``k`` experts a token is routed to, the shared ones and the router), and the LM head
(``D x V``). The input embedding is a lookup, no multiply, and is not counted (tied or not: a tied matrix
counts once, as the head). Norms, biases, the softmax, the loss and the optimizer are elementwise: left out,
as Kaplan and PaLM leave them out (a few per cent of XLA's count for tiny models, ``tests/core/cost/test_flops.py``).

**Model FLOPs** are these: what the model needs, whatever the implementation. **Hardware FLOPs** add what the
implementation computes again: ``remat="full"`` recomputes each layer's forward in its backward, ``2N_layers``
plus the attention forward a token, less a dense MLP's output projection, whose result the backward does not
read (XLA removes its recompute); the head is outside the remat. ``"dots_saveable"`` recomputes no matmul.
**MFU** (model FLOPs utilisation, :func:`mfu`) is model FLOPs per second over the peak FLOP/s of the chips that
ran them; **HFU** (:func:`hfu`) the same with the hardware FLOPs. PaLM (section 4.1, appendix B) reports MFU: it
does not reward recomputation, and it compares implementations fairly. The dots of a compiled step are hardware
FLOPs (a recomputed forward is in the program): they give HFU, never MFU. These two functions are the only place
either is computed; :class:`~workbench.core.cost.step.StepTime` and the advisor call them.

A forward step (prefill, decode: :func:`model_flops`) has no backward and no recompute: ``2N`` a token for the
layers' weights and the attention scores over its context, the head at each sequence's last position only.

The count is the one :func:`workbench.core.cost.predicted.predict_step` prices (the same per-layer shapes,
:func:`model_shapes`), and it equals the FLOPs of the dots in the compiled step.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

from workbench.core.checks import batch_shape, one_of
from workbench.core.vocab import REMATS, TASKS


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """Per-layer sizes of a config in elements, undivided by any mesh axis: what the FLOPs here and
    :func:`~workbench.core.cost.predicted.predict_step` count (:mod:`workbench.core.cost.work` says what each is)."""

    hidden: int
    vocab: int
    layers: int
    dense_layers: int  # a MoE family's leading dense layers
    moe: bool
    attn_split: int  # weights of the attention matmuls tp splits
    attn_rep: int  # ... tp does not split (MLA's latent down-projections)
    attn_act_full: int  # activation elements a token those matmuls read / write that tp does not split
    attn_act_split: int  # ... that tp splits
    heads: int
    score_qk: int  # a head's QK^T contraction width
    score_v: int  # a head's PV width
    kv_ring: int  # K and V elements a token that ring attention passes on
    kv_cache: int  # KV cache elements a token and layer
    kv_split: bool  # whether tp splits the K / V heads (MLA's latent: no)
    kv_heads: int  # K / V heads a token and layer (MLA: 1, the latent)
    mlp: int  # a dense MLP's weights
    mlp_down: int
    mlp_act_full: int
    mlp_act_split: int
    expert: int  # one routed expert's weights
    experts: int
    topk: int
    expert_width: int
    shared: int  # the shared experts' weights
    shared_width: int
    router: int
    head: int
    embed: int  # 0 when tied to the head
    recompute_down: bool  # a post-MLP norm reads the output projection's result in the backward


@functools.lru_cache(maxsize=128)
def model_shapes(c: tp.Any) -> ModelShapes:
    d, f, h = c.hidden_size, c.intermediate_size, c.num_attention_heads
    if c.mla:
        lat, r, nope, vd, rq = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank
        q_split = (rq or d) * h * (nope + r)
        attn_rep = (d * rq if rq else 0) + d * (lat + r)
        attn_split = q_split + lat * h * (nope + vd) + h * vd * d  # q(_b), kv_b (W_uk, W_uv), o
        act_full = (d + 2 * rq if rq else d) + d + (lat + r) + d  # q(_a) in (+ q_a out, q_b in), kv_a in/out, o out
        act_split = h * (nope + r) + h * (nope + lat) + h * (lat + vd) + h * vd  # q out, W_uk, W_uv, o in
        score_qk, score_v = lat + r, lat  # the absorbed form: an MQA over [c; k_pe] with values c
        kv_ring, kv_cache, kv_split, kv_heads = 2 * lat + r, lat + r, False, 1
    else:
        hd, kv = c.head_dim, c.num_key_value_heads
        attn_rep, attn_split = 0, 2 * d * h * hd + 2 * d * kv * hd
        act_full, act_split = 4 * d, 2 * h * hd + 2 * kv * hd
        score_qk = score_v = hd
        kv_ring = kv_cache = 2 * kv * hd
        kv_split, kv_heads = True, kv
    gated = c.mlp_type != "gelu"
    widths = 3 if gated else 2
    fe = c.expert_intermediate_size if c.mlp_type == "moe" else 0
    moe = c.mlp_type == "moe"
    return ModelShapes(
        hidden=d, vocab=c.vocab_size, layers=c.num_hidden_layers, dense_layers=c.first_dense_layers, moe=moe,
        attn_split=attn_split, attn_rep=attn_rep, attn_act_full=act_full, attn_act_split=act_split, heads=h,
        score_qk=score_qk, score_v=score_v, kv_ring=kv_ring, kv_cache=kv_cache, kv_split=kv_split,
        kv_heads=kv_heads,
        mlp=widths * d * f, mlp_down=d * f, mlp_act_full=(widths - 1) * d + d,
        mlp_act_split=(widths - 1) * f + f + 3 * f,
        expert=3 * d * fe, experts=c.num_local_experts if moe else 0, topk=c.num_experts_per_tok if moe else 0,
        expert_width=fe, shared=3 * d * fe * c.moe_shared_experts, shared_width=fe * c.moe_shared_experts,
        router=d * c.num_local_experts if moe else 0, head=d * c.vocab_size,
        embed=0 if c.tie_word_embeddings else d * c.vocab_size, recompute_down=bool(c.sandwich_norms))


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): ``model_flops`` (``6N`` plus attention a
    token, no recompute) done in ``seconds`` over ``peak_flops`` (FLOP/s of the chips that did them)."""
    return model_flops / (seconds * peak_flops)


def hfu(hardware_flops: float, seconds: float, peak_flops: float) -> float:
    """Hardware FLOPs utilisation: as :func:`mfu` with the FLOPs the hardware ran, recompute included (a compiled
    program's dots)."""
    return hardware_flops / (seconds * peak_flops)


@dataclasses.dataclass(frozen=True)
class TrainFlops:
    """FLOPs of one train step of ``tokens = batch x seq_len`` tokens: ``6 N`` a token for the weights,
    ``attention_per_token`` for the scores, and what ``remat`` computes again (``recompute_per_token``)."""

    batch: int
    seq_len: int
    matmul_params: int  # N: the weights a token is multiplied by (embedding lookup excluded, head included)
    attention_per_token: float  # 6 L H (d_qk + d_v) T: PaLM's 12 L H Q T
    recompute_per_token: float  # what the remat policy adds (0 for "none" and "dots_saveable")
    remat: str = "none"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def model_per_token(self) -> float:
        """``6 N + 12 L H Q T``."""
        return 6 * self.matmul_params + self.attention_per_token

    @property
    def hardware_per_token(self) -> float:
        return self.model_per_token + self.recompute_per_token

    @property
    def model(self) -> float:
        """Model FLOPs of the step (all its tokens)."""
        return self.tokens * self.model_per_token

    @property
    def hardware(self) -> float:
        """Hardware FLOPs of the step: the model's plus the recompute."""
        return self.tokens * self.hardware_per_token

    def mfu(self, step_s: float, peak_flops: float) -> float:
        """:func:`mfu` of this step's model FLOPs in ``step_s`` on chips of ``peak_flops`` FLOP/s in all."""
        return mfu(self.model, step_s, peak_flops)

    def hfu(self, step_s: float, peak_flops: float) -> float:
        """:func:`hfu`: the recompute counted as work done."""
        return hfu(self.hardware, step_s, peak_flops)


def train_flops(config: tp.Any, batch: tuple[int, int], *, remat: str = "none") -> TrainFlops:
    """The FLOPs of one train step of ``config`` (a ``ModelConfig``, or a model: its ``.config``) on ``batch =
    (sequences, length)`` with the layers' remat policy ``remat`` (see the module doc for each term).

    >>> from workbench.core.models.presets import tiny_config
    >>> from workbench.core.models.config import ModelConfig
    >>> f = train_flops(ModelConfig.from_hf(tiny_config("llama")), (4, 64))
    >>> f.matmul_params, f.attention_per_token  # 2 x (attention 12288 + MLP 24576) + head 16896; 6*2*4*(16+16)*64
    (90624, 98304.0)
    """
    one_of("remat", remat, REMATS)
    s = model_shapes(_config(config, batch))
    t = batch[1]
    layers, moe_layers, dense_layers, attention_weights, routed = _layer_weights(s)
    n = _layer_params(s) + s.head
    scores = 2 * t * s.heads * (s.score_qk + s.score_v)  # a token's QK^T and PV in one layer, forward
    recompute = 0.0
    if remat == "full":
        down = 0 if s.recompute_down else s.mlp_down
        shared_down = 0 if s.recompute_down else s.hidden * s.shared_width
        recompute = (2 * layers * attention_weights + layers * scores + 2 * dense_layers * (s.mlp - down)
                     + 2 * moe_layers * (routed - shared_down))
    return TrainFlops(batch[0], t, n, 3.0 * layers * scores, float(recompute), remat)


def model_flops(config: tp.Any, batch: tuple[int, int], *, task: str = "train", kv_length: int | None = None) -> float:
    """The model FLOPs of one ``task`` step (what :func:`mfu` counts): a train step's ``TrainFlops.model``; a
    prefill's ``2N`` a token for the layers, the scores over its ``length``, the head at each sequence's last
    position; a decode step's one token per sequence over a context of ``kv_length`` (default: ``length``).

    >>> from workbench.core.models.presets import tiny_config
    >>> from workbench.core.models.config import ModelConfig
    >>> # one token: 2 x 73728 layer weights + 2 layers x 2*64*4*(16+16) scores + 2 x 16896 head
    >>> model_flops(ModelConfig.from_hf(tiny_config("llama")), (1, 64), task="decode")
    214016.0
    """
    one_of("task", task, TASKS)
    if task == "train":
        return train_flops(config, batch).model
    s = model_shapes(_config(config, batch))
    sequences, length = batch
    tokens, context = (sequences, kv_length or length) if task == "decode" else (sequences * length, length)
    scores = 2 * context * s.heads * (s.score_qk + s.score_v)
    return float(tokens * (2 * _layer_params(s) + s.layers * scores) + sequences * 2 * s.head)


def _config(config: tp.Any, batch: tp.Any) -> tp.Any:
    batch_shape(batch)
    return getattr(config, "config", config)


def _layer_weights(s: ModelShapes) -> tuple[int, int, int, int, int]:
    """Layers, MoE layers, dense layers, a layer's attention weights, the weights a token meets in a MoE layer."""
    moe_layers = s.layers - s.dense_layers if s.moe else 0
    routed = s.topk * s.expert + s.shared + s.router
    return s.layers, moe_layers, s.layers - moe_layers, s.attn_split + s.attn_rep, routed


def _layer_params(s: ModelShapes) -> int:
    """The layers' part of ``N``: the weights a token is multiplied by, the head aside."""
    layers, moe_layers, dense_layers, attention_weights, routed = _layer_weights(s)
    return layers * attention_weights + dense_layers * s.mlp + moe_layers * routed


__all__ = ["ModelShapes", "TrainFlops", "hfu", "mfu", "model_flops", "model_shapes", "train_flops"]
