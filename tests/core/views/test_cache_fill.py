"""cache_view and token_stream: the predicted fill against the cache generate returns, and stopping a
compiled decode loop from the streamer.

The generate calls share one shape (1-layer tiny Llama, a prompt left padded to 16, 8 new tokens, 32
slots) with tests/widgets/test_generation_view.py, so the whole run compiles each program once.
"""

import threading

import numpy as np
import pytest

from workbench.core.models.generation import GenerationConfig
from workbench.core.models.presets import tiny
from workbench.core.models.tokenizer import ByteTokenizer
from workbench.core.views.cache_fill import ContiguousFill, PagedFill, cache_fill, streamed_fill
from workbench.core.views.token_stream import TokenStream

CONFIG = GenerationConfig(max_new_tokens=8, pad_token_id=ByteTokenizer.pad_token_id)


@pytest.fixture(scope="module")
def model():
    return tiny("llama", num_hidden_layers=1)


def prompt(texts=("Hello",), width=16):
    ids = np.full((len(texts), width), ByteTokenizer.pad_token_id, np.int32)
    mask = np.zeros_like(ids)
    for i, t in enumerate(texts):
        row = ByteTokenizer().encode(t)
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def test_prediction_equals_the_returned_cache_at_every_step_count(model):
    ids, mask = prompt()
    seen = []
    stream = TokenStream(lambda s: seen.append((s.num_steps, s.new_BN.copy())), min_interval_s=0)
    out = model.generate(ids, CONFIG, mask, streamer=stream, cache=model.init_cache(1, 32))
    assert out.num_new_tokens == 8 and stream.finished and stream.num_steps == 8
    np.testing.assert_array_equal(stream.prompt_BP, ids)
    np.testing.assert_array_equal(stream.new_BN, np.asarray(out.sequences)[:, 16:])  # streamed == returned
    assert [n for n, _ in seen] == [0, *range(1, 9), 8]  # the prompt, each step, then end()
    real = cache_fill(out.cache)
    predicted = streamed_fill("contiguous", mask, 8, max_length=32)
    assert isinstance(real, ContiguousFill) and real.index == 16 + 8 - 1  # the last token is never fed back
    assert predicted.index == real.index
    np.testing.assert_array_equal(predicted.valid_BS, real.valid_BS)
    assert real.tokens_B.tolist() == [5 + 7]  # padding is written but invalid


def test_paged_prediction_and_the_page_table(model):
    ids, mask = prompt()
    cache = model.init_ragged_pages(batch_size=1, page_size=4, num_pages=8, max_model_length=32)
    out = model.generate(ids, CONFIG, mask, streamer=TokenStream(), cache=cache)
    real = cache_fill(out.cache)
    predicted = streamed_fill("paged", mask, out.num_new_tokens, max_length=32, page_size=4, num_pages=8)
    assert isinstance(real, PagedFill) and real.known and not predicted.known
    assert real.lengths_B.tolist() == predicted.lengths_B.tolist() == [5 + 7]  # padding is not stored
    assert real.pages_in_use == predicted.pages_in_use == 3 and real.num_free == predicted.num_free == 5
    held = real.page_table_BP[0, :3]
    assert sorted(held.tolist()) == sorted(set(held.tolist())) and (real.page_table_BP[0, 3:] == -1).all()
    np.testing.assert_array_equal(held, np.asarray(out.cache.page_table)[0, :3])
    assert [real.tokens_in_page(0, p) for p in range(4)] == [4, 4, 4, 0]


def test_stop_from_another_thread_ends_the_compiled_loop(model):
    ids, mask = prompt()
    asked = threading.Event()

    def stop_after_three(s):
        if s.num_steps == 3:
            threading.Thread(target=lambda: (s.stop(), asked.set())).start()
            asked.wait(5)  # the stop lands while this step is still being handed over

    stream = TokenStream(stop_after_three, min_interval_s=0)
    out = model.generate(ids, CONFIG, mask, streamer=stream, cache=model.init_cache(1, 32))
    assert stream.stop_requested and out.num_new_tokens == 3 and stream.num_steps == 3
    assert cache_fill(out.cache).index == streamed_fill("contiguous", mask, 3, max_length=32).index == 18


def test_streamed_fill_with_padding_and_errors():
    mask = np.array([[0, 0, 1], [1, 1, 1]])
    fill = streamed_fill("contiguous", mask, 3, max_length=8)
    assert fill.index == 5 and fill.valid_BS.astype(int).tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [1] * 5 + [0] * 3]
    assert streamed_fill("contiguous", mask, 0, max_length=8).index == 3  # right after the prefill
    paged = streamed_fill("paged", mask, 3, max_length=8, page_size=2, num_pages=6)
    assert paged.lengths_B.tolist() == [3, 5] and paged.pages_held_B.tolist() == [2, 3] and paged.num_free == 1
    with pytest.raises(ValueError, match="page_size= and num_pages="):
        streamed_fill("paged", mask, 1, max_length=8)
    with pytest.raises(ValueError, match="kind must be"):
        streamed_fill("ring", mask, 1, max_length=8)
    with pytest.raises(TypeError, match="KVCache or PagedKVCache"):
        cache_fill(object())


def test_token_stream_throttles_and_keeps_listener_errors():
    calls = []
    stream = TokenStream(lambda s: calls.append(s.num_steps), min_interval_s=60)
    stream.put(np.array([[1, 2]]))
    for t in range(5):
        stream.put(np.array([t]))
    stream.end()
    assert calls == [0, 1, 5]  # the prompt, the first step, then end(); the rest throttled
    assert stream.new_BN.tolist() == [[0, 1, 2, 3, 4]] and not stream.should_stop()
    stream.stop()
    assert stream.should_stop()
    broken = TokenStream(lambda s: 1 / 0, min_interval_s=0)
    broken.put(np.array([[1]]))
    assert isinstance(broken.callback_error, ZeroDivisionError)
    with pytest.raises(ValueError, match="min_interval_s"):
        TokenStream(min_interval_s=-1)
