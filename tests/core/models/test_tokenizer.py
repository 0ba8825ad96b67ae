"""ByteTokenizer and CharTokenizer: round trips, special ids, padding layout."""

import numpy as np
import pytest

from workbench.core.models.tokenizer import ByteTokenizer, CharTokenizer
from workbench.data import load_text

UNICODE = ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀", "", "tab\tnew\nline"]


def test_byte_round_trip_unicode():
    tok = ByteTokenizer()
    for text in UNICODE:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_byte_specials_and_invalid_bytes():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (259, 256, 257, 258)
    ids = tok.encode("hi", add_bos=True, add_eos=True)
    assert ids == [257, 104, 105, 258]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>hi<eos>"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_layout(side):
    tok = ByteTokenizer()
    batch = tok(["a", "abc", "日"], padding_side=side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.dtype == mask.dtype == np.int32 and ids.shape == mask.shape == (3, 3)
    assert mask.sum(1).tolist() == [1, 3, 3]
    assert np.all((ids == tok.pad_token_id) == (mask == 0))
    if side == "left":
        assert ids[0].tolist() == [256, 256, 97] and mask[:, -1].all()
    else:
        assert ids[0].tolist() == [97, 256, 256] and mask[:, 0].all()
    for row, m, text in zip(ids, mask, ["a", "abc", "日"], strict=True):
        assert tok.decode(row[m.astype(bool)]) == text


def test_call_errors_and_single_string():
    tok = ByteTokenizer()
    assert tok("ab")["input_ids"].shape == (1, 2)
    with pytest.raises(ValueError, match="padding_side"):
        tok(["a"], padding_side="middle")
    with pytest.raises(ValueError, match="empty"):
        tok([])


def test_char_tokenizer_on_shipped_text():
    text = load_text("genesis")
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text)) + 4 < 80
    assert tok.decode(tok.encode(text[:2000])) == text[:2000]
    assert tok.encode("Q@") [1] == tok.unk_token_id
    batch = tok(["In", "God"], add_bos=True)
    assert batch["input_ids"][0].tolist() == [0, tok.bos_token_id, *tok.encode("In")]
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer(["a", "a"])
