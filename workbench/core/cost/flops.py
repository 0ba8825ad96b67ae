"""FLOPs of a transformer train step by formula, and the utilisation they give: MFU and HFU.

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
MFU (model FLOPs utilisation) is model FLOPs per second over the chip's peak; HFU counts the hardware FLOPs.
PaLM (section 4.1) reports MFU: it does not reward recomputation, and it compares implementations fairly.

The count is the one :func:`workbench.core.cost.predicted.predict_step` prices (the same per-layer shapes), and it
equals the FLOPs of the dots in the compiled step.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from workbench.core.cost.predicted import REMATS, _shapes


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
        """Model FLOPs utilisation: model FLOPs per second over ``peak_flops`` (FLOP/s of the chips that ran it)."""
        return self.model / step_s / peak_flops

    def hfu(self, step_s: float, peak_flops: float) -> float:
        """Hardware FLOPs utilisation: the recompute counted as work done."""
        return self.hardware / step_s / peak_flops


def train_flops(config: tp.Any, batch: tuple[int, int], *, remat: str = "none") -> TrainFlops:
    """The FLOPs of one train step of ``config`` (a ``ModelConfig``, or a model: its ``.config``) on ``batch =
    (sequences, length)`` with the layers' remat policy ``remat`` (see the module doc for each term).

    >>> from workbench.core.models.presets import tiny_config
    >>> from workbench.core.models.config import ModelConfig
    >>> f = train_flops(ModelConfig.from_hf(tiny_config("llama")), (4, 64))
    >>> f.matmul_params, f.attention_per_token  # 2 x (attention 12288 + MLP 24576) + head 16896; 6*2*4*(16+16)*64
    (90624, 98304.0)
    """
    config = getattr(config, "config", config)
    if remat not in REMATS:
        raise ValueError(f"remat must be one of {REMATS}; got {remat!r}")
    if (not isinstance(batch, tuple | list) or len(batch) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch)):
        raise ValueError(f"batch is (sequences, length), two positive ints; got {batch!r}")
    s = _shapes(config)
    t = batch[1]
    layers, moe_layers = s.layers, (s.layers - s.dense_layers if s.moe else 0)
    dense_layers = layers - moe_layers
    attention_weights = s.attn_split + s.attn_rep
    routed = s.topk * s.expert + s.shared + s.router  # the weights a token meets in a MoE layer
    n = layers * attention_weights + dense_layers * s.mlp + moe_layers * routed + s.head
    scores = 2 * t * s.heads * (s.score_qk + s.score_v)  # a token's QK^T and PV in one layer, forward
    recompute = 0.0
    if remat == "full":
        down = 0 if s.recompute_down else s.mlp_down
        shared_down = 0 if s.recompute_down else s.hidden * s.shared_width
        recompute = (2 * layers * attention_weights + layers * scores + 2 * dense_layers * (s.mlp - down)
                     + 2 * moe_layers * (routed - shared_down))
    return TrainFlops(batch[0], t, n, 3.0 * layers * scores, float(recompute), remat)


__all__ = ["TrainFlops", "train_flops"]
