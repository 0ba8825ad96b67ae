"""Tokenizers for the tiny models: bytes (any text, fixed vocab) or the characters of one text.

Both give ``encode``/``decode`` and a Hugging Face style ``__call__`` that pads a batch:

>>> tok = ByteTokenizer()
>>> tok.encode("hé")
[104, 195, 169]
>>> tok.decode(tok.encode("hé"))
'hé'
>>> batch = tok(["a", "abc"])
>>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
([[256, 256, 97], [97, 98, 99]], [[0, 0, 1], [1, 1, 1]])
"""

from __future__ import annotations

import typing as tp

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>")


class _Tokenizer:
    """Padding and batching shared by the tokenizers; subclasses define ``encode``/``decode``."""

    vocab_size: int
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        raise NotImplementedError

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        return [self.bos_token_id] * add_bos + ids + [self.eos_token_id] * add_eos

    def __call__(self, texts: str | tp.Sequence[str], *, padding_side: str = "left", add_bos: bool = False,
                 add_eos: bool = False) -> dict[str, np.ndarray]:
        """Encode a batch, padded to the longest: ``input_ids`` and ``attention_mask``, int32 ``(B, T)``.

        Left padding (the default) puts every prompt's last token in the last column, as
        generation wants; use ``padding_side="right"`` for training batches.
        """
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right'; got {padding_side!r}")
        if isinstance(texts, str):
            texts = [texts]
        rows = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        if not rows:
            raise ValueError("texts is empty; pass at least one string")
        width = max(1, max(len(r) for r in rows))
        ids = np.full((len(rows), width), self.pad_token_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            cols = slice(width - len(row), width) if padding_side == "left" else slice(0, len(row))
            ids[i, cols], mask[i, cols] = row, 1
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, ids_BT: tp.Iterable[tp.Iterable[int]], **kwargs: tp.Any) -> list[str]:
        return [self.decode(row, **kwargs) for row in ids_BT]


class ByteTokenizer(_Tokenizer):
    """UTF-8 bytes as ids 0-255, then ``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258 (``vocab_size`` 259).

    Any text encodes, so a model trained with it takes any prompt; the tiny presets use a
    vocab of 264 (the next multiple of 8) so the vocab dimension shards evenly over tp.
    """

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(list(text.encode("utf-8")), add_bos, add_eos)

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD, ids >= 256 are dropped or shown as ``<pad>`` etc."""
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(SPECIALS[i - 256] if i - 256 < len(SPECIALS) else f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class CharTokenizer(_Tokenizer):
    """The characters of one text: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the sorted characters.

    A smaller vocab than bytes (Genesis: 70 characters), but prompts may only use characters
    of that text (others encode to ``<unk>``), and the vocab must travel with the weights.

    >>> tok = CharTokenizer.from_text("abba")
    >>> tok.vocab_size, tok.encode("ab?"), tok.decode([4, 5, 3])
    (6, [4, 5, 3], 'ab�')
    """

    pad_token_id, bos_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3

    def __init__(self, chars: tp.Sequence[str]):
        chars = list(chars)
        if len(set(chars)) != len(chars) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("CharTokenizer(chars) takes distinct single characters; use CharTokenizer.from_text(text)")
        self.chars = tuple(chars)
        self._ids = {c: i + 4 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 4

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap([self._ids.get(c, self.unk_token_id) for c in text], add_bos, add_eos)

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``<unk>`` and out-of-range ids become U+FFFD, pad/bos/eos are dropped or shown."""
        out = []
        for i in (int(i) for i in ids):
            if 4 <= i < self.vocab_size:
                out.append(self.chars[i - 4])
            elif i in (0, 1, 2):
                out.append("" if skip_special_tokens else SPECIALS[i])
            else:
                out.append("\ufffd")
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
