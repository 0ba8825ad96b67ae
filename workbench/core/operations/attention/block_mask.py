"""Block masks for ``flex`` attention: which ``(block_q, block_k)`` tiles of the ``T x S`` logits a mask leaves empty
(skipped), full (no mask arithmetic) or partial (mask applied), built tile row by tile row from a ``mask_mod``.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and a ``score_mod(score, b, h, q_idx, kv_idx) -> score`` are written for
scalars with ``jnp`` ops, as PyTorch's FlexAttention takes them; :func:`vectorize_mask` / :func:`vectorize_score`
vmap them over tiles. ``q_idx`` is a query's position, aligned so the last query is the last key (``S - T`` is
added to the query's index, as ``causal`` aligns here); with ``T == S`` it is the index.

:func:`create_block_mask` evaluates the mod one row of tiles at a time (``B x H x block_q x S`` booleans, never
``T x S``) and caches the result by ``(mod, shape, blocks)``. A :class:`BlockMask` composes with ``&`` and ``|``,
reports its sparsity and draws itself (``_repr_html_``).
"""

from __future__ import annotations

import dataclasses
import functools
import html
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from workbench.core.checks import positive_int

EMPTY, PARTIAL, FULL = 0, 1, 2
# measured on this CPU (benchmarks/flex.py): 128 x 256 tiles balance causal and sparse masks
DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = 128, 256
KIND_NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
_COLORS = {EMPTY: "#f4f4f4", PARTIAL: "#9ecae1", FULL: "#3182bd"}

MaskMod = tp.Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
ScoreMod = tp.Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


# -- vectorising scalar mods ---------------------------------------------------------------------------------
def vectorize_mask(mask_mod: MaskMod) -> tp.Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]:
    """``mask_mod`` over index vectors ``b (B,), h (H,), q (tq,), k (tk,)`` -> bool ``(B, H, tq, tk)``."""
    f = lambda b, h, q, k: jnp.asarray(mask_mod(b, h, q, k), jnp.bool_)
    for axes in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = jax.vmap(f, in_axes=axes)
    return f


def vectorize_score(score_mod: ScoreMod) -> tp.Callable[..., jax.Array]:
    """``score_mod`` over a ``(B, H, tq, tk)`` score and index vectors ``b, h, q, k`` -> ``(B, H, tq, tk)``."""
    f = lambda s, b, h, q, k: jnp.asarray(score_mod(s, b, h, q, k), s.dtype)
    for axes in ((0, None, None, None, 0), (0, None, None, 0, None), (0, None, 0, None, None),
                 (0, 0, None, None, None)):
        f = jax.vmap(f, in_axes=axes)
    return f


def depends_on_batch_or_head(mask_mod: MaskMod) -> bool:
    """Whether ``mask_mod``'s result depends on its ``b`` or ``h`` argument (read off its jaxpr): a mask that does
    not is built once for every batch row and head."""
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        closed = jax.make_jaxpr(lambda b, h, q, k: jnp.asarray(mask_mod(b, h, q, k)))(i32, i32, i32, i32)
    except Exception as err:
        raise ValueError(f"mask_mod(b, h, q_idx, kv_idx) failed on int32 scalars ({type(err).__name__}: {err}); "
                         f"write it with jnp ops on scalars, e.g. lambda b, h, q, k: q >= k") from err
    from jax.extend.core import Var

    jaxpr = closed.jaxpr
    tainted = {id(v) for v in jaxpr.invars[:2]}
    for eqn in jaxpr.eqns:  # a sub-jaxpr (a pjit, a cond) counts as one equation: conservative
        if any(isinstance(v, Var) and id(v) in tainted for v in eqn.invars):
            tainted.update(id(v) for v in eqn.outvars)
    return any(isinstance(v, Var) and id(v) in tainted for v in jaxpr.outvars)


