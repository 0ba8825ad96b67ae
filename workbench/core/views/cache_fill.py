"""What a KV cache holds, as host arrays to draw: slots per row (contiguous) or the page table (paged).

:func:`cache_fill` reads a real ``KVCache`` / ``PagedKVCache``. :func:`streamed_fill` says what a fresh
cache holds while ``generate`` streams, from the prompt mask and the step count alone: the prefill
writes the prompt, then every new token but the last is fed back, so when token ``k`` (``k >= 1``) is
streamed the cache holds ``P + k - 1`` slots per row (left padding included, marked invalid). The
decode loop's cache is donated and lives inside the compiled program, so a live view can only be
predicted; tests compare the prediction with the cache ``generate`` returns.

>>> fill = streamed_fill("contiguous", np.array([[0, 1, 1]]), 2, max_length=6)
>>> fill.index, fill.valid_BS.astype(int).tolist()
(4, [[0, 1, 1, 1, 0, 0]])
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import numpy as np

__all__ = ["ContiguousFill", "PagedFill", "cache_fill", "streamed_fill"]


@dataclasses.dataclass(frozen=True)
class ContiguousFill:
    """``valid_BS`` marks slots holding real tokens; ``index`` slots are written in every row (the rest
    are empty); padding is written but invalid."""

    valid_BS: np.ndarray
    index: int

    @property
    def batch_size(self) -> int:
        return self.valid_BS.shape[0]

    @property
    def max_length(self) -> int:
        return self.valid_BS.shape[1]

    @property
    def tokens_B(self) -> np.ndarray:
        """Real tokens per row."""
        return self.valid_BS.sum(axis=1)


@dataclasses.dataclass(frozen=True)
class PagedFill:
    """``page_table_BP`` holds the physical page of each row's logical page, -1 where the row holds none.

    ``known`` is False for a prediction (:func:`streamed_fill`): then how many pages each row holds
    is known, but not which physical pages the compiled step popped, and held entries are -1 too.
    """

    page_table_BP: np.ndarray
    lengths_B: np.ndarray
    page_size: int
    num_pages: int
    num_free: int
    known: bool = True

    @property
    def pages_held_B(self) -> np.ndarray:
        return -(-self.lengths_B // self.page_size)

    @property
    def pages_in_use(self) -> int:
        return int(self.pages_held_B.sum())

    def tokens_in_page(self, row: int, page: int) -> int:
        """Tokens row ``row`` keeps in its logical page ``page`` (0 .. page_size)."""
        return int(np.clip(self.lengths_B[row] - page * self.page_size, 0, self.page_size))


def cache_fill(cache: tp.Any) -> ContiguousFill | PagedFill:
    """The fill of a ``KVCache`` or ``PagedKVCache`` (copied to the host)."""
    if hasattr(cache, "valid_BS") and hasattr(cache, "index"):
        return ContiguousFill(np.asarray(cache.valid_BS).astype(bool), int(cache.index))
    if hasattr(cache, "page_table") and hasattr(cache, "lengths"):
        lengths_B = np.asarray(cache.lengths).astype(np.int64)
        table = np.asarray(cache.page_table).astype(np.int64).copy()
        held_B = -(-lengths_B // cache.page_size)
        table[np.arange(table.shape[1])[None, :] >= held_B[:, None]] = -1
        return PagedFill(table, lengths_B, int(cache.page_size), int(cache.num_pages), int(cache.num_free))
    raise TypeError(f"cache_fill takes a KVCache or PagedKVCache; got {type(cache).__name__}")


def streamed_fill(kind: str, mask_BP: tp.Any, steps: int, *, max_length: int, page_size: int | None = None,
                  num_pages: int | None = None) -> ContiguousFill | PagedFill:
    """What a fresh cache of ``kind`` ("contiguous" or "paged") holds once ``steps`` tokens were streamed
    after a prompt with mask ``mask_BP`` (``steps=0``: right after the prefill).

    ``max_length`` is the contiguous cache's slots per row, or the paged cache's ``max_length``
    (page-table width times ``page_size``); a paged prediction needs ``page_size`` and ``num_pages``.
    """
    mask_BP = np.asarray(mask_BP).astype(bool)
    if mask_BP.ndim != 2:
        raise ValueError(f"mask_BP must be (batch, prompt_len); got shape {mask_BP.shape}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0; got {steps}")
    b, p = mask_BP.shape
    fed = max(steps - 1, 0)
    if kind == "contiguous":
        index = min(p + fed, max_length)
        valid_BS = np.zeros((b, max_length), bool)
        valid_BS[:, :p] = mask_BP[:, :max_length]
        valid_BS[:, p:index] = True
        return ContiguousFill(valid_BS, index)
    if kind == "paged":
        if page_size is None or num_pages is None:
            raise ValueError("a paged prediction needs page_size= and num_pages=")
        lengths_B = mask_BP.sum(axis=1).astype(np.int64) + fed
        table = np.full((b, math.ceil(max_length / page_size)), -1, np.int64)
        used = int((-(-lengths_B // page_size)).sum())
        return PagedFill(table, lengths_B, int(page_size), int(num_pages), int(num_pages) - used, known=False)
    raise ValueError(f"kind must be 'contiguous' or 'paged'; got {kind!r}")
