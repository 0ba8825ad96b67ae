"""Tokenizers: bytes (any text, fixed vocab), the characters of one text, or a Hugging Face tokenizer.

All give ``encode``/``decode`` and a Hugging Face style ``__call__`` that pads a batch; ``as_tokenizer``
wraps a ``transformers`` tokenizer (or loads one from a local directory) so that it works wherever
ours do (the generation view, the attention lab, ``TokenStream``):

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

import functools
import os
import sys
import typing as tp

import numpy as np

__all__ = ["ByteTokenizer", "CharTokenizer", "HFTokenizer", "as_tokenizer"]

SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer:
    """Padding and batching shared by the tokenizers; subclasses define ``encode``/``decode``."""

    vocab_size: int
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int
    chat_template: str | None = None

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True, errors: str = "replace") -> str:
        """Text of ``ids``. ``errors`` treats bytes that are not UTF-8 as ``bytes.decode`` does: ``"replace"``
        (U+FFFD, what Hugging Face gives) or ``"backslashreplace"`` (``\\xe2``, what a view shows)."""
        raise NotImplementedError

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        for wanted, name in ((add_bos, "bos_token_id"), (add_eos, "eos_token_id")):
            if wanted and getattr(self, name) is None:
                raise ValueError(f"{self!r} has no {name[:3]} token: call it with {name[:3]}=False")
        return [self.bos_token_id] * add_bos + ids + [self.eos_token_id] * add_eos

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: str | tp.Sequence[tp.Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation formatted by the tokenizer's chat template (a Hugging Face
        tokenizer's); ours have none and say so."""
        raise ValueError(f"{type(self).__name__} has no chat template: use a Hugging Face tokenizer that has one, "
                         f"e.g. as_tokenizer(local_checkpoint()) (SmolLM2-135M-Instruct)")

    def __call__(self, texts: str | tp.Sequence[str], *, padding_side: str = "left", add_bos: bool = False,
                 add_eos: bool = False, **encode_kwargs: tp.Any) -> dict[str, np.ndarray]:
        """Encode a batch, padded to the longest: ``input_ids`` and ``attention_mask``, int32 ``(B, T)``.

        Left padding (the default) puts every prompt's last token in the last column, as
        generation wants; use ``padding_side="right"`` for training batches. ``encode_kwargs``
        go to ``encode`` (e.g. ``add_special_tokens=True`` for a Hugging Face tokenizer).
        """
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right'; got {padding_side!r}")
        if isinstance(texts, str):
            texts = [texts]
        rows = [self.encode(t, add_bos=add_bos, add_eos=add_eos, **encode_kwargs) for t in texts]
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


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, then ``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258 (``vocab_size`` 259).

    Any text encodes, so a model trained with it takes any prompt; the tiny presets use a
    vocab of 264 (the next multiple of 8) so the vocab dimension shards evenly over tp.
    """

    pad_token_id, bos_token_id, eos_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return self._wrap(list(text.encode("utf-8")), add_bos, add_eos)

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True, errors: str = "replace") -> str:
        """Text of ``ids``; invalid UTF-8 as ``errors`` says (U+FFFD by default), ids >= 256 are dropped or shown
        as ``<pad>`` etc."""
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors=errors))
            run = bytearray()
            if not skip_special_tokens:
                out.append(SPECIALS[i - 256] if i - 256 < len(SPECIALS) else f"<{i}>")
        out.append(run.decode("utf-8", errors=errors))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class CharTokenizer(Tokenizer):
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

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True, errors: str = "replace") -> str:
        """Text of ``ids``; ``<unk>`` and out-of-range ids become U+FFFD, pad/bos/eos are dropped or shown
        (characters, not bytes: ``errors`` has nothing to act on)."""
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


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``transformers.PreTrainedTokenizerBase``) behind our interface.

    ``encode`` adds no special tokens unless asked (``add_bos``/``add_eos``, or ``add_special_tokens=True``
    for what the tokenizer itself adds); ``decode`` drops special tokens unless asked; ``__call__`` pads
    a batch (left by default) into int32 numpy arrays. ``pad_token_id`` falls back to the EOS id (then 0)
    when the tokenizer has no pad token: the attention mask marks padding either way. ``vocab_size`` is
    ``len(tokenizer)``, added tokens included. The wrapped tokenizer is :attr:`hf`.
    """

    def __init__(self, tokenizer: tp.Any):
        self.hf = tokenizer
        self.bos_token_id = _token_id(tokenizer.bos_token_id)
        self.eos_token_id = _token_id(tokenizer.eos_token_id)
        pad = _token_id(tokenizer.pad_token_id)
        self.pad_token_id = pad if pad is not None else self.eos_token_id if self.eos_token_id is not None else 0
        self.vocab_size = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
        self.chat_template = getattr(tokenizer, "chat_template", None) or None

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
               add_special_tokens: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return self._wrap([int(i) for i in ids], add_bos, add_eos)

    def decode(self, ids: tp.Iterable[int], *, skip_special_tokens: bool = True, errors: str = "replace") -> str:
        """The Hugging Face tokenizer's text of ``ids``. With ``errors`` other than ``"replace"``, a byte-level
        BPE's (GPT-2, Llama 3, SmolLM2) tokens are turned back into their bytes and decoded with ``errors``
        wherever Hugging Face's text has a U+FFFD; other tokenizers keep Hugging Face's text."""
        ids = [int(i) for i in ids]
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if errors == "replace" or "\ufffd" not in text:
            return text
        tokens = self.hf.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        to_byte = _byte_level_decoder()
        if not all(isinstance(t, str) and all(ch in to_byte for ch in t) for t in tokens):
            return text  # not byte-level (SentencePiece, added tokens): Hugging Face's text as it is
        return bytes(to_byte[ch] for t in tokens for ch in t).decode("utf-8", errors=errors)

    def apply_chat_template(self, messages: str | tp.Sequence[tp.Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (``[{"role": "user", "content": "Hi"}, ...]``, or one user message as a
        string) formatted by the chat template, ending with the assistant's turn when
        ``add_generation_prompt``: what an instruct model should continue."""
        if not self.has_chat_template:
            super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        out = self.hf.apply_chat_template([dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False)
        if isinstance(out, tp.Mapping):  # a BatchEncoding, whatever the version's default
            out = out["input_ids"]
        return [int(i) for i in np.asarray(out).reshape(-1)]

    def __repr__(self) -> str:
        name = getattr(self.hf, "name_or_path", "") or type(self.hf).__name__
        chat = ", chat template" if self.has_chat_template else ""
        return f"HFTokenizer({name!r}, vocab_size={self.vocab_size}{chat})"


def _token_id(value: tp.Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):  # some configs list several EOS ids: the first is the tokenizer's own
        return int(value[0]) if value else None
    return int(value)


def _is_hf_tokenizer(obj: tp.Any) -> bool:
    """An instance of ``transformers.PreTrainedTokenizerBase``, checked without importing transformers."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedTokenizerBase", None) if transformers is not None else None
    return base is not None and isinstance(obj, base)


def as_tokenizer(tokenizer: tp.Any) -> tp.Any:
    """``tokenizer`` with our interface: ours and other objects with ``encode``/``decode`` as they are, a
    Hugging Face tokenizer wrapped in :class:`HFTokenizer`, a local directory (e.g. ``local_checkpoint()``)
    loaded with ``transformers.AutoTokenizer`` (no download) and wrapped.

    >>> as_tokenizer(ByteTokenizer())
    ByteTokenizer(vocab_size=259)
    """
    import pathlib

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if _is_hf_tokenizer(tokenizer):
        return HFTokenizer(tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        path = pathlib.Path(tokenizer).expanduser()
        if not path.is_dir():
            raise ValueError(f"as_tokenizer takes a tokenizer or a local directory holding one; {str(tokenizer)!r} "
                             f"is not a directory (nothing is downloaded: pass e.g. local_checkpoint())")
        transformers = _import_transformers()
        return HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    if callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None)):
        return tokenizer
    raise TypeError(f"a tokenizer needs encode() and decode(): pass ByteTokenizer(), CharTokenizer, a Hugging Face "
                    f"tokenizer (transformers.AutoTokenizer.from_pretrained(path)) or a local directory; got "
                    f"{type(tokenizer).__name__}")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards (character -> byte): the printable bytes stand for themselves,
    the other 68 for the characters from U+0100 up, in byte order (``bytes_to_unicode`` in GPT-2's encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(rest)}


def _import_transformers():
    """``transformers``, without its advisory on stderr that PyTorch is missing: a tokenizer needs no PyTorch
    (and on Python 3.12+ there may be none: notebooks would show the advisory as an error output)."""
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    before = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # read when transformers' __init__ logs the advisory
    try:
        import transformers
    finally:
        if before is None:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = before
    return transformers