# -- the block mask ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Per ``(b, h, query block, key block)`` tile: :data:`EMPTY`, :data:`PARTIAL` or :data:`FULL` (``kinds``,
    int8 ``(B, H, nq, nk)``; ``B`` or ``H`` is 1 when the mask is the same for every batch row or head)."""

    mask_mod: MaskMod
    shape: tuple[int, int, int, int]  # (B, H, T, S); B, H may be 1 (broadcast)
    block_q: int
    block_k: int
    kinds: np.ndarray
    build_seconds: float = 0.0

    @property
    def q_offset(self) -> int:
        """Added to a query's index to give its position (``S - T``)."""
        return self.shape[3] - self.shape[2]

    @property
    def num_tiles(self) -> int:
        return int(self.kinds.size)

    def count(self, kind: int) -> int:
        return int(np.sum(self.kinds == kind))

    @property
    def sparsity(self) -> float:
        """The share of tiles that are empty (skipped)."""
        return self.count(EMPTY) / self.num_tiles

    def tile_kinds(self) -> np.ndarray:
        """``(nq, nk)`` kinds shared by every batch row and head, as one kernel call visits them: empty where every
        ``(b, h)`` is empty, full where every one is full, else partial."""
        k = self.kinds.reshape(-1, *self.kinds.shape[2:])
        return np.where(np.all(k == EMPTY, 0), EMPTY, np.where(np.all(k == FULL, 0), FULL, PARTIAL)).astype(np.int8)

    def kv_lists(self) -> tuple[np.ndarray, np.ndarray]:
        """``(kv_indices, kv_kinds)``, int32 and int8 ``(nq, n_max)``: each query block's non-empty key blocks in
        order and their kinds, padded with kind :data:`EMPTY` (index 0) to the longest row."""
        kinds = self.tile_kinds()
        rows = [np.nonzero(row != EMPTY)[0] for row in kinds]
        n_max = max(1, max(len(r) for r in rows))
        idx = np.zeros((len(rows), n_max), np.int32)
        kind = np.zeros((len(rows), n_max), np.int8)
        for i, r in enumerate(rows):
            idx[i, :len(r)], kind[i, :len(r)] = r, kinds[i, r]
        return idx, kind

    def _same_grid(self, other: BlockMask, op: str) -> None:
        if not isinstance(other, BlockMask):
            raise TypeError(f"BlockMask {op} takes another BlockMask; got {type(other).__name__}")
        mine = (self.shape[2:], self.block_q, self.block_k)
        theirs = (other.shape[2:], other.block_q, other.block_k)
        if mine != theirs:
            raise ValueError(f"BlockMask {op}: (T, S) and blocks differ, {mine} vs {theirs}; build both with the "
                             f"same T, S, block_q and block_k")

    def _combined(self, other: BlockMask, op: str, fn: tp.Callable) -> BlockMask:
        self._same_grid(other, op)
        a, b = self.mask_mod, other.mask_mod
        mod = _Combined(fn, a, b, op)
        shape = tuple(max(x, y) for x, y in zip(self.shape[:2], other.shape[:2], strict=True))
        return create_block_mask(mod, *shape, *self.shape[2:], self.block_q, self.block_k)

    def __and__(self, other: BlockMask) -> BlockMask:
        return self._combined(other, "&", jnp.logical_and)

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._combined(other, "|", jnp.logical_or)

    def __repr__(self) -> str:
        b, h, t, s = self.shape
        return (f"BlockMask({_name(self.mask_mod)}, B={b}, H={h}, T={t}, S={s}, blocks {self.block_q}x{self.block_k}: "
                f"{self.count(FULL)} full, {self.count(PARTIAL)} partial, {self.count(EMPTY)} empty of "
                f"{self.num_tiles} tiles, sparsity {self.sparsity:.1%}, built in {self.build_seconds * 1e3:.0f} ms)")

    def picture(self, b: int = 0, h: int = 0, *, cell: int | None = None) -> str:
        """The ``(b, h)`` tiles as HTML boxes (rows are query blocks, columns key blocks; a tile is ``block_k``
        wide by ``block_q`` tall in proportion, ``cell`` pixels tall). Plain boxes, not SVG: JupyterLab's
        sanitiser keeps them in an untrusted notebook."""
        kinds = self.kinds[min(b, self.kinds.shape[0] - 1), min(h, self.kinds.shape[1] - 1)]
        nq, nk = kinds.shape
        wide = self.block_k / self.block_q
        cell = cell or max(2, min(14, int(320 // max(nq, nk * wide))))
        width = max(1, round(cell * wide))
        box = lambda kind: f'<div style="width:{width}px;height:{cell}px;background:{_COLORS[kind]}"></div>'
        rows = "".join('<div style="display:flex">' + "".join(box(int(k)) for k in row) + "</div>" for row in kinds)
        return (f'<div class="wb-block-mask" style="display:inline-block;line-height:0;'
                f'border:1px solid #ccc">{rows}</div>')

    def _repr_html_(self) -> str:
        legend = " ".join(f'<span style="white-space:nowrap"><span style="display:inline-block;width:10px;'
                          f'height:10px;background:{_COLORS[k]};border:1px solid #ccc"></span> {n} '
                          f"{self.count(k)}</span>" for k, n in KIND_NAMES.items())
        return (f'<div style="font-size:12px"><div>{html.escape(repr(self))}</div>{self.picture()}'
                f"<div>{legend}</div></div>")


@dataclasses.dataclass(frozen=True)
class _Combined:
    """``a op b`` of two mask mods, hashable by its parts (so the combination is cached like any mod)."""

    fn: tp.Callable
    a: MaskMod
    b: MaskMod
    op: str

    def __call__(self, b, h, q, k):
        return self.fn(self.a(b, h, q, k), self.b(b, h, q, k))

    @property
    def __name__(self) -> str:
        return f"({_name(self.a)} {self.op} {_name(self.b)})"


def _name(fn: tp.Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _check_int(name: str, value: tp.Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    return positive_int(f"create_block_mask: {name}", value, what="a positive int" + " or None" * allow_none)


def create_block_mask(mask_mod: MaskMod, B: int | None, H: int | None, T: int, S: int,
                      block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> BlockMask:
    """The :class:`BlockMask` of ``mask_mod`` over ``B`` batch rows and ``H`` heads (None: the same for all) of
    ``T`` queries by ``S`` keys, in ``block_q x block_k`` tiles. Cached by ``(mask_mod, B, H, T, S, blocks)``."""
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask takes a mask_mod(b, h, q_idx, kv_idx) -> bool; got {mask_mod!r}")
    B, H = _check_int("B", B, True), _check_int("H", H, True)
    T, S = _check_int("T", T), _check_int("S", S)
    block_q, block_k = min(_check_int("block_q", block_q), T), min(_check_int("block_k", block_k), S)
    try:
        hash(mask_mod)
    except TypeError:
        raise TypeError(f"mask_mod must be hashable (a function is); got {type(mask_mod).__name__}") from None
    return _build(mask_mod, B or 1, H or 1, T, S, block_q, block_k)


@functools.lru_cache(maxsize=256)
def _build(mask_mod: MaskMod, B: int, H: int, T: int, S: int, block_q: int, block_k: int) -> BlockMask:
    start = time.perf_counter()
    with jax.ensure_compile_time_eval():  # concrete even when the first call comes from inside a jit trace
        kinds = np.asarray(_kinds(mask_mod, B, H, T, S, block_q, block_k))
    return BlockMask(mask_mod, (B, H, T, S), block_q, block_k, kinds.transpose(1, 2, 0, 3).astype(np.int8),
                     time.perf_counter() - start)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _kinds(mask_mod: MaskMod, B: int, H: int, T: int, S: int, block_q: int, block_k: int) -> jax.Array:
    """int8 ``(nq, B, H, nk)``, one row of tiles at a time."""
    nq, nk = -(-T // block_q), -(-S // block_k)
    mod = vectorize_mask(mask_mod)
    k_idx = jnp.arange(nk * block_k)
    k_real = k_idx < S

    def row(i: jax.Array) -> jax.Array:
        q_row = i * block_q + jnp.arange(block_q)
        q_real = (q_row < T)[None, None, :, None, None]
        m = mod(jnp.arange(B), jnp.arange(H), q_row + (S - T), k_idx) & k_real
        m = m.reshape(B, H, block_q, nk, block_k)
        seen = jnp.any(m & q_real, axis=(2, 4))
        full = jnp.all(m | ~q_real, axis=(2, 4))
        return jnp.where(full, FULL, jnp.where(seen, PARTIAL, EMPTY)).astype(jnp.int8)

    return jax.lax.map(row, jnp.arange(nq))


# -- mods: masks ----------------------------------------------------------------------------------------------
def causal(b, h, q_idx, kv_idx):
    """Each query sees itself and the keys before it."""
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=64)
def sliding_window(window: int) -> MaskMod:
    """Causal, and only the last ``window`` keys (the query's own included)."""
    _check_int("window", window)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    sliding_window_mask.__name__ = f"sliding_window({window})"
    sliding_window_mask.window = window  # kernels that take a window (TPU splash attention) read it
    return sliding_window_mask


@functools.lru_cache(maxsize=64)
def streaming(window: int, sinks: int) -> MaskMod:
    """StreamingLLM (Xiao et al. 2023): a causal sliding window of ``window`` keys plus the first ``sinks`` tokens,
    which every later query keeps seeing."""
    _check_int("window", window), _check_int("sinks", sinks)

    def streaming_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx < window) | (kv_idx < sinks))

    streaming_mask.__name__ = f"streaming(window={window}, sinks={sinks})"
    return streaming_mask


@functools.lru_cache(maxsize=64)
def prefix_lm(prefix: int) -> MaskMod:
    """Bidirectional over the first ``prefix`` tokens, causal after them."""
    _check_int("prefix", prefix)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    prefix_lm_mask.__name__ = f"prefix_lm({prefix})"
    return prefix_lm_mask


def document(doc_ids: tp.Any, *, causal: bool = True) -> MaskMod:
    """Queries see keys of their own document (``doc_ids``: one id per position, ``(S,)``), causally by default.
    Keep the returned mod to reuse its cached block mask (each call makes a new one)."""
    ids = jnp.asarray(doc_ids)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"document takes one int id per position, shape (S,); got {ids.dtype} {ids.shape}")
    n = int(ids.shape[0])

    def document_mask(b, h, q_idx, kv_idx):
        same = ids[jnp.clip(q_idx, 0, n - 1)] == ids[jnp.clip(kv_idx, 0, n - 1)]
        return same & (q_idx >= kv_idx) if causal else same

    document_mask.__name__ = f"document({len(np.unique(np.asarray(ids)))} docs{', causal' if causal else ''})"
    return document_mask


# -- mods: scores ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def soft_cap(cap: float) -> ScoreMod:
    """Gemma 2's logit soft cap: ``cap * tanh(score / cap)``."""
    if not cap > 0:
        raise ValueError(f"soft_cap takes a positive cap; got {cap!r}")

    def soft_cap_score(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    soft_cap_score.__name__ = f"soft_cap({cap})"
    return soft_cap_score


def alibi(num_heads: int) -> ScoreMod:
    """ALiBi (Press et al. 2022): ``score + m_h (kv_idx - q_idx)`` with the paper's slopes ``m_h = 2^(-8 (h+1) / H)``
    for ``H`` a power of two."""
    _check_int("num_heads", num_heads)
    slopes = jnp.asarray([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], jnp.float32)

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h].astype(score.dtype) * (kv_idx - q_idx).astype(score.dtype)

    alibi_score.__name__ = f"alibi({num_heads} heads)"
    return alibi_score


__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMask", "alibi", "causal", "create_block_mask", "depends_on_batch_or_head",
           "document", "prefix_lm", "sliding_window", "soft_cap", "streaming", "vectorize_mask", "vectorize_score"]
