"""What every attention implementation shares: input checks, visibility, logits, capabilities.

Conventions (all implementations):

- layout BTHD: ``query (B, T, H, D)``, ``key``/``value`` ``(B, S, KV, D)``, ``H % KV == 0``; with
  ``value_head_dim`` the value may have its own last dimension ``Dv`` (``(B, S, KV, Dv)``, output
  ``(B, T, H, Dv)``): MLA in its absorbed form attends with keys ``[latent; rope key]`` to values that are
  the latent alone;
- positions are bottom-right aligned: query ``i`` sits at ``L - T + i`` where ``L`` is
  ``kv_lengths[b]`` if given, else ``S``; keys at index ``>= L`` are padding;
- ``causal``: a query at position ``p`` sees keys at ``<= p``; ``sliding_window=w``: keys in
  ``(p - w, p]``; segment ids: equal ids only; ``mask``: bool, True = attend;
- logits: ``scale * q.k``, then ``c * tanh(logits / c)`` with ``logits_soft_cap=c``, then
  ``+ bias``, then the mask; softmax in float32 (float64 for float64 inputs: :func:`accumulation_dtype`);
- ``sinks (H,)`` (GPT-OSS's learned attention sinks): head ``h``'s sink logit joins every row's softmax
  as one more column, which takes weight and is dropped: the weights of the keys sum to less than 1;
- a query that sees no key gets a zero output (never NaN, never mean(V)).
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp

from workbench.core.operations.base import OperationRegistry

Array = jax.Array

# Feature names used in Capabilities and in "unsupported" errors.
CAUSAL = "causal"
SLIDING_WINDOW = "sliding_window"
SOFT_CAP = "logits_soft_cap"
SEGMENT_IDS = "segment_ids"
KV_LENGTHS = "kv_lengths"
BIAS = "bias"
MASK = "mask"
GQA = "gqa"
RETURN_WEIGHTS = "return_weights"
GRADIENTS = "gradients"
SINKS = "sinks"
VALUE_DIM = "value_head_dim"  # values whose head dim differs from the queries'/keys' (MLA's latent values)
ALL_FEATURES = frozenset({CAUSAL, SLIDING_WINDOW, SOFT_CAP, SEGMENT_IDS, KV_LENGTHS, BIAS, MASK, GQA,
                          RETURN_WEIGHTS, GRADIENTS, SINKS, VALUE_DIM})


@dataclasses.dataclass(frozen=True)
class Visibility:
    """Which keys each query sees, evaluable for any block of query and key indices.

    Blockwise kernels (flash, ring) call :meth:`block` per tile instead of building the
    dense ``(B, H, T, S)`` mask. Arrays are stored broadcastable to 4-D.
    """

    q_len: int
    kv_len: int
    causal: bool = False
    sliding_window: int | None = None
    kv_lengths: Array | None = None  # (B,)
    q_segment_ids: Array | None = None  # (B, T)
    kv_segment_ids: Array | None = None  # (B, S)
    mask: Array | None = None  # bool, (B|1, H|1, T|1, S|1)

    def query_positions(self, q_idx: Array) -> Array:
        """Absolute positions ``(B|1, tq)`` of query indices (bottom-right aligned)."""
        length = jnp.asarray(self.kv_len) if self.kv_lengths is None else self.kv_lengths[:, None]
        return jnp.reshape(length, (-1, 1)) - self.q_len + q_idx[None, :]

    def block(self, q_idx: Array, k_idx: Array) -> Array | None:
        """Bool ``(B|1, H|1, tq, tk)``: True where query ``q_idx[i]`` sees key ``k_idx[j]``.

        None when nothing is masked at all.
        """
        parts = []
        k_pos = k_idx[None, None, None, :]
        if self.kv_lengths is not None:
            parts.append(k_pos < self.kv_lengths[:, None, None, None])
        if self.causal or self.sliding_window is not None:
            q_pos = self.query_positions(q_idx)[:, None, :, None]
            parts.append(k_pos <= q_pos)
            if self.sliding_window is not None:
                parts.append(k_pos > q_pos - self.sliding_window)
        if self.q_segment_ids is not None:
            q_seg = jnp.take(self.q_segment_ids, q_idx, axis=1)[:, None, :, None]
            k_seg = jnp.take(self.kv_segment_ids, k_idx, axis=1)[:, None, None, :]
            parts.append(q_seg == k_seg)
        if self.mask is not None:
            m = self.mask
            m = m if m.shape[2] == 1 else jnp.take(m, q_idx, axis=2)
            m = m if m.shape[3] == 1 else jnp.take(m, k_idx, axis=3)
            parts.append(m)
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out & p
        return out


def take_bias(bias: Array | None, q_idx: Array, k_idx: Array) -> Array | None:
    """The ``(B|1, H|1, tq, tk)`` tile of a bias broadcastable to ``(B, H, T, S)``."""
    if bias is None:
        return None
    b = bias if bias.shape[2] == 1 else jnp.take(bias, q_idx, axis=2)
    return b if b.shape[3] == 1 else jnp.take(b, k_idx, axis=3)


def _as_4d(x: Array | None, name: str, b: int, h: int, t: int, s: int, impl: str) -> Array | None:
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{impl}: {name} has shape {x.shape}; it must broadcast to (B, H, T, S) = {(b, h, t, s)}")
    x = jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape)
    for got, want, axis in zip(x.shape, (b, h, t, s), "BHTS", strict=True):
        if got not in (1, want):
            raise ValueError(f"{impl}: {name} has shape {x.shape}; dimension {axis} is {got}, expected 1 or "
                             f"{want}: it must broadcast to (B, H, T, S) = {(b, h, t, s)}")
    return x


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Validated inputs of one attention call (shapes checked, masks normalised to 4-D)."""

    query: Array
    key: Array
    value: Array
    visibility: Visibility
    bias: Array | None
    logits_soft_cap: float | None
    scale: float
    return_weights: bool
    sinks: Array | None = None  # (H,) in the accumulation dtype

    def sinks_tiles(self) -> Array | None:
        """The sinks as ``(1, KV, G, 1, 1)``, to broadcast against tile logits."""
        if self.sinks is None:
            return None
        _, _, _, h, kv, _ = self.shape
        return self.sinks.reshape(1, kv, h // kv, 1, 1)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(B, T, S, H, KV, D)``; ``D`` is the query/key head dim (see :attr:`value_dim`)."""
        b, t, h, d = self.query.shape
        return b, t, self.key.shape[1], h, self.key.shape[2], d

    @property
    def value_dim(self) -> int:
        """The values' head dim ``Dv``, the output's last dimension (``D`` unless ``value_head_dim``)."""
        return self.value.shape[3]


def prepare(impl: str, supported: frozenset[str], query: Array, key: Array, value: Array, *,
            mask: Array | None = None, bias: Array | None = None, causal: bool = False,
            sliding_window: int | None = None, logits_soft_cap: float | None = None,
            q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
            kv_lengths: Array | None = None, return_weights: bool = False,
            softmax_scale: float | None = None, sinks: Array | None = None) -> AttentionCall:
    """Check the inputs of ``impl`` and refuse features it does not support, naming who does."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{impl}: {name} must be 4-D BTHD (batch, length, heads, head_dim); got shape "
                             f"{getattr(x, 'shape', type(x))}")
    b, t, h, d = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(f"{impl}: key {key.shape} and value {value.shape} must be (B, S, KV, D) and (B, S, KV, Dv) "
                         f"with B={b} and D={d} from query {query.shape}")
    s, kv = key.shape[1], key.shape[2]
    if h % kv:
        raise ValueError(f"{impl}: {h} query heads are not a multiple of {kv} key/value heads; H % KV must be 0")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{impl}: pass both q_segment_ids (B, T) and kv_segment_ids (B, S), or neither")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{impl}: sliding_window must be a positive int; got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{impl}: logits_soft_cap must be positive; got {logits_soft_cap!r}")
    used = {CAUSAL: causal, SLIDING_WINDOW: sliding_window is not None, SOFT_CAP: logits_soft_cap is not None,
            SEGMENT_IDS: q_segment_ids is not None, KV_LENGTHS: kv_lengths is not None, BIAS: bias is not None,
            MASK: mask is not None, GQA: kv != h, RETURN_WEIGHTS: return_weights, SINKS: sinks is not None,
            VALUE_DIM: value.shape[3] != d}
    for feature, on in used.items():
        if on and feature not in supported:
            raise unsupported(impl, feature)
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        if q_segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, s):
            raise ValueError(f"{impl}: q_segment_ids {q_segment_ids.shape} must be (B, T) = {(b, t)} and "
                             f"kv_segment_ids {kv_segment_ids.shape} must be (B, S) = {(b, s)}")
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)
        if kv_lengths.shape != (b,) or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise ValueError(f"{impl}: kv_lengths must be an int array of shape (B,) = ({b},); got "
                             f"{kv_lengths.dtype} {kv_lengths.shape}")
    mask = _as_4d(mask, "mask", b, h, t, s, impl)
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"{impl}: mask must be bool (True = attend); got {mask.dtype}. For an additive float "
                         f"mask pass it as bias=")
    bias = _as_4d(bias, "bias", b, h, t, s, impl)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (h,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"{impl}: sinks must be a float array (H,) = ({h},), one logit per query head; got "
                             f"{sinks.dtype} {sinks.shape}")
        sinks = sinks.astype(accumulation_dtype(query.dtype))
    vis = Visibility(t, s, causal, sliding_window, kv_lengths, q_segment_ids, kv_segment_ids, mask)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return AttentionCall(query, key, value, vis, bias, logits_soft_cap, scale, return_weights, sinks)


def call_extras(call: AttentionCall, *names: str) -> list[str]:
    """Which of the optional inputs ``names`` (``"kv_lengths"``, ``"segment ids"``, ``"a dense mask"``, ``"a bias"``,
    ``"sinks"``, ``"a soft cap"``, ``"values of another head dim"``) ``call`` uses, in that order: what a kernel that
    lacks them names when it cannot serve the call."""
    vis = call.visibility
    present = {"kv_lengths": vis.kv_lengths is not None, "segment ids": vis.q_segment_ids is not None,
               "a dense mask": vis.mask is not None, "a bias": call.bias is not None,
               "sinks": call.sinks is not None, "a soft cap": call.logits_soft_cap is not None,
               "values of another head dim": call.value_dim != call.shape[5]}
    unknown = sorted(set(names) - set(present))
    if unknown:
        raise ValueError(f"call_extras: unknown inputs {unknown}; known: {list(present)}")
    return [n for n in names if present[n]]


def unsupported(impl: str, feature: str) -> ValueError:
    """The error for a feature ``impl`` does not support, listing the implementations that do."""
    others = [n for n in OperationRegistry.supporting(feature) if n != impl]
    return ValueError(f"attention implementation {impl!r} does not support {feature}; implementations that do: "
                      f"{others or 'none registered'}")


def logits(q_BKGTD: Array, k_BKSD: Array, call: AttentionCall, q_idx: Array, k_idx: Array
           ) -> tuple[Array, Array | None]:
    """Float32 logits ``(B, KV, G, tq, tk)`` of a tile and its visibility (or None).

    Tiles use the matmul-ready layout of :func:`to_tile_layout`: queries grouped by KV head
    (``G = H // KV``, GQA without repeating K/V), heads before positions, so each tile is a
    plain batched matmul with no transpose.
    """
    acc = accumulation_dtype(q_BKGTD.dtype)
    s = jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD, k_BKSD, preferred_element_type=acc)
    if call.scale != 1.0:
        s = s * call.scale
    if call.logits_soft_cap is not None:
        s = call.logits_soft_cap * jnp.tanh(s / call.logits_soft_cap)
    kv = k_BKSD.shape[1]
    bias = take_bias(call.bias, q_idx, k_idx)
    if bias is not None:
        s = s + group_heads(bias.astype(acc), kv)
    visible = call.visibility.block(q_idx, k_idx)
    return s, None if visible is None else group_heads(visible, kv)


def accumulation_dtype(dtype: tp.Any) -> jnp.dtype:
    """Where logits and softmax run: float32 for float32 and narrower inputs, float64 for float64 ones."""
    return jnp.promote_types(dtype, jnp.float32)


def group_heads(x_BHTS: Array, kv: int) -> Array:
    """``(B|1, H|1, T, S)`` -> ``(B|1, KV|1, G|1, T, S)``, query head ``h`` = ``k * G + g``."""
    b, h, t, s = x_BHTS.shape
    if h == 1:
        return x_BHTS[:, :, None]
    return x_BHTS.reshape(b, kv, h // kv, t, s)


def queries_to_tiles(q_BTHD: Array, kv: int) -> Array:
    """``(B, T, H, D)`` -> ``(B, KV, G, T, D)``."""
    b, t, h, d = q_BTHD.shape
    return q_BTHD.reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)


def keys_to_tiles(k_BSKD: Array) -> Array:
    """``(B, S, KV, D)`` -> ``(B, KV, S, D)`` (keys or values)."""
    return k_BSKD.transpose(0, 2, 1, 3)


def tiles_to_output(o_BKGTD: Array) -> Array:
    """``(B, KV, G, T, D)`` -> ``(B, T, H, D)``."""
    b, k, g, t, d = o_BKGTD.shape
    return o_BKGTD.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def dense_attention(call: AttentionCall) -> tuple[Array, Array | None]:
    """Reference-style attention over all keys at once: output BTHD and weights BHTS (float32, or float64).

    Rows with no visible key get zero weights and a zero output.
    """
    b, t, s, h, kv, _ = call.shape
    q_idx, k_idx = jnp.arange(t), jnp.arange(s)
    scores, visible = logits(queries_to_tiles(call.query, kv), keys_to_tiles(call.key), call, q_idx, k_idx)
    if visible is not None:
        scores = jnp.where(visible, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    sinks = call.sinks_tiles()
    if sinks is not None:
        m = jnp.maximum(m, sinks)
    # the softmax does not depend on the shift: no gradient flows through it (as in flash kernels), which spares
    # the backward the max's argmax mask and keeps it finite on rows with masked keys at any optimisation level
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(scores - m)  # exp(-inf) = 0 on masked keys
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:  # the sink's column: in the denominator, not in the output
        denom = denom + jnp.exp(sinks - m)
    weights = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights, keys_to_tiles(call.value).astype(weights.dtype))
    out = tiles_to_output(out).astype(call.query.dtype)
    return out, weights.reshape(b, h, t, s) if call.return_weights else None


class AttentionImplMixin:
    """Shared helpers for attention ``OperationImpl``s (capability-checked ``prepare``)."""

    def prepare(self, query: Array, key: Array, value: Array, **kwargs: tp.Any) -> AttentionCall:
        name = type(self).get_impl_name()
        name = name if isinstance(name, str) else name[0]
        if kwargs.get("softmax_scale") is None:
            kwargs["softmax_scale"] = self.metadata.softmax_scale
        return prepare(name, self.capabilities.features, query, key, value, **kwargs)


# -- online softmax (flash, ring): accumulate one key tile at a time ---------------------------
class SoftmaxCarry(tp.NamedTuple):
    """Running state over key tiles: unnormalised output, row max, row sum (float32, or float64 for float64).

    ``o (B, KV, G, tq, Dv)`` (``Dv``: the values' head dim), ``m`` and ``l`` ``(B, KV, G, tq, 1)``.
    """

    o: Array
    m: Array
    l: Array  # noqa: E741

    @classmethod
    def init(cls, b: int, kv: int, g: int, tq: int, d: int, dtype=jnp.float32) -> SoftmaxCarry:
        acc = accumulation_dtype(dtype)
        return cls(jnp.zeros((b, kv, g, tq, d), acc), jnp.full((b, kv, g, tq, 1), -jnp.inf, acc),
                   jnp.zeros((b, kv, g, tq, 1), acc))


def tile_update(carry: SoftmaxCarry, q_BKGTD: Array, k_BKSD: Array, v_BKSD: Array, call: AttentionCall,
                q_idx: Array, k_idx: Array) -> SoftmaxCarry:
    """Fold one key/value tile (tile layout) into the running softmax; masked rows stay 0."""
    s, visible = logits(q_BKGTD, k_BKSD, call, q_idx, k_idx)
    return fold_logits(carry, s, visible, v_BKSD)


def fold_logits(carry: SoftmaxCarry, s: Array, visible: Array | None, v_BKSD: Array) -> SoftmaxCarry:
    """Fold a tile's float32 logits ``(B, KV, G, tq, tk)`` (where ``visible``, when given) into the running
    softmax: the online softmax's one step."""
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jax.lax.stop_gradient(jnp.maximum(carry.m, jnp.max(s, axis=-1, keepdims=True)))  # a shift: as above
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(carry.m - m_safe)  # 0 while nothing was visible (m = -inf)
    l_new = alpha * carry.l + jnp.sum(p, axis=-1, keepdims=True)
    o_new = alpha * carry.o + jnp.einsum("bkgts,bksd->bkgtd", p, v_BKSD.astype(carry.o.dtype))
    return SoftmaxCarry(o_new, m_new, l_new)


def tile_finish(carry: SoftmaxCarry, dtype: tp.Any, sinks: Array | None = None) -> Array:
    """Normalise the carry into a BTHD output; rows that saw no key are 0. ``sinks`` (``(1, KV, G, 1, 1)``,
    :meth:`AttentionCall.sinks_tiles`) join the softmax's denominator here, once, as one more column."""
    o, l = carry.o, carry.l  # noqa: E741
    if sinks is not None:
        m = jax.lax.stop_gradient(jnp.maximum(carry.m, sinks))  # a shift: as in dense_attention
        alpha = jnp.exp(carry.m - m)  # 0 where no key was visible (m = -inf)
        o, l = alpha * o, alpha * l + jnp.exp(sinks - m)  # noqa: E741
    return tiles_to_output(o / jnp.where(l == 0, 1.0, l)).astype(dtype)
