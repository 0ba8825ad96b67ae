"""ByteTokenizer and CharTokenizer: round trips, special ids, padding layout; a Hugging Face tokenizer (the real
SmolLM2 one) through as_tokenizer, against transformers' own calls."""

import numpy as np
import pytest

from workbench.core.models.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, as_tokenizer
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


# -- a Hugging Face tokenizer through as_tokenizer, checked against transformers' own calls -------------------
TEXTS = ["Hello world", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀", "  leading spaces\tand\ttabs\n",
         "def f(x):\n    return x ** 2", "<|im_end|> is text here", "a"]


@pytest.fixture(scope="module")
def hf(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def tok(hf):
    return as_tokenizer(hf)


def test_hf_ids_and_vocab(tok, hf):
    assert isinstance(tok, HFTokenizer) and tok.hf is hf
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                       hf.pad_token_id) == (1, 2, 2)
    assert tok.vocab_size == len(hf) == 49152
    assert "HFTokenizer(" in repr(tok) and "chat template" in repr(tok)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_encode_and_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text, add_special_tokens=False)["input_ids"] and all(type(i) is int for i in ids)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_bos=True, add_eos=True) == [hf.bos_token_id, *ids, hf.eos_token_id]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    with_specials = [hf.bos_token_id, *ids, hf.eos_token_id]
    assert tok.decode(np.asarray(with_specials)) == hf.decode(with_specials, skip_special_tokens=True)
    assert tok.decode(with_specials, skip_special_tokens=False) == hf.decode(with_specials)


@pytest.mark.parametrize("side", ["left", "right"])
def test_hf_padded_batches_match_transformers(tok, hf, side):
    batch = tok(TEXTS, padding_side=side)
    ref = hf(TEXTS, padding=True, padding_side=side, add_special_tokens=False, return_tensors="np")
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == np.int32
    np.testing.assert_array_equal(batch["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(batch["attention_mask"], ref["attention_mask"])
    assert tok.batch_decode(batch["input_ids"]) == hf.batch_decode(ref["input_ids"], skip_special_tokens=True)
    single = tok("Hello world", add_special_tokens=True)["input_ids"]
    assert single.tolist() == [hf.encode("Hello world", add_special_tokens=True)]


def test_hf_chat_template_matches_transformers(tok, hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    for add in (True, False):
        ref = hf.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=False)
        assert tok.apply_chat_template(messages, add_generation_prompt=add) == list(ref)
    one = [{"role": "user", "content": "Hi"}]
    text = hf.apply_chat_template(one, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert tok.apply_chat_template("Hi") == tok.apply_chat_template(one) == hf.encode(text, add_special_tokens=False)
    assert tok.has_chat_template


def test_hf_without_a_pad_token_pads_with_eos(hf):
    import copy

    no_pad = copy.deepcopy(hf)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    tok = as_tokenizer(no_pad)
    assert tok.pad_token_id == hf.eos_token_id
    assert tok(["a", "Hello world"])["input_ids"][0, 0] == hf.eos_token_id


def test_as_tokenizer_takes_ours_hf_and_local_directories(smollm2_dir, hf):
    byte = ByteTokenizer()
    assert as_tokenizer(byte) is byte
    from_dir = as_tokenizer(smollm2_dir)
    assert isinstance(from_dir, HFTokenizer) and from_dir.encode(TEXTS[1]) == hf.encode(TEXTS[1],
                                                                                         add_special_tokens=False)
    assert as_tokenizer(str(smollm2_dir)).vocab_size == 49152

    class Custom:  # anything with encode/decode passes through (what the widgets took before)
        def encode(self, text):
            return [1]

        def decode(self, ids):
            return "x"

    custom = Custom()
    assert as_tokenizer(custom) is custom
    with pytest.raises(ValueError, match="not a directory"):
        as_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub name: nothing is downloaded
    with pytest.raises(TypeError, match="needs encode"):
        as_tokenizer(42)


def test_ours_have_no_chat_template():
    for tok in (ByteTokenizer(), CharTokenizer.from_text("abc")):
        assert not tok.has_chat_template and tok.chat_template is None
        with pytest.raises(ValueError, match="has no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "Hi"}])
