"""TokenStream's text with a tokenizer: a byte-level BPE (the real SmolLM2 tokenizer) streamed token by token
never shows a garbled character, and the pieces add up to transformers' decode of the whole sequence."""

import numpy as np
import pytest

from workbench.core.models.tokenizer import ByteTokenizer
from workbench.core.views.token_stream import TokenStream, stable_text

# characters that byte-level BPE splits over several tokens (CJK, emoji, accents)
TEXT = "Voilà: naïve café, 日本語のテキスト, emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.\nNext line."


@pytest.fixture(scope="module")
def hf(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


def stream_ids(stream, ids_BN, prompt_BP=None):
    """What generate does: the prompt (B, P), then one (B,) per step."""
    ids_BN = np.asarray(ids_BN)
    stream.put(np.zeros((ids_BN.shape[0], 1), np.int32) if prompt_BP is None else prompt_BP)
    pieces = []
    for step in range(ids_BN.shape[1]):
        stream.put(ids_BN[:, step])
        pieces.append(stream.new_text())
    stream.end()
    pieces.append(stream.new_text())
    return pieces


def test_bpe_streaming_never_garbles_and_adds_up_to_the_whole_decode(hf):
    ids = hf.encode(TEXT, add_special_tokens=False)
    # token by token, transformers itself garbles this text: the test needs whole-list decoding to pass
    assert "\ufffd" in "".join(hf.decode([i]) for i in ids)
    stream = TokenStream(tokenizer=hf, min_interval_s=0)
    pieces = [p[0] for p in stream_ids(stream, [ids])]
    assert "".join(pieces) == hf.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # at every step the text so far is transformers' decode of the ids so far, less an unfinished character
    for n in range(1, len(ids) + 1):
        assert "".join(pieces[:n]) == hf.decode(ids[:n]).rstrip("\ufffd")
    assert stream.text() == [TEXT]


def test_a_batch_drops_eos_and_the_padding_after_it(hf):
    row0 = hf.encode("The capital of France is Paris.", add_special_tokens=False) + [hf.eos_token_id] * 3
    row1 = hf.encode("日本語 🙂 ok", add_special_tokens=False)
    width = max(len(row0), len(row1))
    row1 = row1 + [hf.eos_token_id] * (width - len(row1))
    row0 = row0 + [hf.pad_token_id] * (width - len(row0))
    stream = TokenStream(tokenizer=hf)
    pieces = stream_ids(stream, [row0, row1])
    texts = ["".join(p[b] for p in pieces) for b in range(2)]
    assert texts == hf.batch_decode([row0, row1], skip_special_tokens=True) == ["The capital of France is Paris.",
                                                                              "日本語 🙂 ok"]
    assert stream.text() == texts


def test_a_listener_prints_the_stream_as_it_arrives(hf):
    ids = hf.encode(TEXT, add_special_tokens=False)
    printed = []
    stream = TokenStream(lambda s: printed.append(s.new_text()[0]), tokenizer=hf, min_interval_s=0)
    stream_ids(stream, [ids])
    assert "".join(printed) == TEXT and not any("\ufffd" in p for p in printed)


def test_bytes_hold_back_an_unfinished_character_until_the_end():
    tok = ByteTokenizer()
    ids = tok.encode("é🙂")  # 2 + 4 bytes
    stream = TokenStream(tokenizer=tok)
    pieces = [p[0] for p in stream_ids(stream, [ids])]
    assert pieces == ["", "é", "", "", "", "🙂", ""]
    # a stream that ends mid-character shows the byte it could not decode, as Python escapes it
    escaped = bytes(ids[:3]).decode("utf-8", errors="backslashreplace")
    assert escaped == "é\\xf0"
    cut = TokenStream(tokenizer=tok)
    assert "".join(p[0] for p in stream_ids(cut, [ids[:3]])) == escaped
    assert stable_text(tok, ids[:3]) == "é" and stable_text(tok, ids[:3], final=True) == escaped
    assert tok.decode(ids[:3]) == "é\ufffd"  # decode's default is Hugging Face's: the replacement character


def test_a_byte_level_hf_tokenizer_escapes_the_bytes_it_cannot_decode(hf):
    """SmolLM2's byte-level BPE: a character cut off after 1, 2 or 3 of its 4 bytes (one byte token each) comes
    back with those bytes escaped, as Python decodes the same bytes; text Hugging Face decodes whole is its own."""
    from workbench.core.models.tokenizer import _byte_level_decoder, as_tokenizer

    tok, emoji = as_tokenizer(hf), "🙂".encode()
    char_of = {b: ch for ch, b in _byte_level_decoder().items()}
    head = tok.encode("café ")
    for cut in range(1, 4):
        partial = head + [hf.convert_tokens_to_ids(char_of[b]) for b in emoji[:cut]]
        assert "\ufffd" in hf.decode(partial) and tok.decode(partial) == hf.decode(partial)
        want = ("café ".encode() + emoji[:cut]).decode("utf-8", errors="backslashreplace")
        assert tok.decode(partial, errors="backslashreplace") == want and want.endswith("\\x9f" if cut == 2 else "")
    ids = tok.encode("café 🙂")
    assert tok.decode(ids, errors="backslashreplace") == hf.decode(ids) == "café 🙂"


def test_text_needs_a_tokenizer_and_takes_a_local_directory(smollm2_dir, hf):
    with pytest.raises(ValueError, match="no tokenizer"):
        TokenStream().text()
    stream = TokenStream(tokenizer=smollm2_dir)  # anything as_tokenizer takes
    ids = hf.encode("Hello 🙂", add_special_tokens=False)
    assert "".join(p[0] for p in stream_ids(stream, [ids])) == "Hello 🙂"


def test_a_background_listener_never_holds_up_put():
    """``background=True``: the listener runs on its own thread; a slow one neither delays ``put`` nor misses
    the end (it sees every token once the stream ends)."""
    import threading
    import time

    seen, threads = [], set()

    def slow(stream):
        threads.add(threading.get_ident())
        time.sleep(0.05)
        seen.append((stream.num_steps, stream.finished))

    stream = TokenStream(slow, min_interval_s=0, background=True)
    start = time.perf_counter()
    stream.put(np.array([[1, 2]]))
    for token in range(40):
        stream.put(np.array([token]))
    put_seconds = time.perf_counter() - start
    stream.end()
    assert stream.join(timeout=5)
    assert put_seconds < 0.05 * 40 / 4  # a synchronous listener would take 41 x 50 ms
    assert threading.get_ident() not in threads and len(threads) == 1
    assert seen[-1] == (40, True) and len(seen) < 41  # the newest state, skipping what it had no time for
    broken = TokenStream(lambda s: 1 / 0, background=True)
    broken.put(np.array([[1]]))
    broken.end()
    assert broken.join(timeout=5) and isinstance(broken.callback_error, ZeroDivisionError)
